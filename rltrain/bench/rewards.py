"""Benchmark: what the `math` reward costs per 1,000 responses, and that a hung grader does not stall a step.

    python -m rltrain.bench.rewards [--responses 1000] [--workers 4] [--timeout 2] [--hung 3]

Responses like a math rollout's (prose, a `\\boxed{}` answer or a last number, LaTeX fractions,
equations, intervals, units; about a third wrong; some with no answer), 8 per prompt, each
against its prompt's answer. Timed, each over the same responses:

- the normaliser alone (`normalised_math_reward`): the floor, what `math` costs without math-verify;
- `math` (the normaliser, then math-verify where it does not match) in the caller's thread;
- `math` through the loop's `RewardRunner` (`--workers` threads, `reward.timeout_s` = `--timeout`);
- the same with `--hung` graders that never return (a sample whose grader hangs): the step's
  scoring must end within about one timeout, every other sample scored.

The machine's CPU count is printed: the runner's threads share one interpreter, so math-verify's
Python work does not run faster with more of them; what they buy is that a slow grader does not
hold the others.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
from typing import Any

from rltrain.rollout.rewards import RewardRunner, math_reward, normalised_math_reward, verified_math_reward

_FORMS = [
    (lambda a: f"First we add the parts, then divide. So the answer is \\boxed{{{a}}}.", lambda a: str(a)),
    (lambda a: f"Counting again gives {a - 3} and {a}. The total is {a}", lambda a: str(a)),
    (lambda a: f"Half of it is $\\frac{{{a}}}{{2}}$, so we get \\boxed{{\\frac{{{a}}}{{2}}}}", lambda a: f"{a / 2}"),
    (lambda a: f"Solving the equation: \\boxed{{x = {a}}}", lambda a: str(a)),
    (lambda a: f"The set is \\boxed{{(1, {a}]}}", lambda a: f"(1,{a}]"),
    (lambda a: f"It measures \\boxed{{{a}\\text{{ cm}}}} in all", lambda a: str(a)),
    (lambda a: "I am not sure how to solve this one.", lambda a: str(a)),
]


_WORDS = ["so", "then", "we", "have", "the", "sum", "of", "each", "part"]


def responses(n: int, samples: int = 8, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """`n` (response, record) pairs of the forms above, `samples` per prompt (its record shared);
    about a third answer the wrong number."""
    rng = random.Random(seed)
    out: list[tuple[str, dict[str, Any]]] = []
    while len(out) < n:
        a = rng.randrange(4, 2000)
        say, gold = rng.choice(_FORMS)
        record = {"answer": gold(a)}
        for _ in range(min(samples, n - len(out))):
            wrong = rng.random() < 0.33
            filler = " ".join(rng.choice(_WORDS) for _ in range(60))
            out.append((f"{filler}. {say(a + 1 if wrong else a)}", record))
    return out


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rltrain.bench.rewards", description=__doc__)
    ap.add_argument("--responses", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=4, help="reward.workers")
    ap.add_argument("--timeout", type=float, default=2.0, help="reward.timeout_s")
    ap.add_argument("--hung", type=int, default=3, help="graders that never return, in the last run")
    a = ap.parse_args(argv)
    items = responses(a.responses)
    if verified_math_reward(*items[0]) is None:
        raise SystemExit("rltrain.bench.rewards measures math-verify: install the math extra (pip install '.[math]')")
    print(
        f"# rltrain.bench.rewards  {time.strftime('%Y-%m-%d')}  {os.cpu_count()} CPUs  {a.responses} responses  "
        f"workers {a.workers}  timeout {a.timeout:g} s"
    )
    per = 1000 / a.responses
    floor, plain = _timed(lambda: [normalised_math_reward(t, r) for t, r in items])
    inline, scored = _timed(lambda: [math_reward(t, r) for t, r in items])
    runner = RewardRunner(math_reward, a.timeout, a.workers)
    try:
        pooled, out = _timed(lambda: runner.score(items))
    finally:
        runner.close()
    hang = set(range(0, a.responses, max(1, a.responses // max(a.hung, 1))))
    hang = set(sorted(hang)[: a.hung])
    release = threading.Event()

    def graded(text: str, record: dict[str, Any]) -> float:
        if record.get("hang"):
            release.wait()  # never returns while the run lasts
        return math_reward(text, record)

    stuck = [(t, {**r, "hang": i in hang}) for i, (t, r) in enumerate(items)]
    runner = RewardRunner(graded, a.timeout, a.workers)
    try:
        hung_s, hung_out = _timed(lambda: runner.score(stuck))
    finally:
        release.set()
        runner.close()
    failed = [i for i, s in enumerate(hung_out) if s.error]
    matched = sum(scored)
    print(f"{'':>46s} {'s / 1,000':>10s} {'of the floor':>13s}")
    print(f"{'the normaliser alone (the floor)':>46s} {floor * per:10.3f} {1:12.0%}")
    print(f"{'math, in the caller':>46s} {inline * per:10.3f} {inline / floor:12.0f}x")
    print(f"{'math, RewardRunner':>46s} {pooled * per:10.3f} {pooled / floor:12.0f}x")
    print(f"{f'math, RewardRunner, {len(hang)} graders hung':>46s} {hung_s * per:10.3f} {hung_s / floor:12.0f}x")
    print(
        f"matched: normaliser {sum(plain):.0f}, math {matched:.0f} of {a.responses}; the runner's scores equal the "
        f"caller's: {[s.reward for s in out] == scored}"
    )
    print(
        f"hung graders: {len(failed)} samples failed ({sorted(failed) == sorted(hang)}: exactly the hung ones), the "
        f"others scored; the scoring took {hung_s:.2f} s against {pooled:.2f} s without them "
        f"(+{hung_s - pooled:.2f} s; timeout {a.timeout:g} s)"
    )
    return 0 if sorted(failed) == sorted(hang) and [s.reward for s in out] == scored else 1


if __name__ == "__main__":
    raise SystemExit(main())
