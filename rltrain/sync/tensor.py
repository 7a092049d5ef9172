"""`sync.transport=tensor`: each bucket handed to the engines by handle (CUDA IPC on GPU, shared
memory on CPU), `load_format=flattened_bucket`, inside one weight-update session per version.

A push is a session (`Session`: begun, or opened inline by the first bucket; ended) around a
stream of buckets, each flattened into a buffer (`BufferRing`: a fresh one per bucket, or a ring
refilled in turn, sent by slot number where the engines keep slots) and sent on a sender thread
while the calling thread gathers and flattens the next bucket (the session's begin while it
gathers the first). Against SGLang one request is in flight and every bucket has a fresh buffer
(SGLang answers before its copies out of the buffer are done). An engine that answers after
them (`caps.synchronous`, the embedded engine) gets `DEPTH` requests in flight — one's copy
overlaps the next one's handling — and `DEPTH + 1` buffers refilled in turn: bucket k's buffer
was last used by bucket k - DEPTH - 1, whose request has returned before bucket k - 1 was sent.
Where the engines keep buffers by slot number (`caps.slots`, weights/bucket.py), each buffer's
handle is sent once per session.

An engine of TP size k gets one payload per TP rank, in TP-rank order
(`serialized_named_tensors[tp_rank]`), and each TP rank's payload is built on that rank's own GPU
by the trainer rank colocated there: a CUDA-IPC handle is opened by exactly one consumer
(SGLang's TP rank k reads entry k only; a handle opened by several processes breaks the
producer's IPC refcounting — freed under a peer's copy, or leaked — and puts a context of every
TP process on one GPU). Where the plan routes experts inside the engine (SGLang's `--ep-size`),
a TP rank's payload holds only its own EP rank's experts, with every other weight
(`SyncPlan.needed_by`). The same loop then runs on every rank of the engine over per-TP-rank
payloads (`_send_across_tp`): each rank flattens its copy into a fresh buffer, the engine's
leader gathers the payloads over the engine's bridge subgroup and sends the one request itself,
and all keep their buffers until a second gather, of the engine's answer. Every rank joins both
gathers of every bucket carrying its payload or its error (the leader: the answer or its error),
so a failure on any of them — an out-of-memory while one flattens, the engine's refusal — stops
all of them at the same bucket with the same error; none waits in a collective for a rank that
left it. A failure on a rank is never raised mid-stream: it keeps joining the trainer's gathers
to the end and raises then (the `Transport` contract).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from rltrain.sync.plan import Bucket
from rltrain.sync.transport import Named, SessionEnds, SyncContext, WeightStream, end_session, failure_text
from rltrain.weights.bucket import BucketViews, bucket_layout, flatten_bucket, serialize

log = logging.getLogger("rltrain.sync")

DEPTH = 2  # requests in flight against an engine that answers after its copies

Tags = dict[int, str | None]  # receiver -> the version this bucket sets on it (its last bucket), else None


class Session:
    """One push's weight-update session on each receiver (SGLang requires one around tensor
    updates). Begun explicitly before the first bucket's request (`begin`, on a sender thread
    while the first bucket is gathered; every request waits for it) and ended after the last
    answer; or, `inline` (the embedded engine), opened by a receiver's first bucket request and
    closed by its last, which carries the end's reports (a one-bucket sync is one request). What
    the ends report is kept in `ends`."""

    def __init__(self, ctx: SyncContext, ends: SessionEnds, inline: bool):
        self.ctx, self.ends, self.inline = ctx, ends, inline
        self.begun: Future[Any] | None = None
        self.opened: set[int] = set()  # receivers whose session a request has (maybe) opened
        self._opener: Future[None] | None = None  # the last request that opened sessions

    def begin(self, pool: ThreadPoolExecutor) -> None:
        if not self.inline:
            checksum = self.ctx.checksums  # (the engines sum the buckets as they land)
            self.begun = pool.submit(lambda: [c.begin_weight_update(checksum) for c in self.ctx.receivers])

    def opens(self, tags: Tags) -> set[int]:
        """The receivers whose session this bucket's request opens (inline: those not opened
        yet), once the request that opened others has returned."""
        if self._opener is not None:
            self._opener.result()
        opens = {r for r in tags if self.inline and r not in self.opened}
        self.opened |= opens
        return opens

    def sent(self, request: Future[None], opens: set[int]) -> None:
        self._opener = request if opens else None

    def update(self, receiver: int, payloads: list[str], tag: str | None, opens: Collection[int] = ()) -> None:
        """One bucket's request to `receiver`, inside its session (opening it where `receiver`
        is in `opens`; closing it where inline and the bucket sets the version)."""
        closes = self.inline and tag is not None
        answer = self.ctx.receivers[receiver].update_weights_from_tensor(
            payloads,
            load_format="flattened_bucket",
            weight_version=tag,
            flush_cache=tag is not None,
            begin_session=receiver in opens,
            end_session=closes,
            **(SessionEnds.asked(self.ctx) if closes else {"checksum": self.ctx.checksums}),
        )
        if closes:
            self.ends.keep(receiver, answer, closed=True)

    def end(self) -> None:
        """End the sessions no request closed, once every request has returned: every
        receiver's where begun (none where the begin failed: its error is the push's), else
        those a failed push opened inline and never closed."""
        if self.begun is not None:
            wait([self.begun])
            if self.begun.exception() is None:
                for r in range(len(self.ctx.receivers)):
                    end_session(self.ctx, r, self.ends)  # the embedded engine unmaps the reused buffers here
        else:
            for r in sorted(self.opened - self.ends.closed):
                end_session(self.ctx, r, self.ends)

    def failure(self) -> BaseException | None:
        return self.begun.exception() if self.begun is not None else None


class BufferRing:
    """Where each bucket is flattened. `size` 0: a fresh buffer per bucket. Else `size` buffers
    refilled in turn — on a GPU this push's, on the CPU (shared host memory, as large as the
    largest bucket) kept for the next push, whose handles go out again — and, where the engines
    keep at least that many slots (`slotted`), each buffer's handle goes to an engine once per
    session, its slot number after."""

    def __init__(self, size: int, slots: int):
        self.size = size
        self.slotted = bool(size) and slots >= size
        self.ring: list[torch.Tensor | None] = []
        self.sent: set[tuple[int, int]] = set()  # (receiver, slot): holds the slot's buffer, this push
        # By plan index: the bucket's layout, its BucketViews, its handle-less payloads by slot.
        self.layouts: dict[int, tuple[tuple[list[Any], int], BucketViews, dict[int, str]]] = {}

    def start(self) -> None:
        """A new push: a new session, where every buffer's handle goes out again."""
        if len(self.ring) != self.size:
            self.ring = [None] * self.size
        self.sent = set()

    def fill(self, i: int, named: Named, targets: Tags) -> tuple[dict[str, Any], str, Any]:
        """Bucket `i` flattened: (the flat bucket, its payload, the event the sender waits for
        before the request, or None). An engine that finds a reused buffer already mapped does not
        wait for the producer's event (torch's IPC cache): the sender waits for the fill instead."""
        layout, views, by_slot = self._layout(i, named)
        if not self.size:
            flat = flatten_bucket(named, layout=layout, views=views)
            return flat, serialize(flat), None
        slot = i % self.size
        out = self._buffer(slot, layout[1], named[0][1].device)
        flat = flatten_bucket(named, out=out, layout=layout, views=views)
        filled = _record(flat["flattened_tensor"])
        payload = self._slotted(flat, out, slot, targets, by_slot) if self.slotted else serialize(flat)
        return flat, payload, filled

    def release(self, device: torch.device) -> None:
        if device.type != "cpu":
            self.ring = []  # unmapped by now, so freed (not parked in torch's IPC limbo)

    def _slotted(
        self, flat: dict[str, Any], out: torch.Tensor, slot: int, targets: Tags, by_slot: dict[int, str]
    ) -> str:
        """The serialized payload with the buffer-slot extension: the buffer's handle only if
        some target has not been sent this buffer in this session, the slot number always.
        Without the handle it is the same string every sync (kept in `by_slot`)."""
        if all((r, slot) in self.sent for r in targets):
            if slot not in by_slot:
                by_slot[slot] = serialize({"flattened_tensor": None, "metadata": flat["metadata"], "buffer": slot})
            return by_slot[slot]
        self.sent.update((r, slot) for r in targets)
        return serialize({"flattened_tensor": out, "metadata": flat["metadata"], "buffer": slot})

    def _layout(self, i: int, named: Named) -> tuple[tuple[list[Any], int], BucketViews, dict[int, str]]:
        """Bucket `i`'s layout, its views and its handle-less payloads by slot, made at its
        first sync: the plan, and so every bucket's names, shapes and dtypes, is fixed."""
        kept = self.layouts.get(i)
        if kept is None or [n for n, _ in named] != [m.name for m in kept[0][0]]:
            layout = bucket_layout(named)
            kept = self.layouts[i] = (layout, BucketViews(layout[0]), {})
        return kept

    def _buffer(self, slot: int, size: int, device: torch.device) -> torch.Tensor:
        """Reused buffer `slot`, grown to hold `size` bytes."""
        buf = self.ring[slot]
        if buf is None or buf.numel() < size or buf.device != device:
            self.ring[slot] = None  # drop the old one before allocating its successor
            # A new buffer (even at the old one's address) is sent with its handle again.
            self.sent -= {k for k in self.sent if k[1] == slot}
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            if buf.device.type == "cpu":
                buf.share_memory_()
            self.ring[slot] = buf
        return buf


