"""HF checkpoint files: sharded safetensors + `model.safetensors.index.json` + the config, streamed.

Tensors arrive one at a time (from a sharded trainer, each is an all-gather every rank joins), so
shards are written as they fill and the whole model is never held in host memory at once. Only
the writing rank keeps anything; the others drain the iterator. Every file is fsynced; making the
directory appear atomically is the caller's job (write into a temporary directory, then rename).

Shards are written here, not by `safetensors.save_file`, for two reasons: device tensors are copied
into a reused page-locked staging buffer (a per-tensor `.to("cpu")` into fresh pageable memory runs
at a fraction of the pinned-copy rate), and each file's xxh3 is computed from memory while it is
written instead of by reading it back. The format is safetensors' (8-byte header length, JSON
header, packed data); the files are read by `safetensors` and `from_pretrained` in the tests.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from rltrain.runtime.files import fsync_file, map_file
from rltrain.runtime.memory import host_bytes
from rltrain.runtime.pinned import pinned_empty

INDEX = "model.safetensors.index.json"
# What a checkpoint directory carries beside its weights, copied into every version and checkpoint
# from the model it was trained from: its config and its tokenizer (a version is then a whole HF
# checkpoint; without its tokenizer, AutoTokenizer.from_pretrained(version) silently builds a
# degenerate one).
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)


_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write host tensors as one safetensors file, fsynced; returns the xxh3 of its bytes, hashed
    on a second thread while the file is written (both release the GIL), instead of after it."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors code")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    chunks: list[Any] = [len(head).to_bytes(8, "little"), head]  # bytes, then each tensor's memory
    chunks += [memoryview(host_bytes(t)) for t in tensors.values() if t.numel()]

    def digest() -> str:
        h = xxhash.xxh3_64()
        for chunk in chunks:
            h.update(chunk)
        return h.hexdigest()

    with ThreadPoolExecutor(1, thread_name_prefix="rltrain-hash") as hasher:
        hashed = hasher.submit(digest)
        with open(path, "wb") as fh:
            for chunk in chunks:
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        return hashed.result()


_CODES = {code: dtype for dtype, code in _DTYPES.items()}


class CorruptWeightsError(ValueError):
    """A published weight version does not match its manifest."""


def map_safetensors(path: Path, xxh3: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as host tensors over one memory map of it (`map_file`).
    Read-only: the tensors must not be written. With `xxh3`, the file's bytes are checked against
    it first, from the same map (CorruptWeightsError). Raises ValueError on a file whose header
    does not describe its data."""
    m = map_file(path)
    if m is None or len(m) < 8:
        raise ValueError(f"{path.name}: {len(m) if m else 0} bytes, too short for a safetensors header")
    size = len(m)
    if xxh3 is not None and xxhash.xxh3_64(m).hexdigest() != xxh3:
        raise CorruptWeightsError(
            f"weight version {path.parent}: {path.name} does not match its checksum (corrupt or partly "
            f"written); the engine keeps its current weights"
        )
    n = int.from_bytes(m[:8], "little")
    try:
        header = json.loads(m[8 : 8 + n]) if 8 + n <= size else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: unreadable safetensors header")
    header.pop("__metadata__", None)
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable": it is not written
        for name, spec in header.items():
            try:
                dtype, shape, (begin, end) = (
                    _CODES[spec["dtype"]],
                    [int(d) for d in spec["shape"]],
                    spec["data_offsets"],
                )
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{path.name}: tensor {name!r} has a malformed header entry {spec!r}") from None
            if not 0 <= begin <= end <= size - 8 - n or end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(
                    f"{path.name}: tensor {name!r} {shape} {spec['dtype']} does not fit bytes "
                    f"{begin}..{end} of a {size - 8 - n}-byte data section (truncated?)"
                )
            if end == begin:
                out[name] = torch.empty(shape, dtype=dtype)
            else:
                out[name] = (
                    torch.frombuffer(m, dtype=torch.uint8, count=end - begin, offset=8 + n + begin)
                    .view(dtype)
                    .view(shape)
                )
    return out


