"""The embedded engine's paged path (engine/embedded/: paged.py, batching.py, kv_pool.py, graphs.py):
paged KV cache, continuous batching, shared prompt pages, and the decode-attention kernel it reads the
cache with.

On CPU the paged path runs when asked for (`decode="paged"`; the CPU default stays on
transformers' own cache) with the torch reference attention, without CUDA graphs; the Triton
kernel runs under Triton's interpreter. What only a GPU has (the Triton kernel compiled, CUDA
graphs, device memory) is tested in test_gpu.py on the H200.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import replace

import pytest
import torch
import transformers

from models import hf_greedy, make_model
from rltrain.engine.embedded import batching
from rltrain.engine.embedded.engine import EmbeddedEngine
from rltrain.engine.embedded.kv_pool import PAGE_SIZE
from rltrain.generation import SamplingParams
from rltrain.kernels.decode_attention import paged_decode_attention, reference_paged_decode_attention
from rltrain.kernels.extend_attention import paged_extend_attention, reference_paged_extend_attention


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("paged") / "m", 3, arch="qwen3", hidden=64, layers=2)


@pytest.fixture(scope="module")
def engines(model):
    hf = EmbeddedEngine(str(model), decode="hf")
    paged = EmbeddedEngine(str(model), decode="paged", max_total_tokens=64 * PAGE_SIZE)
    yield hf, paged
    hf.shutdown()
    paged.shutdown()


def run(engine, prompts, params, logprob=True):
    return engine.submit(prompts, params, logprob).result(timeout=120)


def logprobs(sample):
    return [t[0] for t in sample["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("new", [False, True], ids=["cached", "new-kv"])
@pytest.mark.parametrize("groups,pages", [(1, [3, 1, 2]), (2, [1, 2, 3]), (4, [2, 2, 1])])
def test_decode_kernel_reads_each_row_to_its_length_like_the_reference(groups, pages, new):
    """The Triton kernel (interpreted) against the torch reference, and the reference against
    attention over exactly the row's tokens. With `new`, the row's last token's key and value
    are given to the call: both store them in the row's last slot (nothing else in the pool
    changes) and attend over them; a row of one token attends to its new token alone."""
    torch.manual_seed(groups)
    kvh, D, P = 2, 32, 16
    B, H = len(pages) + 1, kvh * groups
    pool = 12
    k, v = torch.randn(pool, kvh, P, D), torch.randn(pool, kvh, P, D)
    order = torch.randperm(pool - 1)[: sum(pages) + 1] + 1
    table = torch.zeros(B, 4, dtype=torch.int32)
    at = 0
    for b, n in enumerate([*pages, 1]):
        table[b, :n] = order[at : at + n]
        at += n
    lens = torch.tensor([n * P - b * 5 for b, n in enumerate(pages)] + [1], dtype=torch.int32)
    q = torch.randn(B, H, D)
    k_new, v_new = (torch.randn(B, kvh, D), torch.randn(B, kvh, D)) if new else (None, None)
    pools = [(k.clone(), v.clone()) for _ in range(2)]
    out = paged_decode_attention(q, *pools[0], table, lens, D**-0.5, k_new, v_new, impl="triton")
    ref = reference_paged_decode_attention(q, *pools[1], table, lens, D**-0.5, k_new, v_new)
    assert torch.allclose(out, ref, atol=1e-5)
    written = torch.zeros(pool, kvh, P, dtype=torch.bool)
    for b in range(B):
        page, offset = int(table[b, (lens[b] - 1) // P]), int((lens[b] - 1) % P)
        if new:
            written[page, :, offset] = True
            for kk, vv in pools:
                assert torch.equal(kk[page, :, offset], k_new[b]) and torch.equal(vv[page, :, offset], v_new[b])
    for kk, vv in pools:  # nothing else written
        assert torch.equal(kk[~written], k[~written]) and torch.equal(vv[~written], v[~written])
    k, v = pools[1]
    for b in range(B):  # and the reference is attention over exactly the row's tokens
        n = int(-(-lens[b] // P))
        kk = torch.cat([k[int(p)] for p in table[b, :n]], dim=1)[:, : lens[b]]
        vv = torch.cat([v[int(p)] for p in table[b, :n]], dim=1)[:, : lens[b]]
        for h in range(H):
            w = torch.softmax(q[b, h] @ kk[h // groups].T * D**-0.5, -1)
            assert torch.allclose(ref[b, h], w @ vv[h // groups], atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_extend_kernel_reads_each_rows_pages_causally_like_the_reference(groups):
    """The Triton extend kernel (interpreted) against the torch reference, and the reference
    against attention over exactly the row's keys: rows of new queries after cached keys (a page
    boundary inside and across), one of more than a block of queries, one with no cached key, one
    with no query at all; the rows' queries packed after a whole prompt's, which stays unwritten."""
    torch.manual_seed(groups)
    kvh, D, P = 2, 32, 16
    H = kvh * groups
    # (cached keys, new queries) per row
    rows = [(5, 3), (16, 20), (0, 7), (33, 1), (9, 0)]
    pool = 20
    k, v = torch.randn(pool, kvh, P, D), torch.randn(pool, kvh, P, D)
    order = (torch.randperm(pool - 1) + 1).tolist()
    table = torch.zeros(len(rows), 4, dtype=torch.int32)
    for r, (c, n) in enumerate(rows):
        for j in range(-(-(c + n) // P)):
            table[r, j] = order.pop()
    whole = 6  # a whole prompt's queries first in the pack
    starts = [whole + sum(n for _, n in rows[:r]) for r in range(len(rows))]
    T = whole + sum(n for _, n in rows)
    q = torch.randn(H, T, D).transpose(0, 1)  # [T, H, D] as the prefill holds it: tokens not outermost
    args = (
        table,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([n for _, n in rows], dtype=torch.int32),
        torch.tensor([c for c, _ in rows], dtype=torch.int32),
        D**-0.5,
    )
    out = paged_extend_attention(q, k, v, *args, max(n for _, n in rows), impl="triton")
    ref = reference_paged_extend_attention(q, k, v, *args)
    assert torch.allclose(out[whole:], ref[whole:], atol=1e-5)
    for r, (c, n) in enumerate(rows):
        keys = torch.cat([k[int(p)] for p in table[r, : -(-(c + n) // P)]], dim=1)
        vals = torch.cat([v[int(p)] for p in table[r, : -(-(c + n) // P)]], dim=1)
        for i in range(n):
            for h in range(H):
                w = torch.softmax(q[starts[r] + i, h] @ keys[h // groups, : c + i + 1].T * D**-0.5, -1)
                assert torch.allclose(ref[starts[r] + i, h], w @ vals[h // groups, : c + i + 1], atol=1e-5)


class _Recorded:
    """A Triton kernel whose launches record their keyword arguments (the constexprs)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append(kwargs)
            return launch(*args, **kwargs)

        return run


