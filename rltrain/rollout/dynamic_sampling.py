"""DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): a group whose rewards are all equal has zero
advantage everywhere and teaches nothing, so a step samples more prompts while the ranks together
hold fewer than data.prompts_per_step informative groups (at most algo.dynamic_sampling_max_batches
batches of prompts), then each rank keeps its share of them: the target over all ranks.

The counts are gathered over the bridge (the NCCL world is down during the rollout). Every rank
decides on the same gathered counts, so all of them run the same number of gathers.
"""

from __future__ import annotations

import logging

from rltrain.config import Config
from rltrain.interfaces import World
from rltrain.rollout.collect import Rollout, informative

log = logging.getLogger("rltrain.rollout")


def enough_informative(world: World, rollout: Rollout, target: int) -> bool:
    """Whether the ranks' kept groups hold `target` informative ones in all (a collective)."""
    return sum(_informative_counts(world, rollout)) >= target


def keep_informative_over_ranks(cfg: Config, world: World, rollout: Rollout, batches: int) -> Rollout:
    """data.prompts_per_step informative groups over all ranks (fewer, said, if the budget ran out)."""
    counts = _informative_counts(world, rollout)
    share = quotas(counts, cfg.data.prompts_per_step)
    if world.rank == 0 and sum(share) < cfg.data.prompts_per_step:
        log.warning(
            "dynamic sampling: %d of %d groups informative after %d batches of prompts "
            "(algo.dynamic_sampling_max_batches=%d); training on those",
            sum(share),
            cfg.data.prompts_per_step,
            batches,
            cfg.algo.dynamic_sampling_max_batches,
        )
    return keep_informative(rollout, share[world.rank], batches)


def quotas(counts: list[int], target: int) -> list[int]:
    """How many informative groups each rank keeps so that the ranks keep `target` in all (or all
    they have): an even share first, then the rest to the ranks with more, in rank order."""
    share = [min(c, target // len(counts) + (r < target % len(counts))) for r, c in enumerate(counts)]
    left = target - sum(share)
    for r, c in enumerate(counts):
        extra = min(c - share[r], max(left, 0))
        share[r] += extra
        left -= extra
    return share


def keep_informative(rollout: Rollout, quota: int, batches: int) -> Rollout:
    """This rank's part: of the kept groups, those whose rewards differ, at most `quota` of them;
    what was sampled, dropped and kept is counted."""
    useful = [g for g in rollout.groups if informative(g)]
    kept = useful[:quota]
    stats = dict(rollout.stats)
    stats.update(
        dynamic_groups_sampled=float(len(rollout.every_group)),
        dynamic_groups_zero_advantage=float(len(rollout.groups) - len(useful)),
        dynamic_groups_surplus=float(len(useful) - len(kept)),
        dynamic_groups_kept=float(len(kept)),
        dynamic_batches=float(batches),
    )
    stats["response_tokens"] = float(sum(len(s.completion.output_ids) for g in kept for s in g))
    stats["groups_zero_advantage"] = 0.0
    return Rollout(kept, stats, rollout.every_group)


def _informative_counts(world: World, rollout: Rollout) -> list[int]:
    """Each rank's number of kept groups whose rewards differ."""
    return world.bridge.all_gather_object(sum(map(informative, rollout.groups)), phase="dynamic sampling")
