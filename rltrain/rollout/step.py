"""A rank's rollout of each step, in the loop's order: the step's prompts drawn and sampled (every
sample with its own seed: the step's if rollout.seeded, else fresh ones), more batches of prompts
while DAPO's dynamic sampling wants them (dynamic_sampling.py); after an engine restart, the
failed groups once more; then the groups trained on: every sample from the current weights, and
with dynamic sampling this rank's share of the informative groups.

`collect` starts a step; `retry_failed` and `for_training` act on that step's prompts, sampling
parameters and number of batches, which `collect` keeps.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from rltrain.config import Config
from rltrain.generation import SamplingParams
from rltrain.interfaces import RolloutClient, World
from rltrain.rollout import collect
from rltrain.rollout.collect import Rollout
from rltrain.rollout.data import Prompt, PromptSampler
from rltrain.rollout.dynamic_sampling import enough_informative, keep_informative_over_ranks
from rltrain.rollout.multiturn import MultiTurn
from rltrain.rollout.rewards import RewardRunner
from rltrain.weights.versions import StaleWeightsError


class StepRollout:
    """This rank's rollout, step by step, through the engine client it is given at each call (an
    engine restart gives the rank a new one)."""

    def __init__(self, cfg: Config, world: World, sampler: PromptSampler, tokenizer: Any, rewards: RewardRunner):
        self.cfg, self.world, self.sampler, self.tokenizer, self.rewards = cfg, world, sampler, tokenizer, rewards
        self.run_params = SamplingParams(
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            n=cfg.rollout.n,
            stop_token_ids=list(cfg.rollout.stop_token_ids) or None,
        )
        # rollout.seeded=false still seeds every sample, from this rank's own generator: SGLang's
        # deterministic sampler gives a row without a seed the seed 42, which makes the n samples of
        # a prompt one sample n times. A new run draws what the last drew; a resumed one does not.
        self._fresh_seeds = random.Random(f"rltrain/rollout/{cfg.run.seed}/{world.rank}")
        # Multi-turn trajectories (rollout.env or rollout.tools), else one response per sample.
        self.turns = MultiTurn.from_config(cfg.rollout, tokenizer) if cfg.rollout.multi_turn else None
        # The step's, set by `collect`.
        self._prompts: list[Prompt] = []
        self._params = self.run_params
        self._batches = 0

    def collect(self, client: RolloutClient, step: int) -> Rollout:
        """Step `step`'s prompts for this rank, sampled and scored (a collective with dynamic sampling)."""
        cfg, world = self.cfg, self.world
        if cfg.rollout.seeded:
            seed = rollout_seed(cfg.run.seed, step, world.rank)
        else:  # spaced as the step's seeds are (rows add their place, far below the spacing)
            seed = self._fresh_seeds.randrange(1 << 40) * 1_000_000
        self._params = dataclasses.replace(self.run_params, sampling_seed=seed)
        self._prompts = self.sampler.next_batch(world.rank, world.world_size)
        rollout = collect.collect(client, self._prompts, self._params, self.tokenizer, self.rewards, turns=self.turns)
        self._batches = 1
        # DAPO's dynamic sampling: more prompts while too few groups are informative.
        while (
            cfg.algo.dynamic_sampling
            and self._batches < cfg.algo.dynamic_sampling_max_batches
            and not enough_informative(world, rollout, cfg.data.prompts_per_step)
        ):
            more = self.sampler.next_batch(world.rank, world.world_size)
            fresh = collect.collect(
                client, more, self._params, self.tokenizer, self.rewards, len(self._prompts), self.turns
            )
            rollout = collect.extend(rollout, fresh)
            self._prompts, self._batches = self._prompts + more, self._batches + 1
        return rollout

    def retry_failed(self, client: RolloutClient, rollout: Rollout) -> Rollout:
        """After an engine restart: the step's groups whose generation failed, sampled once more
        with the seeds they had."""
        rollout = collect.retry_failed(
            rollout, client, self._prompts, self._params, self.tokenizer, self.rewards, self.turns
        )
        rollout.stats["engine_restarts"] = 1.0
        return rollout

    def for_training(self, rollout: Rollout, version: str | None) -> Rollout:
        """The groups this rank trains on, all sampled from weight version `version` (a collective
        with dynamic sampling: the ranks agree on their shares of the informative groups)."""
        check_versions(rollout, version, self.world.rank)
        if self.cfg.algo.dynamic_sampling:
            rollout = keep_informative_over_ranks(self.cfg, self.world, rollout, self._batches)
        return rollout


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of a rank's requests at a step: spaced so no two samples share a stream."""
    return (seed * 1_000_003 + step * 1_009 + rank) * 1_000_000


def check_versions(rollout: Rollout, expected: str | None, rank: int) -> None:
    """Never train on samples from stale weights: every completion must carry the current version."""
    if expected is None:
        return
    seen = {s.completion.weight_version for g in rollout.groups for s in g}
    if seen - {expected}:
        raise StaleWeightsError(
            f"rank {rank}: rollout produced by weight version(s) {sorted(map(str, seen))}, "
            f"expected {expected}; the engine did not load the published weights"
        )