def test_the_attention_kernels_take_any_table_width_without_a_kernel_of_its_own(monkeypatch):
    """Triton compiles a kernel for every value of a constexpr argument. The page table's width
    (the pages of the call's longest row) changes with nearly every prefill of a multi-turn
    rollout as contexts grow; as a constexpr it compiled the extend kernel again at each new
    width on the GPU (a JIT compile inside the rollout, up to one per context length). It is a
    runtime argument now: launches over tables of different widths pass the same constexprs
    (test_gpu.py counts the compiled kernels on the GPU)."""
    from rltrain.kernels import triton_decode, triton_extend

    kvh, D, P, pool = 2, 32, 16, 12
    k, v = torch.randn(pool, kvh, P, D), torch.randn(pool, kvh, P, D)
    extend = _Recorded(triton_extend._paged_extend_kernel)
    decode = _Recorded(triton_decode._paged_decode_kernel)
    monkeypatch.setattr(triton_extend, "_paged_extend_kernel", extend)
    monkeypatch.setattr(triton_decode, "_paged_decode_kernel", decode)
    for width in (2, 5):
        table = torch.arange(1, 1 + 2 * width, dtype=torch.int32).reshape(2, width) % (pool - 1) + 1
        q = torch.randn(6, 2 * kvh, D)
        starts, lens, ctx = (torch.tensor(x, dtype=torch.int32) for x in ([0, 3], [3, 3], [P * width - 3] * 2))
        ref = reference_paged_extend_attention(q, k, v, table, starts, lens, ctx, D**-0.5)
        out = paged_extend_attention(q, k, v, table, starts, lens, ctx, D**-0.5, 3, impl="triton")
        assert torch.allclose(out, ref, atol=1e-5)
        lens = torch.tensor([P * width, P * width - 5], dtype=torch.int32)
        q = torch.randn(2, 2 * kvh, D)
        out = paged_decode_attention(q, k, v, table, lens, D**-0.5, impl="triton")
        assert torch.allclose(out, reference_paged_decode_attention(q, k, v, table, lens, D**-0.5), atol=1e-5)
    for kernel in (extend, decode):
        assert len(kernel.launches) == 2 and kernel.launches[0] == kernel.launches[1], kernel.launches


