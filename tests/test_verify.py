"""The post-sync checks (rltrain/sync/verify.py) as pure functions: what they flag and name."""

from __future__ import annotations

import math

import torch

from rltrain.sync.verify import EngineDigest, disagreements, probe_batch, probe_error, probe_tokens, probe_tolerance


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
