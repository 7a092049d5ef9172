"""Benchmark: world destroy / rebuild / first collective, against plain torch in the same run.

    python -m rltrain.bench.world                      # gloo at 2 and 4 ranks (+ NCCL world 1 if CUDA)
    python -m rltrain.bench.world --ranks 4 --cycles 20 --backend gloo
    python -m rltrain.bench.world --backend nccl --ranks 1

Per cycle it measures, on every rank (the table shows the slowest rank of each cycle):
  rltrain:  destroy on the critical path (bridge barrier + detach; teardown in background),
            the background teardown itself, rebuild + first all_reduce on every rebuilt group;
            the cycle on the critical path and the whole cycle (the teardown included: moved to
            another thread, it still costs), each against plain torch's whole cycle
  plain:    destroy_process_group(), init_process_group() on a fresh prefix, re-creation of the
            same groups, first all_reduce on every group — the limit rltrain is measured against.
With --groups megatron (default at 4 ranks) the Megatron TP=2 PP=2 EP=2 group set is registered
(megatron-core's own set, Gloo twins included; TP=2 EP=2 without PP at 2 ranks). Gloo groups
outlive the world's cycles (they hold no accelerator memory); NCCL groups are rebuilt. On CUDA it also reports
device memory before/after destroy and its growth over the cycles; on CPU, open file descriptors and
threads over the cycles.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rltrain.bench.topology import ParallelDims, megatron_group_plan
from rltrain.runtime.net import free_port
from rltrain.runtime.world import World


def _gpu_used() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def _group_plan(kind: str, world_size: int) -> list[tuple[str, tuple[int, ...], str | None]]:
    if kind == "megatron":
        dims = ParallelDims(world_size, tp=2, pp=2 if world_size >= 4 else 1, ep=2, etp=1)  # PP needs 4 ranks
        return [(f"{e.kind}{list(e.ranks)}", e.ranks, e.backend) for e in megatron_group_plan(dims)]
    return []


def _first_collectives(world_size: int, device: torch.device, groups: list) -> None:
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    for pg, backend, ranks in groups:
        if pg is None or dist.get_rank() not in ranks:
            continue
        x = torch.ones(1, device=device if backend is None else torch.device("cpu"))
        dist.all_reduce(x, group=pg)
    if device.type == "cuda":
        torch.cuda.synchronize()


def _worker(rank: int, world_size: int, port: int, args: dict, out_dir: str) -> None:
    from rltrain.runtime.env import single_node_variables

    os.environ.update(single_node_variables(rank, world_size, port))
    backend = args["backend"]
    context_mib = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        torch.zeros(1, device="cuda")  # CUDA context only: the floor no destroy can go below
        torch.cuda.synchronize()
        context_mib = _gpu_used()
    world = World(backend=backend, timeout=120, async_destroy=True)
    plan = _group_plan(args["groups"], world_size)
    for desc, ranks, gb in plan:
        world.new_group(ranks, backend=gb, description=desc)
    device = world.device
    proc = psutil.Process()
    rows = []
    cuda = device.type == "cuda"
    for cycle in range(args["warmup"] + args["cycles"]):
        rec: dict[str, float] = {}
        world.bridge.barrier()
        if cuda:
            torch.cuda.synchronize()
            rec["mem_before_destroy_mib"] = _gpu_used()
        t0 = time.perf_counter()
        world.destroy(block=False)
        rec["rl_destroy_critical"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        world.wait_destroyed()
        rec["rl_destroy_background"] = time.perf_counter() - t0 + rec["rl_destroy_critical"]
        if cuda:
            rec["mem_after_destroy_mib"] = _gpu_used()
        world.bridge.barrier()
        t0 = time.perf_counter()
        world.rebuild()  # includes the first all_reduce on every group and a bridge barrier
        rec["rl_rebuild_first"] = time.perf_counter() - t0
        for k in ("init", "groups", "prime", "barrier"):
            rec[f"rl_rebuild_{k}"] = world.transitions[-1].seconds[k]
        rec["rl_cycle"] = rec["rl_destroy_critical"] + rec["rl_rebuild_first"]
        # The whole cost, the background teardown included (it still runs, on another thread).
        rec["rl_whole"] = rec["rl_destroy_background"] + rec["rl_rebuild_first"]

        # Plain torch, same ranks, same groups: destroy, init on a fresh prefix, groups, first collective.
        world.bridge.barrier()
        world.destroy(block=True)
        world.bridge.barrier()
        t0 = time.perf_counter()
        store = dist.PrefixStore(f"bench/plain/{cycle}/", world._base_store)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
            device_id=device if cuda else None,
        )
        t1 = time.perf_counter()
        groups = [(dist.new_group(list(r), backend=gb, group_desc=d), gb, r) for d, r, gb in plan]
        t2 = time.perf_counter()
        _first_collectives(world_size, device, groups)
        t3 = time.perf_counter()
        world.bridge.barrier()
        t4 = time.perf_counter()
        dist.destroy_process_group()
        t5 = time.perf_counter()
        # The groups' resources (threads, sockets, communicators) go when the last reference does:
        # that is part of the destroy a user pays for, just later than destroy_process_group returns.
        del groups  # refcounting frees them here; no gc pass, which would only add its own cost
        t6 = time.perf_counter()
        rec.update(
            plain_init_first=(t1 - t0) + (t3 - t2),
            plain_groups=t2 - t1,
            plain_destroy=t5 - t4,
            plain_free=t6 - t5,
            plain_cycle=(t6 - t4) + (t3 - t0),
        )
        if cuda:
            rec["mem_after_plain_destroy_mib"] = _gpu_used()
        world.bridge.barrier()
        world.rebuild()  # back up for the next cycle
        rec["fds"] = proc.num_fds()
        rec["threads"] = proc.num_threads()
        if context_mib is not None:
            rec["mem_context_mib"] = context_mib
        if cycle >= args["warmup"]:
            rows.append(rec)
    gathered = world.bridge.all_gather_object(rows)
    world.close()
    if rank == 0:
        Path(out_dir, "rows.json").write_text(json.dumps(gathered))


def _stats(vals: list[float]) -> str:
    return f"{statistics.median(vals) * 1e3:8.1f} {min(vals) * 1e3:8.1f} {max(vals) * 1e3:8.1f}"


def run(backend: str, ranks: int, cycles: int, warmup: int, groups: str) -> list[str]:
    with tempfile.TemporaryDirectory() as out_dir:
        args = dict(backend=backend, cycles=cycles, warmup=warmup, groups=groups)
        mp.start_processes(_worker, args=(ranks, free_port(), args, out_dir), nprocs=ranks, start_method="spawn")
        per_rank = json.loads(Path(out_dir, "rows.json").read_text())
    # Slowest rank per cycle: a phase switch is over when the last rank is through.
    cyc = [{k: max(r[i][k] for r in per_rank) for k in per_rank[0][i]} for i in range(len(per_rank[0]))]
    n_groups = len(_group_plan(groups, ranks))
    label = f"{backend} x{ranks}, {n_groups} groups"
    lines = [f"\n## {label}: {cycles} cycles after {warmup} warm-up, ms (median / min / max, slowest rank)"]
    lines.append(f"{'what':48s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for key, name in [
        ("rl_destroy_critical", "rltrain destroy, critical path"),
        ("rl_destroy_background", "rltrain destroy, background teardown (total)"),
        ("rl_rebuild_first", "rltrain rebuild + first all_reduce (all groups)"),
        ("rl_rebuild_init", "  of which init_process_group"),
        ("rl_rebuild_groups", "  of which group replay"),
        ("rl_rebuild_prime", "  of which first all_reduce on every group"),
        ("rl_rebuild_barrier", "  of which final bridge barrier"),
        ("rl_cycle", "rltrain cycle on the critical path"),
        ("rl_whole", "rltrain whole cycle (teardown included)"),
        ("plain_destroy", "plain destroy_process_group"),
        ("plain_free", "plain: freeing the destroyed group objects"),
        ("plain_groups", "plain new_group x groups"),
        ("plain_init_first", "plain init_process_group + first all_reduce"),
        ("plain_cycle", "plain cycle (destroy + free + init + groups + first)"),
    ]:
        lines.append(f"{name:48s} {_stats([c[key] for c in cyc])}")
    plain = statistics.median([c["plain_cycle"] for c in cyc])
    critical = statistics.median([c["rl_cycle"] for c in cyc]) / plain
    whole = statistics.median([c["rl_whole"] for c in cyc]) / plain
    lines.append(f"{'ratio critical path / plain whole cycle':48s} {critical:8.2f}")
    lines.append(f"{'ratio whole cycle / plain whole cycle':48s} {whole:8.2f}")
    if backend == "gloo" and groups == "megatron" and ranks >= 4:
        lines.append(
            f"goal (CPU, megatron's TP2/PP2/EP2 set): whole <= 0.40 ({'met' if whole <= 0.40 else 'missed'}), "
            f"critical path <= 0.15 ({'met' if critical <= 0.15 else 'missed'})"
        )
    if "fds" in cyc[0]:
        lines.append(
            f"open fds (rank max) first/last cycle: {cyc[0]['fds']:.0f} / {cyc[-1]['fds']:.0f}; "
            f"threads: {cyc[0]['threads']:.0f} / {cyc[-1]['threads']:.0f}"
        )
    if "mem_before_destroy_mib" in cyc[0]:
        b = [c["mem_before_destroy_mib"] for c in cyc]
        a = [c["mem_after_destroy_mib"] for c in cyc]
        p = [c["mem_after_plain_destroy_mib"] for c in cyc]
        lines.append(
            f"GPU used MiB before destroy first/last: {b[0]:.0f} / {b[-1]:.0f}; after destroy first/last: "
            f"{a[0]:.0f} / {a[-1]:.0f}; freed per destroy: {statistics.median([x - y for x, y in zip(b, a)]):.0f}; "
            f"after plain destroy: {p[-1]:.0f}; CUDA context alone (before any NCCL): "
            f"{cyc[0]['mem_context_mib']:.0f}"
        )
    return lines


def nccl_breakdown(cycles: int) -> list[str]:
    """Where plain NCCL destroy spends its time, world size 1: backend shutdown vs the rest."""
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    base = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 1, True, timeout=timedelta(seconds=60))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rows: list[tuple[str, dict[str, float]]] = []  # (mode, its times and memory)
    for i in range(cycles + 1):
        for mode in ("shutdown", "abort"):
            t0 = time.perf_counter()
            dist.init_process_group(
                "nccl", store=dist.PrefixStore(f"probe/{mode}/{i}/", base), rank=0, world_size=1, device_id=dev
            )
            x = torch.ones(1, device=dev)
            dist.all_reduce(x)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            used_up = _gpu_used()
            world = dist.group.WORLD
            assert world is not None
            backend = world._get_backend(dev)
            t2 = time.perf_counter()
            backend.shutdown() if mode == "shutdown" else backend.abort()
            t3 = time.perf_counter()
            dist.destroy_process_group()
            del backend
            gc.collect()
            t4 = time.perf_counter()
            if i:
                rows.append(
                    (
                        mode,
                        dict(
                            init_first=t1 - t0,
                            backend_call=t3 - t2,
                            rest=t4 - t3,
                            used_up=used_up,
                            used_down=_gpu_used(),
                        ),
                    )
                )
    lines = [f"\n## NCCL x1 destroy breakdown over {cycles} cycles, ms (median / min / max)"]
    for mode in ("shutdown", "abort"):
        rs = [r for m, r in rows if m == mode]
        for key in ("init_first", "backend_call", "rest"):
            lines.append(f"{mode + ': ' + key:48s} {_stats([r[key] for r in rs])}")
        lines.append(
            f"{mode}: GPU used MiB up / down (last cycle): {rs[-1]['used_up']:.0f} / {rs[-1]['used_down']:.0f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["gloo", "nccl", "all"], default="all")
    ap.add_argument("--ranks", type=int, nargs="*", default=None)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--groups", choices=["auto", "none", "megatron"], default="auto")
    ap.add_argument("--nccl-breakdown", action="store_true", help="also time NCCL backend shutdown/abort vs the rest")
    a = ap.parse_args(argv)
    runs = []
    if a.backend in ("gloo", "all"):
        for n in a.ranks or [2, 4]:
            kinds = (
                ["none", "megatron"] if a.groups == "auto" and n == 4 else ["none" if a.groups == "auto" else a.groups]
            )
            runs += [("gloo", n, k) for k in kinds]
    if a.backend in ("nccl", "all") and torch.cuda.is_available():
        runs += [
            ("nccl", n, "none" if a.groups == "auto" else a.groups) for n in (a.ranks or [torch.cuda.device_count()])
        ]
    print(
        f"# rltrain.bench.world  torch {torch.__version__}  {time.strftime('%Y-%m-%d')}  "
        f"cpus={os.cpu_count()} cuda={torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}"
    )
    for backend, n, groups in runs:
        for line in run(backend, n, a.cycles, a.warmup, groups):
            print(line, flush=True)
    if a.nccl_breakdown and torch.cuda.is_available():
        for line in nccl_breakdown(a.cycles):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
