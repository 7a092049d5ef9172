"""Prompt datasets: jsonl, parquet, `datasets.save_to_disk` directories; chat templates;
resumable sharding.

Each record has the prompt as `prompt` (text) or `messages` (chat list), and any other fields
(e.g. `answer`) that reward functions read. Where a dataset names them otherwise,
`data.fields` maps rltrain's names to its columns (`{prompt: question, answer: solution}`): each
record gets the named column's value under rltrain's name. Every prompt is checked up front —
a malformed line, a record without its prompt, a prompt longer than the context — and reported
(file and line, or file and record) before any expensive work starts; the check of the lengths
is shared over the ranks (`LazyPrompts.check`).

Formats, by `data.path`: a `.parquet` file, a directory that `datasets.Dataset.save_to_disk`
wrote (its Arrow files; a `DatasetDict`'s directory names its splits: point at one), anything
else one JSON object per line. Parquet and Arrow are read by pyarrow (the `data` extra, or
`datasets` itself, installs it).

Large datasets. A rank never holds a dataset's records as Python objects, nor their token ids:
parquet is converted once into an uncompressed Arrow file in the run directory (rank 0 writes it,
a batch at a time, atomically; it is kept while the parquet file is unchanged), and every rank
memory-maps that file, or save_to_disk's own files, so the ranks of a node share one copy in the
page cache. A record becomes a dict, and its prompt token ids, only when a step draws it
(`ArrowRecords`, `LazyPrompts`). jsonl is read into memory. `python -m rltrain.bench.data`
measures both on 1M records.

Sharding. Each epoch is a seeded permutation of the records; step k takes the next
`prompts_per_step` of it, and rank r takes every world_size-th of those, so the global batch does
not depend on the number of ranks. The iterator's state is (epoch, position): saved with
checkpoints, it resumes exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import torch


class DataError(ValueError):
    """A dataset that cannot be used; names the file and line (`index`: the record, where one)."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


@dataclass
class Prompt:
    index: int
    input_ids: list[int]
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return str(self.record.get("prompt", self.record.get("messages", "")))


def read_records(
    path: str | Path, fields: dict[str, str] | None = None, cache_dir: Path | None = None
) -> Sequence[dict[str, Any]]:
    """The records of the dataset at `path` (module doc), `fields` mapped, each checked to have its
    prompt; a `DataError` naming the file and line (or record) otherwise. A parquet file is read
    through its Arrow copy in `cache_dir` (`parquet_to_arrow`) where one is given, else into memory."""
    p = Path(path)
    if p.is_dir():
        return ArrowRecords(_saved_dataset(p), str(p), fields or {})
    if not p.is_file():
        raise DataError(f"dataset {str(p)!r} does not exist")
    if p.suffix == ".parquet":
        if cache_dir is not None:
            return ArrowRecords(_mapped(parquet_to_arrow(p, cache_dir)), str(p), fields or {})
        return ArrowRecords(_parquet_table(p), str(p), fields or {})
    records = []
    for lineno, rec in _jsonl_rows(p):
        for ours, theirs in (fields or {}).items():
            if theirs not in rec:
                raise DataError(
                    f"{p}:{lineno}: has no field {theirs!r} (data.fields maps {ours} to it); it has {sorted(rec)}"
                )
            rec[ours] = rec[theirs]
        if "prompt" not in rec and "messages" not in rec:
            raise DataError(f"{p}:{lineno}: {_NO_PROMPT} has {sorted(rec)} {_FIELDS_HINT}")
        records.append(rec)
    if not records:
        raise DataError(f"dataset {p} has no records")
    return records


_NO_PROMPT = "needs a 'prompt' (text) or 'messages' (chat) field;"
_FIELDS_HINT = "(data.fields maps a dataset's own names, e.g. {prompt: question, answer: solution})"


