"""The paged path's runner: continuous batching over the paged decoder (paged.py).

    batcher = ContinuousBatcher(decoder, generator, token_hash, eos_ids, deterministic, overlap)
    batcher.serve(take, can_run, running, abort, weight_version)   # until nothing runs or waits

**Admission.** Queued requests are admitted whole and in order, while they fit: the batch's rows
(`max_rows`) and the KV pool's pages (kv_pool.py). A row reserves at admission the pages its
prompt plus `max_new_tokens` can fill, so decoding never waits for memory; requests that do not
fit wait until rows finish. A prefill forward takes at most PREFILL_TOKENS new prompt tokens
(PREFILL_CONTEXT cached ones): requests that fit but did not go in are admitted by the next
forward, a decode step later (as SGLang's chunked prefill goes on). The n samples of one prompt
share the prompt's full pages (prefilled once) and each gets a copy of its last, partial page
(copy-on-write at the fork).

**Continuous batching.** Between decode steps, finished rows leave (their requests are answered
at once, their pages freed) and queued requests join (prefilled, then decoding with the rest).
Sampling runs after each step, batched, in one pass over the logits on CUDA (sampling.py).

**Overlap.** Step t+1 is queued (its input tokens are step t's samples, on the device) before the
host reads step t's tokens, so Python's per-step work runs while the device computes (`_serve`).
Admissions too, after the step in flight is read (the wait gathers what arrives meanwhile into
one admission): the batch's device state gets the joining rows appended (their first tokens,
still on the device, are the next step's inputs) and the next step is queued behind the prefill
before the first tokens are read, so the device goes from prefill to step with no wait for the
host (rows whose min_new_tokens reads the host's count: their first tokens are read at once,
the state rebuilt). `overlap=False` (SGLang's
--disable-overlap-schedule) reads each step before queuing the next: the same tokens, with the
host's work between the device's steps (bench.engine compares them).

**Prefill in pieces.** Queuing a prefill forward takes the host ~1 ms per layer (~25-30 ms at the
1.7B shape; about as long as its kernels run for ~130 prompts of a later turn: docs/benchmarks/),
and at once it stops every running row until its first tokens are sampled: a multi-turn
rollout's turns arrive spread and are admitted in many waves, each a stop. With `prefill_pieces`
(`--enable-prefill-pieces`; off: no gain on a GPU, BENCHMARKS.md) an admission made while rows
run has its prefill (and its first tokens' sampling) queued a piece at a time, on a stream of
its own, in the host's spare time between decode steps (what it waited for the device at the
steps before); its kernels run beside the decode steps; its rows join at the first step after
they are done. The pieces run on a thread of their own handed over to and from the scheduler's
(pieces.py): never two threads' Python at once. One prefill at a time; what arrives meanwhile
is admitted together next. Its pages are reserved at admission; its stream starts after the
decode steps queued before it (a page a finished row gave back may still take its last step's
key).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from rltrain.engine.embedded import batch_state
from rltrain.engine.embedded.launched import Launched, Prefill, Seq, to_host
from rltrain.engine.embedded.paged import PagedDecoder
from rltrain.engine.embedded.pieces import Pieces
from rltrain.engine.embedded.prefix_cache import Hit, PrefixCache
from rltrain.engine.embedded.rows import GenRequest, Row
from rltrain.engine.embedded.sampling import LogitShaper, SamplingPlan, device_tensor, sample

log = logging.getLogger("rltrain.engine.embedded")

PREFILL_TOKENS = 16384  # prompt tokens per prefill forward (SGLang's chunked_prefill_size, larger)
# Tokens of the prompts that extend cached keys, per prefill forward (their keys are gathered from
# the pages for the attention).
PREFILL_CONTEXT = 8 * PREFILL_TOKENS
# A prefill's piece runs at least this long (s), else as long as the host waited for the device per
# decode step lately (module doc).
PIECE_MIN_S = 0.001


class ContinuousBatcher:
    """Continuously batched generation on one engine's paged decoder (module doc). `waiting`:
    requests taken from the engine's queue, not yet admitted."""

    def __init__(
        self,
        decoder: PagedDecoder,
        generator: torch.Generator,
        token_hash: Callable[[int], torch.Tensor | None],
        eos_ids: set[int],
        deterministic: bool = False,
        overlap: bool = True,
        prefill_pieces: bool = False,
    ):
        self.decoder = decoder
        self.device = decoder.device
        self.vocab = decoder.vocab
        self.generator = generator
        self.token_hash = token_hash
        self.eos_ids = eos_ids
        self.deterministic = deterministic
        self.overlap = overlap
        self.prefill_pieces = prefill_pieces and overlap and not deterministic  # (module doc)
        if self.prefill_pieces:
            decoder.pausable()
        self._stream = torch.cuda.Stream(self.device) if self.prefill_pieces and self.device.type == "cuda" else None
        self._spare = 0.002  # the host's idle time per decode step lately: its wait, plus a piece run in it
        self._in_pieces: Pieces | None = None  # the prefill being queued in pieces
        self.stats = decoder.stats  # (tokens are counted here, the forwards in the decoder)
        self.waiting: deque[GenRequest] = deque()

    def serve(
        self,
        take: Callable[[], GenRequest | None],
        can_run: Callable[[GenRequest], bool],
        running: threading.Event,
        abort: threading.Event,
        weight_version: Callable[[], str],
    ) -> None:
        """Generate until nothing runs and nothing waits. `take()`: the next queued request or
        None; `can_run(req)`: False when the engine's state refuses it (the request has been
        answered). While `running` is clear: with `abort` set, in-flight rows end now (finish
        reason abort) and the waiting requests stay for later; else in-flight rows are held.
        If anything fails, every request in flight or waiting gets the exception."""
        remaining: dict[int, list[Any]] = {}  # id(request) -> [its rows, how many still run]
        self.decoder.graphs.last_rows = 0
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            self._serve(take, can_run, running, abort, weight_version, remaining)
        except BaseException as e:
            log.exception("generation failed; failing %d requests", len(remaining) + len(self.waiting))
            if self._in_pieces is not None:
                self._in_pieces.cancel()  # (a prefill paused between its pieces unwinds)
            for rows, _ in remaining.values():
                if not rows[0].req.future.done():
                    rows[0].req.future.set_exception(e)
            while self.waiting:
                self.waiting.popleft().future.set_exception(e)
            self.decoder.free_memory(kv_cache=True)  # its pages' owners are gone: a fresh pool next time
            if not isinstance(e, Exception):
                raise
        finally:
            self._in_pieces = None
            self.stats["serve_s"] += time.perf_counter() - t0
            self.stats["serve_cpu_s"] += time.thread_time() - cpu0

    def _serve(
        self,
        take: Callable[[], GenRequest | None],
        can_run: Callable[[GenRequest], bool],
        running: threading.Event,
        abort: threading.Event,
        weight_version: Callable[[], str],
        remaining: dict[int, list[Any]],
    ) -> None:
        """The scheduling loop. Decode steps overlap the host: step t+1 is launched (its inputs
        are step t's sampled tokens, on the device) before the host reads step t's tokens,
        appends them to the rows and answers the rows that finished, so the device never waits
        for Python between steps. A row that finishes at step t has had step t+1 computed for
        it too: that token is dropped, its key written to the row's own (reserved) page, which
        is handed out again only after (the stream orders the writes). The host syncs with the
        step in flight (`settle`) only where it must: before admitting queued requests, when
        paused, and at every step where sampling reads host state (a min_new_tokens hold) or
        the engine runs `deterministic`; an admission's first tokens are read after the next step
        is queued (module doc). With `prefill_pieces`, an admission made while rows run
        is prefilled a piece after each step is queued, and its rows join at the first step
        after it is done (at once where nothing else runs or the engine pauses)."""
        seqs: list[Seq] = []
        state: dict[str, Any] = {}  # the batch's device tensors (rows that join: appended, or all rebuilt)
        pending: list[tuple[Launched, str]] = []  # queued, not yet read (with the stat its wait counts in)
        prefilling: Prefill | None = None  # an admission being prefilled in pieces
        freed = True  # rows finished (or none ran) since the last try to admit
        t0, before = time.perf_counter(), dict(self.stats)

        def done(row: Row) -> None:
            entry = remaining[id(row.req)]
            entry[1] -= 1
            if entry[1] == 0:
                del remaining[id(row.req)]
                now = time.time()
                row.req.future.set_result([r.result(weight_version(), now) for r in entry[0]])

        def settle() -> None:
            """Read the step in flight; drop the rows that finished from the batch (and from its
            device tensors: the next step's inputs stay on the device)."""
            nonlocal pending, seqs, freed
            for launched, waited in pending:
                self._collect(launched, done, waited)
            pending = []
            keep = [b for b, s in enumerate(seqs) if s.row.finish is None]
            if len(keep) < len(seqs):
                freed = True
                seqs = [seqs[b] for b in keep]
                if state:
                    t_subset = time.perf_counter()
                    batch_state.subset(state, keep, self._plan([s.row for s in seqs]), self.device)
                    self.stats["subset_s"] += time.perf_counter() - t_subset

        def join() -> None:
            """The rows of the admission prefilled in pieces join the batch (its rest queued and
            waited for where not done), after the step in flight is read (the batch's device
            state is rebuilt from the rows)."""
            nonlocal prefilling, seqs, freed
            assert prefilling is not None
            t_join = time.perf_counter()
            self._piece(prefilling, float("inf"))
            settle()
            joining, prefilling = prefilling, None
            launched = joining.work.result()  # (its error, if any, is the serve's)
            self._collect(launched, done, "prefill_wait_s")
            joined = [s for s in joining.seqs if s.row.finish is None]
            if joined:
                seqs += joined
                state.clear()
            freed = True
            self.stats["admit_s"] += time.perf_counter() - t_join

        while True:
            while not running.is_set():
                if prefilling is not None:
                    join()  # (its rows are held or aborted with the others)
                settle()
                if abort.is_set():
                    for s in seqs:
                        s.row.finish = {"type": "abort", "message": "generation paused with mode=abort"}
                        assert self.decoder.pool is not None
                        self.decoder.pool.release(s.pages)
                        done(s.row)
                    return
                if not seqs:
                    return
                running.wait(0.05)
            while (req := take()) is not None:
                self.waiting.append(req)
                freed = True
            if prefilling is not None and (not seqs or prefilling.done()):
                join()
            admitted = 0
            if self.waiting and freed and prefilling is None and not (self.deterministic and seqs):
                settle()  # (the step in flight read first: what arrives meanwhile joins this admission)
                # The joining rows' first tokens stay on the device, the next step's inputs (module
                # doc), where the batch's device state is there to append to; else they are read and
                # the state rebuilt from the rows.
                unread = self.overlap and not self.deterministic and (bool(state) or not seqs)
                unread = unread and not (self.prefill_pieces and seqs)  # (in pieces: `join`)
                t_admit = time.perf_counter()
                self.stats["admits"] += 1
                # (tried again next time round where the forward's caps left some that fit waiting;
                # else once rows finish or requests arrive)
                joined, admitted, prefilling, freed, first = self._admit(can_run, len(seqs), remaining, done, unread)
                if first is not None:
                    launched, joining = first
                    pending.append((launched, "prefill_wait_s"))
                    self.stats["admits_unread"] += 1
                    t_state = time.perf_counter()
                    seqs = seqs + joined
                    batch_state.append(
                        state, seqs, joining, self._plan([s.row for s in seqs]), self.decoder.max_pages, self.device
                    )
                    self.stats["batch_state_s"] += time.perf_counter() - t_state
                elif joined:
                    seqs = seqs + joined
                    state.clear()
                self.stats["admit_s"] += time.perf_counter() - t_admit
            if not seqs:
                if prefilling is not None:
                    continue  # (joined above)
                settle()  # (nothing may run on the device once this returns: a release may follow)
                if admitted or not self.waiting:
                    if not self.waiting:
                        n, dt = self.stats["tokens"] - before["tokens"], time.perf_counter() - t0
                        log.info(
                            "decoded %d tokens in %.2f s (%.0f tokens/s; %d graph captures took %.2f s of it)",
                            n,
                            dt,
                            n / max(dt, 1e-9),
                            self.stats["graph_captures"] - before["graph_captures"],
                            self.stats["capture_s"] - before["capture_s"],
                        )
                        return
                    freed = True
                    continue
                req = self.waiting.popleft()  # it does not fit even with nothing else running
                assert self.decoder.pool is not None
                need = sum(len(p) + (q.max_new_tokens or 0) * q.n for p, q in zip(req.input_ids, req.params))
                req.future.set_exception(
                    ValueError(
                        f"the request's {need} tokens (prompts + max_new_tokens x n) do not fit the KV cache "
                        f"({(self.decoder.pool.pages - 1) * self.decoder.page_size} tokens); raise "
                        "--max-total-tokens or --mem-fraction-static, or send fewer samples per request"
                    )
                )
                freed = True
                continue
            if pending and all(len(s.row.out) + 1 >= s.row.max_new for s in seqs):
                settle()  # every row ends with the step in flight: none after it
                continue
            if not state:
                t_state = time.perf_counter()
                plan = self._plan([s.row for s in seqs])
                state.update(batch_state.build(seqs, plan, self.vocab, self.decoder.max_pages, self.device))
                self.stats["batch_state_s"] += time.perf_counter() - t_state
            t_launch = time.perf_counter()
            launched = self._launch(seqs, state)
            self.stats["launch_s"] += time.perf_counter() - t_launch
            piece = self._piece(prefilling, max(PIECE_MIN_S, 0.8 * self._spare)) if prefilling is not None else 0.0
            waited, read = self.stats["wait_s"], bool(pending)
            settle()  # the step before it, read while this one runs
            if read or piece:
                self._spare += 0.2 * (self.stats["wait_s"] - waited + piece - self._spare)
            pending = [(launched, "wait_s")]
            if self.deterministic or state["shaper"].hold or not self.overlap:
                settle()

    def _launch(self, seqs: list[Seq], state: dict[str, Any]) -> Launched:
        """Queue one decode step and its sampling for the rows; advance the batch's device
        tensors to the next step (its input tokens are this step's samples) and start copying
        the samples to the host."""
        logits = self.decoder.decode(state["tokens"], state["pos"], state["table"])
        shaper = state["shaper"]
        shaped = shaper.shape(logits, [len(s.row.out) for s in seqs] if shaper.hold else 0)
        tokens, logps = sample(shaped, state["plan"], state["steps"], self.generator)
        shaper.count(tokens)
        state["tokens"], state["pos"], state["steps"] = tokens, state["pos"] + 1, state["steps"] + 1
        return Launched(seqs, *to_host(tokens, logps))

    def _collect(self, launched: Launched, done: Callable[[Row], None], waited: str = "wait_s") -> None:
        """The launched step's tokens join their rows (rows that finished before it drop
        theirs); a row that finishes gives its pages back and is answered."""
        pool = self.decoder.pool
        assert pool is not None
        t0 = time.perf_counter()
        if launched.ready is not None:
            launched.ready.synchronize()
        t1 = time.perf_counter()
        self.stats[waited] += t1 - t0
        toks, lps = launched.host.tolist()
        for b, s in enumerate(launched.seqs):
            if s.row.finish is not None:
                continue
            self.stats["tokens"] += 1
            if s.row.append(int(toks[b]), lps[b]):
                self._finished(s)
                done(s.row)
        self.stats["collect_s"] += time.perf_counter() - t1

    def _finished(self, s: Seq) -> None:
        """A finished row's pages go to the prefix cache (the keys of its prompt and of every
        sampled token but the last, which no step fed back), then back to the pool."""
        assert self.decoder.pool is not None
        cache = self.prefixes
        if cache is not None:
            tokens = s.row.prompt + s.row.out[:-1]
            cache.insert(tokens, s.pages[: -(-len(tokens) // self.decoder.page_size)])
        self.decoder.pool.release(s.pages)

    def _plan(self, rows: list[Row]) -> SamplingPlan:
        """The rows' sampling plan (what stays the same at every step of this set of rows)."""
        return SamplingPlan(
            [r.params for r in rows], [r.seed for r in rows], self.vocab, self.device, self.token_hash(self.vocab)
        )

    def _admit(
        self,
        can_run: Callable[[GenRequest], bool],
        running: int,
        remaining: dict[int, list[Any]],
        done: Callable[[Row], None],
        unread: bool = False,
    ) -> tuple[list[Seq], int, Prefill | None, bool, tuple[Launched, dict[str, Any]] | None]:
        """Queued requests that fit (rows and pages), prefilled, their first tokens sampled: (the
        rows that go on decoding, how many requests were admitted, the prefill queued in pieces
        whose rows join once it is done: then no rows now, whether more that fit wait for the
        next forward: PREFILL_TOKENS, PREFILL_CONTEXT; with `unread`, the first tokens queued and
        not read: see `_prefill`). Requests are admitted whole and in order. A prompt's cached
        prefix (prefix_cache.py) needs no pages of its own and is not prefilled again; pages only
        the cache holds count as free (evicted as needed), less those the admitted prompts' hits
        use."""
        P = self.decoder.page_size
        beside = self.prefill_pieces and running > 0  # (rows decode while it is prefilled)
        batch: list[tuple[GenRequest, list[Row]]] = []
        hits: dict[tuple[int, ...], Hit] = {}
        used: set[int] = set()  # pages of the hits that only the cache holds: not evictable now
        tokens = context = 0
        free = -1
        counted = False  # whether `free` counts the pages only the prefix cache holds
        capped = False  # whether requests that fit wait for the next forward (its token caps)
        while self.waiting:
            req = self.waiting[0]
            if not can_run(req):
                self.waiting.popleft()
                continue
            if free < 0:
                self.decoder.allocate()
                assert self.decoder.pool is not None
                free = self.decoder.pool.free
            pool = self.decoder.pool
            assert pool is not None
            rows = req.rows(self.eos_ids)
            prompts = {tuple(r.prompt) for r in rows if r.finish is None}
            found = {k: hits.get(k) or self._match(k) for k in prompts}
            newly = {
                p
                for h in found.values()
                for p in (*h.pages, *([h.partial] if h.partial is not None else []))
                if p not in used and pool.refs(p) == 1
            }
            pages = sum(len(k) // P - len(found[k].pages) for k in prompts)
            pages += sum(-(-(len(r.prompt) + r.max_new) // P) - len(r.prompt) // P for r in rows if r.finish is None)
            new_tokens = sum(len(k) - found[k].tokens(P) for k in prompts)
            new_context = sum(len(k) for k in prompts if found[k].tokens(P))
            if running + len(rows) > self.decoder.max_rows and (running or batch):
                break
            if pages > free - len(newly) and not counted and self.prefixes is not None:
                free += self.prefixes.evictable()  # (a walk of the cache: only when the free pages fall short)
                counted = True
            if pages > free - len(newly):
                break
            if batch and (tokens + new_tokens > PREFILL_TOKENS or context + new_context > PREFILL_CONTEXT):
                capped = True  # (the rest fits: admitted by the next forward)
                break
            self.waiting.popleft()
            batch.append((req, rows))
            hits.update(found)
            used |= newly
            free -= pages + len(newly)
            tokens += new_tokens
            context += new_context
            running += len(rows)
            if self.deterministic:
                break
        if not batch:
            return [], 0, None, False, None
        live, later, first = self._prefill(batch, hits, remaining, done, in_pieces=beside, unread=unread)
        return live, len(batch), later, capped, first

    @property
    def prefixes(self) -> PrefixCache | None:
        """The pool's prefix cache (None: none, or the engine runs `deterministic`: a prompt's
        logits must not depend on what was cached before it)."""
        return None if self.deterministic else self.decoder.prefixes

    def _match(self, prompt: tuple[int, ...]) -> Hit:
        cache = self.prefixes
        return cache.match(list(prompt)) if cache is not None else Hit([])

    def _prefill(
        self,
        batch: list[tuple[GenRequest, list[Row]]],
        hits: dict[tuple[int, ...], Hit],
        remaining: dict[int, list[Any]],
        done: Callable[[Row], None],
        in_pieces: bool = False,
        unread: bool = False,
    ) -> tuple[list[Seq], Prefill | None, tuple[Launched, dict[str, Any]] | None]:
        """The admitted requests' rows get their pages and their prompts' keys: a prompt's cached
        pages are shared (a page the match ends inside is taken over, or copied, before the rest
        of the prompt is written into it), the rest prefilled, once per distinct prompt; the
        first token of every row is sampled. Returns the rows that go on decoding; `in_pieces`:
        none yet, and the prefill to queue in pieces (`_piece`), whose rows join once done;
        `unread` (where no row holds its stop tokens: min_new_tokens reads the host's count):
        every row, their first tokens not read, and those tokens (queued, with the rows' logit
        shaper that counted them) for the next step's inputs: batch_state.py's `append`."""
        pool = self.decoder.pool
        assert pool is not None
        cache = self.prefixes
        P = self.decoder.page_size
        # The hits' pages are the rows' now (the cache keeps its own reference); a page the match
        # ends inside is handed over where only the cache holds a tail, else held until copied.
        taken: dict[tuple[int, ...], int | None] = {}
        for key, hit in hits.items():
            pool.share(hit.pages)
            if hit.partial is not None:
                taken[key] = cache.take(hit) if cache is not None else None
                if taken[key] is None:
                    pool.share([hit.partial])  # the copy's source, until copied
        live_rows = [r for _, rows in batch for r in rows if r.finish is None]
        need = sum(-(-(len(r.prompt) + r.max_new) // P) - len(r.prompt) // P for r in live_rows)
        for key in {tuple(r.prompt) for r in live_rows}:
            need += len(key) // P - len(hits[key].pages) - (1 if taken.get(key) is not None else 0)
        if cache is not None and pool.free < need:
            cache.evict(need)
        prompts: dict[tuple[int, ...], list[Seq]] = {}
        copies: list[tuple[int, int]] = []  # (source, destination) pages
        for req, rows in batch:
            remaining[id(req)] = [rows, len(rows)]
            for r in rows:
                if r.finish is not None:
                    continue
                key = tuple(r.prompt)
                hit = hits[key]
                r.cached = hit.tokens(P)
                group = prompts.setdefault(key, [])
                full = len(r.prompt) // P
                total = -(-(len(r.prompt) + r.max_new) // P)
                if group:
                    shared = group[0].pages[:full]
                    pool.share(shared)
                    s = Seq(r, shared + pool.alloc(total - full))
                else:
                    k = len(hit.pages)
                    mine = pool.alloc(total - k - (1 if taken.get(key) is not None else 0))
                    if hit.partial is not None:
                        if taken.get(key) is not None:
                            mine.insert(0, hit.partial)
                        else:
                            copies.append((hit.partial, mine[0]))
                    s = Seq(r, hit.pages + mine)
                group.append(s)
        for rows in [rows for _, rows in batch]:
            for r in rows:
                if r.finish is not None:  # max_new_tokens 0
                    done(r)
        groups = list(prompts.values())
        seqs = [s for g in groups for s in g]
        if not seqs:
            return [], None, None
        # the prompt's last, partial page: copied from the first sample's to the others'
        src, dst = [], []
        for g in groups:
            n = len(g[0].row.prompt)
            if n % P:
                for s in g[1:]:
                    src.append(g[0].pages[n // P])
                    dst.append(s.pages[n // P])
        rows = [s.row for s in seqs]
        of_seq = [u for u, g in enumerate(groups) for _ in g]

        def launch() -> tuple[Launched, torch.Tensor, LogitShaper]:
            """The device's part: copies, the prefill forward, the first tokens' sampling."""
            assert pool is not None
            cpu0 = time.thread_time()
            if copies:
                pool.copy([a for a, _ in copies], [b for _, b in copies])
            logits = self.decoder.prefill_forward(
                [list(k) for k in prompts], [g[0].pages for g in groups], [hits[k].tokens(P) for k in prompts]
            )
            pool.copy(src, dst)
            row_logits = logits[device_tensor(of_seq, torch.long, self.device)]
            shaper = LogitShaper([r.params for r in rows], [r.stops for r in rows], self.vocab, self.device)
            tokens, logps = sample(shaper.shape(row_logits, 0), self._plan(rows), 0, self.generator)
            launched = Launched(seqs, *to_host(tokens, logps))
            self.stats["prefill_launch_cpu_s"] += time.thread_time() - cpu0
            return launched, tokens, shaper

        if not in_pieces:
            t0 = time.perf_counter()
            launched, tokens, shaper = launch()
            self.stats["prefill_launch_s"] += time.perf_counter() - t0
            if copies:
                pool.release([a for a, _ in copies])
            if unread and not shaper.hold:
                shaper.count(tokens)
                return seqs, None, (launched, {"tokens": tokens, "shaper": shaper})
            self._collect(launched, done, "prefill_wait_s")
            return [s for s in seqs if s.row.finish is None], None, None
        # Its stream starts after the steps queued so far (their last writes). The copies' sources
        # go back to the pool now: no page is handed out again before this prefill joins.
        after = None
        if self._stream is not None:
            after = torch.cuda.Event()
            after.record()
        stream = self._stream

        def in_pieces_on_its_stream() -> Launched:
            with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None and after is not None:
                    stream.wait_event(after)
                return launch()[0]

        later = Prefill(seqs, Pieces(in_pieces_on_its_stream, name="prefill"))
        self._in_pieces = later.work
        if copies:
            pool.release([a for a, _ in copies])
        self.stats["prefills_in_pieces"] += 1
        return [], later, None

    def _piece(self, prefill: Prefill, budget_s: float) -> float:
        """Queue the next piece of `prefill` (the rest with an infinite budget): its host time."""
        if prefill.work.done:
            return 0.0
        t0 = time.perf_counter()
        prefill.work.resume(budget_s)
        dt = time.perf_counter() - t0
        self.stats["prefill_launch_s"] += dt
        self.stats["prefill_pieces"] += 1
        return dt
