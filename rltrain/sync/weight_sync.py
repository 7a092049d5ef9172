"""Weight sync after each step: one plan, four transports, every sync verified.

Every rank calls `push(version)` with the world up: a sharded trainer all-gathers each weight
(`trainer.export_weights(names)`, the same names in the same order on every rank), and each
node's leader hands the full tensors to its engine by the configured transport:

    tensor       per bucket, one fresh contiguous buffer passed by handle (CUDA IPC / shared
                 memory), load_format flattened_bucket, inside a weight-update session
    disk         rank 0 publishes an HF checkpoint version; each leader verifies its files
                 against the manifest, then its engine loads it
    delta        rank 0 publishes a delta (or every K-th time a full version); each leader
                 rebuilds the full version next to its engine, verified, then loads it
    distributed  per bucket, the leader broadcasts one flat buffer over a weight-update group
                 made once through /init_weights_update_group (NCCL on GPU, gloo on CPU)

Integrity: while sending, the leader checksums each tensor in the engine's dtype; afterwards
the engine reports its version and its own checksum over what it holds, and a mismatch fails
the step on every rank (`WeightMismatchError`). SGLang has no checksum endpoint: there the
version is verified (and said so once in the log).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import torch

from rltrain.weights import bucket as tensor_payload
from rltrain.engine.client import EngineError
from rltrain.weights.delta import DeltaPublisher, reconstruct
from rltrain.weights.hf_files import CorruptWeightsError
from rltrain.weights.names import checkpoint_names, num_experts
from rltrain.weights.versions import StaleWeightsError, prune, publish, read_manifest, verify, version_dir
from rltrain.weights.hf_files import HostStaging, write_checkpoint
from rltrain.weights.checksum import WeightMismatchError, combine, entry
from rltrain.sync.plan import EngineTopology, SyncPlan, WeightSpec, build_plan

log = logging.getLogger("rltrain.sync")
SHARD_BYTES = 2 << 30


class WeightSync:
    """`receivers`: this node's engine clients, indexed by EP rank (one per engine instance; the
    loop has one per node). With several and a MoE model, experts are routed (plan.py). The
    leader talks to them; every rank must hold the same list (each checks the served version)."""

    def __init__(self, cfg: Any, world: Any, trainer: Any, receivers: list[Any], engine_model_path: str):
        from transformers import AutoConfig

        self.cfg, self.world, self.trainer, self.receivers = cfg, world, trainer, list(receivers)
        self.transport = cfg.sync.transport
        self.leader = world.env.is_node_leader
        self.root = cfg.weights_dir
        weights = [WeightSpec(n, tuple(s), d) for n, _, s, d in trainer.weight_specs()]
        engine_names, aliases = checkpoint_names(engine_model_path)
        experts = num_experts(AutoConfig.from_pretrained(engine_model_path))
        topology = EngineTopology((len(self.receivers),), experts)
        self.plan: SyncPlan = build_plan(weights, topology, cfg.sync.bucket_mb << 20, engine_names, aliases)
        self.engine_dtype: torch.dtype | None = None
        self.engine_checksums = False
        self.reuse_buffers = False  # tensor: refill two buffers instead of a fresh one per bucket
        self.buffer_slots = 0  # tensor: how many refilled buffers every engine keeps by slot number
        self.engines_verify = False  # disk: every engine checks a version's files against its manifest
        if self.leader:
            probes = [_probe(c) for c in self.receivers]
            self.engine_dtype = probes[0].dtype
            self.engine_checksums = all(p.checksums for p in probes)
            self.reuse_buffers = all(p.synchronous for p in probes)
            self.buffer_slots = min((p.slots for p in probes), default=0)
            self.engines_verify = bool(probes) and all(p.verifies_files for p in probes)
            if cfg.sync.verify and not self.engine_checksums:
                log.info("engine reports no weight checksum (SGLang): syncs are verified by version only")
        self.publisher = DeltaPublisher(cfg.sync.delta_full_every) if world.rank == 0 else None
        if world.rank == 0:  # versions whose publication a dead job cut short (never loaded: not renamed)
            for stale in self.root.glob("**/.weight_v*.tmp*"):
                log.warning("removing %s, left by an interrupted publication", stale)
                shutil.rmtree(stale, ignore_errors=True)
        self.node_dir = self.root / f"node{world.env.node_rank}"  # delta: full versions rebuilt for this node
        self.node_base: Path | None = None
        self._groups: list[Any] = []
        self._pruner: threading.Thread | None = None
        self._staging: list[HostStaging] | None = None
        self._ring: list[torch.Tensor | None] = []  # tensor: the buffers refilled in turn
        self._layouts: dict[int, tuple[Any, Any, dict[int, str]]] = {}  # tensor: by plan index (`_layout`)
        self.slotted = False  # tensor, this push: buffers go to the engines by slot number
        self._sent: set[tuple[int, int]] = set()  # (receiver, slot): holds the slot's buffer, this push
        self.timings: dict[str, float] = {}  # seconds per part of the last bucketed push (benchmarks)
        self._timing_lock = threading.Lock()
        self._group_name = f"rltrain_weights_node{world.env.node_rank}"

    # ------------------------------------------------------------------ entry

    def push(self, version: str) -> dict[str, float]:
        """Send the trainer's weights as `version`; verified on return (collective)."""
        t0 = time.perf_counter()
        sums: dict[str, Any] = {}
        error = None
        try:
            if self.transport in ("disk", "delta"):
                sent = self._via_disk(version, sums)
            else:
                sent = self._via_buckets(version, sums)
        except (OSError, ValueError, RuntimeError) as e:  # this rank failed; the others must hear of it
            error, sent = f"rank {self.world.rank}: sync of version {version} by {self.transport} failed: {e}", 0
        errors = self.world.bridge.all_gather_object(error, phase="sync")
        if any(errors):
            raise SyncError(next(e for e in errors if e))
        self._verify(version, sums)
        log.debug("synced version %s by %s: %d bytes in %.3fs", version, self.transport, sent, time.perf_counter() - t0)
        return {"sync_bytes": float(sent)}  # its time is the loop's "sync" phase

    def _stream(self, names: list[str] | None, sums: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's tensors (a collective); the leader checksums each in the engine's dtype."""
        for name, t in self.trainer.export_weights(names):
            if self.leader and self.cfg.sync.verify:
                sums[name] = entry(t if self.engine_dtype is None else t.to(self.engine_dtype))
            yield name, t

    def _owned(self, sums: dict[str, Any], receiver: int) -> dict[str, Any]:
        return {n: v for n, v in sums.items() if receiver in self.plan.targets[n]}

    # ------------------------------------------------------------------ disk and delta

    def _via_disk(self, version: str, sums: dict[str, Any]) -> int:
        tensors = self._stream(None, sums)
        target = version_dir(self.root, version)
        error = None
        clock = time.perf_counter
        self.timings = timings = dict.fromkeys(("prune_wait", "publish", "verify", "load"), 0.0)
        try:
            if self.world.rank == 0:
                t0 = clock()
                publish(target, None, lambda tmp: self._write(tmp, version, tensors))
                t1 = clock()
                if self.publisher is not None and self.transport == "delta":
                    self.publisher.commit()
                prune(target, None)  # versions above this one, from an earlier run (rarely any)
                self._wait_pruned()
                timings["publish"], timings["prune_wait"] = t1 - t0, clock() - t1
                # Deleting old versions (unlinking GBs of cached pages, 0.7 s for 8.8 GB on the
                # H200's disk) runs while the engine loads and the next step trains.
                self._pruner = threading.Thread(target=prune, args=(target, self.cfg.sync.keep_weight_versions, False),
                                                name="rltrain-prune", daemon=True)
                self._pruner.start()
        except (OSError, ValueError) as e:
            error = f"publishing weight version {version} to {target} failed: {e}"
        finally:
            for _ in tensors:  # every rank joins every all-gather, also after a failed write
                pass
        errors = self.world.bridge.all_gather_object(error, phase="sync publish")
        if any(errors):
            raise OSError(next(e for e in errors if e))
        sent = sum(f.stat().st_size for f in target.iterdir()) if self.leader else 0
        if self.leader:
            t0 = clock()
            path = self._local_full_version(target)
            t1 = clock()
            for client in self.receivers:
                client.update_weights_from_disk(str(path), weight_version=version)
            timings["verify"], timings["load"] = t1 - t0, clock() - t1
        return sent

    def _wait_pruned(self) -> None:
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def _write(self, tmp: Path, version: str, tensors: Any) -> dict[str, Any]:
        model_path = self.trainer.model_path
        if self.transport == "delta":
            return self.publisher.write(tmp, version, tensors, model_path)
        if self._staging is None:  # page-locked, reused by every version (up to one shard each)
            self._staging = [HostStaging(min(SHARD_BYTES, sum(w.nbytes for w in self.plan.weights))) for _ in range(2)]
        digests: dict[str, str] = {}
        write_checkpoint(tmp, model_path, tensors, shard_bytes=SHARD_BYTES, staging=self._staging, digests=digests)
        return {"version": version, "kind": "full", "digests": digests}

    def _local_full_version(self, published: Path) -> Path:
        """The verified full version this node's engine loads: the published one, or for a delta
        the one rebuilt here from this node's previous version. Engines that check a version's
        files against its manifest as they read them (`"weight_files": "verified"`, the embedded
        engine) are left to do so: reading 8.8 GB once instead of twice."""
        manifest = read_manifest(published)
        if manifest.get("kind") != "full" or not self.engines_verify:
            manifest = verify(published)
        if manifest["kind"] == "full":
            self.node_base = published
            return published
        if self.node_base is None or not self.node_base.exists():
            raise CorruptWeightsError(f"{published.name} is a delta but this node holds no base version")
        out = publish(version_dir(self.node_dir, manifest["version"]), 2,
                      lambda tmp: (reconstruct(published, self.node_base, tmp),
                                   {"version": manifest["version"], "kind": "full"})[1])
        self.node_base = out
        return out

    # ------------------------------------------------------------------ tensor and distributed

    def _via_buckets(self, version: str, sums: dict[str, Any]) -> int:
        sent, failure = 0, None
        session = self.leader  # SGLang requires a weight-update session around tensor and distributed updates
        if self.transport == "distributed" and self.leader and not self._groups:
            self._groups = [self._open_group(c, r) for r, c in enumerate(self.receivers)]
        if session:
            for client in self.receivers:
                client.begin_weight_update()
        # tensor: requests run on sender threads while this thread gathers and flattens the next
        # bucket. Against SGLang one request is in flight and each bucket has a fresh buffer (it
        # answers before its copies out of the buffer are done). The embedded engine answers after
        # them, so `depth` requests are in flight (one's copy overlaps the next one's handling)
        # and `depth` + 1 buffers are refilled in turn: bucket k's buffer was last used by bucket
        # k - depth - 1, whose request has returned before bucket k - 1 was sent.
        depth = (2 if self.reuse_buffers else 1) if self.transport == "tensor" else 0
        sender = ThreadPoolExecutor(depth, thread_name_prefix="rltrain-sync") if depth else None
        self._ring = [None] * (depth + 1 if self.reuse_buffers else 0)
        # Engines that keep buffers by slot number get each buffer's handle once per session.
        self.slotted = bool(self._ring) and self.buffer_slots >= len(self._ring)
        self._sent = set()
        in_flight: collections.deque[Any] = collections.deque()
        clock = time.perf_counter
        self.timings = timings = dict.fromkeys(("gather", "flatten", "wait", "request"), 0.0)
        try:
            last = {r: max((i for i, b in enumerate(self.plan.buckets) if r in b.targets), default=-1)
                    for r in range(len(self.receivers))}
            for i, bucket in enumerate(self.plan.buckets):
                t0 = clock()
                named = list(self._stream(bucket.names, sums))
                timings["gather"] += clock() - t0
                if not self.leader or failure is not None:
                    continue  # keep joining the all-gathers; the failure is reported after
                try:
                    tags = {r: version if i == last[r] else None for r in bucket.targets}
                    if sender is not None:
                        t0 = clock()
                        layout, split, by_slot = self._layout(i, named)
                        slot = i % len(self._ring) if self._ring else None
                        out = self._buffer(slot, layout[1], named[0][1].device) if slot is not None else None
                        flat = tensor_payload.flatten_bucket(named, out=out, layout=layout, views=split)
                        del named
                        # An engine that finds a reused buffer already mapped does not wait for the
                        # producer's event (torch's IPC cache): the sender waits for the fill instead.
                        filled = _record(flat["flattened_tensor"]) if out is not None else None
                        payload = self._slotted(flat, out, slot, tags, by_slot) if self.slotted else tensor_payload.serialize(flat)
                        t1 = clock()
                        # The bucket that sets the version goes only after every other has loaded.
                        while len(in_flight) >= (1 if any(tags.values()) else depth):
                            in_flight.popleft().result()
                        timings["flatten"] += t1 - t0
                        timings["wait"] += clock() - t1
                        in_flight.append(sender.submit(self._send_handles, flat, payload, tags, filled))
                    else:
                        for r, tag in tags.items():  # routed: only the EP ranks that own these weights
                            self._broadcast(r, named, tag)
                    sent += bucket.nbytes * len(bucket.targets)
                except (EngineError, OSError, RuntimeError, ValueError) as e:
                    failure = e
            while in_flight and failure is None:
                in_flight.popleft().result()
        except (EngineError, OSError, RuntimeError, ValueError) as e:
            failure = e
        finally:
            if sender is not None:
                sender.shutdown(wait=True)
            try:
                if session:
                    for client in self.receivers:
                        client.end_weight_update()  # the embedded engine unmaps the reused buffers here
            finally:
                self._ring = []  # unmapped by now, so freed (not parked in torch's IPC limbo)
        if failure is not None:
            raise RuntimeError(str(failure)) from failure
        return sent

    def _slotted(self, flat: dict[str, Any], out: torch.Tensor, slot: int, tags: dict[int, Any],
                 by_slot: dict[int, str]) -> str:
        """The serialized payload with the engines' buffer-slot extension: the buffer's handle
        only if some target has not been sent this buffer in this session, the slot number
        always. Without the handle it is the same string every sync (kept in `by_slot`)."""
        if all((r, slot) in self._sent for r in tags):
            if slot not in by_slot:
                by_slot[slot] = tensor_payload.serialize({"flattened_tensor": None, "metadata": flat["metadata"], "buffer": slot})
            return by_slot[slot]
        self._sent.update((r, slot) for r in tags)
        return tensor_payload.serialize({"flattened_tensor": out, "metadata": flat["metadata"], "buffer": slot})

    def _layout(self, i: int, named: list[tuple[str, torch.Tensor]]) -> tuple[Any, Any, dict[int, str]]:
        """Bucket `i`'s layout, its `Layout` and its handle-less payloads by slot, made at its
        first sync: the plan, and so every bucket's names, shapes and dtypes, is fixed."""
        kept = self._layouts.get(i)
        if kept is None or [n for n, _ in named] != [m.name for m in kept[0][0]]:
            layout = tensor_payload.bucket_layout(named)
            kept = self._layouts[i] = (layout, tensor_payload.BucketViews(layout[0]), {})
        return kept

    def _buffer(self, slot: int, size: int, device: torch.device) -> torch.Tensor:
        """Reused buffer `slot`, grown to hold `size` bytes."""
        buf = self._ring[slot]
        if buf is None or buf.numel() < size or buf.device != device:
            buf = self._ring[slot] = None  # drop the old one before allocating its successor
            # A new buffer (even at the old one's address) is sent with its handle again.
            self._sent -= {k for k in self._sent if k[1] == slot}
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            if buf.device.type == "cpu":
                buf.share_memory_()
            self._ring[slot] = buf
        return buf

    def _send_handles(self, flat: dict[str, Any], payload: str, tags: dict[int, str | None], filled: Any) -> None:
        """One bucket to each receiver that owns it (sender thread). `flat` stays referenced
        until every engine has answered, i.e. finished copying out of it."""
        t0 = time.perf_counter()
        if filled is not None:
            filled.synchronize()
        for r, tag in tags.items():
            self.receivers[r].update_weights_from_tensor([payload] * self.cfg.engine.tp_size,
                                                         load_format="flattened_bucket",
                                                         weight_version=tag, flush_cache=tag is not None)
        with self._timing_lock:
            self.timings["request"] += time.perf_counter() - t0
        del flat

    def _open_group(self, client: Any, receiver: int) -> Any:
        from rltrain.runtime.net import free_port
        from rltrain.runtime.weight_group import UnregisteredGroup

        port = free_port()
        backend = "nccl" if self.trainer.device.type == "cuda" else "gloo"
        size = 1 + self.cfg.engine.tp_size
        name = f"{self._group_name}_ep{receiver}"
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, size, name, backend)
            # Outside torch's registry: the world's destroy between steps must not take it down.
            pg = UnregisteredGroup("127.0.0.1", port, 0, size, name, backend,
                                   timeout_s=self.cfg.engine.request_timeout_s)
            joined.result()
        return pg

    def _broadcast(self, receiver: int, named: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        client = self.receivers[receiver]
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(client.update_weights_from_distributed, [n for n, _ in named],
                                   [str(t.dtype).removeprefix("torch.") for _, t in named],
                                   [list(t.shape) for _, t in named], f"{self._group_name}_ep{receiver}", version,
                                   version is not None, "flattened_bucket")
            # If the engine refuses the request it never joins the broadcast: stop waiting then.
            self._groups[receiver].broadcast(flat, src=0, give_up=lambda: received.done() and received.exception())
            received.result()

    def close(self) -> None:
        from rltrain.runtime.weight_group import close_weight_update_group

        self._wait_pruned()
        for r, pg in enumerate(self._groups):
            # Both ends tear down at once: NCCL's communicator teardown waits for its peer (seen on
            # two H200s: the engine's destroy did not return while the trainer's end stayed open).
            with ThreadPoolExecutor(1) as pool:
                left = pool.submit(self.receivers[r].destroy_weights_update_group, f"{self._group_name}_ep{r}")
                close_weight_update_group(pg)
                try:
                    left.result()
                except EngineError as e:
                    log.warning("engine did not leave the weight-update group: %s", e)
        self._groups = []

    def engine_restarted(self) -> None:
        """This node's engine was started again: its ends of the weight-update groups died with
        it, so ours are dropped (the next push opens new ones)."""
        for pg in self._groups:
            try:
                pg.abort()
            except (RuntimeError, OSError) as e:
                log.warning("dropping the weight-update group of a dead engine: %s", e)
        self._groups = []

    # ------------------------------------------------------------------ verify

    def _verify(self, version: str, sums: dict[str, Any]) -> None:
        error, kind = None, WeightMismatchError
        try:
            for r, client in enumerate(self.receivers):
                if error is None and self.leader and self.cfg.sync.verify and self.engine_checksums:
                    rep = client.weights_checksum()
                    owned = self._owned(sums, r)
                    mine = combine(owned)
                    if rep["weight_version"] != version or rep["checksum"] != mine:
                        error = (f"rank {self.world.rank}: after syncing version {version}, engine {r} serves version "
                                 f"{rep['weight_version']!r} with weight checksum {rep['checksum']} over {rep['count']} "
                                 f"tensors; the trainer's is {mine} over {len(owned)}")
                served = client.weight_version()
                if error is None and served != version:
                    kind = StaleWeightsError
                    error = f"rank {self.world.rank}: engine {r} serves weight version {served!r} after loading {version!r}"
        except EngineError as e:
            error = f"rank {self.world.rank}: cannot verify weight version {version}: {e}"
        errors = self.world.bridge.all_gather_object(error, phase="sync verify")
        if any(errors):
            raise kind(next(e for e in errors if e))


def _record(t: torch.Tensor) -> Any:
    """A CUDA event after the work queued so far on `t`'s device (None on CPU: already done)."""
    if t.device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


class SyncError(RuntimeError):
    """A rank could not send or load a weight version; the engine keeps its previous weights."""


@dataclasses.dataclass
class _Probe:
    dtype: torch.dtype | None  # of the engine's weights, as its checksum report says
    checksums: bool  # it reports weight checksums
    synchronous: bool  # its update requests answer only after the copies out of the sender's buffers
    slots: int  # buffers it keeps by slot number within a weight-update session (0: none)
    verifies_files: bool  # it checks a disk version's files against the version's manifest


def _probe(client: Any) -> _Probe:
    try:
        info = client.server_info()
    except (EngineError, ValueError, TypeError):
        info = {}
    synchronous = info.get("weight_updates") == "synchronous"
    verifies = info.get("weight_files") == "verified"
    slots = info.get("weight_buffer_slots", 0) if synchronous else 0
    slots = slots if isinstance(slots, int) else 0
    try:
        rep = client.weights_checksum()
    except (EngineError, ValueError, TypeError):
        rep = None
    if not isinstance(rep, dict) or "dtype" not in rep:
        return _Probe(None, False, synchronous, slots, verifies)
    return _Probe(getattr(torch, rep["dtype"]), True, synchronous, slots, verifies)
