"""HF checkpoint files: sharded safetensors + `model.safetensors.index.json` + the config, streamed.

Tensors arrive one at a time (from a sharded trainer, each is an all-gather every rank joins), so
shards are written as they fill and the whole model is never held in host memory at once. Only
the writing rank keeps anything; the others drain the iterator. Every file is fsynced; making the
directory appear atomically is the caller's job (write into a temporary directory, then rename).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(path: str | Path, config_from: str | Path, tensors: Iterable[tuple[str, torch.Tensor]],
                     write: bool = True, shard_bytes: int = 2 << 30) -> dict[str, str]:
    """Write `tensors` as HF shards under `path` (if `write`), copying the config files of
    `config_from`. Returns the weight map (name -> file) on the writing rank."""
    from safetensors.torch import save_file

    path = Path(path)
    if write:
        path.mkdir(parents=True, exist_ok=True)
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    parts: list[list[str]] = []
    total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        tmp = path / f".part-{len(parts):05d}.safetensors"
        save_file(pending, str(tmp), metadata={"format": "pt"})
        fsync_file(tmp)
        parts.append(list(pending))
        pending, pending_bytes = {}, 0

    for name, t in tensors:
        if not write:
            continue
        size = t.numel() * t.element_size()
        if pending and pending_bytes + size > shard_bytes:
            flush()
        pending[name] = t.detach().to("cpu").contiguous()
        pending_bytes += size
        total += size
    if not write:
        return {}
    flush()
    weight_map: dict[str, str] = {}
    for i, names in enumerate(parts):
        final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" if len(parts) > 1 else "model.safetensors"
        os.replace(path / f".part-{i:05d}.safetensors", path / final)
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
    return weight_map
