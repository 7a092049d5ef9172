"""Reward functions: built-in verifiable rewards and user `module:function` rewards.

A reward function takes (response_text, record) and returns a float. Built-ins:
- `math`: 1.0 if the response's answer equals `record["answer"]`, else 0.0. With Hugging Face's
  `math-verify` installed (the `math` extra; the dev set-up installs it) both are parsed and
  compared symbolically: `0.5` = `1/2` = `\\frac{1}{2}`, `x = 3` = `3`, intervals, sets, units,
  the last `\\boxed{}` in prose. Either way the normaliser's answer also counts: the last
  `\\boxed{...}` in the response (else its last number) equal to the answer after normalisation
  (spaces, trailing zeros, commas, `$`) — what `math` does without math-verify.
- `exact_match`: 1.0 if the stripped response equals `record["answer"]` stripped.
- `format`: 1.0 if the response matches `record["format"]` or the configured regex.
A reward that raises or runs past `timeout_s` marks the sample failed: it is excluded from
training and counted in the metrics, never scored 0. A reward that never returns holds a thread
of the pool for good (a thread cannot be stopped): the runner leaves it and goes on with a fresh
pool, so a hung grader costs its own samples and the timeout once, never the rest of the step;
its thread is a daemon, which does not keep the process from exiting.
math-verify's own timeouts use signals, which work only in a process's main thread: off it,
`math` calls math-verify without them and `timeout_s` bounds the call.
"""

from __future__ import annotations

import functools
import importlib
import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

RewardFn = Callable[[str, dict[str, Any]], float]


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_answer(ans: str) -> str:
    s = ans.strip().strip("$").replace(",", "").replace(" ", "")
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".")
    return s


def normalised_math_reward(response: str, record: dict[str, Any]) -> float:
    """`math` without math-verify: the last boxed answer (else the last number), normalised."""
    got = extract_boxed(response)
    if got is None:
        numbers = _NUMBER.findall(response)
        got = numbers[-1] if numbers else None
    if got is None:
        return 0.0
    return float(normalize_answer(got) == normalize_answer(str(record["answer"])))


MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own per-parse and per-comparison limit (main thread only)


def _math_verify() -> Any:
    """The math_verify module, or None where it is not installed."""
    try:
        import math_verify  # noqa: PLC0415 - optional (the `math` extra)
    except ImportError:
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # (its note that off the main thread we time it)
    return math_verify


def verified_math_reward(response: str, record: dict[str, Any]) -> float | None:
    """math-verify's judgement of the response against `record["answer"]` (None: not installed).
    A bare answer is read as LaTeX math (`$...$`), as the datasets write it."""
    mv = _math_verify()
    if mv is None:
        return None
    t = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    expected = _parsed_answer(str(record["answer"]))
    got = mv.parse(response, parsing_timeout=t)
    return float(bool(expected) and bool(got) and mv.verify(expected, got, timeout_seconds=t))


@functools.lru_cache(maxsize=4096)
def _parsed_answer(gold: str) -> Any:
    """math-verify's parse of a record's answer, the data's own (no timeout of its own: a call
    in the runner is bounded by `reward.timeout_s`), once for a prompt's n samples (~4 ms each)."""
    if "$" not in gold and "\\boxed" not in gold:
        gold = f"${gold}$"
    return _math_verify().parse(gold, parsing_timeout=None)


def math_reward(response: str, record: dict[str, Any]) -> float:
    if normalised_math_reward(response, record):
        return 1.0
    return verified_math_reward(response, record) or 0.0


def exact_match_reward(response: str, record: dict[str, Any]) -> float:
    return float(response.strip() == str(record["answer"]).strip())


def make_format_reward(pattern: str | None) -> RewardFn:
    def format_reward(response: str, record: dict[str, Any]) -> float:
        pat = record.get("format", pattern)
        if pat is None:
            raise ValueError("format reward needs reward.format_regex or a 'format' field in the record")
        return float(re.fullmatch(pat, response.strip(), flags=re.DOTALL) is not None)

    return format_reward


