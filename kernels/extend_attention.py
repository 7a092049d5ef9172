"""Extend attention over a paged KV cache: each row's new query tokens (a prompt that goes on from
keys already in its pages: a later turn, a prefix-cache hit) attend causally over the row's
keys, read where they are in the pool.

    paged_extend_attention(q, k_pages, v_pages, table, q_start, q_len, ctx_len, scale) -> out

q [T, H, D] (the packed prefill's queries, any strides with the last dim contiguous); k_pages,
v_pages [num_pages, KVH, P, D] (one layer's pool, the new tokens' keys and values written there
already); table [R, max_pages] int32 (row r's pages in order, padded with any page id); q_start,
q_len, ctx_len [R] int32: row r's queries are q[q_start : q_start + q_len], at positions
ctx_len .. ctx_len + q_len - 1, and its keys are positions 0 .. ctx_len + q_len - 1 of its pages.
Returns out [T, H, D] in q's dtype holding every row's outputs at its queries' places (others
unwritten). The H / KVH query heads of one KV head share the loads of its keys: one program per
(row, KV head, block of query tokens) streams the row's pages once with an online softmax in
float32. The Triton kernel runs on CUDA (and under Triton's interpreter in the CPU tests);
`reference_paged_extend_attention` is the plain torch version it is tested against: each row's
pages gathered into one tensor first, which the kernel never builds.
"""

from __future__ import annotations

import torch


def paged_extend_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
    max_q_len: int,
    impl: str | None = None,
) -> torch.Tensor:
    """See the module doc. `max_q_len`: the largest of `q_len` (the host knows it: no read of
    the device's). `impl`: "triton" or "torch" (default: triton on CUDA, torch otherwise)."""
    impl = impl or ("triton" if q.is_cuda else "torch")
    if impl == "torch":
        return reference_paged_extend_attention(q, k_pages, v_pages, table, q_start, q_len, ctx_len, scale)
    if impl != "triton":
        raise ValueError(f"impl {impl!r}: expected triton or torch")
    from . import triton_extend  # noqa: PLC0415 - triton is optional (CPU installs may lack it)

    return triton_extend.paged_extend(q, k_pages, v_pages, table, q_start, q_len, ctx_len, scale, max_q_len)


def reference_paged_extend_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch, a row at a time: its pages gathered, causal SDPA with the KV heads shared by
    their query groups."""
    out = torch.empty_like(q)
    P = k_pages.shape[2]
    for r in range(table.shape[0]):
        s, n, c = int(q_start[r]), int(q_len[r]), int(ctx_len[r])
        if n == 0:
            continue
        keys = c + n
        pages = table[r, : -(-keys // P)].long()
        k = k_pages[pages].transpose(0, 1).reshape(k_pages.shape[1], -1, k_pages.shape[3])[:, :keys]
        v = v_pages[pages].transpose(0, 1).reshape(v_pages.shape[1], -1, v_pages.shape[3])[:, :keys]
        mask = torch.arange(keys, device=q.device)[None, :] <= (c + torch.arange(n, device=q.device))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[s : s + n].transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[s : s + n] = o[0].transpose(0, 1)
    return out
