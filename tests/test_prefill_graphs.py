"""The paged path's prefills from static inputs padded to a bucket (graphs.py's PrefillGraphs,
`--enable-prefill-cuda-graph`): on CUDA they are captured and replayed (test_gpu.py); here the same
static inputs feed an eager forward, which is what a graph replays. Against the packed prefill of
the default path: the same logits, the same keys and values in the same pages and nothing written
outside them but the scratch page, for whole prompts and prompts that extend cached keys, over
several chunks and pages, in every bucket; what does not fit a bucket takes the default path."""

from __future__ import annotations

import pytest
import torch

from models import make_model
from rltrain.engine.embedded import graphs as graphs_module
from rltrain.engine.embedded.engine import EmbeddedEngine
from rltrain.engine.embedded.graphs import CHUNK, PREFILL_BUCKETS
from rltrain.engine.embedded.kv_pool import PAGE_SIZE
from rltrain.generation import SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("prefill-graphs") / "m", 5, arch="qwen3", hidden=64, layers=2)


@pytest.fixture(scope="module")
def engine(model):
    e = EmbeddedEngine(str(model), decode="paged", max_total_tokens=1200 * PAGE_SIZE, prefill_cuda_graph=True)
    yield e
    e.shutdown()


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 250, (length + (i % 5) * 7,), generator=g).tolist() for i in range(count)]