class TensorTransport:
    """Every bucket of a push to this rank's engines by handle: a `Session` around buffers from a
    `BufferRing`, the requests on sender threads (module docstring)."""

    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        # An engine that answers after its copies: DEPTH requests in flight, DEPTH + 1 buffers refilled.
        self.depth = DEPTH if ctx.caps.synchronous else 1
        self.buffers = BufferRing(DEPTH + 1 if ctx.caps.synchronous else 0, ctx.caps.slots)
        self.inline_sessions = ctx.caps.inline_sessions
        self.timings: dict[str, float] = {}
        self.ends = SessionEnds()
        self._sender: ThreadPoolExecutor | None = None  # the request threads (`send`)
        self.rank_bytes: dict[int, int] = {}  # engine TP rank -> bytes its payloads held, last push
        self._timing_lock = threading.Lock()

    @property
    def slotted(self) -> bool:
        """Buffers go to the engines by slot number (never across TP ranks: fresh buffers there)."""
        return self.buffers.slotted and self.ctx.tp_group is None

    def send(self, version: str, weights: WeightStream) -> int:
        ctx = self.ctx
        self.timings = dict.fromkeys(("gather", "flatten", "wait", "request"), 0.0)
        self.ends = SessionEnds()
        if ctx.tp_group is not None:
            return self._send_across_tp(version, weights)
        if not ctx.sender:
            for _ in weights.buckets(self.timings):  # join every gather
                pass
            if weights.failure is not None:
                raise RuntimeError(weights.failure)
            return 0
        if self._sender is None:  # kept for every push: threads started per push are slow on a busy CPU
            self._sender = ThreadPoolExecutor(self.depth, thread_name_prefix="rltrain-sync")
        session = Session(ctx, self.ends, self.inline_sessions)
        session.begin(self._sender)
        self.buffers.start()
        in_flight: collections.deque[Future[None]] = collections.deque()
        sent = 0
        failure: BaseException | None = None
        try:
            for i, bucket, named in weights.buckets(self.timings):
                if named is None or failure is not None or weights.failure is not None:
                    continue  # keep joining the gathers; the failure is reported after
                try:
                    tags = _tags(ctx, version, i, bucket)
                    t0 = time.perf_counter()
                    flat, payload, filled = self.buffers.fill(i, named, tags)
                    del named
                    self.timings["flatten"] += time.perf_counter() - t0
                    self._submit(in_flight, session, tags, flat, payload, filled)
                    sent += bucket.nbytes * len(bucket.targets)
                except Exception as e:  # noqa: BLE001 - any: this rank keeps joining the gathers, reports after
                    failure = e
            while in_flight and failure is None:
                in_flight.popleft().result()
        except Exception as e:  # noqa: BLE001 - reported after, on every rank
            failure = e
        finally:
            wait(in_flight)  # every request has returned (a failed push too) before the session ends
            try:
                session.end()
            finally:
                self.buffers.release(ctx.device)
                _collect_shared(ctx.device)
        failure = failure or session.failure()
        if failure is not None:
            raise RuntimeError(failure_text(failure)) from failure
        if weights.failure is not None:
            raise RuntimeError(weights.failure)
        return sent

    def _submit(
        self,
        in_flight: collections.deque[Future[None]],
        session: Session,
        tags: Tags,
        flat: dict[str, Any],
        payload: str,
        filled: Any,
    ) -> None:
        """Hand one bucket to a sender thread, once there is room: `depth` requests in flight, but
        the bucket that sets the version goes only after every other has loaded."""
        assert self._sender is not None
        t0 = time.perf_counter()
        while len(in_flight) >= (1 if any(tags.values()) else self.depth):
            in_flight.popleft().result()
        opens = session.opens(tags)
        self.timings["wait"] += time.perf_counter() - t0
        request = self._sender.submit(self._send_handles, session, tags, flat, payload, filled, opens)
        in_flight.append(request)
        session.sent(request, opens)

    def _send_handles(
        self, session: Session, tags: Tags, flat: dict[str, Any], payload: str, filled: Any, opens: set[int]
    ) -> None:
        """One bucket to each receiver that owns it (sender thread). `flat` stays referenced
        until every engine has answered, i.e. finished copying out of it."""
        if session.begun is not None:
            session.begun.result()
        t0 = time.perf_counter()
        if filled is not None:
            filled.synchronize()
        for r, tag in tags.items():
            session.update(r, [payload], tag, opens)
        with self._timing_lock:
            self.timings["request"] += time.perf_counter() - t0
        del flat

    def _send_across_tp(self, version: str, weights: WeightStream) -> int:
        """The same loop over per-TP-rank payloads, on every rank of an engine over several GPUs:
        each rank builds its TP rank's payload of each bucket in a fresh buffer on its own device;
        the leader sends the gathered list itself, inside a session it begins and ends itself
        (ended also where the begin failed). Per bucket every rank takes part in both of the
        engine's collectives whatever happened: the gather of the payloads, each rank carrying
        its payload or its error, and the gather of the leader's answer (the engine's, or why
        not), after which the buffers may go. So a failure on any rank (an out-of-memory while
        one flattens, the engine's refusal) is seen by every rank at the same bucket; from there
        on they only join the trainer's gathers, and each raises the same error."""
        ctx = self.ctx
        group = ctx.tp_group
        assert group is not None
        session = Session(ctx, self.ends, inline=False)
        sent = 0
        error: str | None = None  # the leader's failed begin, told to the others with the first bucket
        failure: str | None = None  # the first failure on any rank of the engine: every rank raises it
        self.rank_bytes = {}  # bytes each TP rank of the engine was sent, this push (measured)
        if ctx.sender:
            try:
                for client in ctx.receivers:
                    client.begin_weight_update(ctx.checksums)
            except Exception as e:  # noqa: BLE001 - told to every rank of the engine
                error = f"{ctx.engine_name} did not begin its weight-update session: {failure_text(e)}"
        try:
            for i, bucket, named in weights.buckets(self.timings):
                if failure is not None:
                    continue  # every rank knows it: only the trainer's gathers are left to join
                if weights.failure is not None and error is None:
                    error = f"rank {ctx.world.rank} (TP rank {ctx.tp_rank} of {ctx.engine_name}): {weights.failure}"
                t0 = time.perf_counter()
                flat, payloads, nbytes, failure = self._tp_payloads(i, named, error)  # a collective
                del named
                t1 = time.perf_counter()
                self.timings["flatten"] += t1 - t0
                answer = None
                if ctx.sender and failure is None:
                    try:
                        for r, tag in _tags(ctx, version, i, bucket).items():
                            session.update(r, payloads, tag)
                        sent += nbytes * len(bucket.targets)
                    except Exception as e:  # noqa: BLE001 - told to every rank of the engine
                        answer = f"{ctx.engine_name} did not load bucket {i}: {failure_text(e)}"
                self.timings["request"] += time.perf_counter() - t1
                answers = group.all_gather_object(answer, phase=f"sync bucket {i} loaded")  # the buffers may go
                failure = failure or next((a for a in answers if a), None)
                del flat
        finally:
            if ctx.sender:
                for r in range(len(ctx.receivers)):
                    try:
                        end_session(ctx, r, self.ends)
                    except Exception as e:  # noqa: BLE001 - this rank's failure (the agreement tells the others)
                        ended = f"{ctx.engine_name} did not end its weight-update session: {failure_text(e)}"
                        failure = failure or ended
            _collect_shared(ctx.device)
        failure = failure or error  # (a push of no bucket)
        if failure is not None:
            raise RuntimeError(failure)
        return sent

    def _tp_payloads(
        self, i: int, named: Named | None, error: str | None
    ) -> tuple[dict[str, Any] | None, list[str], int, str | None]:
        """This TP rank's payload of bucket `i` in a fresh buffer, gathered with the engine's
        other ranks' — a collective every rank joins with its payload or its error (`error`:
        this rank's already; else one while it builds the payload, logged here with its
        traceback). Returns this rank's flat bucket, every TP rank's payload in TP order, their
        bytes, and the first rank's error in TP order (then no payload)."""
        ctx = self.ctx
        assert ctx.tp_group is not None
        flat, payload, nbytes = None, None, 0
        if error is None:
            assert named is not None  # (a failed gather is an error)
            try:
                # Routed inside the engine: this TP rank's own experts and every other weight.
                mine = [(n, t) for n, t in named if ctx.plan.needed_by(ctx.tp_rank, n)]
                nbytes = sum(t.numel() * t.element_size() for _, t in mine)
                flat = flatten_bucket(mine)
                del mine
                if flat["flattened_tensor"].device.type == "cuda":  # filled before shared
                    torch.cuda.current_stream(flat["flattened_tensor"].device).synchronize()
                payload = serialize(flat)
            except Exception as e:  # noqa: BLE001 - told to every rank of the engine
                flat = None
                error = (
                    f"rank {ctx.world.rank} (TP rank {ctx.tp_rank} of {ctx.engine_name}) could not build its "
                    f"payload of bucket {i}: {failure_text(e)}"
                )
                log.error("%s", error, exc_info=e)
        gathered = ctx.tp_group.all_gather_object((payload, nbytes, error), phase=f"sync bucket {i} payloads")
        failure = next((e for _, _, e in gathered if e), None)
        if failure is not None:
            return None, [], 0, failure
        for k, (_, b, _) in enumerate(gathered):
            self.rank_bytes[k] = self.rank_bytes.get(k, 0) + b
        return flat, [p for p, _, _ in gathered], sum(b for _, b, _ in gathered), None

    def engine_restarted(self) -> None:
        self.buffers.layouts.clear()  # the payload strings were the dead engine's slots

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True)
            self._sender = None


def _tags(ctx: SyncContext, version: str, i: int, bucket: Bucket) -> Tags:
    """Bucket `i`'s receivers, each with the version it sets there (its last bucket), else None."""
    return {r: version if i == ctx.plan.last_buckets[r] else None for r in bucket.targets}


def _collect_shared(device: torch.device) -> None:
    """Free the buckets the engines have let go of. A CUDA block shared by IPC and dropped while
    a consumer still had it open is parked in torch's IPC limbo, still allocated; torch looks at
    the limbo again only when another shared block is dropped, when an allocation fails, or when
    asked (`ipc_collect`): without this the session's last bucket stays allocated in the
    trainer through the next phases."""
    if device.type == "cuda":
        torch.cuda.ipc_collect()


def _record(t: torch.Tensor) -> torch.cuda.Event | None:
    """A CUDA event after the work queued so far on `t`'s device (None on CPU: already done)."""
    if t.device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev
