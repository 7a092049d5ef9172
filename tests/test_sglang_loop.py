"""The loop on real SGLang (CPU): torchrun, 2 ranks, SGLang engines laid out over them.

What CI can run of the production path: one SGLang engine per rank (tensor and disk sync) and
one SGLang engine at --tp-size 2 over both ranks, whose TP ranks each get the payload their
own trainer rank built. Every step is verified on the engines (version, every parameter
rewritten after /weights_checker's reset, digests in agreement, probe log-probs), the n samples
of a prompt differ, and a generation SGLang refuses is counted as failed, never trained on.
SGLang's memory release is CUDA-only: on CPU the loop skips it and says so (tested here); the
release path runs on GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import HAVE_SGLANG, SGLANG_CPU_MEM_FRACTION, SGLANG_SHIM, SKIP_SGLANG
from test_loop import run_quickstart

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    not HAVE_SGLANG and SKIP_SGLANG, reason="SGLang not installed and RLTRAIN_SKIP_SGLANG=1"
)

SGLANG_CPU = [
    "engine.backend=sglang",
    "engine.release=true",  # asked for: SGLang cannot release on the CPU, and says so
    "engine.device=cpu",
    "engine.dtype=float32",
    f"engine.mem_fraction_static={SGLANG_CPU_MEM_FRACTION}",
    "engine.extra_args=[--max-total-tokens,4096]",
    # Every wait inside the harness's 280 s: a stuck phase fails with rltrain's own message (the
    # phase, the engine's log) rather than the harness's kill. The ranks' waits for each other
    # (world.timeout_s) outlast the engine's start-up, which the other ranks wait for.
    "engine.startup_timeout_s=150",
    "engine.request_timeout_s=120",
    "world.timeout_s=200",
]


def _run(tmp_path: Path, *overrides: str, steps: int = 5, env: dict[str, str] | None = None) -> list[dict]:
    if not HAVE_SGLANG:
        pytest.fail("SGLang is not installed: install it as the README says, or set RLTRAIN_SKIP_SGLANG=1")
    path = os.pathsep.join([str(HERE / "faults"), str(SGLANG_SHIM), os.environ.get("PYTHONPATH", "")])
    r = run_quickstart(
        tmp_path, *SGLANG_CPU, f"loop.steps={steps}", *overrides, env={"PYTHONPATH": path, **(env or {})}
    )
    assert r.returncode == 0, r.stderr[-6000:]
    assert "SGLang releases memory on CUDA only" in r.stderr  # skipped, and said so
    run_dir = tmp_path / "quickstart"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_steps(rows: list[dict], steps: int, engines: int, tp_ranks: int) -> None:
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        # Every engine's weights were reset before every sync and each of its TP ranks found with
        # every parameter rewritten after it; their digests compared with the other engines'.
        assert row["sync_rewrites_checked"] == tp_ranks, row
        assert row["sync_digests_compared"] == (tp_ranks if engines > 1 else 0), row
        # Every sync was verified on every engine (a mismatch fails the step): the probe's
        # log-probs agree with the trainer's (fp32 on both sides), at every position.
        assert 0 <= row["sync_probe_diff"] <= row["sync_probe_worst"] < 1e-3, row
        assert row["logp_diff_engine_trainer"] < 1e-3
        assert row["sync_bytes"] > 0
    # The first steps sample from a random model: if the n samples of a prompt shared a seed,
    # every group would be one response repeated.
    assert sum(row["groups_identical"] for row in rows[:3]) <= 1, [r["groups_identical"] for r in rows[:3]]


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_loop_on_one_sglang_engine_per_rank(tmp_path, transport):
    rows = _run(
        tmp_path,
        "engine.gpus_per_engine=1",
        f"sync.transport={transport}",
        env={"RLTRAIN_TEST_BAD_GENERATE": "1:3"},  # rank 1's 4th request: refused by SGLang
    )
    _check_steps(rows, 5, engines=2, tp_ranks=2)
    failed = [row["generation_failed"] for row in rows]
    assert sum(failed) >= 8 and sum(f > 0 for f in failed) == 1, failed  # counted, in one step
    bad = next(row for row in rows if row["generation_failed"])
    assert bad["samples_trained"] == bad["samples"] - bad["generation_failed"]  # never trained on
    logs = sorted(p.name for p in (tmp_path / "quickstart" / "engine").iterdir())
    assert logs == ["node0-engine0.log", "node0-engine1.log"]


def test_loop_on_one_sglang_engine_at_tp2_over_both_ranks(tmp_path):
    """One engine, --tp-size 2: rank 0 starts it, both ranks generate through it, and each TP
    rank loads the payload its own trainer rank flattened (SGLang reads entry tp_rank)."""
    record = tmp_path / "payloads"
    rows = _run(
        tmp_path,
        "engine.gpus_per_engine=2",
        "sync.transport=tensor",
        env={"RLTRAIN_TEST_RECORD_PAYLOADS": str(record)},
    )
    _check_steps(rows, 5, engines=1, tp_ranks=2)
    assert all(row["generation_failed"] == 0 for row in rows)
    # Rank 0 (the engine's leader) sent every request; entry k of each names rank k's memory alone.
    pids = [int((record / f"rank{r}.pid").read_text()) for r in (0, 1)]
    requests = [json.loads(x) for x in (record / "requests0.jsonl").read_text().splitlines()]
    assert len(requests) >= 5 and not (record / "requests1.jsonl").exists()
    assert all(req["payload_pids"] == [[pids[0]], [pids[1]]] for req in requests), requests[:3]
    run_dir = tmp_path / "quickstart"
    assert sorted(p.name for p in (run_dir / "engine").iterdir()) == ["node0-engine0.log"]
    log = (run_dir / "engine" / "node0-engine0.log").read_text()
    assert "'tp_size': 2" in log and "TP1" in log
