"""Triton kernels of the embedded engine's sampling (engine/embedded/sampling.py).

`sample_tokens`: one token and its log-prob per row, in one pass over the logits, as the torch
ops of `sampling.sample` give them for rows that filter nothing (greedy rows, seeded rows: the
RL rollout's case; rows of the engine's shared generator come with a seed it drew for the
step). Each program reads one chunk of one row's logits (any float dtype: the graph's bf16
output is read as it is, never copied to float32) and writes four numbers: the best value of
the chunk's draw and its column, and the chunk's max and sum of exp (an online logsumexp); a
few torch ops on [rows, chunks] combine them. Splitting the vocabulary over programs keeps
every SM busy at any batch size (one program per row was latency-bound at large vocabularies).

The draw is exactly the torch ops' (`seeded_argmax` is the single-pass form, kept for the
tests): scaled = logits / temperature (IEEE division; greedy rows divide by 1), then for
seeded rows the argmax of scaled minus Gumbel noise that is a hash of (seed, step, token)
(MurmurHash3's finalizer in int64 arithmetic keeping 32 bits, then log(-log(u)) in float64,
rounded to float32), for greedy rows the argmax of the logits; ties go to the lowest column,
chunk by chunk. The log-prob is scaled[token] - logsumexp(scaled), within float32 rounding of
torch's. The vocabulary size is a compile-time constant (Triton 3.6's interpreter cannot loop
to a run-time bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per iteration (measured fastest of 1024, 2048 and 4096 on the H200)
CHUNK = 8192  # vocabulary columns per program
MARGIN = 1e-3  # the float32 draw's lead that settles a chunk (its noise is within ~1e-4 of the exact)


@triton.jit
def _fmix32(h: tl.tensor) -> tl.tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _row_hash(seed: tl.tensor, step: tl.tensor) -> tl.tensor:
    """sampling._row_hash: the (seed, step) half of the noise, a 32-bit value in int64."""
    s = _fmix32((seed & 0xFFFFFFFF) ^ _fmix32((seed >> 32) & 0xFFFFFFFF))
    return _fmix32(s ^ ((step * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF))


@triton.jit
def _gumbel(s: tl.tensor, cols: tl.tensor) -> tl.tensor:
    """log(-log(u)) of the noise at `cols` for row hash `s`, float64 rounded to float32."""
    h = _fmix32(s ^ _fmix32((cols * 0x27D4EB2F) & 0xFFFFFFFF))
    u = (h.to(tl.float64) + 0.5) / 4294967296.0
    return tl.log(-tl.log(u)).to(tl.float32)


@triton.jit
def _seeded_argmax_kernel(
    x_ptr: tl.tensor,
    stride: tl.tensor,
    row_hash_ptr: tl.tensor,
    out_ptr: tl.tensor,
    V: tl.constexpr,
    BLOCK_V: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(row_hash_ptr + row)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int64)
    for start in tl.range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
        inside = cols < V
        x = tl.load(x_ptr + row * stride + cols, mask=inside, other=float("-inf"))
        val = tl.where(inside, x - _gumbel(s, cols), float("-inf"))
        better = val > best
        best = tl.where(better, val, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_idx, V), axis=0))


def seeded_argmax(x: torch.Tensor, row_hash: torch.Tensor) -> torch.Tensor:
    """x [rows, V] float32 (filtered logits / temperature), row_hash [rows] int64 -> tokens [rows]."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    _seeded_argmax_kernel[(x.shape[0],)](x, x.stride(0), row_hash.contiguous(), out, V=x.shape[1], BLOCK_V=BLOCK)
    return out


