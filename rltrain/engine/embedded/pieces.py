"""A function run a piece at a time between the scheduler's decode steps (batching.py's prefill).

    work = Pieces(fn)            # fn runs on a thread of its own, and only while the caller waits
    work.resume(0.004)           # run it until it has run ~4 ms past a boundary, or to its end
    work.finish()                # run the rest
    work.result()                # fn's value (or its exception, raised)
    work.cancel()                # fn raises Cancelled at its next boundary; waits for its end

    boundary()                   # in fn's thread (the transformer blocks' pre-hooks call it): a
                                 # place to pause once the piece's time is spent; elsewhere nothing

A coroutine made of a thread and two events: the caller and `fn` hand over to each other, so only
one of them runs Python at any time (neither waits for the interpreter lock held by the other,
as a prefill thread running beside the scheduler did: measured and dropped, docs/benchmarks/).
What `fn` queues on the GPU runs beside what the caller queues in between (on a stream of `fn`'s
own). `fn` must reach `boundary()` often (every layer of a forward) and touch nothing the caller
changes while it is paused but what it owns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

_here = threading.local()  # .pieces: the Pieces whose fn runs on this thread


class Cancelled(Exception):
    """Raised in `fn` at a boundary after `cancel()`."""


def boundary() -> None:
    """Where the running `fn` may pause (a no-op on any other thread)."""
    pieces: Pieces | None = getattr(_here, "pieces", None)
    if pieces is not None:
        pieces._boundary()


class Pieces:
    """`fn` on a thread of its own, run a piece at a time (module doc)."""

    def __init__(self, fn: Callable[[], Any], name: str = "pieces"):
        self._fn = fn
        self._go, self._paused = threading.Event(), threading.Event()
        self._budget, self._t0 = 0.0, 0.0
        self._fresh = False  # no boundary passed yet in this piece (each piece passes one at least)
        self._cancelled = False
        self._value: Any = None
        self._error: BaseException | None = None
        self.done = False
        self.pieces = 0  # pieces run so far
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._go.wait()
        _here.pieces = self
        try:
            self._value = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, raised by result()
            self._error = e
        finally:
            _here.pieces = None
            self.done = True
            self._paused.set()

    def resume(self, budget_s: float) -> None:
        """Run `fn` until it reaches a boundary after `budget_s` seconds of this piece (past one
        boundary at least: every piece makes progress), or ends; return then (nothing of `fn`
        runs after)."""
        if self.done:
            return
        self._budget, self._t0, self._fresh = budget_s, time.perf_counter(), True
        self.pieces += 1
        self._paused.clear()
        self._go.set()
        self._paused.wait()

    def finish(self) -> None:
        """Run the rest of `fn`."""
        while not self.done:
            self.resume(float("inf"))

    def cancel(self) -> None:
        """End `fn` early: it raises `Cancelled` at its next boundary (or runs to its end)."""
        self._cancelled = True
        self.finish()
        self._thread.join()

    def result(self) -> Any:
        """`fn`'s value, or its exception raised here (after `finish`)."""
        self.finish()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value

    def _boundary(self) -> None:
        if self._cancelled:
            raise Cancelled("cancelled between pieces")
        if self._fresh or time.perf_counter() - self._t0 < self._budget:
            self._fresh = False
            return
        self._go.clear()
        self._paused.set()
        self._go.wait()