def test_paged_path_samples_what_the_plain_path_does(engines):
    """Same tokens, and log-probs equal to float rounding, for every sampling feature: greedy,
    seeded samples of a shared prompt, stop tokens, min_new_tokens, penalties, logit bias,
    top-k/top-p/min-p."""
    hf, paged = engines
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9] * 30, [3] * PAGE_SIZE, [5, 6]]
    cases = [
        SamplingParams(max_new_tokens=20, temperature=0.0),
        SamplingParams(max_new_tokens=24, temperature=1.0, n=3, sampling_seed=5),
        SamplingParams(max_new_tokens=12, temperature=0.8, sampling_seed=9, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(
            max_new_tokens=12,
            temperature=1.0,
            sampling_seed=1,
            min_new_tokens=6,
            stop_token_ids=[17, 40],
            frequency_penalty=0.5,
            presence_penalty=0.3,
            repetition_penalty=1.2,
            logit_bias={11: 5.0},
        ),
        # rows that finish at different steps leave a batch whose next step is already queued
        # (the overlapped schedule): its sampling plan and penalty counts follow the rows left
        SamplingParams(
            max_new_tokens=16,
            temperature=1.0,
            n=3,
            sampling_seed=7,
            stop_token_ids=list(range(0, 200, 3)),
            frequency_penalty=0.4,
            repetition_penalty=1.1,
        ),
    ]
    for params in cases:
        a, b = run(hf, prompts, params), run(paged, prompts, params)
        assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b], params
        assert [x["meta_info"]["finish_reason"] for x in a] == [y["meta_info"]["finish_reason"] for y in b]
        for x, y in zip(a, b):
            assert logprobs(y) == pytest.approx(logprobs(x), abs=1e-4)
    greedy = run(paged, prompts, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    assert [x["output_ids"] for x in greedy] == hf_greedy(paged.model_path, prompts, 10)


@pytest.mark.parametrize("temperature,margin", [(1.0, None), (0.7, None), (1.0, float("inf"))])
def test_fused_sampling_kernel_picks_the_torch_ops_tokens(temperature, margin):
    """kernels/triton_sampling.sample_tokens (the CUDA path's one pass; here under Triton's
    interpreter) against sampling.sample's torch ops: the same token for greedy and seeded
    rows over several vocabulary chunks, -inf columns included, and the same log-prob."""
    from rltrain.engine.embedded.sampling import SamplingPlan, sample
    from rltrain.kernels.triton_sampling import CHUNK, sample_tokens

    torch.manual_seed(0)
    from rltrain.kernels.triton_sampling import MARGIN

    margin = MARGIN if margin is None else margin  # (inf: the exact draw over every chunk)
    rows, vocab = 6, 2 * CHUNK + 123
    x = torch.randn(rows, vocab) * 3
    x[1, : CHUNK + 5] = float("-inf")
    x[2, 7] = 40.0  # (a clear winner in the first chunk)
    params = [SamplingParams(temperature=0.0 if b == 3 else temperature) for b in range(rows)]
    seeds = [None if b == 3 else 1000 * b - 2**40 for b in range(rows)]
    steps = torch.tensor([0, 5, 9, 2, 300, 7])
    plan = SamplingPlan(params, seeds, vocab, torch.device("cpu"))
    want, want_lp = sample(x, plan, steps, torch.Generator())
    temps = None if temperature == 1.0 else torch.where(plan.temps == 0, 1.0, plan.temps)
    drawn = torch.tensor([b != 3 for b in range(rows)], dtype=torch.int8)
    got, got_lp = sample_tokens(x, temps, torch.tensor([s or 0 for s in seeds]), steps, drawn, margin)
    assert torch.equal(got, want)
    assert torch.allclose(got_lp, want_lp, atol=1e-5)
    got_bf16, _ = sample_tokens(x.bfloat16(), temps, torch.tensor([s or 0 for s in seeds]), steps, drawn, margin)
    want_bf16, _ = sample(x.bfloat16(), plan, steps, torch.Generator())
    assert torch.equal(got_bf16, want_bf16)  # (bf16 logits are read as they are)


def test_overlapped_steps_end_with_the_rows(engines):
    """The schedule queues step t+1 before reading step t, yet no step runs past a request whose
    rows all end by length (nothing left queued for a release that follows to race), and rows
    that stop early leave the batch: as many decode steps as the longest row needs."""
    _, paged = engines
    before = paged.decoder.stats["decode_steps"]
    run(paged, [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=9, temperature=1.0, sampling_seed=1, ignore_eos=True))
    assert paged.decoder.stats["decode_steps"] - before == 8  # (the prefill samples the first token)


def test_the_serial_schedule_samples_exactly_what_the_overlapped_one_does(engines, model):
    """--disable-overlap-schedule (each step read before the next is queued: bench.engine's
    baseline for the host time per step) changes when the host reads, nothing it samples: tokens,
    finish reasons equal, log-probs to float rounding (a row that ends leaves the batch one step
    sooner here, so later steps' matmuls have other shapes), rows that stop early included."""
    _, paged = engines
    serial = EmbeddedEngine(str(model), decode="paged", max_total_tokens=64 * PAGE_SIZE, overlap=False)
    try:
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9] * 30, [5, 6]]
        for params in (
            SamplingParams(max_new_tokens=20, temperature=0.0),
            SamplingParams(
                max_new_tokens=16, temperature=1.0, n=3, sampling_seed=7, stop_token_ids=[*range(0, 200, 3)]
            ),
            SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=1, min_new_tokens=6, stop_token_ids=[17]),
        ):
            a, b = run(paged, prompts, params), run(serial, prompts, params)
            assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b], params
            for x, y in zip(a, b):
                assert logprobs(y) == pytest.approx(logprobs(x), abs=1e-5)
            assert [x["meta_info"]["finish_reason"] for x in a] == [y["meta_info"]["finish_reason"] for y in b]
        # Each step read before the next: no step is queued past the rows' end (9 tokens: 8 decode steps).
        before = serial.decoder.stats["decode_steps"]
        run(serial, [[1, 2, 3]], SamplingParams(max_new_tokens=9, temperature=1.0, sampling_seed=1, ignore_eos=True))
        assert serial.decoder.stats["decode_steps"] - before == 8
    finally:
        serial.shutdown()


@pytest.mark.parametrize("pieces", [False, True], ids=["prefill-at-once", "prefill-in-pieces"])
def test_rows_join_and_leave_between_steps_each_as_if_alone(engines, model, pieces):
    """Continuous batching: a short request sent while a long one decodes joins it (its prefill
    at once or in pieces between the long one's steps), finishes first (it does not wait for
    the long one's batch), and every sample is what it is alone."""
    _, paged = engines
    if pieces:
        paged = EmbeddedEngine(str(model), decode="paged", max_total_tokens=64 * PAGE_SIZE, prefill_pieces=True)
        try:
            _join_and_leave(paged)
            assert paged.decoder.stats["prefills_in_pieces"] == 1
        finally:
            paged.shutdown()
    else:
        _join_and_leave(paged)