@triton.jit
def _fmix32_u(h: tl.tensor) -> tl.tensor:
    """_fmix32 in uint32 arithmetic: the same bits (the int64 form keeps the low 32 of each product)."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _gumbel_approx(s32: tl.tensor, cols: tl.tensor) -> tl.tensor:
    """log(-log(u)) of the same noise in float32 arithmetic, within ~1e-4 of `_gumbel` (-log(u) for
    u near 1 through its series in 1 - u, where 1 - u in float32 would lose it)."""
    h = _fmix32_u(s32 ^ _fmix32_u(cols.to(tl.uint32) * 0x27D4EB2F))
    u = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    w = ((h ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 1 - u
    e = tl.where(w < 0.0009765625, w * (1.0 + w * (0.5 + w * 0.3333333333333333)), -tl.log(u))
    return tl.log(e)


@triton.jit
def _scaled_chunk(
    x_ptr: tl.tensor,
    row: tl.tensor,
    stride: tl.tensor,
    temp_ptr: tl.tensor,
    cols: tl.tensor,
    V: tl.constexpr,
    UNIT: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """A block of one row's logits at `cols` in float32 (-inf past the vocabulary) and the same
    divided by the row's temperature (IEEE division; UNIT: every temperature is 1)."""
    x = tl.load(x_ptr + row * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    xs = x
    if not UNIT:
        xs = tl.div_rn(x, tl.load(temp_ptr + row))
    return x, xs


@triton.jit
def _sample_chunks_kernel(
    x_ptr: tl.tensor,
    stride: tl.tensor,
    temp_ptr: tl.tensor,
    seed_ptr: tl.tensor,
    step_ptr: tl.tensor,
    draw_ptr: tl.tensor,
    best_ptr: tl.tensor,
    best_idx_ptr: tl.tensor,
    max_ptr: tl.tensor,
    sum_ptr: tl.tensor,
    V: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNK_V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    UNIT: tl.constexpr,
    MARGIN: tl.constexpr,
) -> None:
    """One chunk of one row. The draw runs in float32 (the noise within ~1e-4 of the exact one),
    keeping each lane's best two; where the chunk's best leads its second by more than MARGIN
    (plus float32 rounding) it is the exact draw's winner too, and only its value is computed
    exactly; otherwise (ties, near-ties: rare) the chunk is drawn again exactly."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    drawn = tl.load(draw_ptr + row) != 0
    s = _row_hash(tl.load(seed_ptr + row), tl.load(step_ptr + row))
    s32 = s.to(tl.uint32)
    first = chunk * CHUNK_V
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    second = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    m = tl.full([], float("-inf"), tl.float32)  # the chunk's running max and sum of exp (one exp per column)
    acc = tl.zeros([], tl.float32)
    for start in tl.range(0, CHUNK_V, BLOCK_V):
        cols = first + start + tl.arange(0, BLOCK_V)  # (int32: a vocabulary is far below 2**31)
        x, xs = _scaled_chunk(x_ptr, row, stride, temp_ptr, cols, V, UNIT)
        val = tl.where(drawn, xs - _gumbel_approx(s32, cols), x)
        val = tl.where(cols < V, val, float("-inf"))
        better = val > best
        second = tl.where(better, best, tl.maximum(second, val))
        best = tl.where(better, val, best)
        best_idx = tl.where(better, cols, best_idx)
        m_new = tl.maximum(m, tl.max(xs, axis=0))
        base = tl.where(m_new > float("-inf"), m_new, 0.0)  # (no -inf - -inf)
        acc = acc * tl.exp(m - base) + tl.sum(tl.exp(xs - base), axis=0)
        m = m_new
    top = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == top, best_idx, V), axis=0).to(tl.int64)
    runner_up = tl.maximum(tl.max(second, axis=0), tl.max(tl.where(best_idx == idx, float("-inf"), best), axis=0))
    if drawn & (top > float("-inf")):
        if top - runner_up > MARGIN + 1e-5 * tl.abs(top):  # the float32 winner is the exact one
            xw = tl.load(x_ptr + row * stride + idx).to(tl.float32)
            if not UNIT:
                xw = tl.div_rn(xw, tl.load(temp_ptr + row))
            top = xw - _gumbel(s, idx)
        else:  # too close to call in float32: the exact draw over the chunk
            exact = tl.full([BLOCK_V], float("-inf"), tl.float32)
            exact_idx = tl.zeros([BLOCK_V], tl.int64)
            for start in tl.range(0, CHUNK_V, BLOCK_V):
                cols = (first + start + tl.arange(0, BLOCK_V)).to(tl.int64)
                _, xs = _scaled_chunk(x_ptr, row, stride, temp_ptr, cols, V, UNIT)
                val = tl.where(cols < V, xs - _gumbel(s, cols), float("-inf"))
                better = val > exact
                exact = tl.where(better, val, exact)
                exact_idx = tl.where(better, cols, exact_idx)
            top = tl.max(exact, axis=0)
            idx = tl.min(tl.where(exact == top, exact_idx, V), axis=0)
    idx = tl.where(top == float("-inf"), 0, idx)  # (nothing finite: column 0, as torch.argmax)
    out = row * CHUNKS + chunk
    tl.store(best_ptr + out, top)
    tl.store(best_idx_ptr + out, idx)
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, acc)


def sample_tokens(
    x: torch.Tensor,
    temps: torch.Tensor | None,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    drawn: torch.Tensor,
    margin: float = MARGIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, V] logits (any float dtype, rows contiguous); temps [rows] float32 (greedy rows
    1; None: every row 1); seeds, steps [rows] int64; drawn [rows] int8 (True: a seeded draw,
    False: the argmax) -> (tokens [rows] int64, log-probs [rows] float32). `margin`: how far the
    float32 draw's best must lead to be taken without the exact draw over its chunk (the
    tests set it to inf to run the exact draw everywhere)."""
    rows, vocab = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    chunks = -(-vocab // CHUNK)
    dev = x.device
    best = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    best_idx = torch.empty(rows, chunks, dtype=torch.int64, device=dev)
    cmax = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    csum = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    unit = temps is None
    _sample_chunks_kernel[(rows, chunks)](
        x,
        x.stride(0),
        seeds if unit else temps,  # (unread when UNIT)
        seeds,
        steps,
        drawn,
        best,
        best_idx,
        cmax,
        csum,
        V=vocab,
        CHUNKS=chunks,
        CHUNK_V=CHUNK,
        BLOCK_V=min(BLOCK, CHUNK),
        UNIT=unit,
        MARGIN=margin,
    )
    tokens = best_idx.gather(1, best.argmax(dim=1, keepdim=True))[:, 0]
    top = cmax.max(dim=1, keepdim=True).values
    lse = top[:, 0] + torch.log((csum * torch.exp(cmax - top)).sum(dim=1))
    picked = x.gather(1, tokens[:, None])[:, 0].float()
    if temps is not None:
        picked = picked / temps
    return tokens, picked - lse
