"""loop.offload_trainer=fit: what stays on the device, what moves, in which order, and that the
overlapped copies change nothing the trainer computes.

The trainer parks on the CPU here (`FSDPTrainer.parks_on_cpu`, plain host memory): the same
`HostPark` steps run in the same order as on a GPU, with the side stream's copies made at the
points where the GPU's would be waited for. What only a GPU shows (the copies overlapping the
sync and the forward, segments returned to the driver) is in tests/test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from models import make_model
from rltrain.between_steps import Residency
from rltrain.runtime.ledger import storage_bytes
from rltrain.trainer.fsdp import FSDPTrainer
from test_trainer import fixed_batch, make_trainer, one_step


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def _state(t: FSDPTrainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The weights, and the optimizer's state (not its parameter groups: the weights)."""
    held = t.held_tensors()
    weights = {w.untyped_storage().data_ptr() for w in held["weights"]}
    return held["weights"], [o for o in held["optimizer"] if o.untyped_storage().data_ptr() not in weights]


def _same_step(t: FSDPTrainer, plain: FSDPTrainer, batch) -> None:
    """One step of each trainer on `batch`: the same statistics, bit for bit (the rate aside)."""
    a, b = one_step(t, batch), one_step(plain, batch)
    assert {k: v for k, v in a.items() if k != "train_tokens_per_s"} == {
        k: v for k, v in b.items() if k != "train_tokens_per_s"
    }


@pytest.mark.parametrize("keep", ["nothing", "the weights", "a byte less than the weights", "everything"])
def test_an_offload_keeps_whole_groups_within_its_budget_the_optimizer_state_leaving_first(tmp_path, keep):
    """Three steps, each: train, `stage_offload` (the optimizer state's copy out begins), the
    offload, the onload (the optimizer state comes back behind the weights, NaN until it is
    settled before the optimizer step). What stays is the fewest whole groups within the budget;
    the ledger's bytes add up; losses and weights are bitwise those of a trainer never offloaded."""
    path = make_model(tmp_path / "m", seed=5)
    plain, t = make_trainer(path, micro=4), make_trainer(path, micro=4)
    t.parks_on_cpu = True
    batch = fixed_batch()
    for _ in range(3):
        _same_step(t, plain, batch)
        weights, optim = _state(t)
        budget = {
            "nothing": 0,
            "the weights": _bytes(weights),
            "a byte less than the weights": _bytes(weights) - 1,
            "everything": _bytes(weights) + _bytes(optim),
        }[keep]
        total = _bytes(weights) + _bytes(optim)
        t.stage_offload(budget)
        t.offload(budget)
        park = t._park
        assert park is not None
        # What moved: the optimizer state first (whole), then the policy's weights (whole).
        moves_optim = keep != "everything"
        moves_weights = keep in ("nothing", "a byte less than the weights")
        assert all((o.untyped_storage().nbytes() == 0) == moves_optim for o in optim)
        assert all((w.untyped_storage().nbytes() == 0) == moves_weights for w in weights)
        # The ledger adds up: what the storages still hold is what was kept, the rest is in the buffer.
        on_host = storage_bytes([*weights, *optim], set())["host"]
        assert on_host == park.kept <= budget
        assert park.total == total and park.kept + sum(p.nbytes for p in park.parked) == total
        assert park.buffer is not None and park.buffer.numel() >= total - park.kept
        assert t.offloaded == (keep != "everything")
        t.onload()
        # Weights back at once; the optimizer state behind them, settled before the optimizer step.
        assert all(w.untyped_storage().nbytes() > 0 for w in weights)
        assert park.unsettled == moves_optim
    for (name, a), (_, b) in zip(plain.export_weights(), t.export_weights(), strict=True):
        assert torch.equal(a, b), name


