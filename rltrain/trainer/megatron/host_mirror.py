"""Copies of the megatron trainer's captured state: into page-locked host buffers kept between
offloads (`HostMirror`), or plain copies on a device (`copied`).

A capture is a nested dict/list of tensors (weights, optimizer state, the reference). Offloads
of a trainer capture the same shapes every time, so the mirror keeps its buffers (from one
`PinnedArena`) and only copies into them: pinning afresh per offload costs seconds. The mirror's
buffers are spare host memory to the ledger while the trainer is on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rltrain.runtime.pinned import PinnedArena
from rltrain.trainer.state import tensors_in


class HostMirror:
    """Page-locked host copies of a nested state, reused while its tensors keep their shapes."""

    def __init__(self) -> None:
        self._arena = PinnedArena()
        self.buffers: list[torch.Tensor] = []

    def copy_in(self, state: Any) -> Any:
        """`state` with each tensor replaced by its buffer, the copies complete."""
        tensors: list[torch.Tensor] = []
        tensors_in(state, tensors)
        fits = len(tensors) == len(self.buffers) and all(
            b.shape == t.shape and b.dtype == t.dtype for b, t in zip(self.buffers, tensors)
        )
        if not fits:
            self.buffers = []
            self.buffers = self._arena.like(tensors)
        for b, t in zip(self.buffers, tensors):
            b.copy_(t.detach(), non_blocking=True)
        torch.cuda.synchronize()
        it = iter(self.buffers)
        return _map(state, lambda _: next(it))


def copied(obj: Any, device: torch.device | str | None) -> Any:
    """A copy of a (nested) state with its tensors on `device` (None: cloned in place)."""
    return _map(obj, lambda t: t.detach().clone() if device is None else t.detach().to(device, copy=True))


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj
