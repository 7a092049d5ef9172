"""Weight sync after each step: one plan, one transport, every sync verified.

Every rank calls `push(version)` with the world up: a sharded trainer all-gathers each weight
(`trainer.export_weights(names)`, the same names in the same order on every rank), and each
node's leader hands the full tensors to its engines by the configured transport (one file each):

    tensor       per bucket, a buffer passed by handle (CUDA IPC / shared memory)   sync/tensor.py
    distributed  per bucket, a broadcast over a weight-update group                 sync/distributed.py
    disk, delta  a published HF version (or a delta against the last one)           sync/disk.py

What every transport shares lives here: the plan (plan.py: coverage, routing, buckets), the
stream of the trainer's tensors, the agreement of every rank on a failure (no rank waits on a
failed one), and the verification afterwards. Integrity: while sending, the leader checksums each
tensor in the engine's dtype; afterwards each engine reports its version and its own checksum over
what it owns, and a mismatch fails the step on every rank (`WeightMismatchError`). SGLang has no
checksum endpoint: there the version is verified (and said so once in the log).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoConfig

from rltrain.config import Config
from rltrain.engine.client import EngineClient, EngineError
from rltrain.interfaces import Trainer, World
from rltrain.sync.disk import DiskTransport
from rltrain.sync.distributed import DistributedTransport
from rltrain.sync.plan import EngineTopology, SyncPlan, WeightSpec, build_plan
from rltrain.sync.tensor import TensorTransport
from rltrain.sync.transport import EngineCaps, SyncContext, Transport, WeightStream, probe
from rltrain.weights.checksum import WeightMismatchError, combine, entry
from rltrain.weights.names import checkpoint_names, num_experts
from rltrain.weights.versions import StaleWeightsError

log = logging.getLogger("rltrain.sync")

Sums = dict[str, Any]  # checkpoint name -> `checksum.entry` of what was sent


def make_transport(name: str, ctx: SyncContext) -> Transport:
    if name == "tensor":
        return TensorTransport(ctx)
    if name == "distributed":
        return DistributedTransport(ctx)
    if name in ("disk", "delta"):
        return DiskTransport(ctx, delta=name == "delta")
    raise ValueError(f"sync.transport={name!r}: expected tensor, distributed, disk or delta")


class WeightSync:
    """`receivers`: this node's engine clients, indexed by EP rank (one per engine instance; the
    loop has one per node). With several and a MoE model, experts are routed (plan.py). The
    leader talks to them; every rank must hold the same list (each checks the served version)."""

    def __init__(
        self, cfg: Config, world: World, trainer: Trainer, receivers: list[EngineClient], engine_model_path: str
    ):
        self.cfg, self.world, self.trainer, self.receivers = cfg, world, trainer, list(receivers)
        self.leader = world.env.is_node_leader
        weights = [WeightSpec(n, tuple(s), d) for n, _, s, d in trainer.weight_specs()]
        engine_names, aliases = checkpoint_names(engine_model_path)
        experts = num_experts(AutoConfig.from_pretrained(engine_model_path))
        topology = EngineTopology((len(self.receivers),), experts)
        self.plan: SyncPlan = build_plan(weights, topology, cfg.sync.bucket_mb << 20, engine_names, aliases)
        self.caps = probe(self.receivers) if self.leader else EngineCaps()
        if self.leader and cfg.sync.verify and not self.caps.checksums:
            log.info("engine reports no weight checksum (SGLang): syncs are verified by version only")
        self.transport: Transport = make_transport(
            cfg.sync.transport,
            SyncContext(
                cfg=cfg.sync,
                world=world,
                receivers=self.receivers,
                plan=self.plan,
                caps=self.caps,
                device=trainer.device,
                model_path=trainer.model_path,
                weights_dir=cfg.weights_dir,
                engine_tp_size=cfg.engine.tp_size,
                request_timeout_s=cfg.engine.request_timeout_s,
            ),
        )

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per part of the last push (benchmarks)."""
        return self.transport.timings

    def push(self, version: str) -> dict[str, float]:
        """Send the trainer's weights as `version`; verified on return (collective)."""
        t0 = time.perf_counter()
        sums: Sums = {}
        error = None
        try:
            sent = self.transport.send(version, WeightStream(self.plan, lambda names: self._tensors(names, sums)))
        except (OSError, ValueError, RuntimeError) as e:  # this rank failed; the others must hear of it
            error, sent = (
                f"rank {self.world.rank}: sync of version {version} by {self.cfg.sync.transport} failed: {e}",
                0,
            )
        errors = self.world.bridge.all_gather_object(error, phase="sync")
        if any(errors):
            raise SyncError(next(e for e in errors if e))
        self._verify(version, sums)
        log.debug(
            "synced version %s by %s: %d bytes in %.3fs",
            version,
            self.cfg.sync.transport,
            sent,
            time.perf_counter() - t0,
        )
        return {"sync_bytes": float(sent)}  # its time is the loop's "sync" phase

    def _tensors(self, names: list[str] | None, sums: Sums) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's tensors (a collective); the leader checksums each in the engine's dtype."""
        dtype = self.caps.dtype
        for name, t in self.trainer.export_weights(names):
            if self.leader and self.cfg.sync.verify:
                sums[name] = entry(t if dtype is None else t.to(dtype))
            yield name, t

    def _verify(self, version: str, sums: Sums) -> None:
        error: str | None = None
        kind: type[RuntimeError] = WeightMismatchError
        try:
            for r, client in enumerate(self.receivers):
                if error is None and self.leader and self.cfg.sync.verify and self.caps.checksums:
                    rep = client.weights_checksum()
                    owned = {n: v for n, v in sums.items() if r in self.plan.targets[n]}
                    mine = combine(owned)
                    if rep["weight_version"] != version or rep["checksum"] != mine:
                        error = (
                            f"rank {self.world.rank}: after syncing version {version}, engine {r} serves version "
                            f"{rep['weight_version']!r} with weight checksum {rep['checksum']} over {rep['count']} "
                            f"tensors; the trainer's is {mine} over {len(owned)}"
                        )
                served = client.weight_version()
                if error is None and served != version:
                    kind = StaleWeightsError
                    error = (
                        f"rank {self.world.rank}: engine {r} serves weight version {served!r} after loading {version!r}"
                    )
        except EngineError as e:
            error = f"rank {self.world.rank}: cannot verify weight version {version}: {e}"
        errors = self.world.bridge.all_gather_object(error, phase="sync verify")
        if any(errors):
            raise kind(next(e for e in errors if e))

    def engine_restarted(self) -> None:
        """This node's engine was started again (its weight-update groups died with it)."""
        self.transport.engine_restarted()

    def close(self) -> None:
        self.transport.close()


class SyncError(RuntimeError):
    """A rank could not send or load a weight version; the engine keeps its previous weights."""
