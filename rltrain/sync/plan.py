"""The sync plan: which weight goes to which engine target, in which bucket — built once.

Every transport consumes the same plan. It is built from the trainer's weight metadata
(checkpoint names, shapes, dtypes) and the engine topology, without touching a tensor:

- coverage: every weight the engine holds is sent exactly once per target that needs it; a name
  missing from the trainer, sent twice, or unknown to the engine raises `SyncPlanError` listing
  them (the classic cause of an engine silently serving stale weights after sleep/wake); so does
  a group of weights that an engine fuses in one load call (below) that the trainer sends only
  part of, or in two dtypes or to two sets of receivers (it could not travel in one bucket);
- routing: a MoE model's expert weights go only to the engine EP rank that owns them. Experts
  are dealt out in contiguous blocks (EP rank r owns experts [r*E/ep, (r+1)*E/ep)), as SGLang
  and Megatron do. Every name is classified first (`weights.names.classify`: routed, shared,
  fused, dense; an unknown expert name is an error). Routing needs the layout each engine
  reports of itself (`EngineParallelism`: no EPLB, no redundant experts, a known dispatch; the same
  layout everywhere; receivers that are the EP ranks of one group), E divisible by ep, and
  per-expert names (`...experts.<e>....`). Otherwise the plan falls back to sending every weight
  to every target and says why (`fallback_reason`, one log line for any MoE model at any EP
  size);
- buckets: first-fit-decreasing by size under `bucket_bytes`, per target set and dtype (a
  bucket is one contiguous buffer of one dtype for one set of receivers, and one request: one
  `load_weights` call in SGLang). The unit packed, never split between two buckets, is:
  - a group of weights that an engine fuses inside one load call, with state local to that call
    (`weights.names.FUSED_IN_ONE_CALL`, the one table of them: each MLA layer's `q_a_proj` with
    its `kv_a_proj_with_mqa`, which SGLang writes as `fused_qkv_a_proj_with_mqa` only when both
    arrive together; split, the fused weight is never updated). Weights SGLang loads shard by
    shard into one parameter (q/k/v, gate/up, an expert's w1/w3) need no such care;
  - all of one routed expert's weights of a dtype;
  - any other weight, alone.
  A unit larger than the limit, a fused group too, gets a bucket of its own: `sync.bucket_mb`
  bounds the buckets that hold more than one unit, never a unit.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from rltrain.weights.names import EXPERT, WeightKind, classify, fused_group

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
class EngineParallelism:
    """One engine's parallel layout, as the engine itself reports it in /get_server_info
    (SGLang's field names; the embedded engine reports the same ones).

    `ep_rank` is set by an engine that is one EP rank of a group of engines (the embedded
    engine's `--ep-rank`); SGLang's expert parallelism is inside one engine, over its TP ranks
    (`ep_rank` None)."""

    tp_size: int = 1
    ep_size: int = 1
    ep_rank: int | None = None
    dp_size: int = 1
    eplb: bool = False
    redundant_experts: int = 0
    a2a_backend: str = "none"
    # SGLang's --moe-dp-size (its EP groups are then cut from tp / (ep * moe_dp) ranks) and its
    # elastic-EP join offset (its EP ranks start there): routing follows neither, and NodeEngine
    # refuses both at launch (moe_dp_size > 1 with ep_size > 1; EngineLayout.check_reported).
    moe_dp_size: int = 1
    ep_offset: int = 0

    @classmethod
    def from_server_info(cls, info: dict) -> EngineParallelism:
        def number(key: str, default: int) -> int:
            v = info.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else default

        rank = info.get("ep_rank")
        return cls(
            tp_size=number("tp_size", 1),
            ep_size=number("ep_size", 1),
            ep_rank=rank if isinstance(rank, int) else None,
            dp_size=number("dp_size", 1),
            eplb=bool(info.get("enable_eplb", False)),
            redundant_experts=number("ep_num_redundant_experts", 0),
            a2a_backend=str(info.get("moe_a2a_backend") or "none"),
            moe_dp_size=number("moe_dp_size", 1),
            ep_offset=number("ep_join_rank_offset", 0),
        )


@dataclass(frozen=True)
class EngineTopology:
    """What the receivers look like. `ep_sizes`: the EP size of each engine instance (one per
    node; the receivers of one node are the EP ranks of a group of engines). `layouts`: what each
    receiver reported of itself (empty: not asked, e.g. the benchmarks' planned figures)."""

    ep_sizes: tuple[int, ...] = (1,)
    num_experts: int = 0  # routed experts of the model (0: dense)
    layouts: tuple[EngineParallelism, ...] = ()
    # The transport hands each TP rank of an engine its own payload (`tensor`: entry k of the
    # request is TP rank k's), so experts can be routed inside an engine.
    per_rank_payloads: bool = False

    @property
    def ep_size(self) -> int:
        return self.ep_sizes[0]

    @property
    def inside(self) -> EngineParallelism | None:
        """The engines' layout when their expert parallelism is inside each engine (SGLang's
        `--ep-size` over its TP ranks), the same in every engine; None otherwise."""
        if not self.layouts or len({(la.tp_size, la.ep_size, la.dp_size) for la in self.layouts}) > 1:
            return None
        la = self.layouts[0]
        return la if la.ep_rank is None and la.ep_size > 1 else None


@dataclass
class SyncPlan:
    weights: list[WeightSpec]
    targets: dict[str, tuple[int, ...]]  # name -> EP ranks receiving it
    buckets: list[Bucket]
    ep_size: int
    routed: bool
    fallback_reason: str | None = None
    # Routing inside each engine: the EP rank of each of its TP ranks (None: not routed inside),
    # and the EP rank owning each routed expert's weight (name -> rank; other weights absent).
    engine_ep_ranks: tuple[int, ...] | None = None
    expert_owner: dict[str, int] = field(default_factory=dict)

    def needed_by(self, tp_rank: int, name: str) -> bool:
        """Whether TP rank `tp_rank` of an engine needs weight `name` (every weight, unless the
        plan routes experts inside the engine: then its own experts, and every other weight).
        Asked for every tensor of every sync: a lookup, the names were classified once."""
        if self.engine_ep_ranks is None:
            return True
        owner = self.expert_owner.get(name)
        return owner is None or owner == self.engine_ep_ranks[tp_rank]

    def rank_bytes(self, tp_rank: int) -> int:
        """Bytes the plan sends TP rank `tp_rank` of an engine per sync."""
        return sum(w.nbytes for b in self.buckets for w in b.weights if self.needed_by(tp_rank, w.name))

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
    inside = topology.inside
    # Where experts could be routed, an unknown expert name raises, naming it. At EP 1 nothing is
    # routed: every rank takes every weight whatever its name says, so no name is refused there.
    routable = (inside.ep_size if inside is not None else ep) > 1
    kinds = {w.name: classify(w.name) if routable else WeightKind("dense") for w in weights}
    reason = _routing_refused(kinds, topology)
    targets: dict[str, tuple[int, ...]] = {}
    for w in weights:
        expert = kinds[w.name].expert
        if reason is None and inside is None and expert is not None:
            targets[w.name] = (expert // (topology.num_experts // ep),)
        else:
            targets[w.name] = everyone  # dense and shared-expert weights: every rank computes them
    _check_fused_groups(weights, targets)
    engine_ep = max((la.ep_size for la in topology.layouts), default=1)
    if reason is not None and (topology.num_experts > 0 or max(ep, engine_ep) > 1):  # said once, at any EP size
        log.log(
            logging.WARNING if max(ep, engine_ep) > 1 else logging.INFO,
            "sync: expert routing off, every engine rank receives every expert weight: %s",
            reason,
        )
    if reason is None and inside is not None:
        # SGLang's MoE groups: TP rank k is in EP rank (k // moe_tp) % ep, moe_tp = tp / ep.
        per_rank = topology.num_experts // inside.ep_size
        ranks = tuple((k // (inside.tp_size // inside.ep_size)) % inside.ep_size for k in range(inside.tp_size))
        owner = {n: k.expert // per_rank for n, k in kinds.items() if k.expert is not None}
        buckets = _first_fit_decreasing(weights, targets, bucket_bytes, rows=per_rank)
        _check_fused_groups_whole(buckets)
        plan = SyncPlan(weights, targets, buckets, ep, True, None, ranks, owner)
        _check_rank_coverage(plan, inside.tp_size)
        return plan
    buckets = _first_fit_decreasing(weights, targets, bucket_bytes)
    _check_fused_groups_whole(buckets)
    return SyncPlan(weights, targets, buckets, ep, routed=reason is None, fallback_reason=reason)


def _check_rank_coverage(plan: SyncPlan, tp_size: int) -> None:
    """The proof, per engine TP rank, that every weight it needs arrives exactly once and
    nothing else does, and that no request leaves a rank with nothing (every TP rank is sent an
    entry of every request)."""
    for k in range(tp_size):
        got = [n for b in plan.buckets for n in b.names if plan.needed_by(k, n)]
        need = {w.name for w in plan.weights if plan.needed_by(k, w.name)}
        seen: set[str] = set()
        twice = sorted({n for n in got if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
        missing, extra = sorted(need - seen), sorted(seen - need)
        if twice or missing or extra:
            raise SyncPlanError(
                f"engine TP rank {k}: the plan's buckets do not deliver its weights exactly once "
                f"(twice: {twice[:10]}; missing: {missing[:10]}; not its own: {extra[:10]})"
            )
        empty = [i for i, b in enumerate(plan.buckets) if not any(plan.needed_by(k, n) for n in b.names)]
        if empty:
            raise SyncPlanError(f"engine TP rank {k} would get an empty payload in bucket(s) {empty[:5]}")


def _routing_refused(kinds: dict[str, WeightKind], topo: EngineTopology) -> str | None:
    """Why experts cannot be routed (None: they can)."""
    layout_reason = _layout_refused(topo)
    if layout_reason is not None:
        return layout_reason
    inside = topo.inside
    ep = inside.ep_size if inside is not None else topo.ep_size
    if ep <= 1:
        return "engines are not expert-parallel (ep_size 1)"
    if inside is None and len(set(topo.ep_sizes)) > 1:
        return f"engines differ in EP size {sorted(set(topo.ep_sizes))}: routing needs homogeneous engines"
    if inside is not None and inside.tp_size % inside.ep_size:
        return f"ep_size {inside.ep_size} does not divide the engine's {inside.tp_size} TP ranks"
    if topo.num_experts <= 0:
        return "the model has no routed experts"
    if topo.num_experts % ep:
        return f"{topo.num_experts} experts do not divide over ep_size {ep}"
    fused = sorted(n for n, k in kinds.items() if k.kind == "fused_experts")
    if fused:
        return f"expert weights stored fused ({fused[0]}, ...): they cannot be routed by name"
    indices = [k.expert for k in kinds.values() if k.expert is not None]
    if not indices:
        return "no weight is named per expert ('...experts.<e>...'): fused expert tensors cannot be routed"
    if max(indices) >= topo.num_experts:
        return f"expert index {max(indices)} in the weight names but the config has {topo.num_experts} experts"
    return None


def _layout_refused(topo: EngineTopology) -> str | None:
    """What in the engines' own layouts the router cannot serve exactly (None: nothing)."""
    layouts = topo.layouts
    if not layouts:
        return None
    for i, la in enumerate(layouts):
        if la.eplb:
            return f"engine {i} runs EPLB: its experts move between ranks at run time"
        if la.redundant_experts:
            return f"engine {i} keeps {la.redundant_experts} redundant experts: some experts live on several ranks"
        if la.a2a_backend != "none":
            return f"engine {i} dispatches experts with {la.a2a_backend!r}: its expert placement is not known here"
        # (refused at launch for the engines rltrain starts; here for any engine it is handed)
        if la.moe_dp_size > 1 and la.ep_size > 1:
            return f"engine {i} runs --moe-dp-size {la.moe_dp_size}: its EP groups are not the ones routed here"
        if la.ep_offset:
            return f"engine {i} joined elastic EP at rank offset {la.ep_offset}: its expert placement is not known here"
    if len({(la.tp_size, la.ep_size, la.dp_size) for la in layouts}) > 1:
        return f"the engines' layouts differ: {[(la.tp_size, la.ep_size, la.dp_size) for la in layouts]} (tp, ep, dp)"
    la = layouts[0]
    if la.ep_rank is None and la.ep_size > 1 and not topo.per_rank_payloads:
        return (
            f"expert parallelism inside each engine (ep_size {la.ep_size} over its {la.tp_size} TP ranks), "
            "and this transport sends one payload for all of an engine's TP ranks (only `tensor` sends "
            "each its own): each TP rank is sent every expert and the engine's loader keeps its own"
        )
    if len(layouts) > 1 or la.ep_rank is not None:
        wrong = [
            f"receiver {i} reports EP rank {la.ep_rank} of {la.ep_size}"
            for i, la in enumerate(layouts)
            if (la.ep_rank, la.ep_size) != (i, len(layouts))
        ]
        if wrong:
            return f"the {len(layouts)} receivers are not EP ranks 0..{len(layouts) - 1} of one group: " + "; ".join(
                wrong
            )
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


def _check_fused_groups(weights: list[WeightSpec], targets: dict[str, tuple[int, ...]]) -> None:
    """Every group an engine fuses in one load call can travel in one bucket: all its members
    are sent, in one dtype, to one set of receivers. Lists every group that cannot."""
    specs = {w.name: w for w in weights}
    problems: dict[str, str] = {}
    why: set[str] = set()
    for w in weights:
        found = fused_group(w.name)
        if found is None or found[0] in problems:
            continue
        key, members, group = found
        sent = [m for m in members if m in specs]
        if len(sent) < len(members):
            problems[key] = f"the trainer sends {sent} without {[m for m in members if m not in specs]}"
        elif len({specs[m].dtype for m in members}) > 1 or len({targets[m] for m in members}) > 1:
            problems[key] = "in different buckets: " + ", ".join(
                f"{m} ({specs[m].dtype} to receivers {targets[m]})" for m in members
            )
        else:
            continue
        why.add(group.engine)
    if problems:
        raise SyncPlanError(
            f"{len(problems)} group(s) of weights that an engine fuses in one load call cannot travel in one "
            "bucket, and the engine would never update the fused weight: "
            + "; ".join(f"{k}: {v}" for k, v in list(problems.items())[:10])
            + f". Fused by: {' '.join(sorted(why))}. Trainer and engine built from different models or configs?"
        )


def _check_fused_groups_whole(buckets: list[Bucket]) -> None:
    """The proof that no bucket holds only part of a group an engine fuses in one load call."""
    home: dict[str, int] = {}
    for i, b in enumerate(buckets):
        for n in b.names:
            if (found := fused_group(n)) is not None and home.setdefault(found[0], i) != i:
                raise SyncPlanError(f"the plan splits {found[1]} between buckets {home[found[0]]} and {i}")


def _unit(name: str, rows: int = 0) -> str:
    """What travels together: a group of weights an engine fuses in one load call
    (`fused_group`); one routed expert's weights (its gate, up and down projections are never
    split between two buckets, so never between two requests); any other weight alone. With
    `rows` (experts per EP rank, routing inside an engine): the experts of one layer that sit at
    the same local slot on every EP rank, so that every request carries an expert for every rank
    and no rank's payload is ever empty."""
    if (group := fused_group(name)) is not None:
        return group[0]
    m = EXPERT.search(name)
    if m is None:
        return name
    if rows:
        return f"{name[: m.start()]}.experts.slot{int(m.group(1)) % rows}"
    return name[: m.end() - 1]


def _first_fit_decreasing(
    weights: list[WeightSpec], targets: dict[str, tuple[int, ...]], limit: int, rows: int = 0
) -> list[Bucket]:
    groups: dict[tuple[tuple[int, ...], torch.dtype], dict[str, list[WeightSpec]]] = {}
    for w in weights:
        groups.setdefault((targets[w.name], w.dtype), {}).setdefault(_unit(w.name, rows), []).append(w)
    buckets: list[Bucket] = []
    for (tgt, dtype), units in groups.items():
        order = sorted(((sum(w.nbytes for w in m), key, m) for key, m in units.items()), key=lambda u: (-u[0], u[1]))
        mine: list[Bucket] = []
        for (_, _, members), i in zip(order, _first_fit([size for size, _, _ in order], limit)):
            if i == len(mine):
                mine.append(Bucket(tgt, dtype, []))
            mine[i].weights.extend(members)
        buckets.extend(mine)
    return buckets


def _first_fit(sizes: list[int], limit: int) -> list[int]:
    """The bin of each size in turn: the lowest-numbered bin with room for it under `limit`, else
    a new one (a size over the limit gets a bin of its own). A tree over the bins holding each
    range's largest free space finds that bin in log time, so that the tens of thousands of
    units of a DeepSeek-V3 at a small `sync.bucket_mb` are packed at once, not in quadratic time."""
    leaves = 1
    while leaves < len(sizes):
        leaves *= 2
    free = [limit] * (2 * leaves)  # node k: the most room in any bin under it (bins not opened are empty)
    opened, bins = 0, []
    for size in sizes:
        if free[1] >= size:
            node = 1
            while node < leaves:
                node = 2 * node if free[2 * node] >= size else 2 * node + 1
        else:
            node = leaves + opened  # fits in no bin, not even an empty one: a bin of its own
        bins.append(node - leaves)
        opened = max(opened, node - leaves + 1)
        free[node] -= size
        while node > 1:
            node //= 2
            free[node] = max(free[2 * node], free[2 * node + 1])
    return bins
