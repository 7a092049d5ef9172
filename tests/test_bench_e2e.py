"""bench.e2e's table from a run's metrics rows: tests/data/e2e-1.7b-auto-h100-metrics.jsonl is the
1.7B run of 2026-12-06 on an H100 (docs/benchmarks/s21-h100-2026-12-06.md), loop.offload_trainer
auto: step 1's put-away moved the whole state (11.35 GiB; its kept part had stranded freed
memory), steps 2 and 3 kept it."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from rltrain.bench import e2e

DATA = Path(__file__).parent / "data" / "e2e-1.7b-auto-h100-metrics.jsonl"


def test_an_onload_is_charged_with_what_the_step_before_put_away_and_each_steps_switches_are_shown(tmp_path):
    """Step 2's onload brings back what step 1 moved though step 2 keeps everything: the table
    charges the onload with the step before's bytes (its floor and rate from them), not the
    put-away's own; its rate is over the steps that moved state; and the switches of each step
    are printed beside their mean."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(DATA, run / "metrics.jsonl")
    (run / "config.yaml").write_text(
        "model:\n  path: m\ndata:\n  path: synthetic:addition\nloop:\n  offload_trainer: auto\n"
    )
    a = argparse.Namespace(nproc=1, shape="1.7b", prompts=64, n=8, max_new_tokens=256, micro=16, transport="tensor")
    lines = e2e.report(run, 2_030_000_000, 784.0, 55.1, 55.2, a, ipc_floor_s=0.006)
    switch = {row.split()[0]: row for row in lines if "of the step" in row}
    assert "moves 5.68 GiB" in switch["trainer_onload"]  # (11.35 + 0) / 2: steps 2 and 3
    assert "moves 0.00 GiB" in switch["trainer_offload"]
    # Its rate over the step that moved the state (step 2: 11.35 GiB in 0.235 s, the copy 0.227 s),
    # not the mean bytes over the mean time of both steps (88.8%: step 3's re-bind counted as copying).
    onload = next(row for row in lines if "trainer_onload bandwidth" in row)
    assert "94.1% of pinned copy (11.35 GiB" in onload and "the 1 of 2 steps" in onload
    assert "its copy alone 53.6 GB/s, 97.3%" in onload
    assert any("trainer_offload bandwidth" in row and "nothing moved" in row for row in lines)
    each = next(row for row in lines if "phase switches, each step" in row)
    assert "1: 3.813s" in each and "3: 0.272s 4.3%" in each
