"""rltrain/engine/embedded/pieces.py: a function run a piece at a time, handed over to and from
its caller (the embedded engine's prefill between decode steps)."""

from __future__ import annotations

import threading
import time

import pytest

from rltrain.engine.embedded.pieces import Cancelled, Pieces, boundary


def _steps(log: list, n: int, each_s: float = 0.0):
    def fn():
        for i in range(n):
            boundary()
            log.append(("fn", i, threading.current_thread().name))
            time.sleep(each_s)
        return n

    return fn


def test_a_piece_runs_to_the_first_boundary_past_its_budget_and_only_while_the_caller_waits():
    log: list = []
    work = Pieces(_steps(log, 6, each_s=0.01), name="worker")
    time.sleep(0.05)
    assert log == [] and not work.done  # (nothing runs before the first resume)
    work.resume(0.0)  # a budget of nothing: past one boundary (every piece makes progress), paused at the next
    assert [x[1] for x in log] == [0]
    work.resume(0.025)  # ~10 ms per step: past the budget at the third boundary
    assert [x[1] for x in log] == [0, 1, 2, 3]
    log.append(("caller",))
    time.sleep(0.03)
    assert log[-1] == ("caller",)  # (paused: fn runs nothing while the caller does)
    assert work.result() == 6 and work.done and work.pieces == 3
    assert [x[1] for x in log if x[0] == "fn"] == list(range(6))
    assert {x[2] for x in log if x[0] == "fn"} == {"worker"}
    boundary()  # (on any other thread: nothing)


def test_an_error_in_the_function_is_raised_by_result_and_cancel_unwinds_a_paused_one():
    def broken():
        boundary()
        raise ValueError("in the function")

    work = Pieces(broken)
    work.resume(1.0)
    assert work.done
    with pytest.raises(ValueError, match="in the function"):
        work.result()

    unwound = threading.Event()

    def long():
        try:
            for _ in range(1000):
                boundary()
                time.sleep(0.001)
        finally:
            unwound.set()

    work = Pieces(long)
    work.resume(0.005)
    assert not work.done
    work.cancel()
    assert work.done and unwound.is_set()
    with pytest.raises(Cancelled):
        work.result()
