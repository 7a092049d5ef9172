"""The paged path's decode steps, and (by default with the memory saver) its prefills, captured as
CUDA graphs and replayed.

    graphs = DecodeGraphs(max_pages, device, enabled, saver, stats, eager, max_rows)
    logits = graphs.run(tokens, pos, table)   # one decode step of len(tokens) rows
    graphs.drop()                             # forget every graph (after a release)
    prefills = PrefillGraphs(max_rows, max_pages, device, enabled, graphs, forward)
    logits = prefills.run(ids, pos, page, offset, last, spans, tables)   # a packed prefill (`PrefillGraphs`)

A decode step (every layer and the LM head; `eager(step, n)` runs it, paged.py) is captured once
per batch-size bucket and replayed: its inputs are static tensors (token, position, page table,
length) filled before each replay; rows past the batch point at the KV pool's scratch page; a
captured graph serves batches down to a quarter of its size. Graphs hold the weights' and the
pool's addresses. With the memory saver (saver.py) those addresses, and the graphs' own memory,
come back at resume: the graphs are kept through releases, the decode sizes are captured at the
first decode step and every prefill bucket at the first prefill (`capture_all`). Without it
they are dropped whenever either is released, and a growing batch after a release is captured
once at the largest size captured before (`for_rows`). Off CUDA (or with graphs off) the same
static inputs feed an eager step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from rltrain.engine.embedded.saver import MemorySaver, in_region

log = logging.getLogger("rltrain.engine.embedded")

BUCKETS = sorted({s for k in range(14) for s in (1 << k, 3 << k >> 1) if s >= 1})  # batch sizes captured


class StepGraph:
    """One decode step for batches of up to `size` rows: its static inputs, and once captured its
    graph and output logits."""

    def __init__(self, size: int, max_pages: int, device: torch.device):
        self.size = size
        self.ids = torch.zeros(size, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(size, 1, dtype=torch.long, device=device)
        self.table = torch.zeros(size, max_pages, dtype=torch.int32, device=device)
        self.lens = torch.ones(size, dtype=torch.int32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class DecodeGraphs:
    """The captured decode steps of one engine, by batch size (module doc). `stats` is the
    decoder's counters (graph_captures, capture_s are counted here)."""

    def __init__(
        self,
        max_pages: int,
        device: torch.device,
        enabled: bool,
        saver: MemorySaver | None,
        stats: dict[str, Any],
        eager: Callable[[StepGraph, int], torch.Tensor],
        max_rows: int = BUCKETS[-1],
    ):
        self.max_pages = max_pages
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.saver = saver  # with it, capture allocates in its cuda_graph region
        self.stats = stats
        self.eager = eager
        self.by_size: dict[int, StepGraph] = {}
        self.captured: set[int] = set()  # every size captured so far (kept across releases)
        self.last_rows = 0  # rows of the last decode step (0 when a serve starts)
        self.pool: Any = None  # the captured graphs' memory pool (None: none captured)
        # With the memory saver the graphs live as long as the engine: batch sizes up to
        # `max_rows` are captured at the first decode step (as SGLang captures its batch sizes
        # at start-up; `capture_all`), so that no rollout's step waits for a capture. Without it
        # they are dropped at every release and captured as batches need them (`for_rows`).
        self.max_rows = max_rows
        self.lasting = saver is not None
        self.all_captured = False

    def for_rows(self, n: int) -> StepGraph:
        """The graph for `n` rows: a captured one of up to 4x as many rows (its extra rows cost
        little next to a capture, which every bucket would need after each release), else one
        captured now: for a growing batch, of the largest size within 4x that this decoder has
        captured before (a rollout's batch grows as its requests arrive: after a release, the
        range the last rollout grew through takes one capture, not one per size); else of the
        smallest bucket."""
        if self.enabled and self.lasting and not self.all_captured:
            self.capture_all()
        near = [s for s in self.by_size if n <= s <= 4 * n and self.by_size[s].graph is not None]
        before = [s for s in self.captured if n <= s <= 4 * n] if n > self.last_rows else []
        self.last_rows = n
        size = min(near) if near else max(before) if before else next((s for s in BUCKETS if s >= n), n)
        return self._graph(size)

    def capture_all(self) -> None:
        """The graphs of every power of two below the bucket that holds `max_rows` rows, and of
        that bucket: any batch runs in one of at most twice its rows (each graph keeps its own
        logits: ~2 x max_rows rows' in all). Their static inputs are zeros: each row's key to the
        scratch page."""
        t0, before = time.perf_counter(), self.stats["graph_captures"]
        top = next((s for s in BUCKETS if s >= self.max_rows), self.max_rows)
        for size in [s for s in BUCKETS if s < top and not s & (s - 1)] + [top]:
            self._graph(size)
        self.all_captured = True
        log.info(
            "decode graphs: %d batch sizes up to %d captured in %.2f s",
            self.stats["graph_captures"] - before,
            top,
            time.perf_counter() - t0,
        )

    def _graph(self, size: int) -> StepGraph:
        """The step of `size` rows, captured now if graphs are on and it is not yet."""
        g = self.by_size.get(size)
        if g is None:
            g = self.by_size[size] = StepGraph(size, self.max_pages, self.device)
        if self.enabled and g.graph is None:
            t0 = time.perf_counter()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                # warm-up outside the capture: lazy inits and compilation the first time this
                # size runs; once more before a capture again (after a release)
                for _ in range(1 if size in self.captured else 2):
                    self.eager(g, size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            capture = self.saver.graph if self.saver is not None else torch.cuda.graph
            with capture(graph, pool=self.pool):
                g.logits = self.eager(g, size)
            g.graph = graph
            self.captured.add(size)
            self.stats["graph_captures"] += 1
            self.stats["capture_s"] += time.perf_counter() - t0  # (host time: the capture syncs)
        return g

    def run(self, tokens: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """One decode step of rows [B] (their last token, its position, their page tables):
        their logits [B, vocab], in the model's dtype. A graph's logits are its output buffer:
        read them (queue what reads them) before the next step, which overwrites them."""
        n = tokens.shape[0]
        g = self.for_rows(n)
        g.ids[:n, 0] = tokens
        g.pos[:n, 0] = pos
        g.table[:n] = table
        g.lens[:n] = (pos + 1).to(torch.int32)
        if g.graph is None:
            return self.eager(g, n)
        if n < g.size:  # rows past the batch: one token on the scratch page
            g.table[n:] = 0
            g.lens[n:] = 1
        g.graph.replay()
        assert g.logits is not None
        return g.logits[:n]

    def drop(self) -> None:
        """Forget every captured graph and their memory pool (a pool handle outliving all of its
        graphs must not be captured into again), once no replay runs."""
        if self.by_size and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.by_size.clear()
        self.pool = None
        self.all_captured = False


# Prefill graphs (by default with the memory saver; engine.py). Queuing a prefill forward costs
# the host ~1 ms per layer (custom op dispatch, the compiled block's wrapper and guards:
# docs/benchmarks/), which at the 1.7B shape is as long as its kernels run, and every running row
# waits for it. Replayed, a prefill costs the host what its inputs' copies do.
# New tokens per prefill captured: every 512 (the padding's compute at most 512 tokens' worth: ~12%
# of a multi-turn rollout's admissions of ~4,200 tokens at the 1.7B shape).
PREFILL_BUCKETS = (256, *range(512, 8192 + 1, 512))
CHUNK = 16  # query tokens per attention row: the extend kernel's grid is (rows, KV heads, 1)


class PrefillInputs:
    """A prefill bucket's static inputs: views of buffers every bucket shares (no two prefills
    run at once). `ids`, `pos` [1, tokens]; `page`, `offset` [tokens] (each token's key slot);
    `keep` [rows] (each prompt's last token in the packed sequence); the attention's chunk rows
    [chunks]: where each chunk's queries start, how many, the keys cached before them, its
    prompt's pages (`table` [chunks, max_pages])."""

    def __init__(self, shared: dict[str, torch.Tensor], tokens: int, rows: int):
        self.tokens, self.rows, self.chunks = tokens, rows, tokens // CHUNK + rows
        tok, meta = shared["tok"][:, :tokens], shared["meta"][:, : self.chunks]
        self.ids, self.pos, self.page, self.offset = tok[0:1], tok[1:2], tok[2], tok[3]
        self.keep = shared["keep"][:rows]
        self.q_start, self.q_len, self.ctx = meta[0], meta[1], meta[2]
        self.table = shared["table"][: self.chunks]
        self.graph: torch.cuda.CUDAGraph | None = None


class PrefillGraphs:
    """The paged path's prefills of up to `PREFILL_BUCKETS[-1]` new tokens and `max_rows` prompts,
    run from static inputs padded to their bucket: captured as CUDA graphs on CUDA (sharing the
    decode graphs' memory pool; dropped with them), eager elsewhere (the tests' path). Every prompt
    attends as one that extends cached keys (a whole prompt extends none), cut into chunks of
    `CHUNK` queries so that the attention's launch does not depend on the prompts' lengths; the
    padding tokens write their keys to the pool's scratch page and are no chunk's queries. A
    graph's logits land in one output buffer that every bucket shares (read before the next
    prefill). `forward(inputs)`: the prefill's logits [1, rows, vocab] from `inputs` (paged.py)."""

    def __init__(
        self,
        max_rows: int,
        max_pages: int,
        device: torch.device,
        capture: bool,
        decode: DecodeGraphs,
        forward: Callable[[PrefillInputs], torch.Tensor],
    ):
        self.max_rows, self.max_pages, self.device = max_rows, max_pages, device
        self.capture = capture and device.type == "cuda"
        self.decode = decode  # (its pool, saver and counters)
        self.forward = forward
        self.by_tokens: dict[int, PrefillInputs] = {}
        self.shared: dict[str, torch.Tensor] = {}
        self.out: torch.Tensor | None = None
        # With the memory saver the graphs live as long as the engine (kept through releases):
        # every bucket is captured at the first prefill that runs here, so that no later one (in
        # a rollout) waits for a capture. Without it they are dropped at every release and
        # captured as prefills need them.
        self.lasting = decode.saver is not None
        self.all_captured = False

    def fits(self, tokens: int, rows: int) -> bool:
        """Whether a prefill of `tokens` new tokens over `rows` prompts runs here."""
        return 0 < tokens <= PREFILL_BUCKETS[-1] and rows <= min(self.max_rows, _bucket(tokens))

    def run(
        self,
        ids: list[int],
        pos: list[int],
        page: list[int],
        offset: list[int],
        last: list[int],
        rows: list[tuple[int, int, int]],
        tables: list[list[int]],
    ) -> torch.Tensor:
        """The packed prefill's logits [len(rows), vocab]: `ids`, `pos`, `page`, `offset` per new
        token; `last[i]`: prompt i's last token in them; `rows[i]`: where prompt i's new tokens
        start there, how many, how many of its keys are cached; `tables[i]`: its pages."""
        if self.capture and self.lasting and not self.all_captured:
            self.capture_all()
        T = _bucket(len(ids))
        g = self._inputs(T)
        n, chunks = len(ids), [(i, c) for i, (_, q, _) in enumerate(rows) for c in range(0, q, CHUNK)]
        tok = torch.zeros(4, T, dtype=torch.long)  # (padding: token 0 at position 0, in the scratch page)
        tok[:, :n] = torch.tensor([ids, pos, page, offset], dtype=torch.long)
        keep = torch.zeros(g.rows, dtype=torch.long)
        keep[: len(last)] = torch.tensor(last, dtype=torch.long)
        meta = torch.zeros(3, g.chunks, dtype=torch.int32)  # (padding: no queries, no keys)
        meta[:, : len(chunks)] = torch.tensor(
            [
                [rows[i][0] + c for i, c in chunks],
                [min(CHUNK, rows[i][1] - c) for i, c in chunks],
                [rows[i][2] + c for i, c in chunks],
            ],
            dtype=torch.int32,
        )
        width = max(len(t) for t in tables)
        per_prompt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        table = per_prompt[torch.tensor([i for i, _ in chunks])]
        # (from pinned memory, no host sync; the padding copied too: a bucket's earlier prefill left its own)
        for dst, src in (
            (self.shared["tok"][:, :T], tok),
            (g.keep, keep),
            (self.shared["meta"][:, : g.chunks], meta),
            (g.table[: len(chunks), :width], table),
        ):
            dst.copy_(src.pin_memory() if self.device.type == "cuda" else src, non_blocking=True)
        if not self.capture:
            return self.forward(g)[0, : len(rows)]
        if g.graph is None:
            self._capture(g)
        assert g.graph is not None and self.out is not None
        g.graph.replay()
        return self.out[: len(rows)]

    def _inputs(self, tokens: int) -> PrefillInputs:
        g = self.by_tokens.get(tokens)
        if g is None:
            if not self.shared:
                T, R = PREFILL_BUCKETS[-1], self.max_rows
                dev = self.device
                with in_region(self.decode.saver, "cuda_graph"):
                    self.shared = {
                        "tok": torch.zeros(4, T, dtype=torch.long, device=dev),
                        "keep": torch.zeros(R, dtype=torch.long, device=dev),
                        "meta": torch.zeros(3, T // CHUNK + R, dtype=torch.int32, device=dev),
                        "table": torch.zeros(T // CHUNK + R, self.max_pages, dtype=torch.int32, device=dev),
                    }
            g = self.by_tokens[tokens] = PrefillInputs(self.shared, tokens, min(self.max_rows, tokens))
        return g

    def capture_all(self) -> None:
        """Every bucket's graph not captured yet, from static inputs that are padding only (every
        token's key to the pool's scratch page, no chunk's queries): no row's keys are touched."""
        t0, before = time.perf_counter(), self.decode.stats["prefill_graph_captures"]
        self.zero()
        for T in PREFILL_BUCKETS:
            g = self._inputs(T)
            if g.graph is None:
                self._capture(g)
        self.all_captured = True
        log.info(
            "prefill graphs: %d buckets of up to %d new tokens captured in %.2f s",
            self.decode.stats["prefill_graph_captures"] - before,
            PREFILL_BUCKETS[-1],
            time.perf_counter() - t0,
        )

    def zero(self) -> None:
        """The static inputs as padding only (the shared buffers made if not yet)."""
        self._inputs(PREFILL_BUCKETS[-1])
        for t in self.shared.values():
            t.zero_()

    def _capture(self, g: PrefillInputs) -> None:
        """Warm `g`'s forward up (compilation, lazy inits) on a side stream, then capture it, its
        logits copied into the shared output buffer."""
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                logits = self.forward(g)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.out is None:
            with in_region(self.decode.saver, "cuda_graph"):
                self.out = torch.empty(self.max_rows, logits.shape[-1], dtype=logits.dtype, device=self.device)
        del logits
        if self.decode.pool is None:
            self.decode.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        capture = self.decode.saver.graph if self.decode.saver is not None else torch.cuda.graph
        with capture(graph, pool=self.decode.pool):
            self.out[: g.rows].copy_(self.forward(g)[0])
        g.graph = graph
        self.decode.stats["prefill_graph_captures"] += 1
        self.decode.stats["capture_s"] += time.perf_counter() - t0

    def drop(self) -> None:
        """Forget every graph and the buffers (before the decode graphs drop their pool)."""
        self.by_tokens.clear()
        self.shared, self.out = {}, None
        self.all_captured = False


def _bucket(tokens: int) -> int:
    return next((b for b in PREFILL_BUCKETS if b >= tokens), tokens)
