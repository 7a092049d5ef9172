"""Reward functions: built-in verifiable rewards and user `module:function` rewards.

A reward function takes (response_text, record) and returns a float. Built-ins:
- `math`: the answer is the last `\\boxed{...}` in the response (else the last number); 1.0 if it
  equals `record["answer"]` after normalisation (spaces, trailing zeros, commas, `$`), else 0.0.
- `exact_match`: 1.0 if the stripped response equals `record["answer"]` stripped.
- `format`: 1.0 if the response matches `record["format"]` or the configured regex.
A reward that raises or runs past `timeout_s` marks the sample failed: it is excluded from
training and counted in the metrics, never scored 0.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
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


def math_reward(response: str, record: dict[str, Any]) -> float:
    got = extract_boxed(response)
    if got is None:
        numbers = _NUMBER.findall(response)
        got = numbers[-1] if numbers else None
    if got is None:
        return 0.0
    return float(normalize_answer(got) == normalize_answer(str(record["answer"])))


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


class RewardRunner:
    """Scores responses in a thread pool with a per-call timeout; failures are failures."""

    def __init__(self, fn: RewardFn, timeout_s: float, workers: int = 4):
        self.fn, self.timeout_s = fn, timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="rltrain-reward")

    def score(self, items: list[tuple[str, dict[str, Any]]]) -> list[Scored]:
        futures = [self._pool.submit(self.fn, text, rec) for text, rec in items]
        out = []
        for fut in futures:
            try:
                value = fut.result(timeout=self.timeout_s)
                value = float(value)
                if value != value:  # NaN
                    raise ValueError("reward is NaN")
                out.append(Scored(value))
            except FutureTimeout:
                out.append(Scored(None, f"reward timed out after {self.timeout_s}s"))
            except Exception as e:  # noqa: BLE001 - the user's function failed: recorded, not scored 0
                out.append(Scored(None, f"reward raised {type(e).__name__}: {e}"))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
