"""Checkpoints, exact resume and release-train: real torchrun runs and real failing writes."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models import make_model
from multiproc import run_ranks, values
from rltrain.checkpoint import Checkpointer, CheckpointError, find_resumable, verify
from test_loop import run_quickstart
from test_trainer import fixed_batch, make_trainer, one_step

# Metrics that must repeat exactly; timings, rates and memory legitimately differ between runs,
# and so does what the trainer's put-away moved and how long its parts took (onload_*, offload_*:
# a released trainer has none, an offloaded one keeps what each rollout left room for).
VARIABLE = {"time", "rollout_time", "memory", "wall", "rollout_tokens_per_s", "train_tokens_per_s"}
MOVEMENT = ("onload_", "offload_", "world_destroy_wait_s")


def rows(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in VARIABLE and not k.startswith(MOVEMENT)}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def final_weights(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "weights" / f"weight_v{version:06d}" / "model.safetensors"))


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


# (weights by disk: each version's files are what the runs are compared by)
DET = ("engine.deterministic=true", "rollout.max_new_tokens=2", "loop.steps=4", "sync.transport=disk")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The reference: 4 steps, uninterrupted, no release."""
    d = tmp_path_factory.mktemp("straight")
    r = run_quickstart(d, "checkpoint.interval=2", *DET)
    assert r.returncode == 0, r.stderr[-3000:]
    return d / "quickstart"


def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path, straight):
    r = run_quickstart(tmp_path, "checkpoint.interval=2", "loop.stop_after=2", *DET)  # a job that ends at step 2
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_quickstart(tmp_path, "checkpoint.interval=2", *DET)  # resubmitted: checkpoint.resume=auto
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step 2, weight version 2" in r.stderr
    resumed = tmp_path / "quickstart"
    assert [x["step"] for x in rows(resumed)] == [1, 2, 3, 4]  # steps 3-4 appended, none repeated
    assert rows(resumed) == rows(straight)
    assert_bitwise_equal(final_weights(straight, 4), final_weights(resumed, 4))


@pytest.mark.parametrize("source", ["disk", "host"])
def test_release_train_equals_a_run_without_release(tmp_path, straight, source):
    r = run_quickstart(tmp_path, "release.train=true", f"release.source={source}", "checkpoint.interval=2", *DET)
    assert r.returncode == 0, r.stderr[-3000:]
    released = tmp_path / "quickstart"
    assert rows(released) == rows(straight)
    assert_bitwise_equal(final_weights(straight, 4), final_weights(released, 4))
    assert (released / "checkpoints" / "latest").read_text() == "step_000004"


def _world1():
    from rltrain.runtime.world import World

    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK"):
        os.environ.pop(k, None)
    return World(backend="gloo", timeout=60)


@pytest.fixture
def world1():
    w = _world1()
    yield w
    w.close()


def test_corrupt_or_partial_checkpoints_are_skipped_with_a_warning(tmp_path, world1, caplog):
    t = make_trainer(make_model(tmp_path / "m", seed=5), micro=4)
    ck = Checkpointer(tmp_path / "ck", world1, keep_last=5)
    for step in (1, 2, 3):
        one_step(t, fixed_batch())
        ck.save(step, t, str(step), {"sampler": {"epoch": 0, "position": step}})
    (tmp_path / "ck" / ".step_000004.tmp").mkdir()  # an interrupted save
    rank_file = tmp_path / "ck" / "step_000003" / "rank0.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank_file.write_bytes(bytes(data))  # bit rot in the newest
    (tmp_path / "ck" / "step_000002" / "manifest.json").unlink()  # and a partial one
    caplog.set_level(logging.WARNING, logger="rltrain.checkpoint")
    assert find_resumable(tmp_path / "ck") == tmp_path / "ck" / "step_000001"
    assert "step_000003: rank0.pt does not match its checksum (corrupt)" in caplog.text
    assert "step_000002: no manifest.json (partial or interrupted save)" in caplog.text
    with pytest.raises(CheckpointError, match="corrupt"):
        ck.load(tmp_path / "ck" / "step_000003", t)


