"""A sequence's log-probs by the plain model (a sync's probe, as SGLang's input_token_logprobs):
eager, or on CUDA replayed from a CUDA graph captured for that sequence.

    scorer = SequenceScorer(model, device, saver)
    scorer.score(input_ids)     # log-probs of input_ids[1:], each given the tokens before it
    scorer.drop()               # forget the graph (a release without the memory saver frees its memory)

A probe is the same sequence at every sync of a run, and its forward is a chain of small kernels
whose launches cost more than their work (a 33-token forward of the 4B shape on an H200: 41 ms
eager, 8 ms replayed; bench.sync --verify-parts). A sequence is scored eagerly until it comes a
second time (a prompt's input log-probs asked once cost no capture); then that scoring runs on a
side stream (the warm-up a capture needs) and captures it, and later ones replay the graph while
the sequence and the addresses of the model's weights and buffers stay the same. One graph is
kept, for the last sequence captured; weights at new addresses capture again. A release without
the memory saver drops the graph (its memory goes back) and leaves the scorer eager from then on:
every resume would bring new addresses and a capture each. With the memory saver
the graph's memory is allocated in its cuda_graph region, like the paged path's graphs: kept
through release and resume. A capture that fails leaves the scorer eager for good, with a
warning. Off CUDA, or with the engine's CUDA graphs off (--disable-cuda-graph), it is eager.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rltrain.engine.embedded.saver import MemorySaver

log = logging.getLogger("rltrain.engine")

SEEN = 8  # sequences remembered: one scored again among this many others is captured


class SequenceScorer:
    """The log-probs of a sequence under `model` at temperature 1 (module doc)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, saver: MemorySaver | None, graphs: bool = True):
        self.model, self.device, self.saver = model, device, saver
        self.graphed = graphs and device.type == "cuda"  # false for good after a failed capture
        self._graph: Any = None
        self._key: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._logp: torch.Tensor | None = None  # the graph's output
        self._seen: dict[tuple[int, ...], None] = {}  # the last SEEN sequences scored eagerly, oldest first
        self.captures = 0

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]

    def _addresses(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))

    def score(self, input_ids: list[int]) -> list[float]:
        """Log-probs of `input_ids[1:]` (the caller holds the engine's lock, weights in memory)."""
        ids = torch.tensor([input_ids], device=self.device)
        if not self.graphed:
            return self._forward(ids).cpu().tolist()
        key = (tuple(input_ids), self._addresses())
        if key == self._key and self._graph is not None:
            self._graph.replay()
            assert self._logp is not None
            return self._logp.cpu().tolist()
        if key[0] in self._seen:
            return self._capture(ids, key)
        self._seen[key[0]] = None
        if len(self._seen) > SEEN:
            del self._seen[next(iter(self._seen))]
        return self._forward(ids).cpu().tolist()

    def _capture(self, ids: torch.Tensor, key: tuple[tuple[int, ...], tuple[int, ...]]) -> list[float]:
        """Score `ids` eagerly on a side stream (the capture's warm-up; its answer is returned),
        then capture the same forward for the replays."""
        self.drop()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            answer = self._forward(ids)
        torch.cuda.current_stream(self.device).wait_stream(side)
        out = answer.cpu().tolist()
        try:
            graph = torch.cuda.CUDAGraph()
            capture = self.saver.graph if self.saver is not None else torch.cuda.graph
            # (a pool of its own: the dropped graph's may not be captured into again)
            with capture(graph, pool=torch.cuda.graph_pool_handle()):
                logp = self._forward(ids)
        except Exception as e:  # noqa: BLE001 - whatever stops a capture, the eager forward still scores
            self.graphed = False
            why = f"{type(e).__name__}: {e}"
            log.warning("the probe's forward cannot be captured in a CUDA graph (%s): scored eagerly", why)
            return out
        self._graph, self._logp, self._key = graph, logp, key
        self.captures += 1
        return out

    def drop(self, for_good: bool = False) -> None:
        """Forget the graph and its output (its memory goes back to the allocator's cache);
        `for_good`: score eagerly from now on (a release without the memory saver: each resume
        brings the weights back at new addresses, and a capture per resume costs more than the
        eager forward it saves)."""
        self._graph = self._logp = self._key = None
        if for_good:
            self.graphed = False
