"""The post-sync checks and the verdict (rltrain/sync/verify.py, rltrain/sync/probe.py) as pure
functions: what they flag and name; and the alarm on the engine-vs-trainer gap (rollout/prepare.py)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from rltrain.config import ConfigError, SyncConfig
from rltrain.engine.client import EngineCapabilities
from rltrain.rollout.prepare import LogpGapAlarm
from rltrain.sync.probe import (
    CALIBRATION_FACTOR,
    CEILING,
    FLOOR,
    ProbeBounds,
    ProbeDiff,
    calibrated,
    natural_prefix,
    precision,
    probe_batch,
    probe_error,
    random_tokens,
    start_error,
    uncalibrated,
)
from rltrain.sync.verify import (
    Checks,
    ChecksumCheck,
    EngineDigest,
    ProbeMoment,
    ProbeScore,
    RankReport,
    Verdict,
    compared,
    disagreements,
    judge,
    unwritten,
)
from rltrain.weights.checksum import WeightMismatchError
from rltrain.weights.versions import StaleWeightsError


def test_engines_that_hold_the_same_shard_must_agree_and_the_odd_one_is_named():
    a, b = "a" * 64, "b" * 64
    same = [EngineDigest(f"node{k}-engine0", 2, (a, b)) for k in range(3)]
    assert disagreements(same) == [] and compared(same) == 6
    odd = [*same[:2], EngineDigest("node2-engine0", 2, (a, "c" * 64))]
    (error,) = disagreements(odd)
    assert error.startswith("node2-engine0 holds a different TP-rank-1 shard") and "2 of the 3 engines" in error
    # Engines of another TP size, or another EP shard, hold other bytes: never compared.
    mixed = [*same, EngineDigest("node3-engine0", 1, ("d" * 64,)), EngineDigest("n4", 2, (a, "e" * 64), shard="ep1/2")]
    assert disagreements(mixed) == [] and compared(mixed) == 6
    # One engine alone (the default: one per node, or TP 8 on one node) has nothing to agree with.
    assert compared([EngineDigest("node0-engine0", 8, (a,) * 8)]) == 0


def test_a_parameter_that_still_hashes_as_the_reset_left_it_was_not_written():
    before = [
        {"tp_rank": 0, "tensors": {"qkv": "1", "norm": "2", "fused_qkv_a": "3"}},
        {"tp_rank": 1, "tensors": {"qkv": "4", "norm": "2", "fused_qkv_a": "6"}},
    ]
    after = [
        {"tp_rank": 0, "tensors": {"qkv": "7", "norm": "8", "fused_qkv_a": "3"}},
        {"tp_rank": 1, "tensors": {"qkv": "9", "norm": "8", "fused_qkv_a": "6"}},
    ]
    assert unwritten(before, after) == {0: ["fused_qkv_a"], 1: ["fused_qkv_a"]}
    assert unwritten(before, before[:1] + after[1:]) == {0: ["fused_qkv_a", "norm", "qkv"], 1: ["fused_qkv_a"]}


def test_the_probe_is_judged_on_the_mean_and_on_the_worst_position():
    tokens = random_tokens(1000, 16)
    assert tokens == random_tokens(1000, 16) and len(set(tokens)) > 8 and max(tokens) < 1000
    batch = probe_batch(tokens)
    assert batch.tokens.shape == (1, 16) and batch.loss_mask[0, 0] == 0 and batch.loss_mask[0, 1:].all()
    assert natural_prefix(list(range(100)), 32) == list(range(16)) and natural_prefix([7, 8], 32) == [7, 8]
    ours = torch.full((15,), -3.0)
    bounds = ProbeBounds(1e-3, 1e-2, "test")
    assert probe_error("e", [-3.0004] * 15, ours, bounds) is None
    assert "differ from the trainer's by 0.5 on average" in probe_error("node0-engine1", [-3.5] * 15, ours, bounds)
    # One position far off, the mean within its bound: the worst position fails it.
    one_off = [-3.0] * 14 + [-3.012]
    assert ProbeDiff.of(one_off, ours).mean < 1e-3
    error = probe_error("node0-engine0", one_off, ours, bounds)
    assert error is not None and "0.012 at the worst position (bounds 0.001 and 0.01, test)" in error
    assert probe_error("e", one_off, ours, 1e-3) is None  # a float: a bound on the mean alone
    assert "non-finite" in probe_error("e", [math.nan] * 15, ours, bounds)
    assert "scored 14 probe tokens" in probe_error("e", [-3.0] * 14, ours, bounds)


def _calibrate_rank(rank: int, world_size: int, riding: bool) -> tuple[float, float]:
    """tokens_and_bounds over a two-rank world: each rank's engine scored the probe at start-up
    exactly as the trainer scores it alone; as a row of a training micro-batch the trainer's
    log-probs move by up to 0.06 (what bf16 does on an H200 at the 1.7B shape)."""
    from types import SimpleNamespace

    from rltrain.runtime.world import World
    from rltrain.sync.calibration import tokens_and_bounds
    from rltrain.sync.plan import WeightSpec
    from rltrain.sync.probe import StartProbe

    world = World(backend="gloo", timeout=60)
    tokens = list(range(1, 17))
    start = StartProbe(tokens, 8, {f"node0-engine{rank}": [-2.0] * 15})
    alone = lambda t: torch.full((len(t) - 1,), -2.0)  # noqa: E731
    in_batch = lambda t: alone(t) + torch.linspace(0.0, 0.06, len(t) - 1)  # noqa: E731
    plan = SimpleNamespace(weights=[WeightSpec("w", (1,), torch.bfloat16)])
    _, bounds = tokens_and_bounds(
        SyncConfig(), world, EngineCapabilities(), plan, 32, start, alone, False, in_batch if riding else None
    )
    world.close()
    return bounds.mean, bounds.worst


@pytest.mark.parametrize("riding", [True, False])
def test_the_probes_bounds_are_calibrated_against_the_trainers_side_as_it_rides_too(riding):
    """The trainer's side of the probe rides a training step as one more row of a micro-batch,
    whose log-probs in half precision differ from the row's alone; calibrated from the row alone
    only, the bounds sat at the floors (then 0.01, 0.05) and an H200 run's first ride failed at
    0.0205 mean, 0.051 at the worst position. Every rank takes rank 0's measurement."""
    from multiproc import run_ranks, values

    out = values(run_ranks(_calibrate_rank, 2, riding, deadline_s=120))
    floor = (FLOOR["half"].mean, FLOOR["half"].worst)
    expected = (CALIBRATION_FACTOR * 0.03, max(CALIBRATION_FACTOR * 0.06, floor[1])) if riding else floor
    assert out == [pytest.approx(expected)] * 2