def test_pruning_keeps_the_newest_recorded_checkpoint_until_a_newer_one_is_recorded(tmp_path, world1):
    """keep_last=1: a save prunes nothing a restart needs (the checkpoint of the last recorded step
    stays beside the new, unrecorded one); once the new step's row is written, one is left."""
    t = make_trainer(make_model(tmp_path / "m", seed=5), micro=4)
    root = tmp_path / "ck"
    ck = Checkpointer(root, world1, keep_last=1)

    def on_disk() -> list[str]:
        return sorted(p.name for p in root.glob("step_*"))

    ck.save(1, t, "1", {})
    assert on_disk() == ["step_000001"]  # nothing recorded yet
    ck.recorded(1)
    for step in (2, 3):
        ck.save(step, t, str(step), {})
        # Between the save and the row: the job dies here, the restart resumes from step - 1.
        assert on_disk() == [f"step_{step - 1:06d}", f"step_{step:06d}"]
        assert find_resumable(root, max_step=step - 1) == root / f"step_{step - 1:06d}"
        ck.recorded(step)
        assert on_disk() == [f"step_{step:06d}"]
    # A resume makes its step the recorded one: the next save keeps it too.
    resumed = Checkpointer(root, world1, keep_last=1)
    assert resumed.load(root / "step_000003", t).step == 3
    resumed.save(4, t, "4", {})
    assert on_disk() == ["step_000003", "step_000004"]


def test_failed_save_keeps_trainer_and_previous_checkpoint(tmp_path, world1):
    t = make_trainer(make_model(tmp_path / "m", seed=5), micro=4)
    ck = Checkpointer(tmp_path / "ck", world1)
    one_step(t, fixed_batch())
    ck.save(1, t, "1", {})
    one_step(t, fixed_batch())
    # A disk that fills up: writes past 4 KiB fail with EFBIG (SIGXFSZ ignored so it is an error).
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(CheckpointError, match="the trainer is kept and the previous checkpoint is untouched"):
            ck.save(2, t, "2", {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert (tmp_path / "ck" / "latest").read_text() == "step_000001"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step_000001"]  # no partial left
    verify(tmp_path / "ck" / "step_000001")
    assert one_step(t, fixed_batch())["grad_norm"] > 0  # the trainer is alive and trains on


def test_a_read_only_checkpoint_directory_keeps_trainer_and_previous_checkpoint(tmp_path, world1):
    """The checkpoint directory's filesystem turns read-only (a real tmpfs remounted ro): the
    save fails with the reason, the trainer trains on, the previous checkpoint verifies."""
    from readonly import tmpfs

    t = make_trainer(make_model(tmp_path / "m", seed=5), micro=4)
    with tmpfs(tmp_path / "ck") as read_only:
        ck = Checkpointer(tmp_path / "ck", world1)
        one_step(t, fixed_batch())
        ck.save(1, t, "1", {})
        read_only()
        with pytest.raises(CheckpointError, match="Read-only file system"):
            ck.save(2, t, "2", {})
        assert (tmp_path / "ck" / "latest").read_text() == "step_000001"
        assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step_000001"]
        verify(tmp_path / "ck" / "step_000001")
        assert one_step(t, fixed_batch())["grad_norm"] > 0


def _release_rss(rank: int, world_size: int, model_dir: str) -> dict:
    import psutil

    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.trainer.fsdp import FSDPTrainer

    proc = psutil.Process()
    import transformers  # noqa: F401 - imports are not the trainer's memory

    baseline = proc.memory_info().rss
    out = {"baseline": baseline}
    t = FSDPTrainer(TrainerConfig(lr=1e-3, micro_batch_size=8), AlgoConfig(), model_dir, torch.device("cpu"))
    for cycle in (1, 2):
        t.create(load_weights=cycle == 1)
        one_step(t, fixed_batch(vocab=8192))
        out["state"] = sum(p.numel() * 4 * 3 for p in t.model.parameters())  # weights + Adam's two moments
        out[f"held{cycle}"] = proc.memory_info().rss
        t.release()
        out[f"released{cycle}"] = proc.memory_info().rss
    return out


def test_release_returns_memory_to_the_pre_trainer_baseline(tmp_path):
    model = make_model(tmp_path / "big", seed=3, vocab=8192, hidden=512, layers=2)
    (m,) = values(run_ranks(_release_rss, 1, str(model), deadline_s=120, fresh=True))
    assert m["held1"] - m["baseline"] > 0.8 * m["state"], m
    # Stated margin: after release the process is within 25% of the trainer's state bytes of its
    # pre-trainer baseline (the first create also loads model code and kernels, which stay) ...
    assert m["released1"] - m["baseline"] < 0.25 * m["state"], m
    # ... and a second create / train / release cycle adds less than 5% of it: nothing accumulates.
    assert m["released2"] - m["released1"] < 0.05 * m["state"], m


# ------------------------------------------------------------------ faults (tests/faults/sitecustomize.py)


def _faulty(tmp_path: Path, fault: str, *overrides: str, restarts: int = 0):
    env = {
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "faults"), os.environ.get("PYTHONPATH", "")]),
        "RLTRAIN_TEST_FAULT": fault,
    }
    return run_quickstart(
        tmp_path,
        "checkpoint.interval=1",
        "world.timeout_s=60",
        *overrides,
        torchrun_args=(f"--max-restarts={restarts}",),
        env=env,
    )