def load_reward(name: str, format_regex: str | None = None) -> RewardFn:
    builtins = {"math": math_reward, "exact_match": exact_match_reward}
    if name in builtins:
        return builtins[name]
    if name == "format":
        return make_format_reward(format_regex)
    if ":" not in name:
        raise ValueError(f"reward.function={name!r}: expected math, exact_match, format or module:function")
    module, fn = name.split(":", 1)
    try:
        obj = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward.function={name!r}: cannot import it ({e})") from None
    if not callable(obj):
        raise ValueError(f"reward.function={name!r} is not callable")
    return obj


@dataclass
class Scored:
    reward: float | None
    error: str | None = None


class Workers:
    """`size` daemon threads running calls from a queue, each call's `Future` returned. Daemon
    threads, unlike ThreadPoolExecutor's (joined when the interpreter exits), leave a call that
    never returns behind at exit: a hung grader cannot hold the job's process open. The threads
    start at the first call: a rank that has not scored yet runs no thread of this pool, so its
    engine can still be started by a fork (engine/forked.py)."""

    def __init__(self, size: int, name: str):
        self._tasks: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(size)]
        self._start = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        with self._start:
            if self._threads[0].ident is None:  # (not started yet)
                for t in self._threads:
                    t.start()
        fut: Future = Future()
        self._tasks.put((fut, fn, args))
        return fut

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            fut, fn, args = task
            if not fut.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the caller's to judge
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Each thread ends once it has run what it holds (a hung one never: it is a daemon)."""
        for _ in self._threads:
            self._tasks.put(None)


class RewardRunner:
    """Scores responses in a thread pool, each call bounded by `timeout_s` from its start;
    failures are failures (module doc)."""

    POLL_S = 0.05  # how often the deadlines of running calls are looked at

    def __init__(self, fn: RewardFn, timeout_s: float, workers: int = 4):
        self.fn, self.timeout_s, self.workers = fn, timeout_s, workers
        self._pool = self._fresh()
        self.abandoned = 0  # calls that never returned: each holds a thread of an old pool

    def _fresh(self) -> Workers:
        return Workers(self.workers, "rltrain-reward")

    def _call(self, started: dict[int, float], i: int, text: str, rec: dict[str, Any]) -> float:
        started[i] = time.monotonic()
        value = float(self.fn(text, rec))
        if value != value:  # NaN
            raise ValueError("reward is NaN")
        return value

    def score(self, items: list[tuple[str, dict[str, Any]]]) -> list[Scored]:
        out: list[Scored | None] = [None] * len(items)
        started: dict[int, float] = {}
        running: dict[Future, int] = {
            self._pool.submit(self._call, started, i, text, rec): i for i, (text, rec) in enumerate(items)
        }
        while running:
            done, _ = wait(running, timeout=self.POLL_S, return_when=FIRST_COMPLETED)
            for fut in done:
                i = running.pop(fut)
                try:
                    out[i] = Scored(fut.result())
                except Exception as e:  # noqa: BLE001 - the user's function failed: recorded, not scored 0
                    out[i] = Scored(None, f"reward raised {type(e).__name__}: {e}")
            now = time.monotonic()
            late = [f for f, i in running.items() if i in started and now - started[i] > self.timeout_s]
            if not late:
                continue
            for fut in late:
                out[running.pop(fut)] = Scored(None, f"reward timed out after {self.timeout_s}s")
            # The late calls keep their threads: the calls not yet started go to a fresh pool.
            self.abandoned += len(late)
            old, self._pool = self._pool, self._fresh()
            for fut, i in list(running.items()):
                if fut.cancel():
                    del running[fut]
                    running[self._pool.submit(self._call, started, i, *items[i])] = i
            old.shutdown()
        return [s if s is not None else Scored(None, "reward not run") for s in out]

    def close(self) -> None:
        self._pool.shutdown()
