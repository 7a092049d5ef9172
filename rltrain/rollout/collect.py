"""Collect scored samples from the engine and lay them out as a train batch.

Honest accounting: a generation the engine failed, or a reward that failed, is never turned into
a sample. A group (the n samples of one prompt) with any failed member is dropped whole, because
group-relative advantages need the whole group; both counts go to the metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrain.engine.protocol import Completion, SamplingParams
from rltrain.rollout.data import Prompt
from rltrain.rollout.rewards import RewardRunner
from rltrain.trainer.native import TrainBatch

log = logging.getLogger("rltrain.rollout")


@dataclass
class Sample:
    prompt: Prompt
    completion: Completion
    text: str = ""
    reward: float | None = None
    error: str | None = None


@dataclass
class Rollout:
    groups: list[list[Sample]]
    stats: dict[str, float] = field(default_factory=dict)


def collect(client: Any, prompts: list[Prompt], params: SamplingParams, tokenizer: Any, rewards: RewardRunner) -> Rollout:
    completions = client.generate([p.input_ids for p in prompts], params)
    samples = [Sample(prompts[c.prompt_index], c) for c in completions]
    gen_failed = 0
    to_score = []
    for s in samples:
        if not s.completion.ok:
            s.error = s.completion.error or f"finish reason {s.completion.finish_reason!r}"
            gen_failed += 1
            continue
        s.text = tokenizer.decode(s.completion.output_ids, skip_special_tokens=True)
        to_score.append(s)
    for s, scored in zip(to_score, rewards.score([(s.text, s.prompt.record) for s in to_score])):
        s.reward, s.error = scored.reward, scored.error
    reward_failed = sum(1 for s in to_score if s.error is not None)
    groups = [samples[i : i + params.n] for i in range(0, len(samples), params.n)]
    kept = [g for g in groups if all(s.error is None for s in g)]
    ok = [s for g in kept for s in g]
    if gen_failed or reward_failed:
        first = next(s.error for s in samples if s.error is not None)
        log.warning("%d generations and %d rewards failed (%d of %d groups dropped); first error: %s",
                    gen_failed, reward_failed, len(groups) - len(kept), len(groups), first)
    stats = {
        "samples": float(len(samples)),
        "generation_failed": float(gen_failed),
        "reward_failed": float(reward_failed),
        "groups_dropped": float(len(groups) - len(kept)),
        "response_tokens": float(sum(len(s.completion.output_ids) for s in ok)),
    }
    return Rollout(kept, stats)


def build_batch(groups: list[list[Sample]], pad_id: int) -> tuple[TrainBatch, torch.Tensor]:
    """Right-padded [B, L] batch of prompt+response, and rewards [G, n]."""
    flat = [s for g in groups for s in g]
    seqs = [s.prompt.input_ids + s.completion.output_ids for s in flat]
    L = max((len(x) for x in seqs), default=1)
    B = len(flat)
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    loss_mask = torch.zeros(B, L, dtype=torch.float32)
    rollout_logp = torch.zeros(B, L, dtype=torch.float32)
    for b, (s, seq) in enumerate(zip(flat, seqs)):
        P, R = len(s.prompt.input_ids), len(s.completion.output_ids)
        tokens[b, : P + R] = torch.tensor(seq)
        attn[b, : P + R] = 1
        loss_mask[b, P : P + R] = 1.0
        if s.completion.logprobs:
            rollout_logp[b, P : P + R] = torch.tensor(s.completion.logprobs)
    n = len(groups[0]) if groups else 0
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32).reshape(len(groups), n)
    return TrainBatch(tokens, attn, loss_mask, rollout_logp=rollout_logp), rewards
