"""A rank's rollout of each step, in the loop's order: the step's prompts drawn and sampled (every
sample with its own seed: the step's if rollout.seeded, else fresh ones), more batches of prompts
while DAPO's dynamic sampling wants them (dynamic_sampling.py); after an engine restart, the
failed groups once more; then the groups trained on: every sample from the current weights, and
with dynamic sampling this rank's share of the informative groups.

`collect` starts a step; `retry_failed` and `for_training` act on that step's prompts, sampling
parameters and number of batches, which `collect` keeps.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import threading
import time
from typing import Any

from rltrain.config import Config
from rltrain.generation import Completion, SamplingParams
from rltrain.interfaces import NodeEngine, RolloutClient, World
from rltrain.rollout import collect
from rltrain.rollout.collect import Rollout
from rltrain.rollout.data import Prompt, PromptSampler
from rltrain.rollout.dynamic_sampling import enough_informative, keep_informative_over_ranks
from rltrain.rollout.inflight import InFlightClient, UpdateGate
from rltrain.rollout.multiturn import MultiTurn
from rltrain.rollout.rewards import RewardRunner
from rltrain.weights.versions import StaleWeightsError


@dataclasses.dataclass
class Drawn:
    """A step's prompts for this rank and their sampling parameters, and how many batches of
    prompts dynamic sampling drew (what an engine restart retries and training keeps use)."""

    step: int
    prompts: list[Prompt]
    params: SamplingParams
    batches: int = 0


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
        self.turns = (
            MultiTurn.from_config(cfg.rollout, tokenizer, cfg.data.chat_template_kwargs)
            if cfg.rollout.multi_turn
            else None
        )

    def draw(self, step: int) -> Drawn:
        """Step `step`'s prompts for this rank and their sampling parameters (in the loop's order:
        a rollout ahead draws in the loop's thread, then samples on its own)."""
        cfg, world = self.cfg, self.world
        if cfg.rollout.seeded:
            seed = rollout_seed(cfg.run.seed, step, world.rank)
        else:  # spaced as the step's seeds are (rows add their place, far below the spacing)
            seed = self._fresh_seeds.randrange(1 << 40) * 1_000_000
        params = dataclasses.replace(self.run_params, sampling_seed=seed)
        return Drawn(step, self.sampler.next_batch(world.rank, world.world_size), params)

    def collect(self, client: RolloutClient, step: int) -> Rollout:
        """Step `step`'s prompts for this rank, sampled and scored (a collective with dynamic sampling)."""
        return self.sample(client, self.draw(step))

    def sample(self, client: RolloutClient, drawn: Drawn) -> Rollout:
        """`drawn`'s prompts sampled and scored; DAPO's dynamic sampling draws more while too few
        groups are informative (a collective)."""
        cfg, world = self.cfg, self.world
        rollout = collect.collect(client, drawn.prompts, drawn.params, self.tokenizer, self.rewards, turns=self.turns)
        drawn.batches = 1
        while (
            cfg.algo.dynamic_sampling
            and drawn.batches < cfg.algo.dynamic_sampling_max_batches
            and not enough_informative(world, rollout, cfg.data.prompts_per_step)
        ):
            more = self.sampler.next_batch(world.rank, world.world_size)
            fresh = collect.collect(
                client, more, drawn.params, self.tokenizer, self.rewards, len(drawn.prompts), self.turns
            )
            rollout = collect.extend(rollout, fresh)
            drawn.prompts, drawn.batches = drawn.prompts + more, drawn.batches + 1
        rollout.drawn = drawn
        return rollout

    def retry_failed(self, client: RolloutClient, rollout: Rollout, versions: list[str | None]) -> Rollout:
        """After an engine restart: the step's groups whose generation failed, or with a sample
        of a version the step may not train on (`versions`: a rollout ahead's request the
        restarted engine served before it was sent the weights), sampled once more with the
        seeds they had."""
        drawn = rollout.drawn
        assert isinstance(drawn, Drawn)
        allowed = set(versions)
        retried = collect.retry_failed(
            rollout,
            client,
            drawn.prompts,
            drawn.params,
            self.tokenizer,
            self.rewards,
            self.turns,
            served_by=None if None in allowed else lambda c: token_versions(c) <= allowed,
        )
        retried.stats["engine_restarts"] = 1.0
        retried.drawn = drawn
        return retried

    def for_training(self, rollout: Rollout, versions: list[str | None]) -> Rollout:
        """The groups this rank trains on, all sampled from the current weight version
        (`versions[0]`) or, with loop.max_staleness, one of the versions before it that it allows
        (`versions[1:]`, newest first) (a collective with dynamic sampling: the ranks agree on
        their shares of the informative groups)."""
        check_versions(rollout, versions, self.world.rank)
        if self.cfg.loop.max_staleness:
            rollout.stats.update(staleness(rollout, versions, self.cfg.loop.in_flight_update != "wait"))
        if self.cfg.algo.dynamic_sampling:
            assert isinstance(rollout.drawn, Drawn)
            rollout = keep_informative_over_ranks(self.cfg, self.world, rollout, rollout.drawn.batches)
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
    seen = {v for g in rollout.groups for s in g for v in token_versions(s.completion)}
    if seen - set(versions):
        within = f" or one of the {len(versions) - 1} before it ({versions[1:]})" if len(versions) > 1 else ""
        raise StaleWeightsError(
            f"rank {rank}: rollout produced by weight version(s) {sorted(map(str, seen))}, "
            f"expected {versions[0]}{within}; the engine did not load the published weights"
        )


def token_versions(c: Completion) -> set[str | None]:
    """The versions that sampled `c`'s tokens (one, unless a weight update cut it: inflight.py)."""
    return set(c.token_versions) if c.token_versions else {c.weight_version}