def _join_and_leave(paged):
    long = SamplingParams(max_new_tokens=300, temperature=1.0, sampling_seed=3, ignore_eos=True)
    short = SamplingParams(max_new_tokens=4, temperature=1.0, sampling_seed=4, n=2, ignore_eos=True)
    alone_long, alone_short = run(paged, [[1, 2, 3]], long), run(paged, [[9, 9]], short)
    prefills = paged.decoder.stats["prefills"]
    f_long = paged.submit([[1, 2, 3]], long, True)
    while paged.decoder.stats["prefills"] == prefills:
        time.sleep(0.005)
    f_short = paged.submit([[9, 9]], short, True)
    got_short = f_short.result(timeout=120)
    assert not f_long.done(), "the short request waited for the long one"
    assert [x["output_ids"] for x in got_short] == [x["output_ids"] for x in alone_short]
    assert [x["output_ids"] for x in f_long.result(timeout=120)] == [x["output_ids"] for x in alone_long]
    paged.flush_cache()  # (the prefix cache keeps the finished rows' pages)
    assert paged.decoder.pool.free == paged.decoder.pool.pages - 1  # every page back


def test_rows_that_join_running_rows_sample_what_they_sample_alone(engines):
    """Requests admitted while a row decodes (its penalty counts on the device) join its batch:
    the next step is queued behind their prefill before their first tokens are read (its inputs,
    still on the device), the batch's device state appended to, its penalty counts, biases and
    plan included. Joiners with penalties, a logit bias, a first token that stops the row (it
    leaves the batch with a step computed for it) and min_new_tokens (its first token read from
    the host: the state rebuilt) each answer what they answer alone, the running row too; every
    page comes back."""
    _, paged = engines
    long = SamplingParams(max_new_tokens=200, temperature=1.0, sampling_seed=3, ignore_eos=True, frequency_penalty=0.3)
    joiners = [
        ([[9, 9, 8]], SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=4, n=2, ignore_eos=True)),
        ([[4, 4, 4, 4]], SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=5, repetition_penalty=1.3)),
        ([[6, 5]], SamplingParams(max_new_tokens=9, temperature=0.0, logit_bias={11: 2.0}, presence_penalty=0.5)),
        ([[2, 7, 2]], SamplingParams(max_new_tokens=7, temperature=1.0, stop_token_ids=[17], logit_bias={17: 100.0})),
        ([[3, 1]], SamplingParams(max_new_tokens=5, temperature=1.0, sampling_seed=8, min_new_tokens=3)),
    ]
    alone = [[x["output_ids"] for x in run(paged, p, q)] for p, q in [([[1, 2, 3]], long), *joiners]]
    assert alone[4] == [[17]]  # (the stopping joiner's first token stops it)
    stats = paged.decoder.stats
    unread = stats["admits_unread"]
    f_long = paged.submit([[1, 2, 3]], long, True)
    got = []
    for prompts, params in joiners:
        steps = stats["decode_steps"]
        while stats["decode_steps"] < steps + 3:
            time.sleep(0.002)
        got.append(paged.submit(prompts, params, True).result(timeout=120))
    assert not f_long.done(), "the joiners waited for the long request"
    assert [[x["output_ids"] for x in g] for g in got] == alone[1:]
    assert [x["output_ids"] for x in f_long.result(timeout=120)] == alone[0]
    assert got[3][0]["meta_info"]["finish_reason"]["type"] == "stop"
    # every admission but the min_new_tokens joiner's (the long request's too: its first step is
    # queued before its first token is read)
    assert stats["admits_unread"] - unread == 5, "an admission read its first tokens before the next step"
    paged.flush_cache()
    assert paged.decoder.pool.free == paged.decoder.pool.pages - 1  # every page back


def _slow_prefill_layers(monkeypatch, engine, marker, seen, fail=False, first=None):
    """A test-only delay: each transformer block of a prefill whose prompts include one starting
    with `marker` sleeps 20 ms (or, with `fail`, raises), after noting the engine's decode steps
    (and calling `first()` at the first block)."""
    decoder, local = engine.decoder, threading.local()
    real = decoder.prefill_forward

    def marked(prompts, *args, **kwargs):
        local.on = any(p[: len(marker)] == marker for p in prompts)
        try:
            return real(prompts, *args, **kwargs)
        finally:
            local.on = False

    def slow(module, args):
        if getattr(local, "on", False):
            seen.append(decoder.stats["decode_steps"])
            if first is not None and len(seen) == 1:
                first()
            if fail:
                raise RuntimeError("injected prefill failure")
            time.sleep(0.02)

    monkeypatch.setattr(decoder, "prefill_forward", marked)
    blocks = [m for m in engine.model.modules() if type(m).__name__ in set(engine.model._no_split_modules)]
    hooks = [m.register_forward_pre_hook(slow) for m in blocks]
    return lambda: [h.remove() for h in hooks]


