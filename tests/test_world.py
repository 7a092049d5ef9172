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
        assert (
            r["groups"] == 53
        )  # what megatron-core makes (test_the_megatron_group_plan_is_the_set_megatron_core_creates)
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


# ------------------------------------------------------------ kept CPU groups, handle ranks, instances


def _kept_rank(rank: int, world_size: int) -> dict:
    world = World(backend="gloo", timeout=60)
    sub = world.new_group([2, 0], description="unsorted")  # torch orders a group's ranks
    everyone = world.new_group(description="all")
    pg0, default0 = everyone.pg, dist.group.WORLD
    out = {"ranks": sub.ranks, "handle_rank": sub.rank(), "torch_rank": dist.get_rank(sub.pg) if sub.is_member else -1}
    same, sums, defaults = [], [], []
    for _ in range(3):
        world.destroy()
        world.wait_destroyed()
        world.rebuild()
        same.append(everyone.pg is pg0)
        defaults.append(dist.group.WORLD is default0)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=everyone.pg)  # the kept communicator, through torch's own API
        if sub.is_member:
            s = torch.tensor([float(rank)])
            dist.broadcast(s, src=2, group=sub.pg)  # a global source rank: torch's rank map is back
            sums.append((t.item(), s.item(), dist.get_rank(sub.pg)))
        else:
            sums.append((t.item(), None, None))
        late = world.new_group([0, 1], description=f"late{world.generation}")  # named clear of the kept ones
        if late.is_member:
            u = torch.ones(1)
            dist.all_reduce(u, group=late.pg)
            assert u.item() == 2
    out.update(same=same, defaults=defaults, sums=sums, kept=world.keeps(everyone.spec))
    world.close()
    return out


def test_gloo_subgroups_stay_up_across_cycles_as_the_same_communicators():
    """A gloo subgroup holds no accelerator memory: the world keeps its communicator across
    destroy/rebuild (the same object, usable through torch.distributed), while the default group
    is a new one each generation. Handle ranks follow torch's order for unsorted ranks."""
    results = values(run_ranks(_kept_rank, 3))
    for rank, r in enumerate(results):
        assert r["ranks"] == (0, 2) and r["kept"] and r["same"] == [True] * 3 and r["defaults"] == [False] * 3
        if rank in (0, 2):
            assert r["handle_rank"] == r["torch_rank"] == (0 if rank == 0 else 1)
            assert r["sums"] == [(6.0, 2.0, r["torch_rank"])] * 3
        else:
            assert r["handle_rank"] == r["torch_rank"] == -1 and r["sums"] == [(6.0, None, None)] * 3


def _second_world_rank(rank: int, world_size: int) -> list:
    seen = []
    for _ in range(2):  # a library user (or a test) that closes one World and opens another
        world = World(backend="gloo", timeout=20)
        t = torch.ones(1)
        dist.all_reduce(t)
        seen.append((world.instance, world.store_prefix(), t.item(), world.bridge.all_gather_object(rank)))
        world.close()
    return seen


def test_a_second_world_in_the_same_job_uses_store_prefixes_of_its_own():
    results = values(run_ranks(_second_world_rank, 2, deadline_s=120))
    for r in results:
        (i0, p0, s0, g0), (i1, p1, s1, g1) = r
        assert i1 == i0 + 1 and p0 != p1 and s0 == s1 == 2.0 and g0 == g1 == [0, 1]


@pytest.mark.parametrize(
    ("configured", "value", "expected"),
    [
        (True, "FALSE", False),
        (True, "off", False),
        (True, "no", False),
        (True, "0", False),
        (False, "1", True),
        (False, "True", True),
        (False, "ON", True),
        (True, "yes", True),
        (True, None, True),
    ],
)
def test_the_reload_escape_hatch_takes_the_usual_spellings_and_says_what_it_did(caplog, configured, value, expected):
    from rltrain.runtime.world import reload_setting

    with caplog.at_level(logging.INFO, logger="rltrain.world"):
        assert reload_setting(configured, value) is expected
    if value is not None:
        said = caplog.text
        assert f"RLTRAIN_RELOAD_WORLD={value}" in said and ("reload on" if expected else "reload off") in said
        if expected != configured:
            assert f"overrides world.reload={str(configured).lower()}" in said


def test_the_reload_escape_hatch_refuses_what_it_cannot_read():
    from rltrain.runtime.world import reload_setting

    with pytest.raises(WorldError, match=r"RLTRAIN_RELOAD_WORLD='maybe': expected one of 1, true, yes, on"):
        reload_setting(True, "maybe")


def _megatron_groups_rank(rank: int, world_size: int) -> list:
    """The groups megatron-core's own initialize_model_parallel asks torch for (on CPU: gloo)."""
    from megatron.core import parallel_state

    from megatron_shim import megatron_on_cpu

    dist.init_process_group("gloo")
    seen: list = []
    real = dist.new_group

    def recording(ranks=None, timeout=None, backend=None, pg_options=None, **kw):
        seen.append((tuple(sorted(ranks)) if ranks is not None else None, backend))
        return real(ranks=ranks, timeout=timeout, backend="gloo", **kw)  # NCCL is not on this machine

    dist.new_group = recording
    try:
        with megatron_on_cpu():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=2,
                pipeline_model_parallel_size=2,
                expert_model_parallel_size=2,
                expert_tensor_parallel_size=1,
            )
    finally:
        dist.new_group = real
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return seen


def test_the_megatron_group_plan_is_the_set_megatron_core_creates():
    """rltrain.bench.topology's plan (what the world benchmark registers) against megatron-core
    itself: the same groups, in the same order, the Gloo twins included."""
    pytest.importorskip("megatron.core")
    theirs = values(run_ranks(_megatron_groups_rank, 4, deadline_s=240))[0]
    plan = megatron_group_plan(ParallelDims(4, tp=2, pp=2, ep=2, etp=1))
    mine = [(e.ranks, e.backend) for e in plan]
    assert len(mine) == len(theirs), (len(mine), len(theirs), theirs)
    assert [r for r, _ in mine] == [r for r, _ in theirs]
    assert [b == "gloo" for _, b in mine] == [b == "gloo" for _, b in theirs]


def _gather_sizes_rank(rank: int, world_size: int) -> list[list[int]]:
    world = World(backend="gloo", timeout=60)
    bridge = world.bridge
    out, slots = [], []
    # Small, then one rank far past the slot (a second collective, the slot widened), then past
    # the widest slot, then small again: every rank gets every object whole, in rank order.
    for size in (10, 5000 * (rank == 1), 300_000 * (rank == 2), 3):
        got = bridge.all_gather_object(b"x" * size + bytes([rank]))
        assert [g[-1] for g in got] == list(range(world_size))
        out.append([len(g) - 1 for g in got])
        slots.append(bridge._slot)  # the same on every rank: the next call's single collective
    assert slots == [1024, 8192, 65536, 65536]
    # A subgroup keeps its own slot: rank 1's big object above did not widen it.
    sub = bridge.subgroup([0, 2], "gather") if rank != 1 else None
    if sub is not None:
        assert sub.all_gather_object(rank) == [0, 2]
        sub.close()
    world.close()
    return out


def test_bridge_gathers_objects_of_any_size_in_one_collective_while_they_fit():
    got = values(run_ranks(_gather_sizes_rank, 3, deadline_s=120))
    assert got == [[[10, 10, 10], [0, 5000, 0], [0, 0, 300_000], [3, 3, 3]]] * 3