def test_a_whole_offload_times_its_choosing_apart_from_its_copies_and_moves_every_byte(tmp_path):
    """loop.offload_trainer=true (no budget), three steps through `TrainerCycle`: the put-away
    chooses what moves (timed as its own part, `offload: choose what moves`), copies it (`offload:
    copy to host`; on a GPU the device's span of the copies beside it, 0 here) and moves every byte
    of the weights and the optimizer state in the park's planned copies; losses and weights are
    bitwise those of a trainer never offloaded."""
    from rltrain.between_steps import BetweenSteps, TrainerCycle

    path = make_model(tmp_path / "m", seed=5)
    plain, t = make_trainer(path, micro=4), make_trainer(path, micro=4)
    t.parks_on_cpu = True
    cycle = TrainerCycle(t, None, BetweenSteps.OFFLOAD, True, 1, ())  # type: ignore[arg-type]
    batch = fixed_batch()
    for _ in range(3):
        _same_step(t, plain, batch)
        weights, optim = _state(t)
        before = [w.clone() for w in weights] + [o.clone() for o in optim]
        total = _bytes(weights) + _bytes(optim)
        cycle.after_train()
        assert t._park is None or not t._park.staged  # (fit alone begins an offload there)
        cycle.put_away()
        park = t._park
        assert park is not None and not park.staged
        assert [x.untyped_storage().nbytes() for x in [*weights, *optim]] == [0] * len(before)
        assert sum(p.nbytes for p in park.parked) == park.total == total and park.copies_out >= 1
        assert {"offload_choose_what_moves_s", "offload_copy_to_host_s", "offload_copies_on_the_device_s"} <= set(
            cycle.figures
        )
        assert cycle.figures["offload_copies_on_the_device_s"] == 0.0  # (no device here)
        cycle.bring_back()
        assert all(torch.equal(x, y) for x, y in zip([*weights, *optim], before, strict=True))
    for (name, x), (_, y) in zip(plain.export_weights(), t.export_weights(), strict=True):
        assert torch.equal(x, y), name


def test_optimizer_state_read_before_it_is_settled_shows(tmp_path, monkeypatch):
    """The control of the test above: without the settle before the optimizer step, the step reads
    the NaN bytes of the state still on its way back, and the weights show it."""
    path = make_model(tmp_path / "m", seed=5)
    t = make_trainer(path, micro=4)
    t.parks_on_cpu = True
    batch = fixed_batch()
    one_step(t, batch)
    weights, _ = _state(t)
    t.stage_offload(_bytes(weights))
    t.offload(_bytes(weights))
    t.onload()
    monkeypatch.setattr(FSDPTrainer, "_settle", lambda self: None)
    one_step(t, batch)
    assert any(not torch.isfinite(w).all() for _, w in t.export_weights())


def test_a_snapshot_or_checkpoint_between_the_onload_and_the_step_reads_the_settled_state(tmp_path):
    """The optimizer state that comes back late is settled by whatever reads it before the step."""
    path = make_model(tmp_path / "m", seed=5)
    plain, t = make_trainer(path, micro=4), make_trainer(path, micro=4)
    t.parks_on_cpu = True
    batch = fixed_batch()
    one_step(plain, batch), one_step(t, batch)
    weights, _ = _state(t)
    t.stage_offload(_bytes(weights))
    t.offload(_bytes(weights))
    t.onload()
    _, optim = t.distributed_state_dict()
    _, want = plain.distributed_state_dict()
    for k, st in want["state"].items():
        for name, v in st.items():
            assert torch.equal(optim["state"][k][name], v), (k, name)
    assert not t._park.unsettled


def test_the_budget_follows_what_each_rollout_left_free():
    """Nothing stays until a rollout is measured; then what the rollout left free, less the
    headroom, is added to what was kept; a rollout that took more shrinks it; never below 0."""
    gib = 2**30
    r = Residency(headroom=2 * gib)
    assert r.budget == r.keep(5 * gib) == 0
    assert r.observe(free=10 * gib, kept=0) == 8 * gib  # the next rollout ends 2 GiB short of the device's end
    assert r.observe(free=2 * gib, kept=8 * gib) == 8 * gib  # (steady)
    assert r.observe(free=1 * gib, kept=8 * gib) == 7 * gib  # the engine took 1 GiB more
    assert r.observe(free=0, kept=1 * gib) == 0


