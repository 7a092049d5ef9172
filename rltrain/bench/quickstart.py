"""Benchmark: the CPU quickstart end to end — the fixed cost of a step, start-up and shutdown.

    python -m rltrain.bench.quickstart                     # the README's quickstart: 800 steps, 2 ranks
    python -m rltrain.bench.quickstart --steps 200 trainer.lr=0.003   # overrides after the flags
    python -m rltrain.bench.quickstart --config configs/quickstart-tools.yaml --steps 200   # the tools one

Runs `torchrun --nproc-per-node=2 -m rltrain --config configs/quickstart.yaml` in a fresh run
directory (the tiny model built there) and reads its metrics. Per step, medians over the steps
after the first five:
  compute        rollout + old log-probs + train: the step's own work, the floor of any step
  switches       world destroy/rebuild, engine release and resumes, trainer onload/offload and the
                 weight sync with its checks (version, checksum): what moving between phases costs
  probe          the awake engines score the probe against the trainer (the sync's last check)
  rest           the step minus every timed phase: metrics, stop agreement, checkpoint bookkeeping
  fixed          the step minus its compute
and once: start-up (launch to the first step's start), shutdown (the last step's end to exit,
plots included), and the mean reward of the last 20 steps (the quickstart must still learn).
For a multi-turn quickstart, also its learning curve: reward and tool calls per trajectory at
a few steps, and the first step (and the wall time to it) where the reward's mean over 10 steps
reaches 0.8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rltrain.bench import e2e
from rltrain.bench.first_error import failed_run_report

COMPUTE = ("rollout", "logprobs", "train")
SWITCHES = tuple(p for p in e2e.SWITCHES if p != "sync_probe")  # the probe is reported on its own


def run(root: Path, steps: int, overrides: list[str], config: str = "") -> tuple[list[dict], float, float]:
    """The quickstart's metrics rows, and the launch and exit wall times."""
    repo = Path(__file__).resolve().parents[2]
    config_path = Path(config).resolve() if config else repo / "configs" / "quickstart.yaml"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "rltrain",
        "--config",
        str(config_path),
        f"run.dir={root}",
        f"model.path={root / 'base_model'}",
        f"loop.steps={steps}",
        "metrics.progress_bar=false",
        "run.start_over=true",  # a kept directory's earlier run is renamed aside, not measured again
        *overrides,
    ]
    log = root / "quickstart.log"
    t0 = time.time()
    with open(log, "w") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root, env={**os.environ})
    t1 = time.time()
    if r.returncode != 0:
        raise SystemExit(failed_run_report("the quickstart", r.returncode, log))
    (metrics,) = root.glob("*/metrics.jsonl")  # (the run's own name)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return rows, t0, t1


def learning_curve(rows: list[dict], t0: float) -> None:
    """A multi-turn run's reward and tool calls per trajectory at a few steps, and when the
    reward's mean over 10 steps first reaches 0.8."""
    print("# learning curve: step, reward, tool calls per trajectory, turns per trajectory")
    for i in sorted({0, 9, 24, 49, 99, 149, 199, len(rows) - 1} & set(range(len(rows)))):
        r = rows[i]
        calls = r.get("multiturn", {}).get("tool_calls", 0.0) / max(r["samples"], 1.0)
        print(f"{r['step']:>24d} {r['reward_mean']:9.3f} {calls:9.2f} {r.get('turns_per_trajectory', 1.0):9.2f}")
    means = [statistics.mean(r["reward_mean"] for r in rows[max(0, i - 9) : i + 1]) for i in range(len(rows))]
    reached = next((i for i, m in enumerate(means) if i >= 9 and m >= 0.8), None)
    if reached is None:
        print(f"{'reward >= 0.8 (10 steps)':>24s} not reached in {len(rows)} steps")
    else:
        when = rows[reached]["wall"] - t0
        print(f"{'reward >= 0.8 (10 steps)':>24s} at step {rows[reached]['step']}, {when:.1f} s after launch")


def summarize(rows: list[dict], t0: float, t1: float) -> dict[str, float]:
    steady = rows[5:] if len(rows) > 10 else rows
    med = lambda f: statistics.median(f(r) for r in steady)  # noqa: E731
    timed = lambda r: sum(v for k, v in r["time"].items() if k != "step")  # noqa: E731
    out = {
        "step": med(lambda r: r["time"]["step"]),
        **{p: med(lambda r, p=p: r["time"].get(p, 0.0)) for p in COMPUTE},
        "compute": med(lambda r: sum(r["time"].get(p, 0.0) for p in COMPUTE)),
        "switches": med(lambda r: sum(r["time"].get(p, 0.0) for p in SWITCHES)),
        "sync": med(lambda r: r["time"].get("sync", 0.0)),
        "probe": med(lambda r: r["time"].get("sync_probe", 0.0)),
        "rest": med(lambda r: r["time"]["step"] - timed(r)),
        "fixed": med(lambda r: r["time"]["step"] - sum(r["time"].get(p, 0.0) for p in COMPUTE)),
        "start-up": rows[0]["wall"] - rows[0]["time"]["step"] - t0,
        "shutdown": t1 - rows[-1]["wall"],
        "reward, last 20 steps": statistics.mean(r["reward_mean"] for r in rows[-20:]),
        "wall": t1 - t0,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--keep", default="", help="run in this directory and keep it")
    ap.add_argument("--config", default="", help="another quickstart's config (default: configs/quickstart.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for the quickstart")
    a = ap.parse_args(argv)
    root = Path(a.keep or tempfile.mkdtemp(prefix="rltrain-bench-quickstart-"))
    root.mkdir(parents=True, exist_ok=True)
    rows, t0, t1 = run(root, a.steps, a.overrides, a.config)
    s = summarize(rows, t0, t1)
    print(
        f"# rltrain.bench.quickstart  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  "
        f"{os.cpu_count()} CPUs; {a.config or 'configs/quickstart.yaml'}, {a.steps} steps, 2 ranks; medians over "
        f"steps 6..{a.steps}"
    )
    print(f"# limit: the step's own compute (rollout + log-probs + train), {s['compute'] * 1e3:.1f} ms")
    for key in ("step", "compute", *COMPUTE, "switches", "sync", "probe", "rest", "fixed"):
        share = f"{s[key] / s['step']:6.1%} of the step" if key != "step" else ""
        print(f"{key:>24s} {s[key] * 1e3:9.1f} ms  {share}")
    for key in ("start-up", "shutdown", "wall"):
        print(f"{key:>24s} {s[key]:9.1f} s")
    print(f"{'reward, last 20 steps':>24s} {s['reward, last 20 steps']:9.3f}")
    if "multiturn" in rows[0]:
        learning_curve(rows, t0)
    print(f"run directory: {next(root.glob('*/metrics.jsonl')).parent}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
