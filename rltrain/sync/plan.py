"""The sync plan: which weight goes to which engine target, in which bucket — built once.

Every transport consumes the same plan. It is built from the trainer's weight metadata
(checkpoint names, shapes, dtypes) and the engine topology, without touching a tensor:

- coverage: every weight the engine holds is sent exactly once per target that needs it; a name
  missing from the trainer, sent twice, or unknown to the engine raises `SyncPlanError` listing
  them (the classic cause of an engine silently serving stale weights after sleep/wake);
- routing: a MoE model's expert weights go only to the engine EP rank that owns them. Experts
  are dealt out in contiguous blocks (EP rank r owns experts [r*E/ep, (r+1)*E/ep)), as SGLang
  and Megatron do. Routing needs homogeneous engines (the same EP size everywhere), E divisible
  by ep, and per-expert names (`...experts.<e>....`); otherwise the plan falls back to sending
  every weight to every target and says why (`fallback_reason`, logged);
- buckets: first-fit-decreasing by size under `bucket_bytes`, per target set and dtype (a
  bucket is one contiguous buffer of one dtype for one set of receivers). A tensor larger than
  the limit gets a bucket of its own.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from rltrain.weights.names import classify

log = logging.getLogger("rltrain.sync")


class SyncPlanError(ValueError):
    """The trainer's weights do not cover the engine's exactly."""


@dataclass(frozen=True)
class WeightSpec:
    name: str  # checkpoint name, as the engine loads it
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass
class Bucket:
    targets: tuple[int, ...]  # EP ranks receiving it
    dtype: torch.dtype
    weights: list[WeightSpec] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.weights]


@dataclass(frozen=True)
class EngineTopology:
    """What the receivers look like: the EP size of each engine instance (one per node)."""

    ep_sizes: tuple[int, ...] = (1,)
    num_experts: int = 0  # routed experts of the model (0: dense)

    @property
    def ep_size(self) -> int:
        return self.ep_sizes[0]


@dataclass
class SyncPlan:
    weights: list[WeightSpec]
    targets: dict[str, tuple[int, ...]]  # name -> EP ranks receiving it
    buckets: list[Bucket]
    ep_size: int
    routed: bool
    fallback_reason: str | None = None

    def bytes_to(self, target: int) -> int:
        return sum(b.nbytes for b in self.buckets if target in b.targets)

    @property
    def bytes_moved(self) -> int:
        """Bytes delivered, summed over receivers (what a link carries without multicast)."""
        return sum(b.nbytes * len(b.targets) for b in self.buckets)

    def buckets_for(self, target: int) -> list[Bucket]:
        return [b for b in self.buckets if target in b.targets]

    @functools.cached_property
    def last_buckets(self) -> dict[int, int]:
        """Target -> index of the last bucket it receives: the one that carries the version.
        Asked for every bucket of every sync; the plan never changes."""
        return {t: i for i, b in enumerate(self.buckets) for t in b.targets}


def build_plan(
    weights: Iterable[WeightSpec],
    topology: EngineTopology,
    bucket_bytes: int,
    engine_names: Iterable[str] | None = None,
    aliases: dict[str, str] | None = None,
) -> SyncPlan:
    """`engine_names`: what the engine holds (checkpoint names; None: trust the trainer).
    `aliases`: engine name -> trainer name for weights the trainer holds once (tied embeddings)."""
    weights = list(weights)
    _check_coverage([w.name for w in weights], engine_names, aliases or {})
    ep = topology.ep_size
    everyone = tuple(range(ep))
    reason = _routing_refused(weights, topology)
    targets: dict[str, tuple[int, ...]] = {}
    for w in weights:
        kind = classify(w.name)
        if reason is None and kind.expert is not None:
            targets[w.name] = (kind.expert // (topology.num_experts // ep),)
        else:
            targets[w.name] = everyone  # dense and shared-expert weights: every rank computes them
    if reason is not None and ep > 1:
        log.warning("sync: expert routing off, every EP rank receives every weight: %s", reason)
    return SyncPlan(
        weights,
        targets,
        _first_fit_decreasing(weights, targets, bucket_bytes),
        ep,
        routed=reason is None,
        fallback_reason=reason,
    )


def _routing_refused(weights: list[WeightSpec], topo: EngineTopology) -> str | None:
    """Why experts cannot be routed (None: they can)."""
    if topo.ep_size <= 1:
        return "engines are not expert-parallel (ep_size 1)"
    if len(set(topo.ep_sizes)) > 1:
        return f"engines differ in EP size {sorted(set(topo.ep_sizes))}: routing needs homogeneous engines"
    if topo.num_experts <= 0:
        return "the model has no routed experts"
    if topo.num_experts % topo.ep_size:
        return f"{topo.num_experts} experts do not divide over ep_size {topo.ep_size}"
    kinds = {w.name: classify(w.name) for w in weights}  # an unknown expert name raises, naming it
    fused = sorted(n for n, k in kinds.items() if k.kind == "fused_experts")
    if fused:
        return f"expert weights stored fused ({fused[0]}, ...): they cannot be routed by name"
    indices = [k.expert for k in kinds.values() if k.expert is not None]
    if not indices:
        return "no weight is named per expert ('...experts.<e>...'): fused expert tensors cannot be routed"
    if max(indices) >= topo.num_experts:
        return f"expert index {max(indices)} in the weight names but the config has {topo.num_experts} experts"
    return None


def _check_coverage(names: list[str], engine_names: Iterable[str] | None, aliases: dict[str, str]) -> None:
    seen: set[str] = set()
    duplicated = sorted({n for n in names if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
    problems = []
    if duplicated:
        problems.append(f"sent twice: {duplicated[:10]}")
    if engine_names is not None:
        engine = {aliases.get(n, n) for n in engine_names}
        missing = sorted(engine - seen)
        unexpected = sorted(seen - engine)
        if missing:
            problems.append(f"{len(missing)} engine weights have no trainer source: {missing[:10]}")
        if unexpected:
            problems.append(f"{len(unexpected)} trainer weights are unknown to the engine: {unexpected[:10]}")
    if problems:
        raise SyncPlanError(
            "weight sync plan does not cover the engine exactly: "
            + "; ".join(problems)
            + " (trainer and engine built from different models or configs?)"
        )


def _first_fit_decreasing(weights: list[WeightSpec], targets: dict[str, tuple[int, ...]], limit: int) -> list[Bucket]:
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[WeightSpec]] = {}
    for w in weights:
        groups.setdefault((targets[w.name], w.dtype), []).append(w)
    buckets: list[Bucket] = []
    for (tgt, dtype), members in groups.items():
        mine: list[tuple[Bucket, int]] = []  # (bucket, bytes used)
        for w in sorted(members, key=lambda w: (-w.nbytes, w.name)):
            for i, (b, used) in enumerate(mine):
                if used + w.nbytes <= limit:
                    b.weights.append(w)
                    mine[i] = (b, used + w.nbytes)
                    break
            else:
                b = Bucket(tgt, dtype, [w])
                mine.append((b, w.nbytes))
        buckets.extend(b for b, _ in mine)
    return buckets
