"""Triton kernel of `decode_attention.paged_decode_attention` (see there for the contract).

One program per (sequence, KV head): it loads the G = H / KVH query heads of that KV head once
(padded to 16 rows, the smallest tl.dot), then walks the sequence's pages in order, one page of
P tokens per iteration: scores by tl.dot, an online softmax in float32, and the weighted values
by a second tl.dot. Each key and value of the sequence is read once for all its query heads.
With the new token's key and value given, the program first stores them in the sequence's last
slot and starts its softmax from them (held in registers), then reads the pages up to the token
before: it never reads what it has just written, and the store costs no kernel of its own.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Pages in flight per program (software pipelining): 2 measured best on the H200 (3 no better,
# 1 slower).
STAGES = 2


def interpreted() -> bool:
    """Whether Triton runs in its interpreter (the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def page_step(
    q: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    page_base: tl.tensor,
    n: tl.tensor,
    d: tl.tensor,
    stride_kn: tl.tensor,
    kmask: tl.tensor,
    visible: tl.tensor,
    m: tl.tensor,
    s_sum: tl.tensor,
    acc: tl.tensor,
    scale: tl.tensor,
    IEEE: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One page of an online softmax, shared by the decode and extend kernels: the page's keys and
    values at `page_base` (the page's offset plus the KV head's) where `kmask` (its tokens held),
    the scores of the tile of queries `q` [rows, D] by tl.dot, `visible` [rows, P] keeping the
    ones each query sees, and the running maximum `m`, sum `s_sum` and weighted values `acc`
    [rows, D] (float32) carried on. Returns the new (m, s_sum, acc)."""
    base = page_base + n[:, None] * stride_kn + d[None, :]
    k = tl.load(k_ptr + base, mask=kmask[:, None], other=0.0)
    v = tl.load(v_ptr + base, mask=kmask[:, None], other=0.0)  # (issued with the keys)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    s_sum = s_sum * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, s_sum, acc


@triton.jit(do_not_specialize=["max_pages"])
def _paged_decode_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    table_ptr: tl.tensor,
    lens_ptr: tl.tensor,
    out_ptr: tl.tensor,
    kn_ptr: tl.tensor,
    vn_ptr: tl.tensor,
    scale: tl.tensor,
    stride_qb: tl.tensor,
    stride_qh: tl.tensor,
    stride_kp: tl.tensor,
    stride_kh: tl.tensor,
    stride_kn: tl.tensor,
    stride_tb: tl.tensor,
    stride_ob: tl.tensor,
    stride_oh: tl.tensor,
    stride_nb: tl.tensor,
    stride_nh: tl.tensor,
    max_pages: tl.tensor,  # (the table's width: the interpreter's loop bound; no kernel per width)
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    DYNAMIC: tl.constexpr,
    IEEE: tl.constexpr,
    NEW: tl.constexpr,
    STAGES: tl.constexpr,
) -> None:
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    n = tl.arange(0, P)
    heads = kvh * G + g
    gmask = g < G
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    length = tl.load(lens_ptr + b)
    if NEW:  # the new token: stored in its slot, and the softmax's first term
        length -= 1
        slot = tl.load(table_ptr + b * stride_tb + length // P).to(tl.int64) * stride_kp + kvh * stride_kh
        slot += (length % P) * stride_kn
        k_new = tl.load(kn_ptr + b * stride_nb + kvh * stride_nh + d).to(k_ptr.dtype.element_ty)
        v_new = tl.load(vn_ptr + b * stride_nb + kvh * stride_nh + d).to(v_ptr.dtype.element_ty)
        tl.store(k_ptr + slot + d, k_new)
        tl.store(v_ptr + slot + d, v_new)
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale  # (exp(s - m) = 1)
        s_sum = tl.full([BLOCK_G], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32) + v_new.to(tl.float32)[None, :]
    else:
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        s_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
    if DYNAMIC:
        hi = length
    else:
        hi = max_pages * P
    for start in tl.range(0, hi, P, num_stages=STAGES):
        page = tl.load(table_ptr + b * stride_tb + start // P).to(tl.int64)
        nmask = start + n < length
        m, s_sum, acc = page_step(
            q,
            k_ptr,
            v_ptr,
            page * stride_kp + kvh * stride_kh,
            n,
            d,
            stride_kn,
            nmask,
            nmask[None, :],
            m,
            s_sum,
            acc,
            scale,
            IEEE,
        )
    out = acc / s_sum[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=gmask[:, None],
    )


def paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    B, H, D = q.shape
    _, KVH, P, Dk = k_pages.shape
    if Dk != D or H % KVH or k_pages.shape != v_pages.shape or k_pages.stride() != v_pages.stride():
        raise ValueError(f"q {tuple(q.shape)} does not fit KV pages {tuple(k_pages.shape)} / {tuple(v_pages.shape)}")
    if D & (D - 1) or P & (P - 1) or P < 16:
        raise ValueError(f"head dim {D} and page size {P} must be powers of two (page size >= 16)")
    q = q.contiguous()
    out = torch.empty_like(q)
    G = H // KVH
    if k_new is None or v_new is None:
        new, k_new, v_new = False, q, q  # (not read)
    else:
        if k_new.shape != (B, KVH, D) or v_new.shape != (B, KVH, D):
            raise ValueError(f"new keys / values must be {(B, KVH, D)}")
        new, k_new, v_new = True, k_new.contiguous(), v_new.contiguous()
    _paged_decode_kernel[(B, KVH)](
        q,
        k_pages,
        v_pages,
        page_table,
        seq_lens,
        out,
        k_new,
        v_new,
        scale,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        page_table.shape[1],
        G=G,
        BLOCK_G=max(16, triton.next_power_of_2(G)),
        D=D,
        P=P,
        DYNAMIC=not interpreted(),
        IEEE=q.dtype == torch.float32,
        NEW=new,
        STAGES=STAGES,
        num_warps=4,
    )
    return out
