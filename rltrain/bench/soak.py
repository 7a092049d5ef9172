"""Soak: many phase cycles on real processes, with what leaks when phase switches leak sampled.

    python -m rltrain.bench.soak [--cycles 200] [--ranks 2] [--device cpu|cuda] [--transport tensor]

Each cycle does what the colocated loop does between phases, without rollout and training:

    world destroy (+ wait) -> engine release -> world rebuild -> trainer onload ->
    engine resume weights -> weight sync (verified) -> trainer offload -> engine resume KV -> probe

The engines are the embedded engine laid out as the loop lays it out: one per GPU, each rank
its own engine's leader, so under `tensor` every rank builds the payloads of its own engine on
its own GPU; released weights are discarded (the sync rewrites every parameter). The trainer
is the torch-native one, FSDP2 over the world, on a small Qwen2 built locally. After each cycle
every rank samples its RSS, open file descriptors, threads and child processes, plus the
engine's RSS; on CUDA also the device memory in use, at the end of the cycle and at its low point
(engine released, trainer offloaded, world down: what is left must be back at the baseline of
the warm-up every time, `cuda_low_mib`). After `--warmup` cycles, growth beyond the
bounds below fails the run (exit 1): allocator caches and lazily started threads settle during
the warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from rltrain.bench.models import SOAK, save_random_qwen2

# Growth allowed from the end of the warm-up, at any cycle. fds and threads: a destroyed Gloo
# group holds ~1.5 sockets and ~1 thread until it is freed, which the trainer forces with a full
# garbage collection every GC_EVERY (8) onloads: up to 8 cycles' worth, plus slack.
BOUNDS = {
    "rss_mib": 64.0,
    "engine_rss_mib": 64.0,
    "fds": 16,
    "threads": 12,
    "children": 0,
    "cuda_used_mib": 64.0,
    "cuda_low_mib": 16.0,
    "trainer_allocated_mib": 1.0,
    "trainer_reserved_mib": 64.0,
    "engine_allocated_mib": 1.0,
    "engine_reserved_mib": 64.0,
}


def _build(path: Path) -> None:
    save_random_qwen2(path, SOAK, torch.float32)


def _worker(rank: int, world_size: int, port: int, args: dict, out: str) -> None:
    from rltrain.runtime.env import single_node_variables

    os.environ.update(single_node_variables(rank, world_size, port))
    from rltrain.config import build_config
    from rltrain.engine.launcher import NodeEngine
    from rltrain.runtime.ledger import device_used
    from rltrain.runtime.memory import trim_host_heap
    from rltrain.runtime.world import World
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer

    device = torch.device(args["device"] if args["device"] == "cpu" else f"cuda:{rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = build_config(
        {
            "run": {"dir": out, "name": "soak"},
            "model": {"path": args["model"]},
            "data": {"path": "synthetic:addition"},
            "engine": {
                "backend": "embedded",
                "device": device.type,
                "dtype": "float32" if device.type == "cpu" else "bfloat16",
                "gpus_per_engine": 1,  # the embedded engine's layout: one per GPU, each rank its own
            },
            "trainer": {"lr": 1e-4},
            "sync": {"transport": args["transport"]},
        }
    )
    world = World(backend="nccl" if device.type == "cuda" else "gloo", timeout=120)
    engine = NodeEngine.launch(cfg.engine, args["model"], world, Path(out), weights_roots=[str(cfg.weights_dir)])
    trainer = FSDPTrainer(cfg.trainer, cfg.algo, args["model"], device)
    trainer.create()
    parts = args["parts"]
    sync = WeightSync(cfg, world, trainer, [engine.client], args["model"], engine.layout) if "sync" in parts else None
    me = psutil.Process()
    samples = []
    try:
        for cycle in range(args["cycles"]):
            t0 = time.perf_counter()
            world.destroy()
            world.wait_destroyed()
            if "engine" in parts:
                engine.release_memory()
            world.rebuild()
            if "trainer" in parts:
                trainer.onload()
            if "engine" in parts:
                engine.resume_weights()
            t_sync = time.perf_counter()
            if sync is not None:
                sync.push(str(cycle + 1))
            t_sync = time.perf_counter() - t_sync
            if "trainer" in parts:
                trainer.offload()
            world.bridge.barrier(phase="soak offload")
            low = None
            if device.type == "cuda":  # the cycle's low point: engine released, trainer offloaded, world down
                world.destroy()
                world.wait_destroyed()
                low = device_used(device) / 2**20
                world.rebuild()
            if "engine" in parts:
                engine.resume_kv()
            if sync is not None:
                sync.probe_engines()
            world.bridge.barrier(phase="soak resume")
            # RSS is sampled after freed heap pages go back (a full collection, malloc_trim): glibc
            # keeps the pages of the sync's freed host tensors otherwise (~0.5 MiB a cycle on CPU,
            # none of it referenced), which a leak could hide behind. What is still referenced stays.
            gc.collect()
            trim_host_heap()
            row = {
                "cycle": cycle,
                "s": time.perf_counter() - t0,
                "sync_s": t_sync,
                "rss_mib": me.memory_info().rss / 2**20,
                "fds": me.num_fds(),
                "threads": me.num_threads(),
                "children": len(me.children(recursive=True)),
            }
            if engine.process is not None:
                row["engine_rss_mib"] = (engine.process.rss() or 0) / 2**20
            if device.type == "cuda":
                row["cuda_used_mib"] = device_used(device) / 2**20  # NVML: every process on the GPU
                row["cuda_low_mib"] = low
                row["trainer_allocated_mib"] = torch.cuda.memory_allocated(device) / 2**20
                row["trainer_reserved_mib"] = torch.cuda.memory_reserved(device) / 2**20
                rep = engine.memory_report()
                if "cuda_allocated" in rep:
                    row["engine_allocated_mib"] = rep["cuda_allocated"] / 2**20
                    row["engine_reserved_mib"] = rep["cuda_reserved"] / 2**20
            samples.append(row)
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(samples))
        if sync is not None:
            sync.close()
        engine.shutdown()
        trainer.release()
        world.close()


def run(
    cycles: int, ranks: int, device: str, warmup: int, parts: str = "engine,trainer,sync", transport: str = "tensor"
) -> tuple[list[str], bool]:
    import torch.multiprocessing as mp

    from rltrain.runtime.net import free_port

    with tempfile.TemporaryDirectory(prefix="rltrain-soak-") as tmp:
        model = Path(tmp) / "model"
        _build(model)
        args = {
            "cycles": cycles,
            "device": device,
            "model": str(model),
            "parts": parts.split(","),
            "transport": transport,
        }
        mp.start_processes(_worker, args=(ranks, free_port(), args, tmp), nprocs=ranks, start_method="spawn")
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
    lines = [
        f"# rltrain.bench.soak  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  {ranks} ranks on {device}, "
        f"{cycles} cycles (destroy, release, rebuild, onload, resume weights, sync by {transport}, offload, "
        f"resume kv, probe; parts: {parts}), warm-up {warmup}",
        f"{'rank':>4s} {'metric':>15s} {'after warm-up':>14s} {'last':>10s} {'max':>10s} {'growth':>8s} "
        f"{'bound':>6s}  ok",
    ]
    ok = True
    for r, rows in enumerate(per_rank):
        if len(rows) < cycles:
            lines.append(f"{r:>4d} only {len(rows)} of {cycles} cycles ran")
            ok = False
            continue
        for key, bound in BOUNDS.items():
            if key not in rows[0]:
                continue
            base, last, top = rows[warmup][key], rows[-1][key], max(x[key] for x in rows[warmup:])
            growth = top - base
            good = growth <= bound
            ok &= good
            lines.append(
                f"{r:>4d} {key:>15s} {base:14.1f} {last:10.1f} {top:10.1f} {growth:8.1f} {bound:6.0f}  "
                f"{'yes' if good else 'NO'}"
            )
        secs = sorted(x["s"] for x in rows)
        lines.append(f"{r:>4d} {'cycle s':>15s} median {secs[len(secs) // 2]:.3f}, max {secs[-1]:.3f}")
        syncs = sorted(x["sync_s"] for x in rows)
        lines.append(f"{r:>4d} {'sync s':>15s} median {syncs[len(syncs) // 2]:.3f}, max {syncs[-1]:.3f}")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument(
        "--parts",
        default="engine,trainer,sync",
        help="what cycles besides the world (to find what grows): engine, trainer, sync (needs both)",
    )
    ap.add_argument("--transport", default="tensor", choices=["tensor", "disk", "distributed"])
    a = ap.parse_args(argv)
    if a.cycles <= a.warmup:
        print(f"--cycles must exceed --warmup ({a.warmup})", file=sys.stderr)
        return 2
    lines, ok = run(a.cycles, a.ranks, a.device, a.warmup, a.parts, a.transport)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
