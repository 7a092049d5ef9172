"""What one paged forward's attention reads and writes (paged.py's custom attention op reads the
running forward's `Step`): the key slots, the page tables, the prompts that extend cached keys."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rltrain.engine.embedded.kv_pool import KVPool


@dataclass
class Extends:
    """Prompts whose first tokens' keys are already in their pages (the prefix cache), with
    `pages` context pages each: their new tokens attend to every key of their pages up to their
    own position. `index` [count, Lq]: each prompt's new tokens in the packed sequence (padded
    with its last); `pages` [count, pages]; `mask` [count, 1, Lq, pages * page_size]; `valid`:
    the rows of the flattened [count * Lq] output that are real tokens, in packed order."""

    index: torch.Tensor
    table: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor


@dataclass
class ExtendRows:
    """Prompts that extend cached keys, for the extend kernel (kernels/extend_attention.py), which
    reads their keys in their pages: [rows] int32 tensors of where each one's new tokens start in
    the packed sequence, how many there are and how many keys were cached before them; its pages
    (`table`, padded with page 0); the most new tokens of any; and where the first one's start."""

    table: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    ctx_len: torch.Tensor
    max_q_len: int
    begin: int
    impl: str = "triton"


@dataclass
class Step:
    """What one forward's attention and cache read. Decode: each row's page table and length
    (the attention kernel writes the new key and value at the row's last slot). Prefill: the
    slot each prompt token's key goes to (page, offset), the groups of equal-length prompts
    in the packed sequence (start, count, length), host ints, then the prompts that extend cached
    keys (`extends`, after the groups in the packed sequence)."""

    pool: KVPool
    table: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    page: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    groups: list[tuple[int, int, int]] | None = None
    extends: list[Extends] = field(default_factory=list)
    extend_rows: ExtendRows | None = None  # (instead of `extends`: the kernel's)
