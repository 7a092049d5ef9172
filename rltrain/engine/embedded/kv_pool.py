"""The paged path's KV cache: every layer's keys and values in pages, allocated once per engine.

    pages = pool_pages(config, dtype, device, max_rows, max_pages, pool_tokens, mem_fraction)
    pool = KVPool(config, pages, PAGE_SIZE, dtype, device)
    got = pool.alloc(3); pool.share(got[:2]); pool.release(got)

One tensor each for keys and values, [layers, pages, kv_heads, page_size, head_dim]. Page 0 is
scratch, never handed out: the padding rows of a captured decode step write there. Pages are
reference-counted: the n samples of one prompt share the prompt's full pages (batching.py), and
the prefix cache holds the pages it keeps (prefix_cache.py).
"""

from __future__ import annotations

from typing import Any

import torch

from rltrain.engine.embedded.sampling import device_tensor

PAGE_SIZE = 64  # tokens per KV page


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class KVPool:
    """Every layer's keys and values in pages of `page_size` tokens, with a free list and
    reference counts (a prompt's pages are shared by its samples). Page 0 is never handed out."""

    def __init__(self, config: Any, pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        kvh = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        shape = (config.num_hidden_layers, pages, kvh, page_size, head_dim_of(config))
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.pages = pages
        self._free = list(range(pages - 1, 0, -1))
        self._refs = [0] * pages

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool: {n} pages asked, {len(self._free)} free")  # callers check `free` first
        got = [self._free.pop() for _ in range(n)]
        for p in got:
            self._refs[p] = 1
        return got

    def share(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] += 1

    def refs(self, page: int) -> int:
        return self._refs[page]

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Every layer's keys and values of pages `src` into pages `dst` (copy-on-write)."""
        if src:
            # (from pinned memory, no host sync: a prefill in pieces must not wait for the device)
            si, di = device_tensor(src, torch.long, self.k.device), device_tensor(dst, torch.long, self.k.device)
            self.k[:, di] = self.k[:, si]
            self.v[:, di] = self.v[:, si]

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    @staticmethod
    def page_bytes(config: Any, page_size: int, dtype: torch.dtype) -> int:
        kvh = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        size = torch.tensor([], dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * kvh * page_size * head_dim_of(config) * size


def pool_pages(
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    max_rows: int,
    max_pages: int,
    pool_tokens: int,
    mem_fraction: float,
) -> int:
    """Pages of `PAGE_SIZE` tokens for the pool: on CUDA what `mem_fraction` of the device leaves
    after this process's allocations (as SGLang's --mem-fraction-static), within what is free now
    less a margin for activations and graphs, and at most `pool_tokens` tokens where given (as
    SGLang's --max-total-tokens); on the CPU `pool_tokens` tokens, or 1 GiB. Never more than
    `max_rows` sequences of `max_pages` pages need (+ the scratch page)."""
    P = PAGE_SIZE
    page_bytes = KVPool.page_bytes(config, P, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = min(
            mem_fraction * total - torch.cuda.memory_allocated(device),
            free - max(2 << 30, 0.05 * total),
        )
        pages = int(budget // page_bytes)
        if pool_tokens:
            pages = min(pages, pool_tokens // P + 1)
    elif pool_tokens:
        pages = pool_tokens // P + 1
    else:
        pages = (1 << 30) // page_bytes
    pages = min(pages, max_rows * max_pages + 1)
    if pages < 2:
        raise RuntimeError(
            f"no memory left for the KV cache (a page of {P} tokens is {page_bytes / 2**20:.1f} MiB); lower "
            "what else runs on the device, or raise --mem-fraction-static"
        )
    return pages
