"""The embedded engine's scheduler: its request queue and the one thread that generates.

    scheduler = Scheduler(state, vocab, context_length, max_batch_size, deterministic, plain, paged)
    scheduler.start()
    future = scheduler.submit(input_ids, params, return_logprob)   # -> each prompt's samples
    scheduler.pause("abort"); scheduler.resume(); scheduler.stop()

Requests queue up and the scheduler thread hands them to one of two runners, under the engine's
lock (state.py):
- the paged path (batching.py: continuous batching over a paged KV cache and CUDA graphs): a
  queued request joins the rows decoding between two steps;
- otherwise the plain path (plain.py): the scheduler takes everything queued (up to
  `max_batch_size` sequences, each prompt expanded into its `n` samples; one request at a time
  when `deterministic`) and runs it as one batch.
Either way a request is answered once all of its samples have finished; a request the engine's
state refuses (released memory, weights resumed without a backup) is answered with that error.
No automatic garbage collection runs from taking a request to answering it (a full collection
stops the process for as long as it walks the heap), and what start-up made is frozen out of
every later collection.

Pause (SGLang's /pause_generation): with mode abort, in-flight rows end now with finish reason
abort; with in_place or retract, they are held until `resume`.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import replace

import torch

from rltrain.engine.embedded.batching import ContinuousBatcher
from rltrain.engine.embedded.plain import PlainRunner
from rltrain.engine.embedded.rows import GenRequest
from rltrain.engine.embedded.state import EngineState, EngineStateError
from rltrain.generation import SamplingParams
from rltrain.runtime.memory import gc_paused

log = logging.getLogger("rltrain.engine.embedded")

THREAD = "rltrain-embedded-scheduler"


class Scheduler:
    """The request queue and the scheduler thread of one engine (module doc). `paged` (the paged
    path's runner) or else `plain` generates."""

    def __init__(
        self,
        state: EngineState,
        vocab: int,
        context_length: int,
        max_batch_size: int,
        deterministic: bool,
        plain: PlainRunner,
        paged: ContinuousBatcher | None,
    ):
        self.state = state
        self.vocab = vocab
        self.context_length = context_length
        self.max_batch_size = max_batch_size
        self.deterministic = deterministic
        self.plain = plain
        self.paged = paged
        self._queue: queue.Queue[GenRequest | None] = queue.Queue()
        self._running = threading.Event()
        self._running.set()
        self._abort_inflight = threading.Event()
        self._stop = threading.Event()
        self._epoch = state.epoch  # the state's epoch the prefix cache was filled in
        self._thread = threading.Thread(target=self._loop, name=THREAD, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(
        self,
        input_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        return_logprob: bool,
        ids: list[str] | None = None,
        logprob_values: bool = False,
    ) -> Future:
        """Sample `n` continuations of each prompt, with its own `params` (one for all: seeds
        `sampling_seed + i * n` for prompt i). HTTP requests are checked by `requests.py` first;
        this re-checks what the engine relies on."""
        if isinstance(params, SamplingParams):
            params = [
                p if p.sampling_seed is None else replace(p, sampling_seed=p.sampling_seed + i * p.n)
                for i, p in enumerate([params] * len(input_ids))
            ]
        if len(params) != len(input_ids) or len({p.n for p in params}) != 1:
            raise ValueError(f"{len(params)} sampling params for {len(input_ids)} prompts, all of one n")
        if not input_ids or any(not isinstance(p, list) or not p for p in input_ids):
            raise ValueError("input_ids must be a non-empty list of non-empty token-id lists")
        vocab = self.vocab
        for prompt, p in zip(input_ids, params):
            p.validate()
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            if p.max_new_tokens is None or len(prompt) + p.max_new_tokens > self.context_length:
                raise ValueError(
                    f"{len(prompt)} prompt tokens + max_new_tokens={p.max_new_tokens} exceed the context length "
                    f"({self.context_length})"
                )
        self.state.check_can_generate()
        req = GenRequest(input_ids, params, return_logprob, ids, logprob_values)
        self._queue.put(req)
        return req.future

    def pause(self, mode: str) -> None:
        """abort: in-flight rows end now with finish reason abort; in_place/retract: hold them."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"pause mode {mode!r}: expected abort, in_place or retract")
        if mode == "abort":
            self._abort_inflight.set()
        self._running.clear()

    def resume(self) -> None:
        self._abort_inflight.clear()
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._running.set()
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        """Take requests and generate; from taking work to answering it, no automatic garbage
        collection pauses the process (memory.gc_paused)."""
        while not self._stop.is_set():
            if self.paged is not None and self.paged.waiting and self._running.is_set():
                with gc_paused():
                    self._serve_paged()  # requests kept waiting by an abort
                continue
            try:
                first = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if first is None:
                break
            self._running.wait()
            with gc_paused():
                if self.paged is not None:
                    self.paged.waiting.append(first)
                    self._serve_paged()
                    continue
                batch, rows = [first], len(first.input_ids) * first.params[0].n
                while rows < self.max_batch_size and not self.deterministic:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._stop.set()
                        break
                    batch.append(nxt)
                    rows += len(nxt.input_ids) * nxt.params[0].n
                self._run_batch(batch)

    def _serve_paged(self) -> None:
        """Continuous batching (batching.py) until nothing runs and nothing waits."""
        assert self.paged is not None

        def take() -> GenRequest | None:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return None
            if req is None:
                self._stop.set()
            return req

        def can_run(req: GenRequest) -> bool:
            try:
                self.state.check_can_generate()
                return True
            except EngineStateError as e:
                req.future.set_exception(e)
                return False

        stats = self.paged.stats
        captures = stats["graph_captures"]
        with self.state.lock, torch.no_grad():
            if self._epoch != self.state.epoch:  # weights or memory changed: no cached key is valid
                self.paged.decoder.forget_prefixes()
                self._epoch = self.state.epoch
            self.paged.serve(take, can_run, self._running, self._abort_inflight, lambda: self.state.weight_version)
        if stats["graph_captures"] != captures:
            # Compiling and capturing leave ~millions of long-lived objects: frozen, a full
            # collection (triggered by the rows' results) no longer walks them (the suspected
            # cause of a rollout's answers arriving late).
            gc.freeze()

    def _run_batch(self, batch: list[GenRequest]) -> None:
        """Run one batch; each request's future gets the list of its samples (prompt-major)."""
        with self.state.lock:
            live = []
            for req in batch:
                try:
                    self.state.check_can_generate()
                    live.append(req)
                except EngineStateError as e:
                    req.future.set_exception(e)
            if not live:
                return
            try:
                results = self.plain.run(live, lambda: self.state.weight_version, self._running, self._abort_inflight)
            except Exception as e:  # noqa: BLE001 - every waiting request learns why
                log.exception("batch of %d requests failed", len(live))
                for req in live:
                    if not req.future.done():
                        req.future.set_exception(e)
                return
            for req, res in zip(live, results):
                req.future.set_result(res)