@pytest.mark.parametrize("pieces", [False, True], ids=["prefill-at-once", "prefill-in-pieces"])
def test_a_prefill_in_pieces_lets_the_running_rows_decode_between_its_layers(model, monkeypatch, pieces):
    """A request admitted while another decodes (its layers slowed by a test-only delay): in
    pieces (--enable-prefill-pieces) the running row's decode steps go on between the prefill's layers;
    at once, none runs until it is done. Both answer what they answer alone, every page back."""
    engine = EmbeddedEngine(str(model), decode="paged", max_total_tokens=64 * PAGE_SIZE, prefill_pieces=pieces)
    try:
        long = SamplingParams(max_new_tokens=400, temperature=1.0, sampling_seed=3, ignore_eos=True)
        short = SamplingParams(max_new_tokens=5, temperature=1.0, sampling_seed=4, n=2, ignore_eos=True)
        alone_long, alone_short = run(engine, [[1, 2, 3]], long), run(engine, [[9, 9, 8] * 3], short)
        engine.flush_cache()
        stats, seen = engine.decoder.stats, []
        remove = _slow_prefill_layers(monkeypatch, engine, [9, 9, 8], seen)
        steps = stats["decode_steps"]
        f_long = engine.submit([[1, 2, 3]], long, True)
        while stats["decode_steps"] == steps:
            time.sleep(0.002)
        f_short = engine.submit([[9, 9, 8] * 3], short, True)
        got_short = f_short.result(timeout=120)
        remove()
        assert len(seen) == engine.model.config.num_hidden_layers
        assert (seen == sorted(seen) and seen[-1] > seen[0]) if pieces else len(set(seen)) == 1, seen
        assert stats["prefills_in_pieces"] == (1 if pieces else 0)
        assert [x["output_ids"] for x in got_short] == [x["output_ids"] for x in alone_short]
        assert [x["output_ids"] for x in f_long.result(timeout=120)] == [x["output_ids"] for x in alone_long]
        engine.flush_cache()
        assert engine.decoder.pool.free == engine.decoder.pool.pages - 1  # every page back
    finally:
        engine.shutdown()


def test_a_prefill_in_pieces_that_fails_or_is_paused_loses_nothing(model, monkeypatch):
    """A prefill queued in pieces fails in a layer: every request in flight gets its error, as
    at once, and the engine serves the next. An abort while one is queued in pieces queues its
    rest, then ends its rows with the others'. Every page comes back."""
    engine = EmbeddedEngine(str(model), decode="paged", max_total_tokens=64 * PAGE_SIZE, prefill_pieces=True)
    try:
        stats, seen = engine.decoder.stats, []
        long = SamplingParams(max_new_tokens=400, temperature=1.0, sampling_seed=3, ignore_eos=True)

        def started(f_steps):
            while stats["decode_steps"] == f_steps:
                time.sleep(0.002)

        remove = _slow_prefill_layers(monkeypatch, engine, [7, 7], seen, fail=True)
        steps = stats["decode_steps"]
        f_long = engine.submit([[1, 2, 3]], long, True)
        started(steps)
        f_bad = engine.submit([[7, 7, 1]], SamplingParams(max_new_tokens=4), True)
        for f in (f_bad, f_long):
            with pytest.raises(RuntimeError, match="injected prefill failure"):
                f.result(timeout=120)
        remove()
        assert stats["prefills_in_pieces"] == 1
        assert run(engine, [[1, 2]], SamplingParams(max_new_tokens=3))[0]["meta_info"]["completion_tokens"] == 3

        seen.clear()
        # the abort comes while the prefill's first layer is queued: its second is not yet
        remove = _slow_prefill_layers(monkeypatch, engine, [9, 9, 8], seen, first=lambda: engine.pause("abort"))
        steps = stats["decode_steps"]
        f_long = engine.submit([[1, 2, 3]], long, True)
        started(steps)
        f_short = engine.submit([[9, 9, 8]], SamplingParams(max_new_tokens=300, ignore_eos=True), True)
        for f in (f_long, f_short):
            (out,) = f.result(timeout=120)
            assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
        remove()
        assert stats["prefills_in_pieces"] == 2 and len(seen) == engine.model.config.num_hidden_layers
        engine.resume_generation()
        assert run(engine, [[9, 9, 8]], SamplingParams(max_new_tokens=3))[0]["meta_info"]["completion_tokens"] == 3
        engine.flush_cache()
        assert engine.decoder.pool.free == engine.decoder.pool.pages - 1
    finally:
        engine.shutdown()


def test_no_garbage_collection_runs_while_either_path_generates(engines):
    """A full collection stops every thread for as long as it walks the heap (0.3 s at a time in
    a rollout on the H200): none runs in the engine's scheduler from taking a request to
    answering it, and collection is on again after."""
    during: list[str] = []
    pending: list = []

    def seen(phase, info):
        if phase == "start" and threading.current_thread().name == "rltrain-embedded-scheduler":
            if pending and not pending[0].done():
                during.append(f"generation {info['generation']}")

    gc.callbacks.append(seen)
    try:
        for engine in engines:
            params = SamplingParams(max_new_tokens=48, n=2, ignore_eos=True)
            for _ in range(3):
                gc.collect()  # (the count starts at 0: what submit and taking it allocate stays under it)
                pending[:] = [engine.submit([[1, 2, 3, 4]] * 6, params, True)]
                assert sum(len(o["output_ids"]) for o in pending[0].result(timeout=120)) == 6 * 2 * 48
    finally:
        gc.callbacks.remove(seen)
    assert during == []
    deadline = time.monotonic() + 10  # (the scheduler leaves its pause just after answering)
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gc.isenabled()


def test_overlapping_pauses_of_two_threads_leave_collection_as_it_was():
    from rltrain.runtime.memory import gc_paused

    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

        def a():
            with gc_paused():
                a_in.set()
                b_in.wait(10)
            a_out.set()

        t = threading.Thread(target=a)
        t.start()
        a_in.wait(10)
        with gc_paused():  # b: enters while a is paused, a leaves first
            b_in.set()
            a_out.wait(10)
            assert not gc.isenabled()  # (still b's pause)
        t.join()
        assert gc.isenabled() is enabled
    gc.enable()