def _nothing_half_written(run_dir: Path, temporary_allowed: bool = False) -> None:
    """Every weight version and checkpoint that exists is complete. A job killed mid-write leaves
    its hidden temporary directory (never loaded); the next job removes it."""
    if not temporary_allowed:
        for root in (run_dir / "weights", run_dir / "checkpoints"):
            assert not [p.name for p in root.glob("**/.*tmp*")], list(root.iterdir())
    for v in (run_dir / "weights").glob("weight_v*"):
        assert (v / "rltrain_version.json").is_file(), v
    for c in (run_dir / "checkpoints").glob("step_*"):
        verify(c)  # raises on a partial or corrupt checkpoint


@pytest.mark.parametrize(
    "phase,action", [("rollout", "raise"), ("train", "kill"), ("save", "raise"), ("world_rebuild", "raise")]
)
def test_a_rank_failing_in_a_phase_ends_every_rank_with_the_phase_named(tmp_path, phase, action):
    """Rank 1 raises (or is SIGKILLed) at step 2: the job ends non-zero, nothing hangs (the
    test's own deadline is far below a hang), the failing phase is named, and every checkpoint and
    weight version on disk is whole."""
    r = _faulty(tmp_path, f"1:{phase}:2:{action}")
    assert r.returncode != 0
    if action == "raise":
        assert f"rank 1 failed in phase {phase} of step 2" in r.stderr, r.stderr[-3000:]
    else:
        assert "Signals.SIGKILL" in r.stderr or "exitcode  : -9" in r.stderr, r.stderr[-3000:]
    _nothing_half_written(tmp_path / "quickstart", temporary_allowed=True)


def test_a_rank_killed_during_sync_is_restarted_by_torchrun_and_ends_as_the_uninterrupted_run(tmp_path, straight):
    """torchrun --max-restarts=1: rank 1 is SIGKILLed in the weight sync of step 3, after that
    step's checkpoint but before its metrics row; the surviving rank names the phase; the
    restarted job skips the unrecorded step-3 checkpoint, resumes from step 2 and ends bitwise
    equal to a run that never failed — every step recorded once, no half-published version.
    With checkpoint.keep_last=1: the save of step 3 must not have pruned step 2's checkpoint (the
    only one a restart may use), and once the rows are written one checkpoint is left."""
    r = _faulty(tmp_path, "1:sync:3:kill", *DET, "checkpoint.keep_last=1", restarts=1)
    assert r.returncode == 0, r.stderr[-3000:]
    # The survivor names the phase, unless torchrun's SIGTERM (sent on rank 1's death) reaches it
    # first, which happens on a loaded machine: then torchrun names the SIGKILL, in its restart log
    # ("failed (exitcode: -9) local_rank: 1") or in its final report ("exitcode  : -9").
    assert any(
        s in r.stderr
        for s in ("rank 0 failed in phase sync of step 3", "(exitcode: -9) local_rank: 1", "exitcode  : -9")
    ), r.stderr[-3000:]
    assert "before step 3 was recorded" in r.stderr, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step 2, weight version 2" in r.stderr, r.stderr[-3000:]
    run_dir = tmp_path / "quickstart"
    assert [x["step"] for x in rows(run_dir)] == [1, 2, 3, 4]
    assert rows(run_dir) == rows(straight)
    assert_bitwise_equal(final_weights(straight, 4), final_weights(run_dir, 4))
    _nothing_half_written(run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000004"]


def _engine_dies(tmp_path: Path, versions: str, *overrides: str):
    env = {
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "faults"), os.environ.get("PYTHONPATH", "")]),
        "RLTRAIN_TEST_ENGINE_DIE": f"{versions}:{tmp_path}",
    }
    return run_quickstart(tmp_path, "world.timeout_s=60", "engine.retries=1", *overrides, env=env)


