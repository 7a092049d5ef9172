"""Environments of multi-turn rollouts: the contract a user's environment follows, and the built-in
one that gives the model tools.

    rollout.env: mypkg.envs:Maze          # a user's environment (`Environment`), one per trajectory
    rollout.tools: [mypkg.tools:add]      # or: the built-in `ToolEnvironment` with these functions

An environment is made for one trajectory from its data record (`cls(record)`); then

    reset()            -> the first prompt: chat messages, text, token ids, or None (the data's prompt)
    step(text, ids)    -> `EnvStep`: what the model sees next (an observation), or done; and a reward

`step` is given each model turn as the model sampled it: the text (special tokens skipped) and
the token ids exactly as the engine returned them. An observation is chat messages (rendered with
the tokenizer's chat template, as a tool or user turn after the model's), plain text, or token
ids (appended as they are). The trajectory's reward is the sum of the rewards `step` returned; an
environment that returns none leaves the reward to `reward.function`, scored on the model's last
turn (the estimators see one reward per trajectory either way). An exception from `reset` or
`step` fails the trajectory (its group is dropped and counted, never scored 0).

`ToolEnvironment`: the model calls tools in the Qwen/Hermes format, a JSON object between
`<tool_call>` and `</tool_call>` (`{"name": ..., "arguments": {...}}`); each call runs (its own
daemon thread, `rollout.tool_timeout_s` at most: a tool that never returns holds neither the
trajectory nor the process's exit) and its result comes back as a `tool` message; a turn
without a call ends the trajectory. A call that is malformed, names no known tool, raises or times
out gives the model an error text instead (counted: `ToolStats`), never a crash. Tools get the
model's arguments as keyword arguments: they are untrusted input, and no tool here evaluates them
as code. A tool with a parameter named `record` also gets the trajectory's data record (a
per-task database, sandbox or answer key the model cannot set). The tools' JSON schemas (from
their signatures and docstrings, transformers' `get_json_schema`) go into the first prompt
through the chat template's `tools`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

Observation = list[dict[str, Any]] | str | list[int]

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
RECORD = "record"  # a tool's parameter that gets the trajectory's data record


@dataclass
class EnvStep:
    """What an environment answers to a model turn: `observation` None ends the trajectory."""

    observation: Observation | None = None
    reward: float | None = None


class Environment(Protocol):
    """One trajectory's environment (module doc). Made as `cls(record)` (`ToolEnvironment` is
    made by the rollout with its tools)."""

    def reset(self) -> Observation | None: ...

    def step(self, text: str, token_ids: list[int]) -> EnvStep: ...


def load_object(spec: str, what: str) -> Any:
    """`module:name` imported (a clear error naming `what` otherwise)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what}={spec!r}: expected module:name")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}={spec!r}: {type(e).__name__}: {e}") from e


@dataclass
class ToolStats:
    """Tool calls over a rollout, per tool (thread-safe: trajectories run at once)."""

    calls: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # raised, timed out, or not a valid call
    timeouts: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, tool: str, error: bool, timed_out: bool, seconds: float) -> None:
        with self._lock:
            self.calls[tool] = self.calls.get(tool, 0) + 1
            if error:
                self.errors[tool] = self.errors.get(tool, 0) + 1
            self.timeouts += int(timed_out)
            self.seconds += seconds