def test_a_growing_batch_takes_the_largest_graph_captured_before_and_a_shrinking_one_its_bucket(engines):
    """Which graph size a decode step gets when none near is captured (after a release every
    size is gone): growing (a rollout's requests arriving), the largest size captured before
    within 4x, so the range takes one capture; shrinking (rows finishing), the smallest bucket.
    (On CPU nothing is captured: the sizes the policy picks are what is checked.)"""
    graphs = engines[1].decoder.graphs
    kept = graphs.captured, graphs.by_size
    try:
        graphs.captured, graphs.by_size = {128, 512, 48}, {}
        graphs.last_rows = 0
        assert [graphs.for_rows(n).size for n in (128, 300, 512, 40, 20, 3)] == [512, 512, 512, 48, 24, 3]
    finally:
        graphs.captured, graphs.by_size = kept
        graphs.last_rows = 0


def test_samples_share_their_prompts_pages(model):
    """A prompt of two full pages and a partial one, 4 samples: 2 shared pages + 4 x 1 own page
    fit a 7-page pool (4 x 3 unshared pages would not), and the samples equal their lone runs."""
    engine = EmbeddedEngine(str(model), decode="paged", max_total_tokens=7 * PAGE_SIZE)
    try:
        prompt = [(5 * i) % 200 + 1 for i in range(2 * PAGE_SIZE + 10)]
        params = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, sampling_seed=2, ignore_eos=True)
        got = run(engine, [prompt], params)
        one = [replace(params, n=1, sampling_seed=2 + j) for j in range(4)]
        alone = [run(engine, [prompt], p) for p in one]
        assert [x["output_ids"] for x in got] == [a[0]["output_ids"] for a in alone]
        assert len({tuple(x["output_ids"]) for x in got}) > 1
        with pytest.raises(ValueError, match="do not fit the KV cache"):
            run(engine, [prompt, [p + 1 for p in prompt]], params)
        assert run(engine, [[1, 2]], SamplingParams(max_new_tokens=3))  # and it serves on
    finally:
        engine.shutdown()


def test_paged_release_drops_the_pool_and_resume_generates_the_same(engines):
    _, paged = engines
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = run(paged, [[4, 5, 6]], params)
    assert paged.memory_report()["kv_cache_bytes"] > 0
    paged.release(["kv_cache", "cuda_graph"])
    assert paged.memory_report()["kv_cache_bytes"] == 0
    with pytest.raises(Exception, match="released"):
        run(paged, [[4, 5, 6]], params)
    paged.resume(["kv_cache", "cuda_graph"])
    assert [x["output_ids"] for x in run(paged, [[4, 5, 6]], params)] == [x["output_ids"] for x in before]


def test_abort_ends_paged_rows_and_the_engine_serves_after_resume(engines):
    _, paged = engines
    steps = paged.decoder.stats["decode_steps"]
    fut = paged.submit([[1, 2]], SamplingParams(max_new_tokens=1000, temperature=1.0, ignore_eos=True), False)
    while paged.decoder.stats["decode_steps"] == steps:
        time.sleep(0.005)
    paged.pause("abort")
    out = fut.result(timeout=120)
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out[0]["meta_info"]["completion_tokens"] < 1000
    paged.resume_generation()
    assert run(paged, [[1, 2]], SamplingParams(max_new_tokens=3))[0]["meta_info"]["completion_tokens"] == 3
    paged.flush_cache()  # (the prefix cache keeps the finished rows' pages)
    assert paged.decoder.pool.free == paged.decoder.pool.pages - 1


