"""Prompt datasets: jsonl (parquet when pyarrow is installed), chat templates, resumable sharding.

Each record has the prompt as `prompt` (text) or `messages` (chat list), and any other fields
(e.g. `answer`) that reward functions read. Prompts are tokenised once, up front, so a prompt
longer than the context or a malformed line is reported before any expensive work starts.

Sharding. Each epoch is a seeded permutation of the records; step k takes the next
`prompts_per_step` of it, and rank r takes every world_size-th of those, so the global batch does
not depend on the number of ranks. The iterator's state is (epoch, position): saved with
checkpoints, it resumes exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class DataError(ValueError):
    """A dataset that cannot be used; names the file and line."""


@dataclass
class Prompt:
    index: int
    input_ids: list[int]
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return str(self.record.get("prompt", self.record.get("messages", "")))


def read_records(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"dataset {str(p)!r} does not exist")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # noqa: PLC0415 - pyarrow is optional (parquet data only)
        except ImportError:
            raise DataError(f"{p}: reading parquet needs pyarrow (pip install pyarrow)") from None
        return pq.read_table(p).to_pylist()
    records = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{p}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            if "prompt" not in rec and "messages" not in rec:
                raise DataError(f"{p}:{lineno}: needs a 'prompt' (text) or 'messages' (chat) field; has {sorted(rec)}")
            records.append(rec)
    if not records:
        raise DataError(f"dataset {p} has no records")
    return records


def tokenize_records(
    records: list[dict[str, Any]],
    tokenizer: Any,
    chat_template: bool,
    max_prompt_tokens: int,
    source: str = "dataset",
    context: tuple[int, int] | None = None,
) -> list[Prompt]:
    """Each record's prompt as token ids; a prompt over data.max_prompt_tokens, or (`context`:
    the model's context length and rollout.max_new_tokens) one that leaves no room for a whole
    response, is an error naming the record."""
    prompts = []
    for i, rec in enumerate(records):
        if "messages" in rec or chat_template:
            messages = rec.get("messages") or [{"role": "user", "content": rec["prompt"]}]
            if not getattr(tokenizer, "chat_template", None):
                raise DataError(f"{source} record {i}: chat prompts need a tokenizer with a chat template")
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(rec["prompt"], add_special_tokens=True)["input_ids"]
        ids = list(map(int, ids))
        if not ids:
            raise DataError(f"{source} record {i}: the prompt tokenises to nothing")
        if len(ids) > max_prompt_tokens:
            raise DataError(
                f"{source} record {i}: prompt has {len(ids)} tokens, more than data.max_prompt_tokens="
                f"{max_prompt_tokens}; shorten it or raise the limit"
            )
        if context is not None and len(ids) + context[1] > context[0]:
            raise DataError(
                f"{source} record {i}: prompt has {len(ids)} tokens; with rollout.max_new_tokens={context[1]} that "
                f"exceeds the model's context length of {context[0]} tokens: shorten the prompt or lower "
                "rollout.max_new_tokens"
            )
        prompts.append(Prompt(i, ids, rec))
    return prompts


class PromptSampler:
    """Deterministic, resumable epoch order; `next_batch(rank, world)` gives this rank's share."""

    def __init__(self, prompts: list[Prompt], prompts_per_step: int, seed: int):
        if prompts_per_step > len(prompts):
            raise DataError(
                f"data.prompts_per_step={prompts_per_step} is more than the dataset's {len(prompts)} prompts"
            )
        self.prompts = prompts
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def next_batch(self, rank: int, world_size: int) -> list[Prompt]:
        """The next global batch (advancing the state on every rank alike), this rank's slice of it."""
        if self.position + self.prompts_per_step > len(self.prompts):
            self.epoch += 1
            self.position = 0
        order = self._order(self.epoch)[self.position : self.position + self.prompts_per_step]
        self.position += self.prompts_per_step
        return [self.prompts[i] for i in order[rank::world_size]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
