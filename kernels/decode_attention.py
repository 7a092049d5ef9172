"""Decode attention over a paged KV cache: one new query token per sequence, GQA, reading each
sequence's keys and values only up to its own length.

    paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, scale) -> out

q [B, H, D]; k_pages, v_pages [num_pages, KVH, P, D] (one layer's pool); page_table [B, max_pages]
int32 (page ids, in order); seq_lens [B] int32 (tokens in the cache, the new one included);
out [B, H, D] in q's dtype. The H query heads of one KV head (H / KVH of them) share the loads of
its keys and values: one program per (sequence, KV head) streams the sequence's pages once,
with an online softmax in float32. The Triton kernel runs on CUDA (and under Triton's
interpreter in the CPU tests); `reference_paged_decode_attention` is the plain torch version it
is tested against, and what runs on the CPU.

Nothing here synchronises with the host, so a decode step that calls it can be captured in a
CUDA graph: the loop bound is read from `seq_lens` on the device. (Triton 3.6's interpreter
cannot loop to a run-time bound: there the loop runs over every column of the page table, masked.)
"""

from __future__ import annotations

import os

import torch


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    impl: str | None = None,
) -> torch.Tensor:
    """Attention of each sequence's new query over its cached keys and values (see module doc).
    `impl`: "triton" or "torch" (default: triton on CUDA, torch otherwise)."""
    impl = impl or ("triton" if q.is_cuda else "torch")
    if impl == "torch":
        return reference_paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, scale)
    if impl != "triton":
        raise ValueError(f"impl {impl!r}: expected triton or torch")
    from . import triton_decode  # noqa: PLC0415 - triton is optional (CPU installs may lack it)

    return triton_decode.paged_decode(q, k_pages, v_pages, page_table, seq_lens, scale)


def reference_paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch: gather each sequence's pages (up to the longest sequence), mask the columns past
    its length, and run SDPA with the KV heads shared by their query groups."""
    B, H, D = q.shape
    P = k_pages.shape[2]
    pages = -(-int(seq_lens.max()) // P)
    table = page_table[:, :pages].long()
    k = k_pages[table].permute(0, 2, 1, 3, 4).reshape(B, k_pages.shape[1], pages * P, D)
    v = v_pages[table].permute(0, 2, 1, 3, 4).reshape(B, v_pages.shape[1], pages * P, D)
    keep = torch.arange(pages * P, device=q.device)[None, :] < seq_lens[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=keep[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0]


def interpreted() -> bool:
    """Whether Triton runs in its interpreter (the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