def test_a_model_the_paged_path_cannot_run_is_refused_with_the_reason(tmp_path):
    from models import SMALL

    cfg = transformers.Qwen2Config(
        **SMALL.config_kwargs(),
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--decode paged: .*sliding-window"):
        EmbeddedEngine(str(tmp_path), decode="paged")


def test_fused_projections_compute_what_the_separate_ones_do_in_any_call_order(model):
    """q, k, v (and gate, up) as one GEMM: the same logits as the model before, a member called
    with another input computes its own, nothing is kept between forwards, and torch.compile
    traces a decoder layer whole (no graph break)."""
    from rltrain.engine.embedded.fused import FusedProjections

    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 9, 27, 81, 243 % 256, 5]])
    attn = m.model.layers[0].self_attn
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    with torch.no_grad():
        before = m(input_ids=ids).logits
        separate = [attn.k_proj(x), attn.q_proj(y), attn.v_proj(x)]
        fused = FusedProjections(m, torch.device("cpu"))
        assert len(fused.groups) == 2 * m.config.num_hidden_layers
        assert attn.q_proj.weight.data_ptr() == fused.groups[0].weight.data_ptr()
        assert torch.allclose(m(input_ids=ids).logits, before, atol=1e-6)
        got = [attn.k_proj(x), attn.q_proj(y), attn.v_proj(x)]  # k and v share x; q computes alone
        for a, b in zip(got, separate):
            assert torch.allclose(a, b, atol=1e-6)
        assert torch.allclose(attn.q_proj(x), x @ attn.q_proj.weight.T, atol=1e-6)
        attn.k_proj(y)  # a forward that stops after its first projection
        assert torch.allclose(attn.k_proj(x), separate[0], atol=1e-6)  # the next one starts afresh
        attn.q_proj(x), attn.v_proj(x)
        assert all(g.x is None and all(o is None for o in g.outs) for g in fused.groups)
        layer = m.model.layers[0]
        h = torch.randn(1, 6, 64)
        pe = m.model.rotary_emb(h, torch.arange(6)[None])
        explained = torch._dynamo.explain(layer.forward)(h, position_embeddings=pe, attention_mask=None)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_fused_weights_keep_their_names_through_updates_release_and_resume(engines):
    """The paged engine's fused projections are views of one tensor per group: an update by name
    writes through them, the checksum and memory report see each weight once, release frees the
    group's tensor and resume restores its values."""
    hf, paged = engines
    assert paged.fused is not None and paged.fused.groups and hf.fused is None
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[4, 5, 6], [7, 8]]
    ids = lambda e: [x["output_ids"] for x in run(e, prompts, params)]  # noqa: E731
    assert paged.memory_report()["weight_bytes"] == hf.memory_report()["weight_bytes"]
    assert paged.weights_checksum()["checksum"] == hf.weights_checksum()["checksum"]
    name = "model.layers.1.self_attn.k_proj.weight"
    old = dict(hf.model.named_parameters())[name].detach().clone()
    try:
        new = torch.randn_like(old)
        for e in engines:
            e.load_named_tensors([(name, new)], None)
        assert torch.equal(paged.fused.groups[2].weight[64 : 64 + 32], new)
        assert paged.weights_checksum()["checksum"] == hf.weights_checksum()["checksum"]
        assert ids(paged) == ids(hf)
    finally:
        for e in engines:
            e.load_named_tensors([(name, old)], None)
    before = ids(paged)
    paged.release(["weights"])
    assert paged.memory_report()["weight_bytes"] == 0
    assert all(g.weight is None for g in paged.fused.groups)
    paged.resume(["weights"])
    assert paged.weights_checksum()["checksum"] == hf.weights_checksum()["checksum"]
    assert paged.model.model.layers[0].self_attn.v_proj.weight.data_ptr() != 0
    assert ids(paged) == before


@pytest.mark.parametrize("extend", ["torch", "triton"])
def test_a_prompt_that_extends_a_finished_row_is_served_its_keys_and_samples_what_a_fresh_prefill_would(
    engines, extend, monkeypatch
):
    """A multi-turn trajectory's next turn (the last turn's prompt and output, then an
    observation) finds the finished row's pages in the prefix cache: only the tokens after its
    last sampled one are prefilled (SGLang's `cached_tokens` says how many were not), two
    branches of one prefix in one request each get it (the row's last page taken over by one,
    copied for the other), a prompt's n samples share it, and everything sampled is what a fresh
    prefill samples, greedy what transformers' own forward continues. The extending prompts'
    attention both ways: their pages gathered for SDPA (the CPU's) and the extend kernel reading
    them in place (CUDA's; interpreted here)."""
    _, paged = engines
    monkeypatch.setattr(paged.decoder, "extend_impl", extend)
    paged.flush_cache()
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    first = [(5 * i + 1) % 250 + 4 for i in range(70)]
    (a,) = run(paged, [first], greedy)
    turn = first + a["output_ids"] + [7, 8, 9, 10, 11]
    branch = first + a["output_ids"] + [12, 13]
    seeded = SamplingParams(max_new_tokens=20, temperature=1.0, sampling_seed=11, n=3, ignore_eos=True)
    before = paged.decoder.stats["prefill_tokens"]
    cached = run(paged, [turn, branch], seeded)
    prefilled = paged.decoder.stats["prefill_tokens"] - before
    paged.flush_cache()
    assert paged.decoder.pool.free == paged.decoder.pool.pages - 1  # every page back once flushed
    fresh = run(paged, [turn, branch], seeded)
    reused = len(first) + len(a["output_ids"]) - 1  # the keys of all but the last sampled token
    assert [x["meta_info"]["cached_tokens"] for x in cached] == [reused] * 6
    assert [x["meta_info"]["cached_tokens"] for x in fresh] == [0] * 6
    assert prefilled == len(turn) + len(branch) - 2 * reused
    assert [x["output_ids"] for x in cached] == [x["output_ids"] for x in fresh]
    for c, f in zip(cached, fresh):
        assert logprobs(c) == pytest.approx(logprobs(f), abs=1e-4)
    paged.flush_cache()
    run(paged, [first], greedy)
    (g,) = run(paged, [turn], replace(greedy, max_new_tokens=12))
    assert g["meta_info"]["cached_tokens"] == reused
    assert g["output_ids"] == hf_greedy(paged.model_path, [turn], 12)[0]


