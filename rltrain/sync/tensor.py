"""`sync.transport=tensor`: each bucket handed to the engines by handle (CUDA IPC on GPU, shared
memory on CPU), `load_format=flattened_bucket`, inside one weight-update session per version.

An engine of TP size k gets one payload per TP rank, in TP-rank order
(`serialized_named_tensors[tp_rank]`), and each TP rank's payload is built on that rank's own GPU
by the trainer rank colocated there: a CUDA-IPC handle is opened by exactly one consumer
(SGLang's TP rank k reads entry k only; a handle opened by several processes breaks the
producer's IPC refcounting — freed under a peer's copy, or leaked — and puts a context of every
TP process on one GPU). Where the plan routes experts inside the engine (SGLang's `--ep-size`),
a TP rank's payload holds only its own EP rank's experts, with every other weight
(`SyncPlan.needed_by`). Per bucket the engine's ranks each flatten their copy, the engine's leader
gathers the payloads over the engine's bridge subgroup and sends the one request, and all keep
their buffers until a barrier after the engine's answer (`_send_across_tp`).

The requests run on sender threads while the calling thread gathers and flattens the next
bucket (the session's begin while it gathers the first). Against SGLang one request is in
flight and every bucket has a fresh buffer (SGLang answers before its copies out of the buffer
are done). An engine that answers after them
(`caps.synchronous`, the embedded engine) gets `DEPTH` requests in flight — one's copy overlaps
the next one's handling — and `DEPTH + 1` buffers refilled in turn: bucket k's buffer was last
used by bucket k - DEPTH - 1, whose request has returned before bucket k - 1 was sent. Where
the engines keep buffers by slot number (`caps.slots`, weights/bucket.py), each buffer's handle
is sent once per session.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from rltrain.engine.client import EngineError
from rltrain.sync.transport import Named, SessionEnds, SyncContext, WeightStream, end_session
from rltrain.weights.bucket import BucketViews, bucket_layout, flatten_bucket, serialize

DEPTH = 2  # requests in flight against an engine that answers after its copies


class TensorTransport:
    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        self.reuse_buffers = ctx.caps.synchronous  # refill DEPTH + 1 buffers instead of a fresh one per bucket
        self.depth = DEPTH if self.reuse_buffers else 1
        self.slotted = False  # this push: buffers go to the engines by slot number
        self.timings: dict[str, float] = {}
        self.ends = SessionEnds()
        self._sender: ThreadPoolExecutor | None = None  # the request threads (`send`)
        self.rank_bytes: dict[int, int] = {}  # engine TP rank -> bytes its payloads held, last push
        self._timing_lock = threading.Lock()
        # The buffers refilled in turn: this push's on a GPU; on the CPU (shared host memory, as
        # large as the largest bucket) kept for the next push, whose handles go out again.
        self._ring: list[torch.Tensor | None] = []
        self._sent: set[tuple[int, int]] = set()  # (receiver, slot): holds the slot's buffer, this push
        # By plan index: the bucket's layout, its BucketViews, its handle-less payloads by slot.
        self._layouts: dict[int, tuple[tuple[list[Any], int], BucketViews, dict[int, str]]] = {}

    def send(self, version: str, weights: WeightStream) -> int:
        ctx = self.ctx
        self.timings = dict.fromkeys(("gather", "flatten", "wait", "request"), 0.0)
        self.ends = SessionEnds()
        if ctx.tp_group is not None:
            return self._send_across_tp(version, weights)
        if not ctx.sender:
            for _ in weights.buckets(self.timings):  # join every gather
                pass
            return 0
        sent = 0
        failure: BaseException | None = None
        if self._sender is None:  # kept for every push: threads started per push cost ~1 ms on a busy CPU
            self._sender = ThreadPoolExecutor(self.depth, thread_name_prefix="rltrain-sync")
        sender = self._sender
        # SGLang requires a weight-update session around tensor updates. It is begun on a sender
        # thread while this one gathers the first bucket; every bucket's request waits for it.
        # An engine with inline sessions opens it with its first bucket and closes it with its
        # last (a one-bucket sync is one request); a bucket after an opening one waits for it.
        inline = ctx.caps.inline_sessions
        begun = None if inline else sender.submit(lambda: [client.begin_weight_update() for client in ctx.receivers])
        opened: set[int] = set()  # receivers whose session a request has (maybe) opened, this push
        opener: Future[None] | None = None
        ring = self.depth + 1 if self.reuse_buffers else 0
        if len(self._ring) != ring:
            self._ring = [None] * ring
        self.slotted = bool(self._ring) and ctx.caps.slots >= len(self._ring)
        self._sent = set()
        in_flight: collections.deque[Future[None]] = collections.deque()
        clock = time.perf_counter
        try:
            for i, bucket, named in weights.buckets(self.timings):
                if failure is not None:
                    continue  # keep joining the gathers; the failure is reported after
                try:
                    tags = {r: version if i == ctx.plan.last_buckets[r] else None for r in bucket.targets}
                    t0 = clock()
                    layout, views, by_slot = self._layout(i, named)
                    slot = i % len(self._ring) if self._ring else None
                    out = self._buffer(slot, layout[1], named[0][1].device) if slot is not None else None
                    flat = flatten_bucket(named, out=out, layout=layout, views=views)
                    del named
                    # An engine that finds a reused buffer already mapped does not wait for the
                    # producer's event (torch's IPC cache): the sender waits for the fill instead.
                    filled = _record(flat["flattened_tensor"]) if out is not None else None
                    if self.slotted and out is not None and slot is not None:
                        payload = self._slotted(flat, out, slot, tags, by_slot)
                    else:
                        payload = serialize(flat)
                    t1 = clock()
                    # The bucket that sets the version goes only after every other has loaded.
                    while len(in_flight) >= (1 if any(tags.values()) else self.depth):
                        in_flight.popleft().result()
                    if opener is not None:
                        opener.result()
                    self.timings["flatten"] += t1 - t0
                    self.timings["wait"] += clock() - t1
                    opens = {r for r in tags if inline and r not in opened}
                    opened |= opens
                    future = sender.submit(self._send_handles, flat, payload, tags, filled, begun, opens)
                    in_flight.append(future)
                    opener = future if opens else None
                    sent += bucket.nbytes * len(bucket.targets)
                except (EngineError, OSError, RuntimeError, ValueError) as e:
                    failure = e
            while in_flight and failure is None:
                in_flight.popleft().result()
        except (EngineError, OSError, RuntimeError, ValueError) as e:
            failure = e
        finally:
            wait(in_flight)  # every request has returned (a failed push too) before the session ends
            try:
                if begun is not None:
                    wait([begun])
                    if begun.exception() is None:  # else no session to end (and its error is the failure)
                        for r in range(len(ctx.receivers)):
                            end_session(ctx, r, self.ends)  # the embedded engine unmaps the reused buffers here
                else:  # a session a request may have opened and none closed (a failed push) ends here
                    for r in sorted(opened - self.ends.closed):
                        end_session(ctx, r, self.ends)
            finally:
                if ctx.device.type != "cpu":
                    self._ring = []  # unmapped by now, so freed (not parked in torch's IPC limbo)
                _collect_shared(ctx.device)
        failure = failure or (begun.exception() if begun is not None else None)
        if failure is not None:
            raise RuntimeError(str(failure)) from failure
        return sent

    def _slotted(
        self, flat: dict[str, Any], out: torch.Tensor, slot: int, tags: dict[int, str | None], by_slot: dict[int, str]
    ) -> str:
        """The serialized payload with the buffer-slot extension: the buffer's handle only if
        some target has not been sent this buffer in this session, the slot number always.
        Without the handle it is the same string every sync (kept in `by_slot`)."""
        if all((r, slot) in self._sent for r in tags):
            if slot not in by_slot:
                by_slot[slot] = serialize({"flattened_tensor": None, "metadata": flat["metadata"], "buffer": slot})
            return by_slot[slot]
        self._sent.update((r, slot) for r in tags)
        return serialize({"flattened_tensor": out, "metadata": flat["metadata"], "buffer": slot})

    def _layout(self, i: int, named: Named) -> tuple[tuple[list[Any], int], BucketViews, dict[int, str]]:
        """Bucket `i`'s layout, its views and its handle-less payloads by slot, made at its
        first sync: the plan, and so every bucket's names, shapes and dtypes, is fixed."""
        kept = self._layouts.get(i)
        if kept is None or [n for n, _ in named] != [m.name for m in kept[0][0]]:
            layout = bucket_layout(named)
            kept = self._layouts[i] = (layout, BucketViews(layout[0]), {})
        return kept

    def _buffer(self, slot: int, size: int, device: torch.device) -> torch.Tensor:
        """Reused buffer `slot`, grown to hold `size` bytes."""
        buf = self._ring[slot]
        if buf is None or buf.numel() < size or buf.device != device:
            self._ring[slot] = None  # drop the old one before allocating its successor
            # A new buffer (even at the old one's address) is sent with its handle again.
            self._sent -= {k for k in self._sent if k[1] == slot}
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            if buf.device.type == "cpu":
                buf.share_memory_()
            self._ring[slot] = buf
        return buf

    def _send_handles(
        self,
        flat: dict[str, Any],
        payload: str,
        tags: dict[int, str | None],
        filled: Any,
        begun: Future[Any] | None,
        opens: set[int],
    ) -> None:
        """One bucket to each receiver that owns it (sender thread), once the session is begun
        (inline: receivers in `opens` open it with this bucket; the bucket that sets a
        receiver's version closes it, with the end's reports kept in `self.ends`). `flat` stays
        referenced until every engine has answered, i.e. finished copying out of it."""
        if begun is not None:
            begun.result()
        t0 = time.perf_counter()
        if filled is not None:
            filled.synchronize()
        for r, tag in tags.items():
            ends = begun is None and tag is not None
            answer = self.ctx.receivers[r].update_weights_from_tensor(
                [payload],
                load_format="flattened_bucket",
                weight_version=tag,
                flush_cache=tag is not None,
                begin_session=r in opens,
                end_session=ends,
                **(SessionEnds.asked(self.ctx) if ends else {}),
            )
            if ends:
                self.ends.keep(r, answer, closed=True)
        with self._timing_lock:
            self.timings["request"] += time.perf_counter() - t0
        del flat

    def _send_across_tp(self, version: str, weights: WeightStream) -> int:
        """An engine over several ranks' GPUs: every rank builds its TP rank's payload of each
        bucket in a fresh buffer on its own device; the leader sends the gathered list. The
        buffers are dropped after the engine has answered (the barrier), never before."""
        ctx = self.ctx
        group = ctx.tp_group
        assert group is not None
        sent, failure = 0, None
        self.rank_bytes = {}  # bytes each TP rank of the engine was sent, this push (measured)
        clock = time.perf_counter
        if ctx.sender:
            try:
                for client in ctx.receivers:
                    client.begin_weight_update()
            except (EngineError, OSError, RuntimeError, ValueError) as e:
                failure = e
        try:
            for i, bucket, named in weights.buckets(self.timings):
                t0 = clock()
                # Routed inside the engine: this TP rank's own experts and every other weight.
                mine = [(n, t) for n, t in named if ctx.plan.needed_by(ctx.tp_rank, n)]
                nbytes = sum(t.numel() * t.element_size() for _, t in mine)
                flat = flatten_bucket(mine)
                del named, mine
                if flat["flattened_tensor"].device.type == "cuda":
                    torch.cuda.current_stream(flat["flattened_tensor"].device).synchronize()  # filled before shared
                gathered = group.all_gather_object((serialize(flat), nbytes), phase=f"sync bucket {i} payloads")
                payloads = [p for p, _ in gathered]
                for k, (_, b) in enumerate(gathered):
                    self.rank_bytes[k] = self.rank_bytes.get(k, 0) + b
                t1 = clock()
                self.timings["flatten"] += t1 - t0
                if ctx.sender and failure is None:
                    try:
                        for r in bucket.targets:
                            tag = version if i == ctx.plan.last_buckets[r] else None
                            ctx.receivers[r].update_weights_from_tensor(
                                payloads,
                                load_format="flattened_bucket",
                                weight_version=tag,
                                flush_cache=tag is not None,
                            )
                        sent += sum(b for _, b in gathered) * len(bucket.targets)
                    except (EngineError, OSError, RuntimeError, ValueError) as e:
                        failure = e
                self.timings["request"] += clock() - t1
                group.barrier(phase=f"sync bucket {i} loaded")  # the engine answered: the buffers may go
                del flat
        finally:
            if ctx.sender:
                for r in range(len(ctx.receivers)):
                    try:
                        end_session(ctx, r, self.ends)
                    except EngineError as e:
                        failure = failure or e
            _collect_shared(ctx.device)
        if failure is not None:
            raise RuntimeError(f"{ctx.engine_name}: {failure}") from failure
        return sent

    def engine_restarted(self) -> None:
        self._layouts.clear()  # the payload strings were the dead engine's slots

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True)
            self._sender = None


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
