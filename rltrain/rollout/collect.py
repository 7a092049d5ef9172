"""Collect scored samples from the engine and lay them out as a train batch.

Honest accounting: a generation the engine failed, or a reward that failed, is never turned into
a sample. A group (the n samples of one prompt) with any failed member is dropped whole, because
group-relative advantages need the whole group; both counts go to the metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from rltrain.batch import TrainBatch
from rltrain.generation import Completion, SamplingParams
from rltrain.interfaces import RolloutClient
from rltrain.rollout.data import Prompt
from rltrain.rollout.multiturn import TURN_STATS, MultiTurn, TurnStats
from rltrain.rollout.rewards import RewardRunner

log = logging.getLogger("rltrain.rollout")
# A rollout's own timing (in its stats): waiting for the engine's answers (the requests, the
# generation, the answers read and parsed), then decoding and scoring the responses.
TIMES = ("generate_s", "score_s")


@dataclass
class Sample:
    prompt: Prompt
    completion: Completion
    text: str = ""
    reward: float | None = None
    error: str | None = None


@dataclass
class Rollout:
    groups: list[list[Sample]]  # the kept groups, in prompt order
    stats: dict[str, float] = field(default_factory=dict)
    every_group: list[list[Sample]] = field(default_factory=list)  # kept or not, one per prompt
    drawn: Any = None  # what it was sampled from (rollout/step.py's Drawn), set by the step's rollout

    @property
    def generation_failed_prompts(self) -> list[int]:
        """Prompts with a failed generation in their group: what an engine restart retries."""
        return [i for i, g in enumerate(self.every_group) if any(not s.completion.ok for s in g)]


def collect(
    client: RolloutClient,
    prompts: list[Prompt],
    params: SamplingParams,
    tokenizer: Any,
    rewards: RewardRunner,
    first: int = 0,
    turns: MultiTurn | None = None,
) -> Rollout:
    """`first`: the position of `prompts[0]` among the step's prompts (samples are seeded by it).
    `turns`: multi-turn trajectories (rollout/multiturn.py) instead of one response per sample."""
    positions = list(range(first, first + len(prompts)))
    times: dict[str, float] = {}
    rollout = _summarize(_generate(client, prompts, positions, params, tokenizer, rewards, times, turns), retried=0)
    rollout.stats.update(times)
    return rollout


def extend(rollout: Rollout, more: Rollout) -> Rollout:
    """One rollout of both's prompts, in order (`more` collected with `first` after `rollout`'s)."""
    out = _summarize(rollout.every_group + more.every_group, retried=int(rollout.stats.get("generation_retried", 0)))
    for k in TIMES:
        out.stats[k] = rollout.stats.get(k, 0.0) + more.stats.get(k, 0.0)
    for k in {*rollout.stats, *more.stats}:
        if k.startswith(TURN_STATS):
            out.stats[k] = rollout.stats.get(k, 0.0) + more.stats.get(k, 0.0)
    return out


def informative(group: list[Sample]) -> bool:
    """Whether a kept group's rewards differ: an all-equal group has zero advantage everywhere."""
    return len({s.reward for s in group}) > 1


def retry_failed(
    rollout: Rollout,
    client: RolloutClient,
    prompts: list[Prompt],
    params: SamplingParams,
    tokenizer: Any,
    rewards: RewardRunner,
    turns: MultiTurn | None = None,
    served_by: Callable[[Completion], bool] | None = None,
) -> Rollout:
    """Generate the groups whose generation failed once more (the engine was restarted), with the
    sampling seeds they had; what fails again stays failed and is dropped. `served_by`: where
    given, also the groups with a sample it refuses (sampled by the restarted engine before it
    was sent the weights it should serve: a rollout ahead's requests after the restart)."""
    again = rollout.generation_failed_prompts
    if served_by is not None:
        again = sorted(
            {*again, *(i for i, g in enumerate(rollout.every_group) if any(not served_by(s.completion) for s in g))}
        )
    groups = list(rollout.every_group)
    if again:
        fresh = _generate(client, [prompts[i] for i in again], again, params, tokenizer, rewards, turns=turns)
        for i in again:
            groups[i] = fresh[i]
    return _summarize(groups, retried=len(again) * params.n)


def _generate(
    client: RolloutClient,
    prompts: list[Prompt],
    positions: list[int],
    params: SamplingParams,
    tokenizer: Any,
    rewards: RewardRunner,
    times: dict[str, float] | None = None,
    turns: MultiTurn | None = None,
) -> dict[int, list[Sample]]:
    """Sample and score; the groups by prompt position. A failed generation is not scored.
    `times`: gets the seconds spent waiting for the engine's answers and scoring them (`TIMES`).
    Multi-turn (`turns`): a sample is a trajectory, scored by its environment's rewards where it
    gave any, else by `rewards` on the model's last turn."""
    t0 = time.perf_counter()
    given: dict[int, float] = {}  # sample -> the environment's reward
    if turns is None:
        completions = client.generate([p.input_ids for p in prompts], params, positions=positions)
        samples = [Sample(dict(zip(positions, prompts))[c.prompt_index], c) for c in completions]
        responses = [s.completion.output_ids for s in samples]
    else:
        turns.stats = TurnStats()
        trajectories = turns.run(client, prompts, positions, params)
        samples = [Sample(t.prompt, t.completion) for t in trajectories]
        responses = [t.last_turn for t in trajectories]
        given = {k: t.env_reward for k, t in enumerate(trajectories) if t.env_reward is not None}
    t1 = time.perf_counter()
    to_score, texts = [], []
    for k, s in enumerate(samples):
        if not s.completion.ok:
            s.error = s.completion.error or f"finish reason {s.completion.finish_reason!r}"
            continue
        if k in given:
            s.reward = given[k]
            continue
        to_score.append(s)
        texts.append(responses[k])
    for s, text in zip(to_score, decode_responses(tokenizer, texts)):
        s.text = text
    for s, scored in zip(to_score, rewards.score([(s.text, s.prompt.record) for s in to_score])):
        s.reward, s.error = scored.reward, scored.error
    groups: dict[int, list[Sample]] = {i: [] for i in positions}
    for s in samples:
        groups[s.completion.prompt_index].append(s)
    if times is not None:
        times.update(generate_s=t1 - t0, score_s=time.perf_counter() - t1)
        if turns is not None:
            times.update(turns.summary())
    return groups


