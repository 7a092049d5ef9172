"""Prompt datasets: jsonl, parquet, `datasets.save_to_disk` directories; chat templates;
resumable sharding.

Each record has the prompt as `prompt` (text) or `messages` (chat list), and any other fields
(e.g. `answer`) that reward functions read. Where a dataset names them otherwise,
`data.fields` maps rltrain's names to its columns (`{prompt: question, answer: solution}`): each
record gets the named column's value under rltrain's name. Prompts are tokenised once, up front,
so a prompt longer than the context, a malformed line or a record without its prompt is
reported (file and line, or file and record) before any expensive work starts.

Formats, by `data.path`: a `.parquet` file (read by pyarrow a row group at a time), a directory
that `datasets.Dataset.save_to_disk` wrote (its Arrow files, read by pyarrow: the `data` extra
or `datasets` itself installs it; a `DatasetDict`'s directory names its splits: point at one),
anything else one JSON object per line.

Sharding. Each epoch is a seeded permutation of the records; step k takes the next
`prompts_per_step` of it, and rank r takes every world_size-th of those, so the global batch does
not depend on the number of ranks. The iterator's state is (epoch, position): saved with
checkpoints, it resumes exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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


def read_records(path: str | Path, fields: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every record of the dataset at `path` (module doc), `fields` mapped, each checked to have
    its prompt; a `DataError` naming the file and line (or record) otherwise."""
    p = Path(path)
    if p.is_dir():
        rows: Any = enumerate(_arrow_rows(p))
        where = lambda i: f"{p} record {i}"  # noqa: E731
    elif not p.is_file():
        raise DataError(f"dataset {str(p)!r} does not exist")
    elif p.suffix == ".parquet":
        rows = enumerate(_parquet_rows(p))
        where = lambda i: f"{p} record {i}"  # noqa: E731
    else:
        rows = _jsonl_rows(p)
        where = lambda i: f"{p}:{i}"  # noqa: E731
    records = []
    for at, rec in rows:
        for ours, theirs in (fields or {}).items():
            if theirs not in rec:
                raise DataError(
                    f"{where(at)}: has no field {theirs!r} (data.fields maps {ours} to it); it has {sorted(rec)}"
                )
            rec[ours] = rec[theirs]
        if "prompt" not in rec and "messages" not in rec:
            raise DataError(
                f"{where(at)}: needs a 'prompt' (text) or 'messages' (chat) field; has {sorted(rec)} "
                "(data.fields maps a dataset's own names, e.g. {prompt: question, answer: solution})"
            )
        records.append(rec)
    if not records:
        raise DataError(f"dataset {p} has no records")
    return records


def _jsonl_rows(p: Path) -> Iterator[tuple[int, dict[str, Any]]]:
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
            yield lineno, rec


def _pyarrow(p: Path) -> Any:
    try:
        import pyarrow  # noqa: PLC0415 - optional (parquet and Arrow datasets only)
    except ImportError:
        raise DataError(f'{p}: reading it needs pyarrow (pip install "rltrain[data]")') from None
    return pyarrow


def _parquet_rows(p: Path) -> Iterator[dict[str, Any]]:
    _pyarrow(p)
    import pyarrow.parquet as pq  # noqa: PLC0415 - optional (above)

    try:
        f = pq.ParquetFile(p)
    except Exception as e:  # noqa: BLE001 - pyarrow's many error types: a file it cannot read
        raise DataError(f"{p}: not a parquet file pyarrow can read ({type(e).__name__}: {e})") from None
    for batch in f.iter_batches():
        yield from batch.to_pylist()


def _arrow_rows(p: Path) -> Iterator[dict[str, Any]]:
    """The rows of a directory `datasets.Dataset.save_to_disk` wrote: its Arrow stream files in
    the order its state.json lists them."""
    if (p / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in p.iterdir() if (d / "state.json").is_file())
        raise DataError(
            f"{p} holds a DatasetDict (splits {', '.join(splits) or 'none'}): set data.path to one split's "
            f"directory, e.g. {p / (splits[0] if splits else 'train')}"
        )
    state = p / "state.json"
    if not state.is_file():
        raise DataError(
            f"{p} is a directory but not one datasets' save_to_disk wrote (no state.json): give a .jsonl or "
            ".parquet file, or a save_to_disk directory"
        )
    try:
        files = [p / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state}: not a datasets state file ({type(e).__name__}: {e})") from None
    pa = _pyarrow(p)
    for path in files:
        try:
            with pa.memory_map(str(path)) as source:
                for batch in pa.ipc.open_stream(source):
                    yield from batch.to_pylist()
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{path}: cannot read it as an Arrow stream ({type(e).__name__}: {e})") from None


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
