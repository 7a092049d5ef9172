"""`sync.transport=disk` and `delta`: weight versions on a filesystem every node sees.

disk   rank 0 publishes an HF checkpoint version (weights/versions.py); each node has its files
       verified against the manifest — by its engines as they read them where they can
       (`caps.verifies_files`, the embedded engine), else first by the node's leader, once —
       and every engine's leader has its engine load it from disk.
delta  rank 0 publishes a delta against the previous version (every `sync.delta_full_every`-th
       time a full one, weights/delta.py); each node's leader rebuilds the full version next to
       its engines from the one it holds, verified, and the node's engines load that.

A rank's own work (rank 0's publication, a node leader's verification or rebuild) catches any
error and carries it into the gather every rank joins next, so that all raise it there together.

Old versions are pruned on a background thread while the engines load and the next step
trains (deleting a version unlinks GBs of cached pages); the next publication waits for it.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rltrain.sync.transport import SessionEnds, SyncContext, WeightStream, failure_text
from rltrain.weights.delta import DeltaPublisher, reconstruct
from rltrain.weights.hf_files import CorruptWeightsError, HostStaging, write_checkpoint
from rltrain.weights.versions import prune, publish, read_manifest, verify, version_dir

SHARD_BYTES = 2 << 30

log = logging.getLogger("rltrain.sync")


class DiskTransport:
    def __init__(self, ctx: SyncContext, delta: bool):
        self.ctx, self.delta = ctx, delta
        self.root = ctx.weights_dir
        self.timings: dict[str, float] = {}
        self.ends = SessionEnds()  # no sessions: the engines are asked after
        world = ctx.world
        self.publisher = DeltaPublisher(ctx.cfg.delta_full_every) if world.rank == 0 and delta else None
        if world.rank == 0:  # versions whose publication a dead job cut short (never loaded: not renamed)
            for stale in self.root.glob("**/.weight_v*.tmp*"):
                log.warning("removing %s, left by an interrupted publication", stale)
                shutil.rmtree(stale, ignore_errors=True)
        self.node_dir = self.root / f"node{world.env.node_rank}"  # delta: full versions rebuilt for this node
        self.node_base: Path | None = None
        self._pruner: threading.Thread | None = None
        self._staging: list[HostStaging] | None = None

    def send(self, version: str, weights: WeightStream) -> int:
        ctx = self.ctx
        tensors = weights.gather(None)
        target = version_dir(self.root, version)
        error = None
        clock = time.perf_counter
        self.timings = timings = dict.fromkeys(("prune_wait", "publish", "verify", "load"), 0.0)
        try:
            if ctx.world.rank == 0:
                t0 = clock()
                publish(target, None, lambda tmp: self._write(tmp, version, tensors))
                t1 = clock()
                if self.publisher is not None:
                    self.publisher.commit()
                prune(target, None)  # versions above this one, from an earlier run (rarely any)
                self._wait_pruned()
                timings["publish"], timings["prune_wait"] = t1 - t0, clock() - t1
                self._pruner = threading.Thread(
                    target=prune, args=(target, ctx.cfg.keep_weight_versions, False), name="rltrain-prune", daemon=True
                )
                self._pruner.start()
        except Exception as e:  # noqa: BLE001 - any: told to every rank in the gather below
            error = f"publishing weight version {version} to {target} failed: {failure_text(e)}"
        finally:
            try:
                for _ in tensors:  # every rank joins every gather, also after a failed write
                    pass
            except Exception as e:  # noqa: BLE001 - this rank's export: told to every rank below
                if error is None:
                    error = f"rank {ctx.world.rank}: gathering the trainer's weights failed: {failure_text(e)}"
        errors = ctx.world.bridge.all_gather_object(error, phase="sync publish")
        if any(errors):
            raise OSError(next(e for e in errors if e))
        t0 = clock()
        local: tuple[str | None, str | None] = (None, None)  # (the node's version directory, error)
        if ctx.node_leader:
            try:
                local = (str(self._local_full_version(target)), None)
            except Exception as e:  # noqa: BLE001 - any: told to every rank in the gather below
                local = (None, f"{ctx.engine_name}: weight version {version} at {target}: {failure_text(e)}")
        node = ctx.world.env.node_rank
        entries = ctx.world.bridge.all_gather_object((node, ctx.node_leader, local), phase="sync verify files")
        failed = [err for _, _, (_, err) in entries if err]
        if failed:
            raise OSError("; ".join(failed))
        t1 = clock()
        if not ctx.sender:
            return 0
        path = next(p for n, lead, (p, _) in entries if n == node and lead)
        assert path is not None
        sent = sum(f.stat().st_size for f in target.iterdir())
        for client in ctx.receivers:
            client.update_weights_from_disk(str(path), weight_version=version)
        timings["verify"], timings["load"] = t1 - t0, clock() - t1
        return sent

    def _write(self, tmp: Path, version: str, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        if self.publisher is not None:
            return self.publisher.write(tmp, version, tensors, self.ctx.model_path)
        if self._staging is None:  # page-locked, reused by every version (up to one shard each)
            size = min(SHARD_BYTES, sum(w.nbytes for w in self.ctx.plan.weights))
            self._staging = [HostStaging(size) for _ in range(2)]
        digests: dict[str, str] = {}
        write_checkpoint(
            tmp, self.ctx.model_path, tensors, shard_bytes=SHARD_BYTES, staging=self._staging, digests=digests
        )
        return {"version": version, "kind": "full", "digests": digests}

    def _local_full_version(self, published: Path) -> Path:
        """The verified full version this node's engines load: the published one, or for a delta
        the one rebuilt here from this node's previous version. Engines that check a version's
        files against its manifest as they read them are left to do so (the files are read once,
        not twice)."""
        manifest = read_manifest(published)
        if manifest.get("kind") != "full" or not self.ctx.caps.verifies_files:
            manifest = verify(published)
        if manifest["kind"] == "full":
            self.node_base = published
            return published
        base = self.node_base
        if base is None or not base.exists():
            raise CorruptWeightsError(f"{published.name} is a delta but this node holds no base version")

        def rebuild(tmp: Path) -> dict[str, Any]:
            reconstruct(published, base, tmp)
            return {"version": manifest["version"], "kind": "full"}

        out = publish(version_dir(self.node_dir, manifest["version"]), 2, rebuild)
        self.node_base = out
        return out

    def _wait_pruned(self) -> None:
        if self._pruner is not None:
            self._pruner.join()
            self._pruner = None

    def engine_restarted(self) -> None:
        pass  # a version on disk does not depend on the engine that loaded it

    def close(self) -> None:
        self._wait_pruned()
