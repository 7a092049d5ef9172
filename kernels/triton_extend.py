"""Triton kernel of `extend_attention.paged_extend_attention` (see there for the contract).

One program per (row, KV head, block of BLOCK_T query tokens): its BLOCK_T x G queries (the G =
H / KVH query heads of that KV head, for each token) are one tile of rows, loaded once; it walks
the row's pages in order up to its last query's position, one page of P keys per iteration:
scores by tl.dot, the causal mask (a key at or before the query's position), an online softmax in
float32, and the weighted values by a second tl.dot (`triton_decode.page_step`, the decode
kernel's step too). Each key and value is read once per block of queries, from its page: nothing
is gathered.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import STAGES, interpreted, page_step

BLOCK_T = 16  # query tokens per program


@triton.jit(do_not_specialize=["max_pages"])
def _paged_extend_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    table_ptr: tl.tensor,
    qstart_ptr: tl.tensor,
    qlen_ptr: tl.tensor,
    ctx_ptr: tl.tensor,
    out_ptr: tl.tensor,
    scale: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_kp: tl.tensor,
    stride_kh: tl.tensor,
    stride_kn: tl.tensor,
    stride_tb: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    max_pages: tl.tensor,  # (the table's width: the interpreter's loop bound; no kernel per width)
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    DYNAMIC: tl.constexpr,
    IEEE: tl.constexpr,
    STAGES: tl.constexpr,
) -> None:
    r = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    t0 = tl.program_id(2) * BLOCK_T
    m = tl.arange(0, BLOCK_T * BLOCK_G)
    t = t0 + m // BLOCK_G  # each tile row's query token (within the row) and head (within the group)
    g = m % BLOCK_G
    d = tl.arange(0, D)
    n = tl.arange(0, P)
    q_len = tl.load(qlen_ptr + r)
    first = tl.load(qstart_ptr + r).to(tl.int64)
    ctx = tl.load(ctx_ptr + r)
    live = (t < q_len) & (g < G)
    pos = ctx + t  # each query's position: it sees the keys at or before it
    tok = first + t
    heads = kvh * G + g
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=live[:, None], other=0.0
    )
    length = ctx + q_len
    m_i = tl.full([BLOCK_T * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_T * BLOCK_G, D], tl.float32)
    if DYNAMIC:
        hi = tl.minimum(length, ctx + t0 + BLOCK_T)  # (the block's last query's position, plus one)
    else:
        hi = max_pages * P
    for start in tl.range(0, hi, P, num_stages=STAGES):
        page = tl.load(table_ptr + r * stride_tb + start // P).to(tl.int64)
        cols = start + n
        kmask = cols < length
        # Key 0 is at or before every query: a row's maximum is finite from the first page on.
        visible = kmask[None, :] & (cols[None, :] <= pos[:, None])
        m_i, l_i, acc = page_step(
            q,
            k_ptr,
            v_ptr,
            page * stride_kp + kvh * stride_kh,
            n,
            d,
            stride_kn,
            kmask,
            visible,
            m_i,
            l_i,
            acc,
            scale,
            IEEE,
        )
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live[:, None],
    )


def paged_extend(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    ctx_len: torch.Tensor,
    scale: float,
    max_q_len: int,
) -> torch.Tensor:
    T, H, D = q.shape
    _, KVH, P, Dk = k_pages.shape
    if Dk != D or H % KVH or k_pages.shape != v_pages.shape or k_pages.stride() != v_pages.stride():
        raise ValueError(f"q {tuple(q.shape)} does not fit KV pages {tuple(k_pages.shape)} / {tuple(v_pages.shape)}")
    if D & (D - 1) or P & (P - 1) or P < 16 or q.stride(2) != 1:
        raise ValueError(f"head dim {D} and page size {P} must be powers of two (page size >= 16), q's last dim dense")
    out = torch.empty_like(q)
    R = table.shape[0]
    if R == 0 or max_q_len == 0:
        return out
    G = H // KVH
    _paged_extend_kernel[(R, KVH, triton.cdiv(max_q_len, BLOCK_T))](
        q,
        k_pages,
        v_pages,
        table,
        q_start,
        q_len,
        ctx_len,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        table.shape[1],
        G=G,
        BLOCK_G=triton.next_power_of_2(G),
        BLOCK_T=BLOCK_T,
        D=D,
        P=P,
        DYNAMIC=not interpreted(),
        IEEE=q.dtype == torch.float32,
        STAGES=STAGES,
        num_warps=4,
    )
    return out