def test_an_engine_dying_mid_rollout_is_restarted_and_its_lost_generations_are_retried(tmp_path, straight):
    """The engine SIGKILLs itself while serving step 2's rollout (weight version 1). It is started
    again, gets version 1 back, the generations it lost are sampled again with their own seeds,
    and the run ends bitwise equal to one where nothing died; no sample was scored zero."""
    r = _engine_dies(tmp_path, "1", *DET)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "engine_died_at_v1").exists()  # it did die
    assert "died during rollout; starting them again (restart 1 of 1)" in r.stderr, r.stderr[-3000:]
    run_dir = tmp_path / "quickstart"
    got = rows(run_dir)
    assert [x["step"] for x in got] == [1, 2, 3, 4]
    assert got[1]["engine_restarts"] == 1 and got[1]["generation_retried"] > 0, got[1]
    assert got[1]["generation_failed"] == 0 and got[1]["samples_trained"] == 64
    retry_only = {"engine_restarts", "generation_retried"}
    assert [{k: v for k, v in x.items() if k not in retry_only} for x in got] == [
        {k: v for k, v in x.items() if k not in retry_only} for x in rows(straight)
    ]
    assert_bitwise_equal(final_weights(straight, 4), final_weights(run_dir, 4))


def test_a_second_engine_death_stops_the_job_with_the_engines_log(tmp_path):
    r = _engine_dies(tmp_path, "1,2", "loop.steps=4", "rollout.max_new_tokens=2")
    assert r.returncode != 0
    assert "the engine died again after 1 restart(s)" in r.stderr, r.stderr[-3000:]
    assert "last lines of" in r.stderr and "rltrain.engine.embedded" in r.stderr, r.stderr[-3000:]
    assert [x["step"] for x in rows(tmp_path / "quickstart")] == [1, 2]  # steps done before it stay recorded


# ------------------------------------------------------------------ stop requests (runtime/stop.py)

SYNC_STATS = "sync"  # a row's sync_* keys: a step stopped after its save syncs nothing


def _stopped_then_resumed(tmp_path: Path, fault: str) -> tuple[Path, dict, str]:
    """A run whose rank 1 alone gets SIGTERM (`fault`), with no checkpoint interval: every rank
    stops at the same point after saving; the marker says where; the job run again resumes."""
    r = _faulty(tmp_path, fault, *DET, "checkpoint.interval=0")
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "quickstart"
    marker = json.loads((run_dir / "stopped.json").read_text())
    assert marker["reason"] == "SIGTERM" and Path(marker["checkpoint"]).name == f"step_{marker['step']:06d}"
    verify(Path(marker["checkpoint"]))
    assert [x["step"] for x in rows(run_dir)] == list(range(1, marker["step"] + 1))
    assert "stop requested (SIGTERM on rank(s) [1])" in r.stderr, r.stderr[-3000:]
    again = run_quickstart(tmp_path, *DET, "checkpoint.interval=0")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"step {marker['step']}, weight version {marker['step']}" in again.stderr, again.stderr[-3000:]
    assert not (run_dir / "stopped.json").exists()  # the run that goes on is not the stopped one
    return run_dir, marker, r.stderr


def _without_sync(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(SYNC_STATS)}


def test_sigterm_in_a_rollout_saves_that_step_and_the_resumed_run_equals_the_uninterrupted_one(tmp_path, straight):
    run_dir, marker, log = _stopped_then_resumed(tmp_path, "1:rollout:3:term")
    assert marker["step"] == 3 and "stopping after the train step" in log
    got, want = rows(run_dir), rows(straight)
    assert [x["step"] for x in got] == [1, 2, 3, 4]
    # Step 3 trained and saved, its weights not synced: its row has no sync figures.
    assert not [k for k in got[2] if k.startswith(SYNC_STATS)]
    assert [_without_sync(x) for x in got] == [_without_sync(x) for x in want]
    assert_bitwise_equal(final_weights(straight, 4), final_weights(run_dir, 4))


