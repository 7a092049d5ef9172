"""This rank's megatron weights from the HF checkpoint, and modules filled from a state.

A state is megatron name -> this rank's tensor. At creation the trainer's model (and its
reference) is filled from the HF checkpoint, of which each rank reads only what it holds: its
pipeline stage's layers, its block of experts (expert parallel), and of each weight the rows or
columns of its tensor-parallel shard (convert.py's `mcore_state`, over `SafetensorsSource`). The
checkpoint's names and shapes are checked against the model's config first, from the files'
headers, before any tensor is read. After a world rebuild or from a snapshot the model is filled
from the trainer's own capture instead. `fill` checks that a state fits the model exactly (every
name, every shape) before it copies anything in.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from rltrain.trainer.megatron.convert import Dims, RankPart, mcore_state
from rltrain.trainer.megatron.model import MegatronGroups, weights_of
from rltrain.weights.hf_sharded import stored_tensors


class SafetensorsSource:
    """The tensors of an HF checkpoint directory, read slice by slice (convert.py's `WeightSource`).

    Names map to files as weights/hf_sharded.py's `stored_tensors` finds them (through
    `model.safetensors.index.json` when there is one), shapes from the files' headers. `safe_open`
    maps a file without reading it; a read copies the rows/columns asked for out of the mapping, so
    the rank's own memory holds its slices, not the files. The file pages a read touches count in
    the process's resident memory while the file is mapped, and a column slice touches nearly every
    page of its tensor: a file is unmapped (and mapped again on its next read) once reads touched
    `unmap_after_bytes` of it. `bytes_read` counts the tensor bytes handed out. Use as a context
    manager: leaving it unmaps every file."""

    unmap_after_bytes = 256 << 20  # re-mapping costs a parse of the file's header

    def __init__(self, model_path: str | Path):
        self.root = Path(model_path)
        self.bytes_read = 0
        self._open_files: dict[Path, Any] = {}  # mapped on first use
        self._touched: dict[Path, int] = {}  # bytes of each mapped file that reads touched
        self._stored = stored_tensors(self.root)  # (the FSDP trainer's reader finds files the same way)

    def _mapped(self, f: Path) -> Any:
        if f not in self._open_files:
            self._open_files[f] = safe_open(str(f), framework="pt")
            self._touched[f] = 0
        return self._open_files[f]

    def _unmap(self, f: Path) -> None:
        self._open_files.pop(f).__exit__(None, None, None)

    def names(self) -> Collection[str]:
        return self._stored.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._stored[name].shape

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        f = self._stored[name].file
        whole = self._mapped(f).get_slice(name)
        rows = slice(None) if rows is None else rows
        view = whole[rows] if cols is None else whole[rows, cols]
        t = view.clone()  # storage of its own: the view is into the mapped file
        self.bytes_read += t.nbytes
        # A column slice spans the pages of its rows whole.
        self._touched[f] += t.nbytes if cols is None else len(t) * math.prod(whole.get_shape()[1:]) * t.element_size()
        if self._touched[f] >= self.unmap_after_bytes:
            self._unmap(f)
        return t

    def close(self) -> None:
        for f in list(self._open_files):
            self._unmap(f)

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hf_state(model_path: str, d: Dims, groups: MegatronGroups) -> dict[str, torch.Tensor]:
    """This rank's part of the HF checkpoint in `model_path`, under its stage's megatron names."""
    g, layout = groups, groups.layout
    part = RankPart(g.tp_rank, layout.tp, g.ep_rank, g.ep_size, g.pp_rank, layout.pp)
    with SafetensorsSource(model_path) as src:
        return mcore_state(src, d, part)


@torch.no_grad()
def fill(gpt: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into the GPTModel's parameters; it must name each of them, at its shape."""
    params = weights_of(gpt)
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"megatron state does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in params.items():
        src = state[name]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(src.shape)} does not fit the model's {tuple(p.shape)}")
        p.copy_(src)