class Tools:
    """The functions `rollout.tools` names, their schemas, and a bounded pool that runs them."""

    def __init__(self, specs: list[str], timeout_s: float, workers: int = 16):
        self.functions: dict[str, Callable[..., Any]] = {}
        for spec in specs:
            fn = load_object(spec, "rollout.tools")
            if not callable(fn):
                raise ValueError(f"rollout.tools: {spec} is not callable")
            self.functions[fn.__name__] = fn
        self.schemas = [_schema(fn) for fn in self.functions.values()]
        self.timeout_s = timeout_s
        # Each call runs on a daemon thread of its own (a tool that never returns must not keep
        # the process from exiting), at most `workers` at once: a call waits for a slot within
        # its timeout, so tools that hang cannot pile threads up without end.
        self._slots = threading.BoundedSemaphore(workers)
        self.stats = ToolStats()

    def call(self, text: str, record: dict[str, Any] | None = None) -> tuple[str, str]:
        """(tool name or "?", the text the model sees) for one `<tool_call>` body. A tool with a
        parameter named `record` is given the trajectory's data record there (the task's own
        context: the model cannot set it, and its schema does not show it)."""
        t0 = time.perf_counter()
        try:
            call = json.loads(text)
            name, args = call["name"], call.get("arguments", {})
            if isinstance(args, str):  # some templates write the arguments as a JSON string
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
        except (ValueError, KeyError, TypeError) as e:
            self.stats.add("?", True, False, time.perf_counter() - t0)
            return "?", f"error: not a valid tool call ({type(e).__name__}: {e}); expected " + (
                '{"name": ..., "arguments": {...}}'
            )
        fn = self.functions.get(name)
        if fn is None:
            self.stats.add(name, True, False, time.perf_counter() - t0)
            return name, f"error: no tool named {name!r}; the tools are {sorted(self.functions)}"
        args.pop(RECORD, None)  # (never the model's to set)
        if RECORD in inspect.signature(fn).parameters:
            args[RECORD] = record if record is not None else {}
        done, box = self._run(fn, args)
        if not done:
            self.stats.add(name, True, True, time.perf_counter() - t0)
            return name, f"error: {name} timed out after {self.timeout_s:g} s"
        if "error" in box:
            raised = box["error"]
            self.stats.add(name, True, False, time.perf_counter() - t0)
            return name, f"error: {name} raised {type(raised).__name__}: {raised}"
        self.stats.add(name, False, False, time.perf_counter() - t0)
        out = box.get("out")
        try:
            return name, out if isinstance(out, str) else json.dumps(out)
        except (TypeError, ValueError) as e:
            return name, f"error: {name} returned {type(out).__name__}, not text or JSON ({e})"

    def _run(self, fn: Callable[..., Any], args: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """(finished within the timeout, {"out": result} or {"error": exception})."""
        deadline = time.monotonic() + self.timeout_s
        box: dict[str, Any] = {}
        if not self._slots.acquire(timeout=self.timeout_s):
            return False, box

        def call() -> None:
            try:
                box["out"] = fn(**args)
            except Exception as e:  # noqa: BLE001 - the model sees what its call did
                box["error"] = e
            finally:
                self._slots.release()

        thread = threading.Thread(target=call, name="rltrain-tool", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        return not thread.is_alive(), box

    def close(self) -> None:
        """Nothing to wait for: a call still running ends with its thread (a daemon)."""


def _schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The tool's JSON schema as transformers makes it, without its `record` parameter."""
    from transformers.utils import get_json_schema  # noqa: PLC0415 - transformers is heavy; tools only

    signature = inspect.signature(fn)
    if RECORD in signature.parameters:

        def shown() -> None: ...

        shown.__name__, shown.__doc__ = fn.__name__, fn.__doc__
        shown.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[p for p in signature.parameters.values() if p.name != RECORD]
        )
        shown.__annotations__ = {k: v for k, v in typing.get_type_hints(fn).items() if k != RECORD}
        fn = shown
    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' own message says what the docstring lacks
        raise ValueError(f"rollout.tools: {fn.__name__}: {e}") from e


class ToolEnvironment:
    """The model and its tools (module doc): the data's prompt with the tools' schemas, then a
    tool message per turn that calls any, until a turn calls none."""

    def __init__(self, record: dict[str, Any], tools: Tools):
        self.record, self.tools = record, tools

    def reset(self) -> Observation | None:
        messages = self.record.get("messages")
        if messages is None and "prompt" in self.record:
            messages = [{"role": "user", "content": str(self.record["prompt"])}]
        return messages

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        calls = TOOL_CALL.findall(text)
        if not calls:
            return EnvStep(None)
        answers = [self.tools.call(call, self.record) for call in calls]
        return EnvStep([{"role": "tool", "name": name, "content": out} for name, out in answers])
