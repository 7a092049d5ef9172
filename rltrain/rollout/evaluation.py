"""Evaluation during training: held-out prompts sampled on the engines as a phase of its own.

    evaluator = Evaluator(cfg, world, prompts, tokenizer, rewards, start_step)
    if evaluator.due(done):                       # done: the steps trained so far
        row = evaluator.run(client, done, version)  # rank 0: the row; other ranks: None

`eval.path` (the formats of `data.path`, the same `data.fields`), its first `eval.max_prompts`
prompts (0: all), each sampled `eval.n` times with its own sampling parameters (greedy by
default), before step 1 (`eval.before_train`) and after every `eval.every`-th step, on the
weights that step synced: no training, no sync. The prompts are shared over the ranks as
training prompts are (rank r takes every world_size-th) and scored by the run's reward; the
ranks' results are gathered on rank 0:

- `eval/reward_mean`, `eval/response_length`: over the samples generated and scored;
- `eval/pass@k` for k = 1, 2, 4, ... up to n (and n): the unbiased estimator of Chen et al.
  (2021), 1 - C(n - c, k) / C(n, k) for a prompt with c of its n samples passing
  (`reward.pass_threshold`), averaged over the prompts whose every sample was scored;
- `eval/generation_failed`, `eval/reward_failed`: samples lost, counted, never scored 0;
  `eval/prompts_scored` of `eval/prompts`.

Each row goes to `eval.jsonl` in the run directory (its `step` is the weight version judged)
and to TensorBoard and W&B. Sampling is seeded by (run.seed, the step, the rank): a run resumed
from a checkpoint evaluates again where it resumes and repeats the same results; the rows of
steps it runs again are moved to `eval.dropped.jsonl` first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from typing import Any

from rltrain.config import Config
from rltrain.generation import SamplingParams
from rltrain.interfaces import RolloutClient, World
from rltrain.rollout import collect
from rltrain.rollout.data import Prompt
from rltrain.rollout.multiturn import MultiTurn
from rltrain.rollout.rewards import RewardRunner
from rltrain.runtime.files import append_line, set_rows_aside

log = logging.getLogger("rltrain.eval")

DROPPED = "eval.dropped.jsonl"


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with `c` of `n` samples passing (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), as a product (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@{k} of {c} passing in {n} samples")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_of(n: int) -> list[int]:
    """The k reported for n samples a prompt: 1, 2, 4, ... below n, and n."""
    return sorted({*(1 << i for i in range(n.bit_length()) if 1 << i < n), n})


def eval_seed(seed: int, step: int, rank: int) -> int:
    """The sampling seed of a rank's evaluation at `step`: apart from every rollout's
    (rollout_seed's spacing, in another range)."""
    return ((seed * 1_000_003 + step * 1_009 + rank) * 1_000_000) ^ (1 << 62)


class Evaluator:
    """This rank's share of the evaluation prompts and how they are sampled (module doc)."""

    def __init__(
        self,
        cfg: Config,
        world: World,
        prompts: list[Prompt],
        tokenizer: Any,
        rewards: RewardRunner,
        start_step: int,
    ):
        e = cfg.eval
        self.cfg, self.world, self.tokenizer, self.rewards = cfg, world, tokenizer, rewards
        self.prompts = prompts[: e.max_prompts] if e.max_prompts else prompts
        self.mine = self.prompts[world.rank :: world.world_size]
        self.params = SamplingParams(
            max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
            temperature=e.temperature,
            top_p=e.top_p,
            n=e.n,
            stop_token_ids=list(cfg.rollout.stop_token_ids) or None,
        )
        self.turns = (
            MultiTurn.from_config(cfg.rollout, tokenizer, cfg.data.chat_template_kwargs)
            if cfg.rollout.multi_turn
            else None
        )
        self.path = cfg.run_dir / "eval.jsonl"
        if world.rank == 0:
            # A resumed run evaluates again from where it resumes: the rows of the steps from there
            # on move to eval.dropped.jsonl (kept, not lost).
            set_rows_aside(self.path, self.path.with_name(DROPPED), lambda step: step < start_step)

    def due(self, done: int) -> bool:
        """Whether the weights after `done` steps are evaluated."""
        e = self.cfg.eval
        return (done == 0 and e.before_train) or (done > 0 and e.every > 0 and done % e.every == 0)

    def run(self, client: RolloutClient, done: int, version: str | None) -> dict[str, Any] | None:
        """Sample and score this rank's prompts; every rank's results gathered: rank 0 gets the
        row (written to eval.jsonl), the others None."""
        t0 = time.perf_counter()
        params = dataclasses.replace(self.params, sampling_seed=eval_seed(self.cfg.run.seed, done, self.world.rank))
        local: list[dict[str, Any]] = []
        if self.mine:
            rollout = collect.collect(client, self.mine, params, self.tokenizer, self.rewards, turns=self.turns)
            thr = self.cfg.reward.pass_threshold
            for group in rollout.every_group:
                scored = [s for s in group if s.reward is not None]
                local.append(
                    {
                        "samples": len(group),
                        "scored": len(scored),
                        "passed": sum(s.reward >= thr for s in scored if s.reward is not None),
                        "reward_sum": sum(s.reward for s in scored if s.reward is not None),
                        "length_sum": sum(len(s.completion.output_ids) for s in scored),
                        "generation_failed": sum(not s.completion.ok for s in group),
                        "reward_failed": sum(s.completion.ok and s.reward is None for s in group),
                    }
                )
        gathered = self.world.bridge.all_gather_object(
            {"prompts": local, "seconds": time.perf_counter() - t0}, phase="eval"
        )
        if self.world.rank != 0:
            return None
        figures = summarize([p for g in gathered for p in g["prompts"]], self.params.n)
        row: dict[str, Any] = {"step": done, "weight_version": version, **figures}
        row["eval/seconds"] = max(g["seconds"] for g in gathered)
        append_line(self.path, json.dumps(row))
        log.info(
            "eval after step %d (weights %s): reward %.3f, pass@1 %.3f over %d prompts x %d, %.1f s",
            done,
            version,
            row["eval/reward_mean"],
            row["eval/pass@1"],
            row["eval/prompts"],
            self.params.n,
            row["eval/seconds"],
        )
        return row


def summarize(prompts: list[dict[str, Any]], n: int) -> dict[str, float]:
    """The eval row's figures from each prompt's counts (module doc)."""
    scored = sum(p["scored"] for p in prompts)
    whole = [p for p in prompts if p["scored"] == p["samples"] == n]
    row: dict[str, float] = {
        "eval/prompts": float(len(prompts)),
        "eval/prompts_scored": float(len(whole)),
        "eval/samples": float(sum(p["samples"] for p in prompts)),
        "eval/reward_mean": sum(p["reward_sum"] for p in prompts) / max(scored, 1),
        "eval/response_length": sum(p["length_sum"] for p in prompts) / max(scored, 1),
        "eval/generation_failed": float(sum(p["generation_failed"] for p in prompts)),
        "eval/reward_failed": float(sum(p["reward_failed"] for p in prompts)),
    }
    for k in ks_of(n):
        row[f"eval/pass@{k}"] = sum(pass_at_k(n, p["passed"], k) for p in whole) / max(len(whole), 1)
    return row