def _both_ways(decoder, prompts, starts):
    """The prefill's logits and every page's keys and values, by the default path and from static
    inputs, each on the same pages of a zeroed pool (each prompt's first `starts[i]` tokens
    prefilled first by the default path: its cached keys)."""
    out = []
    static = decoder.prefill_graphs
    for graphs in (None, static):
        decoder.prefill_graphs = graphs
        pool = decoder.pool
        pool.k.zero_()
        pool.v.zero_()
        ends = [1]
        for p in prompts:
            ends.append(ends[-1] + -(-len(p) // PAGE_SIZE))
        tables = [list(range(a, b)) for a, b in zip(ends, ends[1:])]
        decoder.prefill_graphs = None
        for i, s in enumerate(starts):
            if s:
                decoder.prefill_forward([prompts[i][:s]], [tables[i]])
        decoder.prefill_graphs = graphs
        logits = decoder.prefill_forward(prompts, tables, starts)
        out.append((logits.clone(), pool.k.clone(), pool.v.clone()))
    decoder.prefill_graphs = static
    return out


@pytest.mark.parametrize(
    "count,length,cached",
    [(1, 5, 0), (3, 40, 0), (12, 70, 33), (40, 20, 9), (7, 300, 150)],
    ids=["one-short", "whole", "extending", "many-short", "long-extend"],
)
def test_a_prefill_from_static_inputs_computes_what_the_packed_prefill_does(engine, count, length, cached):
    """Whole prompts (a prompt extending 0 cached keys) and prompts extending their cached keys over
    several chunks of `CHUNK` queries and several pages: the same last-token logits, the same keys
    and values in every prompt's pages, and the padding's keys only in the scratch page (0)."""
    decoder = engine.decoder
    decoder.allocate()
    prompts = _prompts(count, length, seed=count)
    starts = [cached if i % 2 == 0 else 0 for i in range(count)]  # (half of them whole)
    (ref, k_ref, v_ref), (got, k_got, v_got) = _both_ways(decoder, prompts, starts)
    new = sum(len(p) - s for p, s in zip(prompts, starts))
    assert decoder.prefill_graphs.fits(new, count)
    bucket = next(b for b in PREFILL_BUCKETS if b >= new)
    assert bucket in decoder.prefill_graphs.by_tokens  # (the static path ran, in its bucket)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    # (every page past the scratch page: the same keys and values, to float rounding)
    assert torch.allclose(k_got[:, 1:], k_ref[:, 1:], atol=1e-5) and torch.allclose(
        v_got[:, 1:], v_ref[:, 1:], atol=1e-5
    )


def test_every_chunk_of_a_full_bucket_fits_its_inputs(engine):
    """The most chunks a bucket can be given: as many prompts as it has rows, each one query past a
    chunk (two chunks each), filling its tokens; the chunk rows hold them all."""
    decoder = engine.decoder
    decoder.allocate()
    rows = 16
    prompts = _prompts(rows, CHUNK + 1, seed=3)
    prompts = [p[: CHUNK + 1] for p in prompts]
    (ref, k_ref, _), (got, k_got, _) = _both_ways(decoder, prompts, [0] * rows)
    g = decoder.prefill_graphs.by_tokens[512]
    assert rows * 2 <= g.chunks
    assert torch.allclose(got, ref, atol=1e-4) and torch.allclose(k_got[:, 1:], k_ref[:, 1:], atol=1e-5)


def test_a_prefill_past_the_largest_bucket_or_its_rows_takes_the_packed_path(engine, monkeypatch):
    """More new tokens than the largest bucket, or more prompts than a bucket has rows: the default
    path, the same result."""
    decoder = engine.decoder
    decoder.allocate()
    static = decoder.prefill_graphs
    assert not static.fits(PREFILL_BUCKETS[-1] + 1, 1)
    assert not static.fits(300, static.max_rows + 1) and not static.fits(100, 257)  # (bucket 256: 256 rows at most)
    calls = []
    monkeypatch.setattr(static, "run", lambda *a: calls.append(a))
    monkeypatch.setattr(graphs_module, "PREFILL_BUCKETS", (256,))
    prompts = _prompts(2, 200, seed=9)
    assert not static.fits(sum(map(len, prompts)), 2)
    tables = [
        list(range(1, 1 + -(-len(prompts[0]) // PAGE_SIZE))),
        list(range(40, 40 + -(-len(prompts[1]) // PAGE_SIZE))),
    ]
    logits = decoder.prefill_forward(prompts, tables)
    assert calls == [] and logits.shape[0] == 2


def test_an_engine_with_prefill_graphs_samples_what_one_without_does(engine, model):
    """Seeded sampling over a multi-turn shape (a turn's prompt extends the last turn's cached
    keys): the same tokens and log-probs as the default engine."""
    plain = EmbeddedEngine(str(model), decode="paged", max_total_tokens=1200 * PAGE_SIZE)
    try:
        params = SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=5, ignore_eos=True)
        first = _prompts(6, 30, seed=1)
        out = {}
        for name, e in (("plain", plain), ("static", engine)):
            e.flush_cache()
            a = e.submit(first, params, True).result(timeout=120)
            turn = [p + x["output_ids"] + [7, 8, 9] for p, x in zip(first, a)]
            b = e.submit(turn, params, True).result(timeout=120)
            assert all(x["meta_info"]["cached_tokens"] > 0 for x in b)  # (the second turn extends)
            out[name] = [(x["output_ids"], [t[0] for t in x["meta_info"]["output_token_logprobs"]]) for x in a + b]
        for (ids_p, lp_p), (ids_s, lp_s) in zip(out["plain"], out["static"]):
            assert ids_p == ids_s
            assert lp_p == pytest.approx(lp_s, abs=1e-4)
    finally:
        plain.shutdown()


def test_the_padding_only_inputs_that_every_bucket_is_captured_from_write_no_rows_keys(engine):
    """With the memory saver every bucket is captured at the first prefill (graphs.py's
    `capture_all`), from inputs that are padding only, while rows hold keys in the pool: the
    forwards of the capture write the scratch page only, in the smallest bucket and the largest."""
    decoder = engine.decoder
    decoder.allocate()
    static, pool = decoder.prefill_graphs, decoder.pool
    g = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    k0, v0 = pool.k.clone(), pool.v.clone()
    static.zero()
    for tokens in (PREFILL_BUCKETS[0], PREFILL_BUCKETS[-1]):
        with torch.no_grad():
            static.forward(static._inputs(tokens))
    assert not torch.equal(pool.k[:, :1], k0[:, :1])  # (the padding's keys went somewhere: the scratch page)
    assert torch.equal(pool.k[:, 1:], k0[:, 1:]) and torch.equal(pool.v[:, 1:], v0[:, 1:])