def staleness(rollout: Rollout, versions: list[str | None], per_token: bool = False) -> dict[str, float]:
    """How many versions behind the trained weights (`versions[0]`; the ones before it follow)
    each sample's weights were: the count of samples at each lag (`stale_samples_<k>`, a sample
    continued over a weight update at its oldest token's), and where `per_token` (weight updates
    under rollouts in flight: a sample may mix versions) of the sampled tokens (`stale_tokens_<k>`)."""
    if not versions or versions[0] is None:
        return {}
    lags: dict[str, float] = {}
    for g in rollout.groups:
        for s in g:
            v = s.completion.weight_version
            if v in versions:
                key = f"stale_samples_{versions.index(v)}"
                lags[key] = lags.get(key, 0.0) + 1.0
            if per_token:
                each = s.completion.token_versions or [v] * len(s.completion.output_ids)
                mask = s.completion.loss_mask or [1] * len(each)
                for tv, m in zip(each, mask):
                    if m and tv in versions:
                        key = f"stale_tokens_{versions.index(tv)}"
                        lags[key] = lags.get(key, 0.0) + 1.0
    return lags


class RolloutAhead:
    """The rollouts of the next steps generated in threads while this step trains
    (`loop.max_staleness=k`: steps t+1..t+k, each started once the step k before it has taken
    its batch, from the weights then served).

        ahead.start(client, step)      after step t's batch is taken: draw step t+k, sample it on a thread
        ahead.wait()                   before the sync (loop.in_flight_update=wait): the engines
                                       idle while weights change
        ahead.pause(engine) / ahead.resume(engine)
                                       around the sync otherwise: the engines cut the rows in
                                       flight, which go on once updated (inflight.py)
        rollout = ahead.take(step)     at step t+1: its rollout (None if none was started)
        ahead.sampler_state()          what a checkpoint keeps: the state before the first draw
                                       ahead, so a resumed run draws those prompts again

    The threads use only the engine client, the reward runner and the drawn prompts, none of
    which the training step touches (the draw is made in the loop's thread, in step order); a
    thread's failure is raised by `take` (or `wait`) in the loop's thread."""

    def __init__(self, rollouts: StepRollout, in_flight_update: str = "wait", timeout_s: float = 1800.0):
        self.rollouts = rollouts
        self.mode = in_flight_update
        self.gate = UpdateGate(timeout_s)
        self._ahead: collections.deque[_Ahead] = collections.deque()
        self.seconds = 0.0  # the last rollout taken's own duration (overlapped with training)

    @property
    def steps(self) -> list[int]:
        """The steps whose rollouts are ahead, oldest first."""
        return [a.drawn.step for a in self._ahead]

    def start(self, client: RolloutClient, step: int) -> None:
        before = self.rollouts.sampler.state_dict()
        drawn = self.rollouts.draw(step)
        through: RolloutClient | InFlightClient = client
        if self.mode != "wait":
            through = InFlightClient(client, self.gate, "continue" if self.mode == "continue" else "requeue")
        job = _Ahead(drawn, before, through)

        def run() -> None:
            t0 = time.perf_counter()
            try:
                job.result = self.rollouts.sample(through, drawn)
                if isinstance(through, InFlightClient) and through.stats.cut:
                    job.result.stats.update(
                        in_flight_cut=float(through.stats.cut),
                        in_flight_continued=float(through.stats.continued),
                        in_flight_requeued=float(through.stats.requeued),
                    )
            except BaseException as e:  # noqa: BLE001 - raised in the loop's thread by take/wait
                job.error = e
            job.seconds = time.perf_counter() - t0

        job.thread = threading.Thread(target=run, name=f"rollout-ahead-{step + 1}", daemon=True)
        self._ahead.append(job)
        job.thread.start()

    def wait(self) -> None:
        """Every rollout ahead finished (its failure raised)."""
        for job in list(self._ahead):
            job.join()

    def pause(self, engine: NodeEngine) -> None:
        """Before a weight update with rollouts still in flight: the rows in flight are cut (their
        requests answered), new ones held (a collective: every engine)."""
        self.gate.close()
        engine.pause_generation()

    def resume(self, engine: NodeEngine) -> None:
        """After the update: the engines serve again and the cut rows go on (or start again)."""
        engine.continue_generation()
        self.gate.open()

    def take(self, step: int) -> Rollout | None:
        """Step `step`'s rollout, sampled ahead; None where none was (then the loop samples it)."""
        if not self._ahead:
            return None
        job = self._ahead[0]
        assert job.drawn.step == step, f"the rollout ahead is step {job.drawn.step}'s, not {step}'s"
        job.join()
        self._ahead.popleft()
        self.seconds = job.seconds
        return job.result

    def discard(self) -> None:
        """Drop the rollouts ahead that will not be trained (the run stops): their prompts go back."""
        if not self._ahead:
            return
        self.gate.open()  # (a stop between a pause and its resume: nothing may wait on it)
        for job in self._ahead:
            with contextlib.suppress(BaseException):
                job.join()
        self.rollouts.sampler.load_state_dict(self._ahead[0].before)
        self._ahead.clear()

    def sampler_state(self) -> dict[str, int]:
        return dict(self._ahead[0].before) if self._ahead else self.rollouts.sampler.state_dict()


@dataclasses.dataclass
class _Ahead:
    """One rollout ahead: what was drawn, the sampler before the draw, its thread and outcome."""

    drawn: Drawn
    before: dict[str, int]
    client: RolloutClient
    thread: threading.Thread | None = None
    result: Rollout | None = None
    error: BaseException | None = None
    seconds: float = 0.0

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