def test_sigterm_after_a_save_point_stops_at_the_step_boundary_with_that_step_saved(tmp_path, straight):
    run_dir, marker, log = _stopped_then_resumed(tmp_path, "1:sync:2:term")
    assert marker["step"] == 2 and "stopping before the rollout" in log
    assert rows(run_dir) == rows(straight)
    assert_bitwise_equal(final_weights(straight, 4), final_weights(run_dir, 4))


# ------------------------------------------------------------------ history (rltrain/history.py)


def test_a_restart_without_a_checkpoint_is_refused_and_keeps_the_history(tmp_path):
    r = run_quickstart(tmp_path, "checkpoint.interval=0")  # no checkpoint
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = tmp_path / "quickstart" / "metrics.jsonl"
    before = metrics.read_text()
    again = run_quickstart(tmp_path, "loop.steps=5", "checkpoint.interval=0")
    assert again.returncode != 0
    assert "would start again at step 1" in again.stderr and "run.start_over=true" in again.stderr, again.stderr[-3000:]
    assert metrics.read_text() == before  # not one row lost
    over = run_quickstart(tmp_path, "run.start_over=true", "checkpoint.interval=0")
    assert over.returncode == 0, over.stderr[-3000:]
    kept = list(metrics.parent.glob("metrics.jsonl.before-*"))
    assert len(kept) == 1 and kept[0].read_text() == before
    assert [x["step"] for x in rows(metrics.parent)] == [1, 2, 3]


def _history_cfg(tmp_path: Path, *overrides: str):
    from rltrain.config import load_config  # noqa: PLC0415

    return load_config(str(REPO_CONFIGS / "quickstart.yaml"), [f"run.dir={tmp_path}", *overrides])


REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _write_rows(run_dir: Path, steps: range) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))


@pytest.mark.parametrize(
    "overrides,why",
    [((), "no verified checkpoint of a recorded step"), (("checkpoint.resume=none",), "checkpoint.resume=none")],
)
def test_history_refuses_a_start_at_step_one_over_metrics_rows(tmp_path, overrides, why):
    from rltrain.history import HistoryError, begin  # noqa: PLC0415

    cfg = _history_cfg(tmp_path, *overrides)
    _write_rows(cfg.run_dir, range(1, 15))
    with pytest.raises(HistoryError, match=why) as e:
        begin(cfg, cfg.run_dir / "checkpoints")
    assert "records steps up to 14" in str(e.value) and "run.start_over=true" in str(e.value)
    assert len((cfg.run_dir / "metrics.jsonl").read_text().splitlines()) == 14


def test_history_refuses_checkpoints_it_cannot_use_even_without_metrics(tmp_path):
    from rltrain.history import HistoryError, begin  # noqa: PLC0415

    cfg = _history_cfg(tmp_path)
    (cfg.run_dir / "checkpoints" / "step_000004").mkdir(parents=True)  # no manifest: incomplete
    with pytest.raises(HistoryError, match="1 checkpoint.s. but none this job can use"):
        begin(cfg, cfg.run_dir / "checkpoints")
    # Starting over keeps them, renamed beside.
    assert begin(_history_cfg(tmp_path, "run.start_over=true"), cfg.run_dir / "checkpoints") is None
    assert [p.name.split(".")[0] for p in cfg.run_dir.glob("checkpoints.before-*")] == ["checkpoints"]


def test_a_resumed_run_moves_the_rows_after_its_checkpoint_aside_instead_of_deleting_them(tmp_path, world1):
    from rltrain.metrics import MetricsWriter  # noqa: PLC0415

    cfg = _history_cfg(tmp_path, "metrics.progress_bar=false")
    _write_rows(cfg.run_dir, range(1, 8))
    MetricsWriter(cfg, world1, start_step=4).close()
    assert [x["step"] for x in rows(cfg.run_dir)] == [1, 2, 3, 4]
    dropped = (cfg.run_dir / "metrics.dropped.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in dropped] == [5, 6, 7]
