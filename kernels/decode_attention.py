"""Decode attention over a paged KV cache: one new query token per sequence, GQA, reading each
sequence's keys and values only up to its own length; the new token's key and value are written
into the cache by the same call.

    paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, scale, k_new, v_new) -> out

q [B, H, D]; k_pages, v_pages [num_pages, KVH, P, D] (one layer's pool); page_table [B, max_pages]
int32 (page ids, in order); seq_lens [B] int32 (tokens in the cache, the new one included);
out [B, H, D] in q's dtype. k_new, v_new [B, KVH, D] (optional): the new token's key and value,
stored at the sequence's last slot (position seq_lens - 1 of its page table) before it is read;
without them that slot must hold them already. The H query heads of one KV head (H / KVH of
them) share the loads of its keys and values: one program per (sequence, KV head) stores the new
key and value, streams the sequence's older pages once with an online softmax in float32, and
adds the new token from registers. The Triton kernel runs on CUDA (and under Triton's
interpreter in the CPU tests); `reference_paged_decode_attention` is the plain torch version it
is tested against, and what runs on the CPU.

Nothing here synchronises with the host, so a decode step that calls it can be captured in a
CUDA graph: the loop bound is read from `seq_lens` on the device. (Triton 3.6's interpreter
cannot loop to a run-time bound: there the loop runs over every column of the page table, masked.)
"""

from __future__ import annotations

import torch


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Attention of each sequence's new query over its cached keys and values, the new key and
    value stored first when given (see module doc). `impl`: "triton" or "torch" (default: triton
    on CUDA, torch otherwise)."""
    if (k_new is None) != (v_new is None):
        raise ValueError("give both k_new and v_new, or neither")
    impl = impl or ("triton" if q.is_cuda else "torch")
    if impl == "torch":
        return reference_paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, scale, k_new, v_new)
    if impl != "triton":
        raise ValueError(f"impl {impl!r}: expected triton or torch")
    from . import triton_decode  # noqa: PLC0415 - triton is optional (CPU installs may lack it)

    return triton_decode.paged_decode(q, k_pages, v_pages, page_table, seq_lens, scale, k_new, v_new)


def last_slot(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of each sequence's last token, the one at seq_lens - 1."""
    last = (seq_lens - 1).long()
    return page_table.gather(1, (last // page_size)[:, None])[:, 0].long(), last % page_size


def reference_paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: store the new key and value (if given), gather each sequence's pages (up to
    the longest sequence), mask the columns past its length, and run SDPA with the KV heads
    shared by their query groups."""
    B, H, D = q.shape
    P = k_pages.shape[2]
    if k_new is not None and v_new is not None:
        page, offset = last_slot(page_table, seq_lens, P)
        k_pages[page, :, offset] = k_new.to(k_pages.dtype)
        v_pages[page, :, offset] = v_new.to(v_pages.dtype)
    pages = -(-int(seq_lens.max()) // P)
    table = page_table[:, :pages].long()
    k = k_pages[table].permute(0, 2, 1, 3, 4).reshape(B, k_pages.shape[1], pages * P, D)
    v = v_pages[table].permute(0, 2, 1, 3, 4).reshape(B, v_pages.shape[1], pages * P, D)
    keep = torch.arange(pages * P, device=q.device)[None, :] < seq_lens[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=keep[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0]
