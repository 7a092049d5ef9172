"""A two-turn environment for the loop's multi-turn test (tests/test_multiturn.py), importable by
the loop's processes as `multiturn_env:Recheck` (tests/ on PYTHONPATH)."""

from __future__ import annotations

from rltrain.rollout.env import EnvStep


class Recheck:
    """After the model's first answer to "a + b =", shows it the question again ("a + b =", text
    tokenised in the loop) and ends after its second answer; the reward is left to
    `reward.function` (math), scored on that second answer."""

    def __init__(self, record: dict):
        self.question, self.turns = str(record["prompt"]), 0

    def reset(self) -> None:
        return None  # the data's prompt

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        self.turns += 1
        return EnvStep(self.question if self.turns == 1 else None)
