"""The post-sync checks and the verdict (rltrain/sync/verify.py) as pure functions: what they flag and name."""

from __future__ import annotations

import math

import pytest
import torch

from rltrain.engine.client import EngineCapabilities
from rltrain.sync.verify import (
    Checks,
    ChecksumCheck,
    EngineDigest,
    ProbeMoment,
    ProbeScore,
    RankReport,
    Verdict,
    disagreements,
    judge,
    probe_batch,
    probe_error,
    probe_tokens,
    probe_tolerance,
)
from rltrain.weights.checksum import WeightMismatchError
from rltrain.weights.versions import StaleWeightsError


def test_engines_that_hold_the_same_shard_must_agree_and_the_odd_one_is_named():
    a, b = "a" * 64, "b" * 64
    same = [EngineDigest(f"node{k}-engine0", 2, (a, b)) for k in range(3)]
    assert disagreements(same) == []
    odd = [*same[:2], EngineDigest("node2-engine0", 2, (a, "c" * 64))]
    (error,) = disagreements(odd)
    assert error.startswith("node2-engine0 holds a different TP-rank-1 shard") and "2 of the 3 engines" in error
    # Engines of another TP size, or another EP shard, hold other bytes: never compared.
    mixed = [*same, EngineDigest("node3-engine0", 1, ("d" * 64,)), EngineDigest("n4", 2, (a, "e" * 64), shard="ep1/2")]
    assert disagreements(mixed) == []


def test_probe_flags_other_weights_and_non_finite_scores_within_a_precision_tolerance():
    tokens = probe_tokens(1000, 16)
    assert tokens == probe_tokens(1000, 16) and len(set(tokens)) > 8 and max(tokens) < 1000
    batch = probe_batch(tokens)
    assert batch.tokens.shape == (1, 16) and batch.loss_mask[0, 0] == 0 and batch.loss_mask[0, 1:].all()
    ours = torch.full((15,), -3.0)
    assert probe_error("e", [-3.0004] * 15, ours, 1e-3) is None
    assert "differ from the trainer's by 0.5" in probe_error("node0-engine1", [-3.5] * 15, ours, 1e-3)
    assert "non-finite" in probe_error("e", [math.nan] * 15, ours, 1e-3)
    assert "scored 14 probe tokens" in probe_error("e", [-3.0] * 14, ours, 1e-3)
    assert probe_tolerance(0.0, torch.float32, torch.float32) == 1e-3
    assert probe_tolerance(0.0, torch.bfloat16, torch.float32) == 0.1
    assert probe_tolerance(0.25, torch.float32, torch.float32) == 0.25


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
    digests = [RankReport(digests=[EngineDigest(f"node{k}-engine0", 1, (a,))]) for k in range(2)]
    assert judge("3", digests) == Verdict(digests=2, probe_diff=None)
    digests.append(RankReport(digests=[EngineDigest("node2-engine0", 1, (b,))]))
    with pytest.raises(WeightMismatchError, match="node2-engine0 holds a different TP-rank-0 shard"):
        judge("3", digests)


def test_the_probe_is_judged_against_rank_0s_trainer_log_probs_where_a_rank_took_none():
    ours = torch.full((4,), -2.0)
    scores = [ProbeScore("node0-engine0", [-2.0001] * 4), ProbeScore("gone")]  # (gone: not judged)
    right = RankReport(scores=scores, trainer_logp=ours, tolerance=1e-3)
    wrong = RankReport(
        scores=[ProbeScore("node1-engine0", [-2.5] * 4), ProbeScore("node1-engine1", refused="HTTP 400: no")],
        tolerance=1e-3,
    )
    verdict = judge("7", [right, RankReport(scores=[], tolerance=1e-3)])
    assert verdict.digests == 0 and verdict.probe_diff == pytest.approx(1e-4)
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
    assert checks == Checks(checksums=verify, digests=verify, probe=moment)
