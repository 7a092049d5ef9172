"""`python -m rltrain.plot RUN_DIR`: reward curve, phase time breakdown and memory per phase as PNGs."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_plots(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    out = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward_mean"] for r in rows], label="reward mean")
    ax.plot(steps, [r["pass_rate"] for r in rows], label="pass rate", alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"{run_dir.name}: reward")
    out.append(_save(fig, run_dir / "reward.png"))

    phases = [p for p in rows[0]["time"] if p != "step"]
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(rows)
    for p in phases:
        vals = [r["time"].get(p, 0.0) for r in rows]
        ax.bar(steps, vals, bottom=bottom, label=p, width=1.0)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds (slowest rank)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("time per phase")
    out.append(_save(fig, run_dir / "phase_time.png"))

    last = rows[-1]["memory"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for rank, mem in last.items():
        keys = [k for k in next(iter(mem.values()))]
        for key in keys:
            ax.plot(list(mem), [mem[p][key] for p in mem], marker="o", label=f"{rank} {key}")
    ax.set_ylabel("GiB")
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=7)
    ax.set_title(f"memory after each phase (step {rows[-1]['step']})")
    out.append(_save(fig, run_dir / "memory.png"))
    return out


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m rltrain.plot RUN_DIR", file=sys.stderr)
        return 2
    for p in write_plots(args[0]):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
