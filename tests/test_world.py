"""World destroy/rebuild on real processes over gloo (4 ranks, Megatron-like overlapping groups)."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from multiproc import run_ranks, values
from rltrain.bench.topology import ParallelDims, megatron_group_plan, rank_groups
from rltrain.runtime.world import World, WorldError

CYCLES = 3


def _make_groups(world: World) -> list:
    """TP/PP/DP/EP/embedding groups as Megatron lays them out for TP=2 PP=2 EP=2 on 4 ranks."""
    plan = megatron_group_plan(ParallelDims(world.world_size, tp=2, pp=2, ep=2, etp=1))
    handles = []
    for i, e in enumerate(plan):
        # Distinct timeouts per group so the test can see each one replayed with its own.
        timeout = timedelta(seconds=60 + i)
        handles.append(
            world.new_group(e.ranks, backend=e.backend, timeout=timeout, description=f"{e.kind}{list(e.ranks)}")
        )
    return handles


def _check_groups(world: World, handles: list) -> list[str]:
    """all_reduce(rank) on every member group must give the sum of its ranks; returns descriptions."""
    seen = []
    for h in handles:
        if not h.is_member:
            with pytest.raises(WorldError, match="not a member"):
                h.pg  # noqa: B018 - the access raises
            continue
        t = torch.tensor([float(world.rank)])
        dist.all_reduce(t, group=h.pg)
        assert t.item() == sum(h.ranks), (h, t.item())
        assert h.pg.group_desc == h.description
        backend = h.pg._get_backend(torch.device("cpu"))
        assert backend.options._timeout == h.spec.timeout, (h, backend.options._timeout)
        seen.append(h.description)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world.world_size
    return seen


def _cycles_rank(rank: int, world_size: int, async_destroy: bool) -> dict:
    world = World(backend="gloo", timeout=60, async_destroy=async_destroy)
    handles = _make_groups(world)
    first = _check_groups(world, handles)
    prefixes, probes = [], []
    for cycle in range(CYCLES):
        world.destroy()
        assert not world.is_up
        with pytest.raises(WorldError, match="world is down"):
            handles[0].pg  # noqa: B018 - the access raises
        # The bridge carries objects while the world is down.
        gathered = world.bridge.all_gather_object({"rank": rank, "cycle": cycle})
        assert gathered == [{"rank": r, "cycle": cycle} for r in range(world_size)]
        mine = world.bridge.scatter_object([f"shard{r}-{cycle}" for r in range(world_size)] if rank == 0 else None)
        assert mine == f"shard{rank}-{cycle}"
        assert world.bridge.broadcast_object(("cfg", cycle) if rank == 1 else None, src=1) == ("cfg", cycle)
        world.rebuild()
        assert world.generation == cycle + 1
        assert _check_groups(world, handles) == first
        # Keys written through the default group's store land under this generation's prefix.
        dist.distributed_c10d._get_default_store().set(f"probe{rank}", str(cycle))
        keys = [k for k in world._base_store.list_keys() if k.endswith(f"/probe{rank}")]
        # One probe per generation so far, each under its own "rltrain/world/<attempt>/<g>/" prefix.
        probes.append(sorted(int(k.split("/")[3]) for k in keys) == list(range(1, cycle + 2)))
        prefixes.append(world.store_prefix())
    world.close()
    return {"prefixes": prefixes, "probes": probes, "groups": len(handles), "member_groups": len(first)}


@pytest.mark.parametrize("async_destroy", [True, False], ids=["async-destroy", "blocking-destroy"])
def test_megatron_groups_survive_destroy_rebuild_cycles(async_destroy):
    results = values(run_ranks(_cycles_rank, 4, async_destroy, deadline_s=180))
    for r in results:
        assert r["groups"] == 52
        assert r["probes"] == [True] * CYCLES
        assert r["prefixes"] == [f"rltrain/world/0/{g}" for g in range(1, CYCLES + 1)]  # attempt 0
    # Every membership of every group was checked on its rank.
    plan = megatron_group_plan(ParallelDims(4, tp=2, pp=2, ep=2, etp=1))
    assert sum(r["member_groups"] for r in results) == sum(len(e.ranks) for e in plan)


def _p2p_first_rank(rank: int, world_size: int) -> float:
    world = World(backend="gloo", timeout=60)
    tp = [world.new_group(g, description=f"tp{g}") for g in rank_groups({"tp": 2, "dp": 2}, ["tp", "dp"], ["tp"])]
    world.destroy()
    world.rebuild()
    # First op after rebuild: point-to-point inside a 2-rank subgroup, ranks 2/3 idle.
    mine = next(h for h in tp if h.is_member)
    if mine.ranks == (0, 1):
        t = torch.tensor([float(rank + 10)])
        if rank == 0:
            dist.send(t, dst=1, group=mine.pg)
        else:
            dist.recv(t, src=0, group=mine.pg)
        value = t.item()
    else:
        value = -1.0
    world.close()
    return value


def test_subset_point_to_point_first_after_rebuild_completes():
    assert values(run_ranks(_p2p_first_rank, 4, deadline_s=120)) == [10.0, 10.0, -1.0, -1.0]


def _escape_hatch_rank(rank: int, world_size: int) -> tuple:
    world = World(backend="gloo", timeout=60)
    tp = world.new_group([0, 1], description="tp")
    pg_before = tp.pg
    world.destroy()
    world.rebuild()
    t = torch.ones(1)
    dist.all_reduce(t, group=tp.pg)
    out = (world.reload, world.generation, tp.pg is pg_before, t.item())
    world.close()
    return out


def test_escape_hatch_keeps_groups_up(caplog):
    results = values(run_ranks(_escape_hatch_rank, 2, env={"RLTRAIN_RELOAD_WORLD": "0"}))
    assert results == [(False, 0, True, 2.0)] * 2


def _dies_during_rebuild_rank(rank: int, world_size: int) -> str:
    world = World(backend="gloo", timeout=5)
    world.new_group([0, 1], description="pair")
    world.destroy()
    if rank == world_size - 1:
        os._exit(3)  # this rank is gone: no rebuild, no goodbye
    t0 = time.monotonic()
    try:
        world.rebuild()
    except WorldError as e:
        return f"{time.monotonic() - t0:.1f}s {e}"
    return "rebuild succeeded without the dead rank"


def test_rank_dying_during_rebuild_fails_the_others_within_timeout():
    # The deadline is the no-hang check: survivors must give up on their own (timeout 5 s).
    outcomes = run_ranks(_dies_during_rebuild_rank, 3, deadline_s=90)
    assert outcomes[2].exitcode == 3
    for o in outcomes[:2]:
        assert o.ok, o.error
        assert "world rebuild failed at generation 1" in o.value, o.value
        assert f"rank {o.rank}" in o.value


def test_world_size_one_without_torchrun(monkeypatch, caplog):
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
    ):
        monkeypatch.delenv(k, raising=False)
    caplog.set_level(logging.DEBUG, logger="rltrain.world")
    world = World(backend="gloo", timeout=30)
    try:
        g = world.new_group([0], description="solo")
        for _ in range(2):
            world.destroy()
            with pytest.raises(WorldError, match="needs the world up"):
                world.new_group([0])
            world.rebuild()
        t = torch.full((1,), 3.0)
        dist.all_reduce(t, group=g.pg)
        assert t.item() == 3.0 and world.generation == 2
    finally:
        world.close()
    assert "world rebuild generation 2 (1 groups" in caplog.text


def test_nccl_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error only applies without it")
    with pytest.raises(WorldError, match="world.backend=nccl needs CUDA"):
        World(backend="nccl")


def test_megatron_plan_matches_megatron_layout():
    plan = megatron_group_plan(ParallelDims(8, tp=2, pp=2, ep=2, etp=1))
    by_kind: dict[str, list] = {}
    for e in plan:
        by_kind.setdefault(e.kind, []).append(list(e.ranks))
    # tp fastest, then dp, then pp (cp=1): ranks 0,1 share TP; pipeline stride is tp*dp = 4.
    assert by_kind["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert by_kind["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert by_kind["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert by_kind["embd"] == by_kind["pp"]
    assert by_kind["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert by_kind["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert len(by_kind["dp-gloo"]) == len(by_kind["dp"])
    with pytest.raises(ValueError, match="not divisible"):
        ParallelDims(6, tp=4)
