"""Rollout ahead of training (`loop.max_staleness=1`, #54): step t+1's samples generated while step
t trains, each trained one weight version behind, corrected, checked and counted; a stop and a
resume; the settings refused where they cannot work. Engines of their own (`engine.gpus`): one
engine shared by the node's two ranks, fed by its leader, the synchronous run equal to the
engines-beside-the-ranks run. End to end under torchrun on the CPU (the engines are processes of
their own there, as on GPUs of their own)."""

from __future__ import annotations

import json
import os

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
    with pytest.raises(ConfigError, match="each sync would wait for every rollout ahead"):
        load_config(qs, ["loop.colocate=false", "loop.max_staleness=2"])
    with pytest.raises(ConfigError, match="nothing is in flight at a weight update of the synchronous loop"):
        load_config(qs, ["loop.colocate=false", "loop.in_flight_update=continue"])
    with pytest.raises(ConfigError, match="expected one of 'wait', 'continue', 'requeue'"):
        load_config(qs, [*AHEAD, "loop.in_flight_update=retract"])
    assert load_config(qs, ["loop.colocate=false", "loop.max_staleness=3", "loop.in_flight_update=requeue"])
    with pytest.raises(ConfigError, match="dynamic sampling's rounds"):
        load_config(qs, [*AHEAD, "algo.dynamic_sampling=true"])
    cfg = load_config(qs, [*AHEAD, "algo.rollout_rs=geometric", "algo.rollout_rs_threshold=1.01"])
    assert cfg.algo.rollout_is is None and cfg.algo.rollout_rs == "geometric"  # (a correction set: kept as set)
    assert load_config(qs, list(AHEAD)).algo.rollout_is == "token"
    assert load_config(qs, ["loop.colocate=false"]).algo.rollout_is is None


def test_rollouts_two_steps_ahead_are_cut_by_each_weight_update_and_go_on_with_every_token_versioned(tmp_path):
    """loop.max_staleness=2 with loop.in_flight_update=continue (partial rollout), on one engine of
    its own shared by both ranks and fed by `distributed`, the engine slowed (a test-only sleep per
    decode step) so that rollouts are in flight at every sync. Each update pauses them (mode
    abort), and the rows it cut go on from their tokens on the new weights: steps 3-4 train on
    samples begun two versions behind, no sample older (the loop's version check would fail the
    run), and the tokens of a row carry the versions that sampled them (the token histogram mixes
    lags in a step). No generation failed; every sample is trained (its whole group kept), with
    the importance weights of the mixed versions."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "faults"), os.environ.get("PYTHONPATH", "")]),
        "RLTRAIN_TEST_ENGINE_STEP_S": "0.05",
    }
    extra = ("loop.colocate=false", "loop.max_staleness=2", "loop.in_flight_update=continue")
    # One engine of its own for both ranks, fed by `distributed` (NCCL broadcast on GPUs, gloo here).
    apart = ("engine.gpus=1", "sync.transport=distributed")
    r = run_quickstart(tmp_path, *extra, *apart, "loop.steps=4", "rollout.max_new_tokens=12", env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _rows(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[0]["staleness"] == {"0": 64.0} and set(rows[1]["staleness"]) <= {"0", "1"}
    assert all(set(row["staleness"]) <= {"0", "1", "2"} for row in rows)
    assert "2" in rows[3]["staleness"]  # (begun in step 2, from the weights before it)
    cut = [row.get("in_flight_cut", 0) for row in rows]
    assert sum(cut) > 0 and [row.get("in_flight_continued", 0) for row in rows] == cut
    mixed = [row for row in rows if len(row.get("staleness_tokens", {})) > 1]
    assert mixed, rows
    for row in rows:
        assert row["generation_failed"] == 0 and row["samples_trained"] == 64 and row["sync_digests_compared"] == 1
        assert 0.5 < row["is_weight"] <= 2.0
        assert ("rollout_ahead_pause" in row["time"]) == (row["step"] < 4)  # (no rollout ahead after the last)


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


@pytest.mark.parametrize("mode", ["continue", "requeue"])
def test_a_weight_update_cuts_the_rows_in_flight_and_they_go_on_from_the_new_weights(server, model_a, model_b, mode):
    """Real engines (the embedded one and SGLang on the CPU), as the loop drives them with
    loop.in_flight_update: a long greedy generation of weights A is cut by SGLang's
    /pause_generation (mode abort) in the middle and answered with its tokens so far; weights B
    are loaded and the engine continued. With continue (partial rollout) the sample is its tokens of
    A, then exactly what the engine generates from the prompt and them on B, each token with the
    version that produced it and the engine's log-prob of each kept; with requeue, the whole sample
    is B's. The engine is left serving A, as it was."""
    import threading
    import time

    from rltrain.generation import SamplingParams
    from rltrain.rollout.inflight import InFlightClient, UpdateGate

    client, before = server.client, server.client.weight_version()
    prompt, length = [5, 6, 7, 8], 900
    params = SamplingParams(max_new_tokens=length, temperature=0.0, ignore_eos=True)
    delay = 0.3
    try:
        for _ in range(6):  # until the pause lands in the middle of the generation
            gate = UpdateGate(120)
            flight = InFlightClient(client, gate, mode)
            got: dict = {}
            thread = threading.Thread(target=lambda: got.update(out=flight.generate([prompt], params)))
            thread.start()
            time.sleep(delay)
            gate.close()
            client.pause("abort")
            client.update_weights_from_disk(str(model_b), weight_version="b")
            client.continue_generation()
            gate.open()
            thread.join(300)
            (c,) = got["out"]
            assert c.ok and len(c.output_ids) == length and len(c.logprobs) == length, c
            cut = flight.stats.cut
            client.update_weights_from_disk(str(model_a), weight_version=before)
            if cut and (mode == "requeue" or 0 < (c.token_versions or []).count(before) < length):
                break
            delay = delay * 2 if not cut else delay / 2  # (finished before the pause: later; cut at 0: sooner)
        else:
            pytest.fail("the pause never landed in the middle of the generation")
        assert flight.stats.cut == 1 and getattr(flight.stats, "continued" if mode == "continue" else "requeued") == 1
        on_b = lambda ids, n: client.generate([ids], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))  # noqa: E731
        client.update_weights_from_disk(str(model_b), weight_version="b")
        if mode == "continue":
            done = c.token_versions.count(before)
            assert c.token_versions == [before] * done + ["b"] * (length - done) and c.weight_version == before
            (rest,) = on_b(prompt + c.output_ids[:done], length - done)
            assert c.output_ids[done:] == rest.output_ids
            client.update_weights_from_disk(str(model_a), weight_version=before)
            (of_a,) = client.generate([prompt], SamplingParams(max_new_tokens=done, temperature=0.0, ignore_eos=True))
            assert c.output_ids[:done] == of_a.output_ids  # the cut part: weights A's
        else:
            (whole,) = on_b(prompt, length)
            assert c.output_ids == whole.output_ids and c.weight_version == "b" and c.token_versions is None
    finally:
        client.continue_generation()
        client.update_weights_from_disk(str(model_a), weight_version=before)
    assert client.weight_version() == before


