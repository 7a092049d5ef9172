"""What every part of the embedded engine reads about its state, kept in one place.

One `EngineState` per engine, handed to its scheduler, weight receiver and residency manager:
the engine's lock, the memory regions released, whether the weights hold values, their version
and the directory they were last loaded from. A batch runs under `lock`, and so does every
change of what a batch depends on (a release, a resume, a weight update): no batch ever runs on
weights or a KV cache that are changing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


class EngineStateError(RuntimeError):
    """The request cannot run in the engine's current state (released, paused, no weights)."""


@dataclass
class EngineState:
    """The engine's lock and the state a request is checked against (module doc)."""

    model_path: str
    weight_version: str = "default"
    released: set[str] = field(default_factory=set)  # memory regions released (saver.TAGS)
    weights_valid: bool = True  # False after resume without a backup, until weights are loaded
    # Counts every change of what the KV cache's keys were computed with, or of its memory: a
    # weight write, a release, a resume, a flush (the prefix cache is emptied when it moved).
    epoch: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)

    def changed(self) -> None:
        """The weights or the engine's memory changed: no key cached before may be served."""
        self.epoch += 1

    def check_can_generate(self) -> None:
        if self.released:
            raise EngineStateError(
                f"engine memory is released ({', '.join(sorted(self.released))}); "
                "call /resume_memory_occupation before generating"
            )
        if not self.weights_valid:
            raise EngineStateError("engine weights were resumed without a backup; update the weights before generating")

    def check_weights_held(self, doing: str) -> None:
        """Refuse `doing` ("updating", "checking") the weights while they are released."""
        if "weights" in self.released:
            raise EngineStateError(f"weights are released; resume weights before {doing} them")

    def loaded(self, weight_version: str | None) -> None:
        """An update wrote the weights: they hold values, of `weight_version` when it is given."""
        self.changed()
        self.weights_valid = True
        if weight_version is not None:
            self.weight_version = str(weight_version)
