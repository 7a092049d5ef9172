"""A rank's rollout of each step, in the loop's order: the step's prompts drawn and sampled (every
sample with its own seed: the step's if rollout.seeded, else fresh ones), more batches of prompts
while DAPO's dynamic sampling wants them (dynamic_sampling.py); after an engine restart, the
failed groups once more; then the groups trained on: every sample from the current weights, and
with dynamic sampling this rank's share of the informative groups.

`collect` starts a step; `retry_failed` and `for_training` act on that step's prompts, sampling
parameters and number of batches, which `collect` keeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time
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

    def for_training(self, rollout: Rollout, versions: list[str | None]) -> Rollout:
        """The groups this rank trains on, all sampled from the current weight version
        (`versions[0]`) or, with loop.max_staleness, one of the versions before it that it allows
        (`versions[1:]`, newest first) (a collective with dynamic sampling: the ranks agree on
        their shares of the informative groups)."""
        check_versions(rollout, versions, self.world.rank)
        if self.cfg.loop.max_staleness:
            rollout.stats.update(staleness(rollout, versions))
        if self.cfg.algo.dynamic_sampling:
            rollout = keep_informative_over_ranks(self.cfg, self.world, rollout, self._batches)
        return rollout


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of a rank's requests at a step: spaced so no two samples share a stream."""
    return (seed * 1_000_003 + step * 1_009 + rank) * 1_000_000


def check_versions(rollout: Rollout, versions: list[str | None], rank: int) -> None:
    """Never train on samples from stale weights: every completion must carry the current version
    (`versions[0]`), or with loop.max_staleness k one of the k before it (`versions[1:]`, newest
    first)."""
    if not versions or versions[0] is None:
        return
    seen = {s.completion.weight_version for g in rollout.groups for s in g}
    if seen - set(versions):
        within = f" or one of the {len(versions) - 1} before it ({versions[1:]})" if len(versions) > 1 else ""
        raise StaleWeightsError(
            f"rank {rank}: rollout produced by weight version(s) {sorted(map(str, seen))}, "
            f"expected {versions[0]}{within}; the engine did not load the published weights"
        )


def staleness(rollout: Rollout, versions: list[str | None]) -> dict[str, float]:
    """How many versions behind the trained weights (`versions[0]`; the ones before it follow)
    each sample's weights were: the count of samples at each lag (`stale_samples_<k>`)."""
    if not versions or versions[0] is None:
        return {}
    lags: dict[str, float] = {}
    for g in rollout.groups:
        for s in g:
            v = s.completion.weight_version
            if v in versions:
                key = f"stale_samples_{versions.index(v)}"
                lags[key] = lags.get(key, 0.0) + 1.0
    return lags


class RolloutAhead:
    """Step t+1's rollout generated in a thread while step t trains (`loop.max_staleness=1`).

        ahead.start(client, step)      after step t's batch is taken: draw and sample step t+1
        ahead.wait()                   before the sync: the engines idle while weights change
        rollout = ahead.take(step)     at step t+1: its rollout (None if none was started)
        ahead.sampler_state()          what a checkpoint keeps: the state before the draw ahead,
                                       so a resumed run draws those prompts again

    The thread uses only the engine client, the reward runner and the sampler, none of which
    the training step touches; its failure is raised by `take` (or `wait`) in the loop's thread."""

    def __init__(self, rollouts: StepRollout):
        self.rollouts = rollouts
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._before: dict[str, int] | None = None
        self._result: Rollout | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0  # the last rollout ahead's own duration (overlapped with training)

    def start(self, client: RolloutClient, step: int) -> None:
        assert self._thread is None, "one rollout ahead at a time"
        self._step, self._before = step, self.rollouts.sampler.state_dict()
        self._result = self._error = None

        def run() -> None:
            t0 = time.perf_counter()
            try:
                self._result = self.rollouts.collect(client, step)
            except BaseException as e:  # noqa: BLE001 - raised in the loop's thread by take/wait
                self._error = e
            self.seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name=f"rollout-ahead-{step + 1}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            if self._error is not None:
                error, self._error = self._error, None
                self._thread = None
                raise error

    def take(self, step: int) -> Rollout | None:
        """Step `step`'s rollout, sampled ahead; None where none was (then the loop samples it)."""
        if self._thread is None:
            return None
        self.wait()
        assert self._step == step, f"the rollout ahead is step {self._step}'s, not {step}'s"
        rollout, self._thread, self._before = self._result, None, None
        return rollout

    def discard(self) -> None:
        """Drop a rollout ahead that will not be trained (the run stops): its prompts go back."""
        if self._thread is not None:
            with contextlib.suppress(BaseException):
                self.wait()
            assert self._before is not None
            self.rollouts.sampler.load_state_dict(self._before)
            self._thread = self._before = self._result = None

    def sampler_state(self) -> dict[str, int]:
        return dict(self._before) if self._before is not None else self.rollouts.sampler.state_dict()
