"""Soak on real processes: world destroy/rebuild, engine release/resume, trainer offload/onload
and a verified tensor sync, cycled on two ranks (each with its own embedded engine, as the loop
lays them out) with RSS, open files, threads and child processes sampled every cycle
(rltrain.bench.soak; its full runs are recorded in BENCHMARKS.md)."""

from __future__ import annotations

from rltrain.bench.soak import BOUNDS, run


def test_phase_cycles_do_not_grow_memory_files_threads_or_processes():
    lines, ok = run(cycles=40, ranks=2, device="cpu", warmup=10)
    report = "\n".join(lines)
    assert ok, report
    # Every bounded metric was sampled on every rank, the engine's by the rank that owns it (each).
    for key in ("rss_mib", "fds", "threads", "children", "engine_rss_mib"):
        assert sum(f" {key} " in line for line in lines) == 2, report
    assert sum(" sync s " in line for line in lines) == 2, report
    assert set(BOUNDS) >= {"rss_mib", "fds", "threads", "children"}