def test_the_prefix_cache_gives_its_pages_back_when_a_request_needs_them_and_is_emptied_by_a_weight_update(
    engines, model
):
    """Finished rows' pages fill the pool; a request that needs more pages than are free is
    admitted by evicting them (least recently used first), and samples what it samples from an
    empty cache. A weight update empties the cache: nothing computed with the old weights is
    served after it."""
    _, paged = engines
    paged.flush_cache()
    params = SamplingParams(max_new_tokens=60, temperature=1.0, sampling_seed=5, ignore_eos=True)
    for i in range(12):
        run(paged, [[(i * 7 + j) % 250 + 4 for j in range(130)]], params)
    pool = paged.decoder.pool
    assert paged.decoder.prefixes.pages > 30 and pool.free < 30
    big = SamplingParams(max_new_tokens=200, temperature=1.0, sampling_seed=6, n=8, ignore_eos=True)
    prompt = [(3 * j) % 250 + 4 for j in range(200)]
    got = run(paged, [prompt], big)
    paged.flush_cache()
    assert [x["output_ids"] for x in got] == [x["output_ids"] for x in run(paged, [prompt], big)]
    # a weight update: the same prompt's prefix is computed afresh
    again = prompt + got[0]["output_ids"] + [9]
    assert run(paged, [again], params)[0]["meta_info"]["cached_tokens"] > 0
    run(paged, [prompt], big)
    state = {n: t.clone() for n, t in paged.model.state_dict().items()}
    paged.load_named_tensors(list(state.items()), weight_version="same-values")
    assert run(paged, [again], params)[0]["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("pieces", [False, True], ids=["prefill-at-once", "prefill-in-pieces"])
def test_compiled_blocks_trace_whole_through_the_paged_attention_and_generate_what_plain_blocks_do(
    engines, model, monkeypatch, pieces
):
    """--enable-torch-compile: each transformer block is one graph, the paged attention (with its
    cache writes) one op in it, in decode steps and in prefills of whole prompts and of prompts
    extending the prefix cache's keys. A graph break there would put the host back in the loop
    at every layer (a multi-turn rollout's prefills were host-bound): fullgraph makes one fail
    the engine's start-up probe. Traced by dynamo, run by its eager backend (the CPU: no
    inductor build; test_gpu.py compiles with inductor); greedy tokens are the plain engine's."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager", "fullgraph": True}))
    _, plain = engines
    compiled = EmbeddedEngine(
        str(model), decode="paged", max_total_tokens=64 * PAGE_SIZE, compile=True, prefill_pieces=pieces
    )
    try:
        assert compiled.decoder is not None and compiled.decoder.compiled
        greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [[1, 2, 3], [5, 6, 7, 8] * 9, [9] * 20]
        long = replace(greedy, max_new_tokens=100)
        alone = run(plain, [[4, 4, 4]], long)
        for turn in range(2):  # the second turn extends each first turn's cached prompt and answer
            plain.flush_cache()
            a = run(plain, prompts, greedy)
            if pieces:  # admitted while a row decodes: prefilled in pieces between its steps
                steps = compiled.decoder.stats["decode_steps"]
                running = compiled.submit([[4, 4, 4]], long, True)
                while compiled.decoder.stats["decode_steps"] == steps:
                    time.sleep(0.002)
            b = run(compiled, prompts, greedy)
            assert [y["meta_info"]["cached_tokens"] > 0 for y in b] == [turn > 0] * len(prompts)
            assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b], turn
            if pieces:
                assert running.result(timeout=120)[0]["output_ids"] == alone[0]["output_ids"]
            prompts = [p + x["output_ids"] + [11, 12, 13] for p, x in zip(prompts, a)]
        assert compiled.decoder.stats["prefills_in_pieces"] == (2 if pieces else 0)
    finally:
        compiled.shutdown()


def test_the_quickstarts_model_of_a_128_token_context_runs_the_paged_path(tmp_path):
    """The start-up probe fits the engine's context: the quickstart's model (max_position_embeddings
    128: rows of two pages) failed it (the probe's rows took three pages), and the engine fell back
    to transformers' own cache on the GPU, one batch at a time. Greedy tokens are transformers'."""
    from rltrain.rollout.synthetic import build_tiny_model

    path = build_tiny_model(tmp_path / "m", [str(i) for i in range(10)] + ["+", "="], hidden=64)
    engine = EmbeddedEngine(str(path), decode="paged")
    try:
        assert engine.decoder is not None and engine.decoder.max_pages == 2
        prompts = [[3, 4, 5], [6, 7] * 30]
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        assert [x["output_ids"] for x in run(engine, prompts, greedy)] == hf_greedy(path, prompts, 8)
    finally:
        engine.shutdown()


def test_requests_left_waiting_by_a_prefill_forwards_token_cap_are_admitted_at_the_next_step(model, monkeypatch):
    """A prefill forward takes at most PREFILL_TOKENS new prompt tokens; requests that fit but
    did not go into it are admitted by the next forward, not when rows finish: one prompt per
    request (a multi-turn rollout's turns), queued together, all decode together. (They waited
    for the first wave's rows to end, a rollout's turn later: on an H100 a multi-turn rollout of
    512 trajectories ran a turn's worth of decode steps more than it needed, 328 against 252.)"""
    monkeypatch.setattr(batching, "PREFILL_TOKENS", 16)  # two of the 8-token prompts per forward
    engine = EmbeddedEngine(str(model), decode="paged", max_total_tokens=64 * PAGE_SIZE)
    try:
        params = SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=1, ignore_eos=True)
        stats = engine.decoder.stats
        engine.pause("in_place")  # (queued together: the serve takes them at once)
        before = dict(stats)
        futures = [engine.submit([[1 + i] * 8], params, False) for i in range(8)]
        engine.resume_generation()
        outs = [f.result(timeout=120)[0] for f in futures]
        assert all(o["meta_info"]["completion_tokens"] == 12 for o in outs)
        assert stats["prefills"] - before["prefills"] == 4
        steps = stats["decode_steps"] - before["decode_steps"]
        assert steps <= 11 + 3 + 1, f"{steps} decode steps for 8 requests of 12 tokens: admitted in waves"
    finally:
        engine.shutdown()