def decode_responses(tokenizer: Any, responses: list[list[int]]) -> list[str]:
    """Each response's text (special tokens skipped), as `tokenizer.decode` gives it: in one call
    into the Rust tokenizer where transformers' decode would add nothing to it (a fast tokenizer
    whose decode is the base class's and cleans up no spaces; its per-call Python cost adds up over
    a rollout's many responses), else one `decode` per response."""
    fast = transformers.PreTrainedTokenizerFast
    kind = type(tokenizer)
    if (
        isinstance(tokenizer, fast)
        and kind.decode is fast.decode
        and kind._decode is fast._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return list(tokenizer.backend_tokenizer.decode_batch(responses, skip_special_tokens=True))
    return [tokenizer.decode(r, skip_special_tokens=True) for r in responses]


def _summarize(by_position: dict[int, list[Sample]] | list[list[Sample]], retried: int) -> Rollout:
    groups = list(by_position.values()) if isinstance(by_position, dict) else by_position
    samples = [s for g in groups for s in g]
    gen_failed = sum(1 for s in samples if not s.completion.ok)
    reward_failed = sum(1 for s in samples if s.completion.ok and s.error is not None)
    kept = [g for g in groups if all(s.error is None for s in g)]
    ok = [s for g in kept for s in g]
    if gen_failed or reward_failed:
        first = next(s.error for s in samples if s.error is not None)
        log.warning(
            "%d generations and %d rewards failed (%d of %d groups dropped); first error: %s",
            gen_failed,
            reward_failed,
            len(groups) - len(kept),
            len(groups),
            first,
        )
    stats = {
        "samples": float(len(samples)),
        "generation_failed": float(gen_failed),
        "generation_retried": float(retried),
        "reward_failed": float(reward_failed),
        "groups_dropped": float(len(groups) - len(kept)),
        # Groups whose samples are all the same response: no advantage, nothing learned from them.
        # All of them, step after step, means the samples share a seed (or the engine is greedy).
        "groups_identical": float(
            sum(1 for g in kept if len(g) > 1 and len({tuple(s.completion.output_ids) for s in g}) == 1)
        ),
        # Groups whose rewards are all equal: zero advantage, no gradient (DAPO's dynamic sampling drops them).
        "groups_zero_advantage": float(sum(1 for g in kept if not informative(g))),
        "response_tokens": float(sum(len(s.completion.output_ids) for s in ok)),
    }
    return Rollout(kept, stats, groups)


def build_batch(groups: list[list[Sample]], pad_id: int) -> tuple[TrainBatch, torch.Tensor]:
    """Right-padded [B, L] batch of prompt+response, and rewards [G, n] (built from Python lists
    in one tensor each: a tensor op per row costs more than the rows' whole data here)."""
    flat = [s for g in groups for s in g]
    seqs = [s.prompt.input_ids + s.completion.output_ids for s in flat]
    L = max((len(x) for x in seqs), default=1)
    B = len(flat)
    prompt_len = torch.tensor([len(s.prompt.input_ids) for s in flat], dtype=torch.long).reshape(B, 1)
    seq_len = torch.tensor([len(x) for x in seqs], dtype=torch.long).reshape(B, 1)
    tokens = torch.tensor([x + [pad_id] * (L - len(x)) for x in seqs], dtype=torch.long).reshape(B, L)
    pos = torch.arange(L)
    attn = (pos < seq_len).long()
    loss_mask = ((pos >= prompt_len) & (pos < seq_len)).float()
    if any(s.completion.loss_mask is not None for s in flat):  # multi-turn: the model's tokens only
        sampled = torch.tensor(
            [
                [0] * len(s.prompt.input_ids)
                + (s.completion.loss_mask if s.completion.loss_mask is not None else [1] * len(s.completion.output_ids))
                + [0] * (L - len(x))
                for s, x in zip(flat, seqs)
            ],
            dtype=torch.float32,
        ).reshape(B, L)
        loss_mask = loss_mask * sampled
    rollout_logp = torch.tensor(
        [
            [0.0] * len(s.prompt.input_ids)
            + (list(s.completion.logprobs) if s.completion.logprobs else [0.0] * len(s.completion.output_ids))
            + [0.0] * (L - len(x))
            for s, x in zip(flat, seqs)
        ],
        dtype=torch.float32,
    ).reshape(B, L)
    n = len(groups[0]) if groups else 0
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32).reshape(len(groups), n)
    return TrainBatch(tokens, attn, loss_mask, rollout_logp=rollout_logp), rewards