def test_the_kv_cache_maps_beside_a_running_teardown_only_where_the_last_rollout_left_room(monkeypatch):
    """engine_resume_kv waits for the world's NCCL teardown unless the last rollout ended with
    room for the communicators' memory too, beside what the trainer holds now (fit keeps more
    after a roomy rollout: that counts), KV_ROOM_MARGIN to spare; each measure is read once (an
    engine restart's resend, with no rollout before it, waits), and none is taken off GPU."""
    from types import SimpleNamespace

    import rltrain.between_steps as between_steps
    from rltrain.between_steps import KV_ROOM_MARGIN, BetweenSteps, TrainerCycle, kv_room

    gib = 2**30
    assert kv_room(free=4 * gib, kept=3 * gib, now=3 * gib, communicators=gib // 2) == 3.5 * gib
    assert kv_room(free=4 * gib, kept=3 * gib, now=6 * gib, communicators=gib // 2) == gib // 2  # kept 3 GiB more

    held = {"now": 3 * gib}
    trainer = SimpleNamespace(device=torch.device("cuda", 0))
    cycle = TrainerCycle(trainer, None, BetweenSteps.OFFLOAD, True, 1, ())  # type: ignore[arg-type]
    monkeypatch.setattr(cycle, "_on_device", lambda: held["now"])
    free = {"bytes": 4 * gib}
    monkeypatch.setattr(between_steps.torch.cuda, "mem_get_info", lambda device: (free["bytes"], 80 * gib))

    assert not cycle.room_for(gib // 2)  # the first step: nothing measured
    cycle.rollout_done()
    assert cycle.room_for(gib // 2)
    assert not cycle.room_for(gib // 2)  # read once
    cycle.rollout_done()
    held["now"] = 6 * gib  # the put-away kept 3 GiB more than the rollout had beside it
    assert not cycle.room_for(gib // 2)
    free["bytes"], held["now"] = gib // 2 + KV_ROOM_MARGIN, 3 * gib
    cycle.rollout_done()
    assert cycle.room_for(gib // 2)  # exactly the margin left
    cycle.rollout_done()
    assert not cycle.room_for(gib // 2 + 1)

    cpu = TrainerCycle(SimpleNamespace(device=torch.device("cpu")), None, BetweenSteps.OFFLOAD, True, 1, ())  # type: ignore[arg-type]
    cpu.rollout_done()
    assert not cpu.room_for(0)


def test_a_kept_part_that_strands_freed_memory_in_the_allocator_makes_everything_move(tmp_path, monkeypatch, caplog):
    """Where the caching allocator holds more freed bytes than STRANDED_BYTES after an offload
    that kept part of the state (segments shared with what stayed: the engines cannot have them),
    the rest moves too, said, and the state comes back whole. Below it, nothing changes. The
    first time, that offload only: the first step's optimizer state is born on the device among
    the gradients it frees (the e2e's 1.7B on an H100 stranded its put-away at step 1, and every
    step after it moved the whole state), and the onload after it lays the state out anew. Only
    a second stranding makes every offload move (`refuses_keep`). (The allocator's counters are
    set here: on the GPU tests/test_gpu.py checks a real offload strands nothing.)"""
    from rltrain.trainer import host_park
    from rltrain.trainer.host_park import STRANDED_BYTES, HostPark, leaving_order

    path = make_model(tmp_path / "m", seed=5)
    t = make_trainer(path, micro=4)
    one_step(t, fixed_batch())
    weights, optim = _state(t)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    groups = leaving_order(t.model, t.ref_model, t.optimizer)
    park = HostPark("cpu")
    device = torch.device("cuda", 0)
    monkeypatch.setattr(host_park.torch.cuda, "memory_allocated", lambda d: 3 << 30)
    monkeypatch.setattr(host_park, "free_cuda_caches", lambda: None)
    said = []
    for stranded, moves, refuses in (
        (STRANDED_BYTES, False, False),
        (STRANDED_BYTES + 1, True, False),  # the first time: this offload only
        (STRANDED_BYTES, False, False),
        (STRANDED_BYTES + 1, True, True),  # the second: every offload from now on
    ):
        park.park(groups, keep=_bytes(weights))
        monkeypatch.setattr(host_park.torch.cuda, "memory_reserved", lambda d, s=stranded: (3 << 30) + s)
        caplog.clear()
        with caplog.at_level("WARNING", logger="rltrain.trainer"):
            assert park.all_if_stranded(groups, device) == moves
        said.append([r.getMessage() for r in caplog.records if "stay with the caching allocator" in r.getMessage()])
        assert all((w.untyped_storage().nbytes() == 0) == moves for w in weights)
        assert all(o.untyped_storage().nbytes() == 0 for o in optim)
        assert park.refuses_keep == refuses
        park.unpark()
        for k, v in t.model.state_dict().items():
            assert torch.equal(v, before[k]), k
    assert [len(s) for s in said] == [0, 1, 0, 1]
    assert "this time" in said[1][0] and "at every offload from now on" in said[3][0]


def test_storages_back_to_back_on_both_sides_move_as_one_copy_and_only_those():
    """`runs`: storages that lie back to back on the device (here: host memory carved from one
    block, as a group comes back from the allocator) and in the host buffer go as one copy; a gap
    on either side splits the run; every byte arrives where it belongs, both ways."""
    import ctypes

    from rltrain.trainer.host_park import HostPark, Parked, runs

    block = torch.arange(4096, dtype=torch.int32).view(torch.uint8)  # 16 KiB, "the device"
    base = block.data_ptr()

    def carved(start: int, nbytes: int) -> torch.UntypedStorage:
        mem = (ctypes.c_uint8 * nbytes).from_address(base + start)
        return torch.frombuffer(mem, dtype=torch.uint8).untyped_storage()

    # (device start, bytes, host offset): a, b, c back to back on both sides; d after a device gap;
    # e after d on the device but after a gap in the host buffer; f after e on both.
    layout = [
        (0, 1024, 0),
        (1024, 512, 1024),
        (1536, 2048, 1536),
        (4096, 1024, 3584),
        (5120, 512, 5120),
        (5632, 512, 5632),
    ]
    parked = [Parked(carved(d, n), o, 0, n) for d, n, o in layout]
    spans = [(offset, nbytes) for _, offset, nbytes in runs(parked)]
    assert spans == [(0, 3584), (3584, 1024), (5120, 1024)]

    park = HostPark("cpu")
    host = torch.zeros(8192, dtype=torch.uint8)
    expected = block.clone()
    park._copy_out(parked, host)
    assert park.copies_out == 3
    for d, n, o in layout:
        assert torch.equal(host[o : o + n], expected[d : d + n])
    block.zero_()
    park._copy_in(parked, host)
    assert park.copies_in == 3
    for d, n, _ in layout:
        assert torch.equal(block[d : d + n], expected[d : d + n])
    assert torch.count_nonzero(block[3584:4096]) == 0  # the gap on the device is left alone


def test_the_onload_copy_is_chosen_by_name_and_a_wrong_name_is_refused(monkeypatch):
    """HostPark's onload copy: a copy engine by default, the SMs by `onload="kernel"` or
    RLTRAIN_ONLOAD_COPY (bench.hostcopy compares them; test_gpu.py runs the kernel's)."""
    from rltrain.trainer.host_park import HostPark

    assert HostPark("cpu").onload == "engine"
    monkeypatch.setenv("RLTRAIN_ONLOAD_COPY", "kernel")
    assert HostPark("cpu").onload == "kernel"
    with pytest.raises(ValueError, match="expected one of engine, kernel"):
        HostPark("cpu", onload="dma")
    # on the CPU the kernel path is not taken: the state comes back as it went
    t = torch.arange(10, dtype=torch.float32)
    park = HostPark("cpu")
    park.park([[t]])
    park.unpark()
    assert torch.equal(t, torch.arange(10, dtype=torch.float32))
