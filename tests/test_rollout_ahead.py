"""Rollout ahead of training (`loop.max_staleness=1`, #54): step t+1's samples generated while step
t trains, each trained one weight version behind, corrected, checked and counted; a stop and a
resume; the settings refused where they cannot work. Engines of their own (`engine.gpus`): one
engine shared by the node's two ranks, fed by its leader, the synchronous run equal to the
engines-beside-the-ranks run. End to end under torchrun on the CPU (the engines are processes of
their own there, as on GPUs of their own)."""

from __future__ import annotations

import json

import pytest

from rltrain.config import ConfigError, load_config
from test_loop import REPO, run_quickstart

AHEAD = ("loop.colocate=false", "loop.max_staleness=1")


def _rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]


def test_each_step_after_the_first_trains_on_samples_one_version_behind_and_a_resumed_run_draws_them_again(tmp_path):
    """Step 1 samples from the weights it trains (nothing was ahead); steps 2-3 train on samples
    generated while the step before trained, one version behind (the staleness histogram says so
    and the version check allows exactly that), with token importance weights on by default.
    Stopped after step 2 and started again, step 3's prompts are drawn again from the checkpoint
    (the rollout ahead is not saved): it samples them from the weights it trains."""
    r = run_quickstart(tmp_path, *AHEAD, "checkpoint.interval=1", "loop.stop_after=2")
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_quickstart(tmp_path, *AHEAD, "checkpoint.interval=1")
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _rows(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["staleness"] for row in rows] == [{"0": 64.0}, {"1": 64.0}, {"0": 64.0}]
    assert "rollout_ahead_s" not in rows[0] and rows[1]["rollout_ahead_s"] > 0 and "rollout_ahead_s" not in rows[2]
    for row in rows:
        assert row["generation_failed"] == 0 and row["samples_trained"] == 64
        assert 0.5 < row["is_weight"] <= 2.0 and 0 <= row["is_truncated"] <= 1  # (rollout_is=token by default)
        assert "rollout_ahead_wait" in row["time"]
    resolved = (tmp_path / "quickstart" / "config.yaml").read_text()
    assert "rollout_is: token" in resolved and "max_staleness: 1" in resolved


def test_the_rollout_ahead_settings_are_refused_where_they_cannot_work(tmp_path):
    qs = str(REPO / "configs" / "quickstart.yaml")
    with pytest.raises(ConfigError, match="set loop.colocate=false"):
        load_config(qs, ["loop.max_staleness=1"])
    with pytest.raises(ConfigError, match="only 0 .synchronous. and 1"):
        load_config(qs, ["loop.colocate=false", "loop.max_staleness=2"])
    with pytest.raises(ConfigError, match="dynamic sampling's rounds"):
        load_config(qs, [*AHEAD, "algo.dynamic_sampling=true"])
    cfg = load_config(qs, [*AHEAD, "algo.rollout_rs=geometric", "algo.rollout_rs_threshold=1.01"])
    assert cfg.algo.rollout_is is None and cfg.algo.rollout_rs == "geometric"  # (a correction set: kept as set)
    assert load_config(qs, list(AHEAD)).algo.rollout_is == "token"
    assert load_config(qs, ["loop.colocate=false"]).algo.rollout_is is None


def _trained(tmp_path) -> list[dict]:
    """What a run trained on and how, row by row: every figure but times, memory and throughput."""
    skip = ("time", "memory", "wall", "rollout_time", "rollout_tokens_per_s", "train_tokens_per_s")
    return [{k: v for k, v in row.items() if k not in skip} for row in _rows(tmp_path)]


def test_one_engine_of_its_own_serves_both_ranks_and_the_synchronous_run_equals_engines_beside_the_ranks(tmp_path):
    """engine.gpus=1 on a node of two ranks: one engine (node0-engine0, on the "GPU" after the
    trainer's), started and fed by rank 0, generating for both. Synchronous (k = 0), the run
    equals the same seeded, batch-invariant run with an engine beside each rank, row for row."""
    same = ("loop.colocate=false", "engine.deterministic=true", "sync.transport=tensor")
    for d in ("beside", "apart"):
        (tmp_path / d).mkdir()
    r = run_quickstart(tmp_path / "beside", *same)
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_quickstart(tmp_path / "apart", *same, "engine.gpus=1")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "engines: 1 per node of 1 GPU(s) each (embedded, cpu), on GPUs of their own from GPU 2 on" in r.stderr
    assert sorted(p.name for p in (tmp_path / "apart" / "quickstart" / "engine").glob("*.log")) == ["node0-engine0.log"]
    assert sorted(p.name for p in (tmp_path / "beside" / "quickstart" / "engine").glob("*.log")) == [
        "node0-engine0.log",
        "node0-engine1.log",
    ]
    apart, beside = _trained(tmp_path / "apart"), _trained(tmp_path / "beside")
    # one engine's digests compared each sync against two: the rest is the same run
    assert [row.pop("sync_digests_compared") for row in apart] == [1, 1, 1]
    assert [row.pop("sync_digests_compared") for row in beside] == [2, 2, 2]
    assert [row["step"] for row in apart] == [1, 2, 3] and apart == beside


def test_an_engine_of_its_own_dying_under_the_rollout_ahead_is_restarted_before_the_sync_and_its_samples_retried(
    tmp_path,
):
    """One engine of its own for both ranks (engine.gpus=1), fed by `sync.transport=distributed`
    (gloo here, NCCL on GPUs: the transport engines of their own take), k = 1. The engine
    SIGKILLs itself while serving step 3's rollout ahead (weight version 1, while step 2 trains).
    It is started again before step 2's sync reaches it (which sends it version 2), and step 3
    samples every generation it lost again, from version 2: lag 0, none failed; the other steps
    train one version behind, every sync verified. The old loop synced to the dead engine and the
    job failed."""
    from test_checkpoint import _engine_dies

    r = _engine_dies(tmp_path, "1", *AHEAD, "loop.steps=4", "engine.gpus=1", "sync.transport=distributed")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "engine_died_at_v1").exists()  # it did die
    assert "died during rollout; starting them again (restart 1 of 1)" in r.stderr, r.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [row["engine_restarts"] for row in rows] == [0, 0, 1, 0]
    assert [row["staleness"] for row in rows] == [{"0": 64.0}, {"1": 64.0}, {"0": 64.0}, {"1": 64.0}]
    assert rows[2]["generation_retried"] == 64
    for row in rows:
        assert row["generation_failed"] == 0 and row["samples_trained"] == 64 and row["sync_digests_compared"] >= 1
