"""The paged path's decode steps, captured as CUDA graphs and replayed.

    graphs = DecodeGraphs(max_pages, device, enabled, saver, stats, eager)
    logits = graphs.run(tokens, pos, table)   # one decode step of len(tokens) rows
    graphs.drop()                             # forget every graph (after a release)

A decode step (every layer and the LM head; `eager(step, n)` runs it, paged.py) is captured once
per batch-size bucket and replayed: its inputs are static tensors (token, position, page table,
length) filled before each replay; rows past the batch point at the KV pool's scratch page; a
captured graph serves batches down to a quarter of its size. Graphs hold the weights' and the
pool's addresses. With the memory saver (saver.py) those addresses, and the graphs' own memory,
come back at resume: the graphs are kept through releases. Without it they are dropped whenever
either is released, and a growing batch after a release is captured once at the largest size
captured before (`for_rows`). Off CUDA (or with graphs off) the same static inputs feed an
eager step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rltrain.engine.embedded.saver import MemorySaver

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

    def for_rows(self, n: int) -> StepGraph:
        """The graph for `n` rows: a captured one of up to 4x as many rows (its extra rows cost
        little next to a capture, which every bucket would need after each release), else one
        captured now: for a growing batch, of the largest size within 4x that this decoder has
        captured before (a rollout's batch grows as its requests arrive: after a release, the
        range the last rollout grew through takes one capture, not one per size); else of the
        smallest bucket."""
        near = [s for s in self.by_size if n <= s <= 4 * n and self.by_size[s].graph is not None]
        before = [s for s in self.captured if n <= s <= 4 * n] if n > self.last_rows else []
        self.last_rows = n
        size = min(near) if near else max(before) if before else next((s for s in BUCKETS if s >= n), n)
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
