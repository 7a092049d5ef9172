"""Soak: many phase cycles on real processes, with what leaks when phase switches leak sampled.

    python -m rltrain.bench.soak [--cycles 200] [--ranks 2] [--device cpu|cuda]

Each cycle does what the colocated loop does between phases, without the work itself:

    world destroy (+ wait) -> engine release -> world rebuild -> trainer onload ->
    trainer offload -> engine resume

There is one engine: the embedded engine, started by rank 0 as the loop starts it. The trainer
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
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

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
}


def _build(path: Path) -> None:
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)


def _worker(rank: int, world_size: int, port: int, args: dict, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from rltrain.config import AlgoConfig, EngineConfig, TrainerConfig
    from rltrain.engine.client import EngineClient
    from rltrain.engine.launcher import EngineProcess, server_command
    from rltrain.runtime.net import free_port
    from rltrain.runtime.world import World
    from rltrain.trainer.fsdp import FSDPTrainer

    device = torch.device(args["device"] if args["device"] == "cpu" else f"cuda:{rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = World(backend="nccl" if device.type == "cuda" else "gloo", timeout=120)
    engine = client = None
    if rank == 0:
        eport = free_port()
        ecfg = EngineConfig(
            backend="native", device=device.type, dtype="float32" if device.type == "cpu" else "bfloat16"
        )
        engine = EngineProcess.start(
            server_command(ecfg, args["model"], eport), f"http://127.0.0.1:{eport}", Path(out) / "engine.log"
        )
        client = EngineClient(engine.url, retries=0)
        client.wait_healthy(300, alive=lambda: engine.alive)
    trainer = FSDPTrainer(TrainerConfig(lr=1e-4), AlgoConfig(), args["model"], device)
    trainer.create()
    me = psutil.Process()
    parts = args["parts"]
    samples = []
    try:
        for cycle in range(args["cycles"]):
            t0 = time.perf_counter()
            world.destroy()
            world.wait_destroyed()
            if client is not None and "engine" in parts:
                client.release(["kv_cache", "weights"])
            world.bridge.barrier(phase="soak release")
            world.rebuild()
            if "trainer" in parts:
                trainer.onload()
                trainer.offload()
            world.bridge.barrier(phase="soak offload")
            low = None
            if device.type == "cuda":  # the cycle's low point: engine released, trainer offloaded, world down
                world.destroy()
                world.wait_destroyed()
                free, total = torch.cuda.mem_get_info(device)
                low = (total - free) / 2**20
                world.rebuild()
            if client is not None and "engine" in parts:
                client.resume(["weights", "kv_cache"])
            world.bridge.barrier(phase="soak resume")
            row = {
                "cycle": cycle,
                "s": time.perf_counter() - t0,
                "rss_mib": me.memory_info().rss / 2**20,
                "fds": me.num_fds(),
                "threads": me.num_threads(),
                "children": len(me.children(recursive=True)),
            }
            if engine is not None:
                row["engine_rss_mib"] = psutil.Process(engine.proc.pid).memory_info().rss / 2**20
            if device.type == "cuda":
                free, total = torch.cuda.mem_get_info(device)
                row["cuda_used_mib"] = (total - free) / 2**20
                row["cuda_low_mib"] = low
            samples.append(row)
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(samples))
        if client is not None:
            client.close()
        if engine is not None:
            engine.stop()
        trainer.release()
        world.close()


def run(cycles: int, ranks: int, device: str, warmup: int, parts: str = "engine,trainer") -> tuple[list[str], bool]:
    import torch.multiprocessing as mp

    from rltrain.runtime.net import free_port

    with tempfile.TemporaryDirectory(prefix="rltrain-soak-") as tmp:
        model = Path(tmp) / "model"
        _build(model)
        args = {"cycles": cycles, "device": device, "model": str(model), "parts": parts.split(",")}
        mp.start_processes(_worker, args=(ranks, free_port(), args, tmp), nprocs=ranks, start_method="spawn")
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
    lines = [
        f"# rltrain.bench.soak  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  {ranks} ranks on {device}, "
        f"{cycles} cycles (destroy, release, rebuild, onload, offload, resume), warm-up {warmup}",
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
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument(
        "--parts",
        default="engine,trainer",
        help="what cycles besides the world (to find what grows): engine, trainer, both",
    )
    a = ap.parse_args(argv)
    if a.cycles <= a.warmup:
        print(f"--cycles must exceed --warmup ({a.warmup})", file=sys.stderr)
        return 2
    lines, ok = run(a.cycles, a.ranks, a.device, a.warmup, a.parts)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
