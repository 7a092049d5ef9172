"""`python -m rltrain.plot RUN_DIR`: reward curve, evaluation (eval.jsonl), phase time breakdown, the
memory ledger per phase and, for multi-turn runs, turns, tool calls and errors, tokens and seconds
per trajectory, as PNGs.
`--ledger [STEP]` prints a step's memory ledger as a table instead."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rltrain.runtime.ledger import DEVICE_PARTS, format_ledger

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_plots(run_dir: str | Path) -> list[Path]:
    import matplotlib  # noqa: PLC0415 - slow to import; only when plots are written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - slow to import; only when plots are written

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    out = []

    fig, ax = plt.subplots(figsize=(7, 4))
    window = moving_window(len(rows))
    for key, label, colour in (("reward_mean", "reward mean", "C0"), ("pass_rate", "pass rate", "C1")):
        raw = [r[key] for r in rows]
        ax.plot(steps, raw, color=colour, alpha=0.3, linewidth=0.8)
        ax.plot(steps, moving_mean(raw, window), color=colour, label=f"{label} ({window}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"{run_dir.name}: reward (raw, faint; moving mean)")
    out.append(_save(fig, run_dir / "reward.png"))

    evals = (
        [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
        if (run_dir / "eval.jsonl").is_file()
        else []
    )
    if evals:  # evaluation on held-out prompts (rollout/evaluation.py), by the weights' step
        fig, ax = plt.subplots(figsize=(7, 4))
        at = [r["step"] for r in evals]
        for key in [k for k in evals[-1] if k.startswith("eval/pass@")] + ["eval/reward_mean"]:
            ax.plot(at, [r.get(key, float("nan")) for r in evals], marker="o", label=key.removeprefix("eval/"))
        ax.set_xlabel("step (the weights evaluated)")
        ax.set_ylim(0, 1.05)
        ax.legend()
        ax.set_title(f"{run_dir.name}: evaluation")
        out.append(_save(fig, run_dir / "eval.png"))

    phases = list(dict.fromkeys(p for r in rows for p in r["time"] if p != "step"))
    fig, ax = plt.subplots(figsize=(8, 4))
    # One filled band per phase (a bar per step and phase is thousands of patches: seconds to
    # draw), each its own colour (tab20: distinct up to 20 phases). The first step carries the
    # start-up (compilation, first captures, caches): its time is given in the title and the
    # y-axis is set by the steps after it.
    colours = [plt.get_cmap("tab20")(i % 20) for i in range(len(phases))]
    later = rows[1:] or rows
    ax.stackplot(
        [r["step"] for r in later],
        [[r["time"].get(p, 0.0) for r in later] for p in phases],
        labels=phases,
        colors=colours,
        step="mid",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("seconds (slowest rank)")
    ax.legend(fontsize=7, ncol=2)
    first = sum(rows[0]["time"].get(p, 0.0) for p in phases)
    ax.set_title(
        f"time per phase (step 1, with the start-up: {first:.2f} s, not drawn)" if len(rows) > 1 else "time per phase"
    )
    out.append(_save(fig, run_dir / "phase_time.png"))

    multi = [r for r in rows if "multiturn" in r]
    if multi:  # multi-turn rollouts: turns, tool calls and errors, tokens and time per trajectory
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        at = [r["step"] for r in multi]
        per = [max(r["multiturn"].get("turns_trajectories", 0.0), 1.0) for r in multi]
        for key, label in (
            ("turns_turns", "turns"),
            ("tool_calls", "tool calls"),
            ("tool_errors", "tool errors"),
            ("turns_ended_by_max_turns", "ended by max_turns"),
            ("turns_ended_by_budget", "ended by the token budget"),
        ):
            left.plot(at, [r["multiturn"].get(key, 0.0) / n for r, n in zip(multi, per)], label=label)
        left.plot(at, [r["reward_mean"] for r in multi], label="reward mean", linestyle="--")
        left.set_xlabel("step")
        left.set_title("per trajectory")
        left.legend(fontsize=7)
        for key, label in (
            ("turns_sampled_tokens", "sampled tokens"),
            ("turns_observation_tokens", "observation tokens"),
        ):
            right.plot(at, [r["multiturn"].get(key, 0.0) / n for r, n in zip(multi, per)], label=label)
        seconds = right.twinx()
        for key, label in (("turns_engine_s", "s in the engine"), ("turns_env_s", "s in the environment")):
            seconds.plot(at, [r["multiturn"].get(key, 0.0) / n for r, n in zip(multi, per)], label=label, linestyle=":")
        right.set_xlabel("step")
        right.set_title("tokens and seconds per trajectory")
        right.legend(fontsize=7, loc="upper left")
        seconds.legend(fontsize=7, loc="upper right")
        out.append(_save(fig, run_dir / "turns.png"))

    out.append(plot_ledger(rows[-1], run_dir / "memory.png"))
    return out


DEVICE_STACK = (*DEVICE_PARTS, "unexplained")
HOST_STACK = ("trainer_host", "host_pinned", "rss", "engine_rss")


def moving_window(n: int) -> int:
    """Steps averaged by the reward plot's moving mean: a twentieth of the run, 1 to 50."""
    return max(1, min(50, n // 20))


def moving_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the window - 1 before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_ledger(row: dict, path: Path) -> Path:
    """One panel per rank: the ledger after each phase of the row's step, stacked — the device's
    parts where there is a GPU (the stack's top is `device_used`), the host's otherwise."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 - slow to import; only when plots are written

    memory = row["memory"]
    fig, axes = plt.subplots(len(memory), 1, figsize=(9, 3.2 * len(memory)), squeeze=False)
    for ax, (rank, phases) in zip(axes[:, 0], memory.items()):
        names = list(phases)
        first = next(iter(phases.values()))
        stack = DEVICE_STACK if "device_used" in first else HOST_STACK
        bottom = [0.0] * len(names)
        for part in stack:
            vals = [max(phases[p].get(part, 0.0), 0.0) for p in names]
            if any(vals):
                ax.bar(names, vals, bottom=bottom, label=part)
                bottom = [b + v for b, v in zip(bottom, vals)]
        if "device_used" in first:
            ax.plot(names, [phases[p]["device_used"] for p in names], "k_", markersize=18, label="device_used")
        ax.set_ylabel("GiB")
        ax.set_title(f"{rank}: memory after each phase (step {row['step']})", fontsize=9)
        ax.tick_params(axis="x", rotation=30, labelsize=7)
        ax.legend(fontsize=6, ncol=3)
    return _save(fig, path)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt  # noqa: PLC0415 - slow to import; only when plots are written

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(prog="python -m rltrain.plot", description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument(
        "--ledger",
        nargs="?",
        const=-1,
        type=int,
        metavar="STEP",
        help="print the memory ledger of STEP (default: the last step) instead of plotting",
    )
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if a.ledger is not None:
        rows = read_metrics(Path(a.run_dir))
        row = rows[-1] if a.ledger < 0 else next((r for r in rows if r["step"] == a.ledger), None)
        if row is None:
            print(f"no step {a.ledger} in {a.run_dir}/metrics.jsonl", file=sys.stderr)
            return 2
        print(format_ledger(row["memory"], row["step"]))
        return 0
    for p in write_plots(a.run_dir):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