class ArrowRecords(Sequence[dict[str, Any]]):
    """The records of an Arrow table, a row made a dict (its fields mapped) only when asked for.
    The columns are checked whole, up front: the mapped ones exist, and every row has its prompt."""

    def __init__(self, table: Any, source: str, fields: dict[str, str]):
        pa = _pyarrow(Path(source))
        names = table.schema.names
        for ours, theirs in fields.items():
            if theirs not in names:
                raise DataError(
                    f"{source}: has no field {theirs!r} (data.fields maps {ours} to it); its columns are {names}"
                )
        self.table, self.source, self.fields = table, source, dict(fields)
        prompt_columns = [self._column(k) for k in ("prompt", "messages") if self._column(k) in names]
        if not prompt_columns:
            raise DataError(f"{source}: {_NO_PROMPT} its columns are {names} {_FIELDS_HINT}")
        if table.num_rows == 0:
            raise DataError(f"dataset {source} has no records")
        missing = None
        for c in prompt_columns:
            null = pa.compute.is_null(table.column(c))
            missing = null if missing is None else pa.compute.and_(missing, null)
        if pa.compute.any(missing).as_py():
            first = pa.compute.index(missing, True).as_py()
            raise DataError(
                f"{source} record {first}: {_NO_PROMPT} its {' and '.join(map(repr, prompt_columns))} empty"
            )

    def _column(self, ours: str) -> str:
        return self.fields.get(ours, ours)

    def __len__(self) -> int:
        return int(self.table.num_rows)

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        if not -len(self) <= i < len(self):
            raise IndexError(f"record {i} of {len(self)}")
        return self.take([i % len(self)])[0]

    def take(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """These records. A run of consecutive ones is one slice; others are a slice each (pyarrow's
        `take` on a table of many chunks joins the chunks first: a copy of the whole column)."""
        if isinstance(indices, range) and indices.step == 1:
            return [self._named(r) for r in self.table.slice(indices.start, len(indices)).to_pylist()]
        return [self._named(self.table.slice(i, 1).to_pylist()[0]) for i in indices]

    def prompt_bytes(self, indices: Sequence[int]) -> list[int | None]:
        """As `_prompt_bytes`, from the columns (no record is made a dict)."""
        pa = _pyarrow(Path(self.source))
        names = self.table.schema.names
        column = self._column("prompt")
        kind = self.table.schema.field(column).type if column in names else None
        if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            return [None] * len(indices)
        sizes = pa.compute.binary_length(self.table.column(column))  # (of the whole column: no string copied)
        if self._column("messages") in names:
            sizes = pa.compute.if_else(pa.compute.is_null(self.table.column(self._column("messages"))), sizes, None)
        return sizes.take(pa.array(indices, pa.int64())).to_pylist()

    def _named(self, rec: dict[str, Any]) -> dict[str, Any]:
        for ours, theirs in self.fields.items():
            rec[ours] = rec[theirs]
        if rec.get("prompt") is None:
            rec.pop("prompt", None)  # (a row of the messages column's records)
        if rec.get("messages") is None:
            rec.pop("messages", None)
        return rec


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
        import pyarrow.compute  # noqa: PLC0415, F401
        import pyarrow.parquet  # noqa: PLC0415, F401
    except ImportError:
        raise DataError(f'{p}: reading it needs pyarrow (pip install "rltrain[data]")') from None
    return pyarrow


def _parquet_file(p: Path) -> Any:
    pa = _pyarrow(p)
    try:
        return pa.parquet.ParquetFile(p)
    except Exception as e:  # noqa: BLE001 - pyarrow's many error types: a file it cannot read
        raise DataError(f"{p}: not a parquet file pyarrow can read ({type(e).__name__}: {e})") from None


def _parquet_table(p: Path) -> Any:
    f = _parquet_file(p)
    try:
        return f.read()
    except Exception as e:  # noqa: BLE001 - as above, a damaged body
        raise DataError(f"{p}: cannot read it as parquet ({type(e).__name__}: {e})") from None


def parquet_to_arrow(p: Path, cache_dir: Path) -> Path:
    """`p`'s rows as an uncompressed Arrow file in `cache_dir`, memory-mappable: written a row
    group at a time into a temporary file and renamed (never half-written); named by `p`'s path,
    size and modification time, so an unchanged file is converted once and a changed one again (the
    older copy removed)."""
    st = p.stat()
    key = hashlib.sha1(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir / f"{p.stem}.{key}.arrow"
    if out.is_file():
        return out
    pa = _pyarrow(p)
    f = _parquet_file(p)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, f.schema_arrow) as writer:
            for i in range(f.num_row_groups):
                writer.write_table(f.read_row_group(i))
        os.replace(tmp, out)
    except Exception as e:  # noqa: BLE001 - a damaged row group: nothing kept, the file named
        tmp.unlink(missing_ok=True)
        raise DataError(f"{p}: cannot read it as parquet ({type(e).__name__}: {e})") from None
    for old in cache_dir.glob(f"{p.stem}.*.arrow"):
        if old != out:
            old.unlink(missing_ok=True)
    return out


def _mapped(path: Path) -> Any:
    """The Arrow file at `path` as a table over its memory map (no copy: pages are read when used)."""
    pa = _pyarrow(path)
    return pa.ipc.open_file(pa.memory_map(str(path))).read_all()  # (the table's buffers keep the map open)


def _saved_dataset(p: Path) -> Any:
    """The table of a directory `datasets.Dataset.save_to_disk` wrote: its Arrow stream files,
    memory-mapped, in the order its state.json lists them."""
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
    tables = []
    for path in files:
        try:
            tables.append(pa.ipc.open_stream(pa.memory_map(str(path))).read_all())
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{path}: cannot read it as an Arrow stream ({type(e).__name__}: {e})") from None
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as e:
        raise DataError(f"{p}: its Arrow files do not share one schema ({e})") from None


def tokenize_records(
    records: Sequence[dict[str, Any]],
    tokenizer: Any,
    chat_template: bool,
    max_prompt_tokens: int,
    source: str = "dataset",
    context: tuple[int, int] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[Prompt]:
    """Each record's prompt as token ids; a prompt over data.max_prompt_tokens, or (`context`:
    the model's context length and rollout.max_new_tokens) one that leaves no room for a whole
    response, is an error naming the record."""
    return LazyPrompts(records, tokenizer, chat_template, max_prompt_tokens, source, context, template_kwargs)[:]


class LazyPrompts(Sequence[Prompt]):
    """A dataset's prompts, each tokenised when it is drawn: a rank holds no token ids of prompts
    it is not sampling. `check` tokenises a share of them all up front (the module doc)."""

    def __init__(
        self,
        records: Sequence[dict[str, Any]],
        tokenizer: Any,
        chat_template: bool,
        max_prompt_tokens: int,
        source: str = "dataset",
        context: tuple[int, int] | None = None,
        template_kwargs: dict[str, Any] | None = None,  # data.chat_template_kwargs
    ):
        self.records, self.tokenizer, self.chat_template = records, tokenizer, chat_template
        self.max_prompt_tokens, self.source, self.context = max_prompt_tokens, source, context
        self.template_kwargs = dict(template_kwargs or {})

    def __len__(self) -> int:
        return len(self.records)

    @overload
    def __getitem__(self, i: int) -> Prompt: ...
    @overload
    def __getitem__(self, i: slice) -> list[Prompt]: ...
    def __getitem__(self, i: int | slice) -> Prompt | list[Prompt]:
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        (prompt,) = self.take([range(len(self))[i]])
        return prompt

    def take(self, indices: Sequence[int]) -> list[Prompt]:
        """The prompts of these records, read and tokenised as one batch (a step's draw)."""
        if not indices:
            return []
        recs = _take(self.records, indices)
        prompts = []
        for i, rec, ids in zip(indices, recs, self._token_ids(recs, indices)):
            error = self._error(i, len(ids))
            if error:
                raise DataError(error)
            prompts.append(Prompt(i, ids, rec))
        return prompts

    def check(self, rank: int = 0, world_size: int = 1, batch: int = 4096) -> tuple[int, str] | None:
        """The first problem among records rank, rank + world_size, ... (the record and a message
        naming it), or None: each rank checks its share and the ranks exchange the results.

        A plain prompt (no chat template) of b UTF-8 bytes has at most b tokens, since every token
        of a BPE, WordPiece or Unigram vocabulary stands for at least one byte, plus the special
        tokens the tokenizer adds to any text: such a prompt that fits by that bound is not
        tokenised here; the rest are. (Should a tokenizer break the bound, the prompt is still
        checked when a step draws it, and the run stops there, naming it.)"""
        mine: Sequence[int] = range(rank, len(self), world_size)
        limit = self.max_prompt_tokens
        if self.context is not None:
            limit = min(limit, self.context[0] - self.context[1])
        if not self.chat_template:
            added = len(self.tokenizer("")["input_ids"])
            sizes = _prompt_bytes(self.records, mine)
            mine = [i for i, b in zip(mine, sizes) if b is None or b == 0 or b + added > limit]
        for start in range(0, len(mine), batch):
            at = mine[start : start + batch]
            try:
                batch_ids = self._token_ids(_take(self.records, at), at)
            except DataError as e:
                return (at[0] if e.index is None else e.index), str(e)
            except Exception as e:  # noqa: BLE001 - the tokenizer's own errors (a prompt that is not text): named
                return at[0], f"{self.source} records {at[0]}..{at[-1]}: cannot tokenise ({type(e).__name__}: {e})"
            for i, ids in zip(at, batch_ids):
                error = self._error(i, len(ids))
                if error:
                    return i, error
        return None

    def _token_ids(self, recs: Sequence[dict[str, Any]], indices: Sequence[int]) -> list[list[int]]:
        """The prompts of `recs` (records `indices`) as token ids: the plain ones in one
        call of the tokenizer (its batch path), those with `messages` (or all, with
        data.chat_template) through the chat template one by one."""
        chat = [self.chat_template or "messages" in r for r in recs]
        out: list[list[int]] = [[] for _ in recs]
        plain = [k for k, c in enumerate(chat) if not c]
        if plain:
            for k, ids in zip(plain, self.tokenizer([recs[k]["prompt"] for k in plain])["input_ids"]):
                out[k] = list(map(int, ids))
        for k in (k for k, c in enumerate(chat) if c):
            if not getattr(self.tokenizer, "chat_template", None):
                raise DataError(
                    f"{self.source} record {indices[k]}: chat prompts need a tokenizer with a chat template", indices[k]
                )
            r = recs[k]
            messages = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **self.template_kwargs
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            out[k] = list(map(int, ids))
        return out

    def _error(self, i: int, n: int) -> str | None:
        where = f"{self.source} record {i}"
        if not n:
            return f"{where}: the prompt tokenises to nothing"
        if n > self.max_prompt_tokens:
            return (
                f"{where}: prompt has {n} tokens, more than data.max_prompt_tokens={self.max_prompt_tokens}; "
                "shorten it or raise the limit"
            )
        if self.context is not None and n + self.context[1] > self.context[0]:
            return (
                f"{where}: prompt has {n} tokens; with rollout.max_new_tokens={self.context[1]} that exceeds the "
                f"model's context length of {self.context[0]} tokens: shorten the prompt or lower "
                "rollout.max_new_tokens"
            )
        return None


def _take(records: Sequence[dict[str, Any]], indices: Sequence[int]) -> list[dict[str, Any]]:
    if isinstance(records, ArrowRecords):
        return records.take(indices)
    return [records[i] for i in indices]


def _prompt_bytes(records: Sequence[dict[str, Any]], indices: Sequence[int]) -> list[int | None]:
    """The UTF-8 size of each of these records' `prompt`; None where it has chat `messages` or a
    prompt that is not text."""
    if isinstance(records, ArrowRecords):
        return records.prompt_bytes(indices)
    out: list[int | None] = []
    for i in indices:
        r = records[i]
        p = r.get("prompt")
        out.append(len(p.encode()) if isinstance(p, str) and "messages" not in r else None)
    return out


class PromptSampler:
    """Deterministic, resumable epoch order; `next_batch(rank, world)` gives this rank's share."""

    def __init__(self, prompts: Sequence[Prompt], prompts_per_step: int, seed: int):
        if prompts_per_step > len(prompts):
            raise DataError(
                f"data.prompts_per_step={prompts_per_step} is more than the dataset's {len(prompts)} prompts"
            )
        self.prompts = prompts
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of the records (kept while the epoch lasts: one tensor, not a list)."""
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.prompts), generator=g)}
        return self._orders[epoch]

    def next_batch(self, rank: int, world_size: int) -> list[Prompt]:
        """The next global batch (advancing the state on every rank alike), this rank's slice of it."""
        if self.position + self.prompts_per_step > len(self.prompts):
            self.epoch += 1
            self.position = 0
        order = self._order(self.epoch)[self.position : self.position + self.prompts_per_step].tolist()
        self.position += self.prompts_per_step
        mine = order[rank::world_size]
        if isinstance(self.prompts, LazyPrompts):
            return self.prompts.take(mine)  # (read and tokenised as one batch)
        return [self.prompts[i] for i in mine]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