def test_probe_bounds_are_k_times_the_start_up_difference_with_a_floor_or_the_configured_ones():
    assert precision(torch.float32, torch.float32) == "single"
    assert precision(torch.bfloat16, torch.float32) == precision(None, torch.bfloat16) == "half"
    assert precision(None, torch.float64) == "double"
    cfg = SyncConfig()
    b = calibrated(cfg, "half", ProbeDiff(0.02, 0.3))
    assert (b.mean, b.worst) == pytest.approx((CALIBRATION_FACTOR * 0.02, CALIBRATION_FACTOR * 0.3))
    assert "calibrated at start-up" in b.how
    tiny = calibrated(cfg, "single", ProbeDiff(1e-8, 1e-7))  # fp32 on both sides: the floors
    assert (tiny.mean, tiny.worst) == (FLOOR["single"].mean, FLOOR["single"].worst)
    fixed = calibrated(SyncConfig(probe_tolerance=0.2), "half", ProbeDiff(0.02, 0.3))
    assert fixed.mean == 0.2 and fixed.worst == pytest.approx(1.2) and "sync.probe_tolerance" in fixed.how
    assert uncalibrated(cfg, "half") == ProbeBounds(0.1, 1.0, uncalibrated(cfg, "half").how)
    assert uncalibrated(SyncConfig(probe_worst_tolerance=0.5), "single").worst == 0.5
    # At start-up both sides hold model.path's weights: past the precision's ceiling, the engine
    # computes another model, and the run stops.
    assert start_error("node0-engine0", ProbeDiff(1e-6, 1e-5), cfg, "single") is None
    error = start_error("node0-engine0", ProbeDiff(1e-4, CEILING["single"].worst * 2), cfg, "single")
    assert error is not None and error.startswith("node0-engine0's log-probs") and "at start-up" in error
    assert "sync.probe_tolerance and sync.probe_worst_tolerance" in error
    assert start_error("e", ProbeDiff(0.5, 2.0), SyncConfig(probe_tolerance=1, probe_worst_tolerance=3), "half") is None
    assert start_error("e", ProbeDiff(math.nan, math.nan), cfg, "half") is not None


