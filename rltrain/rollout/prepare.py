"""A rank's kept groups as its train step's batch: the trainer's old and reference log-probs,
the rewards (with DAPO's overlong penalty), the advantages (with the KL in the reward, if asked),
DAPO's overlong filter, and how far the engine's log-probs are from the trainer's (with the
alarm on that gap: `LogpGapAlarm`).

Collectives: the trainer's log-prob forwards and REINFORCE++'s sum of moments over the data ranks
run on every rank in the same order, a rank without samples included (it brings an empty batch):
a rank that skipped one would leave the others waiting in it.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable

import torch

from rltrain.algo.advantages import compute_advantages, overlong_penalty, return_moments
from rltrain.algo.losses import kl_penalty
from rltrain.batch import TrainBatch
from rltrain.config import Config
from rltrain.interfaces import Trainer
from rltrain.rollout.collect import Rollout, build_batch

log = logging.getLogger("rltrain.loop")


def prepare_batch(
    cfg: Config, trainer: Trainer, rollout: Rollout
) -> tuple[TrainBatch, torch.Tensor | None, dict[str, float]]:
    """The train batch of this rank's kept groups (empty if none), their rewards [G, n] as
    trained on, and the preparation's metrics."""
    batch, rewards = build_batch(rollout.groups, trainer.pad_id)
    fused = cfg.algo.old_logp_from_training  # then the training forward's, detached (rl_update.micro_loss)
    if not fused:
        batch.old_logp, _ = trainer.logprobs(batch)  # collectives: also on a rank without samples
    if cfg.algo.kl_coef > 0:
        batch.ref_logp, _ = trainer.logprobs(batch, reference=True)
    algo = cfg.algo
    # REINFORCE++ normalises over the whole batch: its moments are summed over the data ranks.
    global_sum = _data_parallel_sum(trainer) if algo.advantage.startswith("reinforce_plus_plus") else None
    if len(batch) == 0 or rewards is None:
        if global_sum is not None:
            return_moments(torch.zeros(0), global_sum)  # the collective the other ranks run
        return batch, rewards, {}
    stats: dict[str, float] = {}
    samples = [s for g in rollout.groups for s in g]
    if algo.overlong_buffer:
        lengths = torch.tensor([len(s.completion.output_ids) for s in samples])
        penalty = overlong_penalty(lengths, cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
        rewards = rewards + penalty.reshape(rewards.shape)
        stats["overlong_penalty"] = float(penalty.mean())
    token_kl = None
    if algo.kl_coef > 0:
        assert batch.ref_logp is not None and batch.old_logp is not None
        token_kl = kl_penalty(batch.old_logp, batch.ref_logp, algo.kl_estimator) * batch.loss_mask
    in_reward = algo.kl_in == "reward" and algo.kl_coef > 0
    batch.advantages = compute_advantages(
        algo.advantage,
        rewards,
        batch.loss_mask,
        norm_std=algo.norm_std,
        token_kl=token_kl if in_reward else None,
        kl_coef=algo.kl_coef if in_reward else 0.0,
        gamma=algo.gamma,
        global_sum=global_sum,
    )
    if algo.overlong_filter:  # DAPO: a response cut at the limit is kept out of the loss
        cut = torch.tensor([s.completion.finish_reason == "length" for s in samples])
        batch.loss_mask[cut] = 0.0
        batch.advantages = batch.advantages * batch.loss_mask
        stats["overlong_filtered"] = float(cut.sum())
    if fused:  # the distance to the engine's log-probs is measured in the training forward
        return batch, rewards, stats
    # How far the engine's log-probs are from the trainer's for the same tokens and weights.
    mask = batch.loss_mask.bool()
    assert batch.rollout_logp is not None and batch.old_logp is not None
    diff = float((batch.old_logp - batch.rollout_logp)[mask].abs().mean())
    if not cfg.algo.corrects_rollout:
        batch.rollout_logp = None
    return batch, rewards, {"logp_diff_engine_trainer": diff, **stats}


def _data_parallel_sum(trainer: Trainer) -> Callable[[torch.Tensor], torch.Tensor]:
    """A sum over the trainer's data-parallel ranks (the ranks that hold different samples)."""

    def total(t: torch.Tensor) -> torch.Tensor:
        if not torch.distributed.is_initialized():
            return t
        on = t.to(trainer.device)
        torch.distributed.all_reduce(on, group=trainer.data_group())
        return on.cpu()

    return total


class LogpGapAlarm:
    """A warning when a rank's engine-vs-trainer log-prob gap (`logp_diff_engine_trainer`: the
    engine's log-probs of the step's rollout against the trainer's old log-probs of the same
    tokens and weights) jumps past `factor` times the median of its earlier steps (and `FLOOR`).
    The sync's verification proves the engine holds the trainer's weights and scores the probe
    as the trainer does; a gap that jumps later says the rollout was sampled from something else
    all the same (a kernel that changed, a cache, a weight the checks cannot see). A warning,
    not an error: a gap drifts as the policy sharpens. `factor` 0: off (`sync.logp_gap_alarm`)."""

    FLOOR = 1e-4  # nats: below it a jump is float noise, in any precision
    HISTORY = 3  # steps of history before the first judgement

    def __init__(self, factor: float, rank: int):
        self.factor, self.rank = factor, rank
        self.gaps: list[float] = []

    def observe(self, step: int, stats: dict[str, float]) -> None:
        """Step `step`'s gap from its statistics (the preparation's, or the training forward's)."""
        gap = stats.get("logp_diff_engine_trainer")
        if gap is None or not self.factor:
            return
        if not math.isfinite(gap):
            log.warning("rank %d, step %d: the engine-vs-trainer log-prob gap is %s", self.rank, step, gap)
            return
        if len(self.gaps) >= self.HISTORY:
            median = statistics.median(self.gaps)
            if gap > max(self.factor * median, self.FLOOR):
                log.warning(
                    "rank %d, step %d: the engine's log-probs of this step's rollout differ from the trainer's by "
                    "%.4g per token, %.1fx the median of the %d steps before (%.4g; sync.logp_gap_alarm=%g): the "
                    "rollout may not have been sampled with the trainer's weights although the sync was verified",
                    self.rank,
                    step,
                    gap,
                    gap / median if median else math.inf,
                    len(self.gaps),
                    median,
                    self.factor,
                )
        self.gaps.append(gap)
