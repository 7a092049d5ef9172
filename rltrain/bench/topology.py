"""Megatron-style parallel layouts: which ranks form each TP/CP/DP/PP/EP group.

Ranks are laid out with tensor parallel fastest, then context, data and pipeline parallel
(Megatron's default order "tp-cp-ep-dp-pp"); expert layers re-slice the same ranks as
expert-tensor x expert x expert-data x pipeline parallel. `megatron_group_plan` lists the
groups in the order megatron-core's `initialize_model_parallel` creates them (including its
Gloo twins of the data-parallel groups), so rltrain can create them through its `World`
registry and hand them to Megatron instead of letting Megatron create unregistered ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of every parallel dimension. dp is derived from the world size."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; defaults to tp

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel size {name}={getattr(self, name)} must be >= 1")
        if self.world_size % (self.tp * self.pp * self.cp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp}"
            )
        if (self.world_size // self.pp) % (self.expert_tp * self.ep):
            raise ValueError(
                f"ranks per pipeline stage ({self.world_size // self.pp}) not divisible by "
                f"etp*ep = {self.expert_tp}*{self.ep}"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.pp * self.expert_tp * self.ep)


def rank_groups(sizes: dict[str, int], order: list[str], varying: list[str]) -> list[list[int]]:
    """Groups of ranks that differ only along the `varying` dimensions.

    `order` lists dimensions from fastest- to slowest-varying in the rank number.
    """
    strides, s = {}, 1
    for d in order:
        strides[d] = s
        s *= sizes[d]
    fixed = [d for d in order if d not in varying]
    groups = []
    for fixed_coords in itertools.product(*(range(sizes[d]) for d in reversed(fixed))):
        base = sum(c * strides[d] for c, d in zip(fixed_coords, reversed(fixed)))
        members = []
        for var_coords in itertools.product(*(range(sizes[d]) for d in reversed(varying))):
            members.append(base + sum(c * strides[d] for c, d in zip(var_coords, reversed(varying))))
        groups.append(sorted(members))
    return sorted(groups)


@dataclass(frozen=True)
class GroupPlanEntry:
    kind: str  # e.g. "tp", "dp-gloo", "ep"
    ranks: tuple[int, ...]
    backend: str | None  # None: the default backend; "gloo" for Megatron's CPU twins


def megatron_group_plan(dims: ParallelDims, gloo_twins: bool = True) -> list[GroupPlanEntry]:
    """Every group megatron-core creates for `dims`, in its creation order."""
    dense = {"tp": dims.tp, "cp": dims.cp, "dp": dims.dp, "pp": dims.pp}
    dense_order = ["tp", "cp", "dp", "pp"]
    expert = {"tp": dims.expert_tp, "ep": dims.ep, "dp": dims.expert_dp, "pp": dims.pp}
    expert_order = ["tp", "ep", "dp", "pp"]
    plan: list[GroupPlanEntry] = []

    def add(kind: str, groups: list[list[int]], gloo: bool = False) -> None:
        for g in groups:
            plan.append(GroupPlanEntry(kind, tuple(g), None))
            if gloo and gloo_twins:
                plan.append(GroupPlanEntry(kind + "-gloo", tuple(g), "gloo"))

    def dense_groups(*varying: str) -> list[list[int]]:
        return rank_groups(dense, dense_order, list(varying))

    add("dp", dense_groups("dp"), gloo=True)
    add("dp-cp", dense_groups("dp", "cp"), gloo=True)
    add("cp", dense_groups("cp"))
    add("mp", dense_groups("tp", "pp"))
    add("tp", dense_groups("tp"))
    # Per pipeline group, as megatron-core makes them: the group, then its embedding group (the
    # first and last stage: word embeddings / LM head), then its position-embedding group (the
    # first stage).
    for g in dense_groups("pp"):
        add("pp", [g])
        add("embd", [sorted({g[0], g[-1]})])
        add("pos-embd", [[g[0]]])
    add("tp-dp-cp", dense_groups("tp", "dp", "cp"))
    add("tp-dp", dense_groups("tp", "dp"))
    add("tp-cp", dense_groups("tp", "cp"))

    def expert_groups(*varying: str) -> list[list[int]]:
        return rank_groups(expert, expert_order, list(varying))

    add("ep", expert_groups("ep"))
    add("etp", expert_groups("tp"))
    add("tp-ep", expert_groups("tp", "ep"))
    add("tp-ep-pp", expert_groups("tp", "ep", "pp"))
    add("edp", expert_groups("dp"), gloo=True)
    # The distributed optimizer's instance groups (one instance, megatron's default): the ranks of
    # `expert dp` consecutive tp-ep-pp groups each.
    chunk: list[int] = []
    for k, g in enumerate(expert_groups("tp", "ep", "pp"), start=1):
        chunk += g
        if k % dims.expert_dp == 0:
            add("dist-opt", [chunk])
            chunk = []
    return plan