def test_a_rank_killed_with_rollouts_in_flight_is_restarted_and_resumes_from_its_checkpoint(tmp_path):
    """k = 2 with partial rollouts: rank 1 is SIGKILLed while step 3 trains, with the rollouts
    of steps 4 and 5 in flight. torchrun restarts the job, which resumes from step 2's checkpoint:
    its engines are started and sent that version, the prompts drawn ahead are drawn again (the
    checkpoint keeps the sampler as it was before them), and steps 3-5 are trained once each,
    every sample within two versions, nothing failed, nothing left waiting on a paused engine."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "faults"), os.environ.get("PYTHONPATH", "")]),
        "RLTRAIN_TEST_ENGINE_STEP_S": "0.05",
        "RLTRAIN_TEST_FAULT": "1:train:3:kill",
    }
    extra = ("loop.colocate=false", "loop.max_staleness=2", "loop.in_flight_update=continue")
    r = run_quickstart(
        tmp_path,
        *extra,
        "loop.steps=5",
        "rollout.max_new_tokens=12",
        "checkpoint.interval=1",
        "world.timeout_s=60",
        torchrun_args=("--max-restarts=1",),
        env=env,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stderr and "step 2, weight version 2" in r.stderr, r.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert rows[2]["staleness"] == {"0": 64.0}  # (the first step after the resume: nothing was ahead)
    for row in rows:
        assert set(row["staleness"]) <= {"0", "1", "2"} and row["generation_failed"] == 0
        assert row["samples_trained"] == 64


def test_an_engine_dying_under_a_rollout_two_steps_ahead_is_restarted_and_that_rollout_sampled_again(tmp_path):
    """k = 2 with partial rollout, one engine of its own for both ranks (fed by `distributed`).
    The engine SIGKILLs itself at its first rollout request of weight version 1: step 4's rollout,
    started while step 2 trained. The loop sees the death at its next check (before step 2's sync
    or at step 3's take): the engine is started again and sent the weights, and step 4, when it
    takes its rollout, samples again every generation the death cut, and anything the restarted
    engine sampled before it had the weights (a version no step may train on): nothing failed,
    nothing trained more than two versions behind. The old loop retried only the rollout taken
    next (step 3's, which had lost nothing): step 4's lost generations were dropped."""
    from test_checkpoint import _engine_dies

    env_extra = ("loop.max_staleness=2", "loop.in_flight_update=continue", "loop.steps=5")
    r = _engine_dies(tmp_path, "1", "loop.colocate=false", *env_extra, "engine.gpus=1", "sync.transport=distributed")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "engine_died_at_v1").exists()  # it did die
    assert "died during rollout; starting them again (restart 1 of 1)" in r.stderr, r.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert sum(row["engine_restarts"] for row in rows) >= 1
    assert sum(row["generation_retried"] for row in rows) > 0
    for row in rows:
        assert row["generation_failed"] == 0 and row["samples_trained"] == 64, row
        assert set(row["staleness"]) <= {"0", "1", "2"}
