"""Soak on real processes: world destroy/rebuild, engine release/resume and trainer
offload/onload, cycled on two ranks with RSS, open files, threads and child processes sampled
every cycle (rltrain.bench.soak; its full 200-cycle run is recorded in BENCHMARKS.md)."""

from __future__ import annotations

from rltrain.bench.soak import BOUNDS, run


def test_phase_cycles_do_not_grow_memory_files_threads_or_processes():
    lines, ok = run(cycles=40, ranks=2, device="cpu", warmup=10)
    report = "\n".join(lines)
    assert ok, report
    # Every bounded metric was sampled on every rank (the engine's on rank 0).
    for key in ("rss_mib", "fds", "threads", "children"):
        assert sum(f" {key} " in line for line in lines) == 2, report
    assert sum(" engine_rss_mib " in line for line in lines) == 1, report
    assert set(BOUNDS) >= {"rss_mib", "fds", "threads", "children"}
