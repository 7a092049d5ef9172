"""What the paged path's runner (batching.py) has queued on the device and reads back.

    Seq(row, pages)                     # a decoding row and its pages
    Launched(seqs, *to_host(t, lp))     # a decode step (or a prefill's first tokens) queued
    Prefill(seqs, work)                 # an admission prefilled in pieces (pieces.py)

A step's sampled tokens and log-probs are copied to pinned host memory as the step is queued;
the host reads them once their event has passed (on the CPU they are there at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rltrain.engine.embedded.pieces import Pieces
from rltrain.engine.embedded.rows import Row


@dataclass
class Seq:
    """A decoding row and its pages (its prompt's shared full pages first, then its own: fixed
    at admission, which reserves them all)."""

    row: Row
    pages: list[int]
    _table: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def table(self, width: int) -> torch.Tensor:
        """Its pages as a row of a page table `width` wide (int32, on the host), made once: the
        batch's table is rebuilt from these whenever rows join (a stack, not a row at a time)."""
        if self._table is None:
            self._table = torch.tensor(self.pages + [0] * (width - len(self.pages)), dtype=torch.int32)
        return self._table


@dataclass
class Launched:
    """A decode step queued on the device: its rows, and their sampled tokens and log-probs
    ([2, rows] float64) being copied to the host, there once `ready` has passed (None: there)."""

    seqs: list[Seq]
    host: torch.Tensor
    ready: Any


@dataclass
class Prefill:
    """An admission whose prefill is queued in pieces: the rows that join once it is done, and
    its work (a `Pieces` whose value is the `Launched` of their first tokens)."""

    seqs: list[Seq]
    work: Pieces

    def done(self) -> bool:
        """Whether it is all queued and its first tokens are on the host (or it failed)."""
        if not self.work.done:
            return False
        try:
            ready = self.work.result().ready
        except Exception:  # noqa: BLE001 - raised again where it joins
            return True
        return ready is None or ready.query()


def to_host(tokens: torch.Tensor, logps: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start copying (tokens, log-probs) to the host: (the host tensor, the event after which it
    holds them; None on CPU)."""
    both = torch.stack([tokens.double(), logps.double()])
    if not both.is_cuda:
        return both, None
    host = both.to("cpu", non_blocking=True)  # (pinned, from the caching host allocator)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