def test_the_probe_keys_are_checked():
    for bad in (dict(probe_tokens=1), dict(probe_worst_tolerance=-1.0), dict(logp_gap_alarm=0.5)):
        with pytest.raises(ConfigError, match="sync."):
            SyncConfig(**bad).check()
    SyncConfig(logp_gap_alarm=0.0).check()


def test_the_verdict_names_every_miss_of_every_rank_and_only_those():
    ok = ChecksumCheck("node0-engine0", "3", "abc", 10, "abc", 10)
    off = ChecksumCheck("node1-engine0 TP rank 1", "3", "abc", 10, "def", 9)
    stale = RankReport(stale={"node1-engine2": "2"}, checksums=[off], unverified={"node1-engine1": "HTTP 500"})
    with pytest.raises(WeightMismatchError) as e:
        judge("3", [RankReport(checksums=[ok]), stale])
    assert str(e.value) == "; ".join(
        [
            "rank 1: node1-engine2 serves weight version '2' after loading '3'",
            "rank 1: after syncing version 3, node1-engine0 TP rank 1 serves version '3' with weight checksum abc "
            "over 10 tensors; the trainer's is def over 9",
            "rank 1: cannot verify weight version 3 on node1-engine1: HTTP 500",
        ]
    )
    with pytest.raises(StaleWeightsError, match="^rank 1: node1-engine2 serves weight version '2' after loading '3'$"):
        judge("3", [RankReport(checksums=[ok]), RankReport(stale={"node1-engine2": "2"})])
    a, b = "a" * 64, "b" * 64
    digests = [RankReport(digests=[EngineDigest(f"node{k}-engine0", 1, (a,))], rewrites=1) for k in range(2)]
    assert judge("3", digests) == Verdict(digests_compared=2, rewrites_checked=2)
    digests.append(RankReport(digests=[EngineDigest("node2-engine0", 1, (b,))]))
    with pytest.raises(WeightMismatchError, match="node2-engine0 holds a different TP-rank-0 shard"):
        judge("3", digests)
    # One engine: nothing to agree with, but every parameter it left as the reset made it is named.
    alone = RankReport(digests=[EngineDigest("node0-engine0", 1, (a,))], rewrites=1)
    assert judge("3", [alone]) == Verdict(digests_compared=0, rewrites_checked=1)
    alone.unwritten["node0-engine0"] = [
        f"model.layers.{k}.self_attn.fused_qkv_a_proj_with_mqa.weight" for k in range(9)
    ]
    with pytest.raises(WeightMismatchError) as e:
        judge("3", [alone])
    assert str(e.value).startswith(
        "rank 0: node0-engine0: 9 parameter(s) not written by the sync of version 3 (their hash is still the one "
        "/weights_checker reset_tensors left before it): model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"
    )
    assert str(e.value).endswith("and 1 more")


def test_an_engine_that_does_not_answer_fails_the_sync_unless_its_process_has_exited():
    ours = torch.full((4,), -2.0)
    bounds = ProbeBounds(1e-3, 1e-2)
    hung = RankReport(scores=[ProbeScore("node0-engine0", refused="it did not answer (no answer in time)")])
    with pytest.raises(WeightMismatchError, match="node0-engine0 could not score the probe of version 7: it did not"):
        judge("7", [RankReport(scores=hung.scores, trainer_logp=ours, bounds=bounds)])
    # The engine's process has exited (its leader says so): the restart path sends and verifies
    # the weights again; its other ranks' failed requests are not misses either.
    dead = RankReport(scores=[ProbeScore("node0-engine0")], trainer_logp=ours, bounds=bounds, dead=["node0-engine0"])
    peer = RankReport(unverified={"node0-engine0": "engine /model_info failed (transport): refused"})
    assert judge("7", [dead, peer]) == Verdict(digests_compared=0, dead=("node0-engine0",))
    with pytest.raises(WeightMismatchError, match="cannot verify weight version 7 on node0-engine0"):
        judge("7", [RankReport(trainer_logp=ours), peer])


def test_the_probe_is_judged_against_rank_0s_trainer_log_probs_where_a_rank_took_none():
    ours = torch.full((4,), -2.0)
    bounds = ProbeBounds(1e-3, 1e-2)
    scores = [ProbeScore("node0-engine0", [-2.0001] * 3 + [-2.0005])]
    right = RankReport(scores=scores, trainer_logp=ours, bounds=bounds)
    wrong = RankReport(
        scores=[ProbeScore("node1-engine0", [-2.5] * 4), ProbeScore("node1-engine1", refused="HTTP 400: no")],
        bounds=bounds,
    )
    verdict = judge("7", [right, RankReport(scores=[], bounds=bounds)])
    assert verdict.digests_compared == 0 and verdict.probe is not None
    assert verdict.probe.mean == pytest.approx(2e-4) and verdict.probe.worst == pytest.approx(5e-4)
    with pytest.raises(WeightMismatchError) as e:
        judge("7", [right, wrong])
    first, second = str(e.value).split("; rank ")
    assert first.startswith("rank 1: version 7: node1-engine0's log-probs of the probe sequence differ")
    assert second == "1: node1-engine1 could not score the probe of version 7: HTTP 400: no"
    # A stale engine's probe says nothing new: the verdict names the version only.
    wrong.stale["node1-engine0"] = "6"
    with pytest.raises(StaleWeightsError) as e:
        judge("7", [right, wrong])
    assert "probe" not in str(e.value)


@pytest.mark.parametrize(
    "verify,tokens,awake,inline,sessions,moment",
    [
        (False, 32, True, True, True, ProbeMoment.OFF),
        (True, 0, True, True, True, ProbeMoment.OFF),
        (True, 32, False, True, True, ProbeMoment.AWAKE),
        (True, 32, True, True, True, ProbeMoment.SESSION_END),
        (True, 32, True, True, False, ProbeMoment.PUSH),  # disk: no sessions
        (True, 32, True, False, True, ProbeMoment.PUSH),  # SGLang
    ],
)
def test_the_probe_runs_at_one_moment_decided_from_the_config_and_the_engines(
    verify, tokens, awake, inline, sessions, moment
):
    caps = EngineCapabilities(checksums=True, weights_checker=True, inline_sessions=inline)
    checks = Checks.decide(verify, tokens, caps, awake, sessions)
    assert checks == Checks(checksums=verify, weights_checker=verify, probe=moment)


def test_a_jump_in_the_engine_trainer_gap_is_a_warning_naming_the_rank_and_step(caplog):
    alarm = LogpGapAlarm(3.0, rank=1)
    with caplog.at_level(logging.WARNING, logger="rltrain.loop"):
        for step, gap in enumerate([0.02, 0.025, 0.018, 0.05, 0.03], start=1):
            alarm.observe(step, {"logp_diff_engine_trainer": gap})
        assert caplog.records == []  # within 3x the median of the steps before
        alarm.observe(6, {"logp_diff_engine_trainer": 0.2})
        alarm.observe(7, {})  # a rank without samples
        alarm.observe(8, {"logp_diff_engine_trainer": math.nan})
    first, second = (r.getMessage() for r in caplog.records)
    assert first.startswith("rank 1, step 6: the engine's log-probs of this step's rollout differ from the trainer's")
    assert "8.0x the median of the 5 steps before (0.025; sync.logp_gap_alarm=3)" in first
    assert second == "rank 1, step 8: the engine-vs-trainer log-prob gap is nan"
    # fp32 noise that triples is still noise (under the floor); 0 turns the alarm off.
    quiet = LogpGapAlarm(3.0, rank=0)
    off = LogpGapAlarm(0.0, rank=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rltrain.loop"):
        for step, gap in enumerate([1e-7, 1e-7, 1e-7, 5e-6, 1.0], start=1):
            quiet.observe(step, {"logp_diff_engine_trainer": min(gap, 5e-6)})
            off.observe(step, {"logp_diff_engine_trainer": gap})
    assert caplog.records == []