class HostStaging:
    """A page-locked host buffer, reused across checkpoints, that device tensors of one shard are
    copied into (asynchronously; `ready()` waits for the copies). On CPU tensors pass through."""

    def __init__(self, capacity: int):
        self.capacity, self._used = capacity, 0
        self._buf: torch.Tensor | None = None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.detach().contiguous()
        nbytes = t.numel() * t.element_size()
        start = -(-self._used // 64) * 64
        if start + nbytes > self.capacity:
            return t.detach().to("cpu").contiguous()  # bigger than the staging buffer: plain copy
        if self._buf is None:
            self._buf = pinned_empty(self.capacity)
        self._used = start + nbytes
        out = self._buf[start : start + nbytes].view(t.dtype).view(t.shape)
        out.copy_(t.detach(), non_blocking=True)
        return out

    def ready(self) -> None:
        if self._used:
            torch.cuda.synchronize()

    def reset(self) -> None:
        self._used = 0


def write_checkpoint(
    path: str | Path,
    config_from: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    write: bool = True,
    shard_bytes: int = 2 << 30,
    staging: HostStaging | list[HostStaging] | None = None,
    digests: dict[str, str] | None = None,
) -> dict[str, str]:
    """Write `tensors` as HF shards under `path` (if `write`), copying the config files of
    `config_from`. Returns the weight map (name -> file) on the writing rank. With `staging`
    (capacity >= shard_bytes is best), device tensors go through it; with two stagings, a shard
    is written on a writer thread while the next one is gathered and copied into the other
    (the copy to the host then overlaps the writes instead of adding to them). `digests`
    receives the xxh3 of every file written."""
    path = Path(path)
    stagings = staging if isinstance(staging, list) else [staging or HostStaging(0)]
    file_digests: dict[str, str] = {}
    if write:
        path.mkdir(parents=True, exist_ok=True)
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    parts: list[list[str]] = []
    writes: list[Any] = []  # a future per part: its file's digest
    total = 0
    writer = ThreadPoolExecutor(1, thread_name_prefix="rltrain-shard-writer")

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        stagings[len(parts) % len(stagings)].ready()
        tmp = path / f".part-{len(parts):05d}.safetensors"
        writes.append(writer.submit(write_safetensors, tmp, pending, {"format": "pt"}))
        parts.append(list(pending))
        pending, pending_bytes = {}, 0
        # The next part fills the staging whose last part (len(stagings) parts ago) must be on disk.
        if len(parts) >= len(stagings):
            writes[len(parts) - len(stagings)].result()
        stagings[len(parts) % len(stagings)].reset()

    try:
        for name, t in tensors:
            if not write:
                continue
            size = t.numel() * t.element_size()
            if pending and pending_bytes + size > shard_bytes:
                flush()
            pending[name] = stagings[len(parts) % len(stagings)].take(t)
            pending_bytes += size
            total += size
        if not write:
            return {}
        flush()
        for i, done in enumerate(writes):
            file_digests[f".part-{i:05d}.safetensors"] = done.result()
    finally:
        writer.shutdown(wait=True)  # a failed write is raised above; none is left running
    weight_map: dict[str, str] = {}
    for i, names in enumerate(parts):
        final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" if len(parts) > 1 else "model.safetensors"
        os.replace(path / f".part-{i:05d}.safetensors", path / final)
        file_digests[final] = file_digests.pop(f".part-{i:05d}.safetensors")
        weight_map.update({n: final for n in names})
    if len(parts) > 1:
        index = path / INDEX
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        fsync_file(index)
    for name in CONFIG_FILES:
        src = Path(config_from) / name
        if src.is_file() and src.resolve() != (path / name).resolve():
            shutil.copyfile(src, path / name)
            fsync_file(path / name)
    if digests is not None:
        digests.update(file_digests)
    return weight_map


CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)


def context_length_of(config: Any) -> int:
    """The longest sequence (prompt + response) a model config allows, read as SGLang reads it:
    the first of CONTEXT_LENGTH_KEYS it states, times its rope scaling factor (none for llama3
    scaling or where the original length is stated), 2048 where it states none."""
    rope = getattr(config, "rope_scaling", None)
    factor = 1.0
    if isinstance(rope, dict) and "original_max_position_embeddings" not in rope and rope.get("rope_type") != "llama3":
        factor = float(rope.get("factor", 1) or 1)
    for key in CONTEXT_LENGTH_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            return int(factor * value)
    return 2048
