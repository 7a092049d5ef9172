"""Benchmark: release-train — release and re-create the trainer from disk vs from a host snapshot.

    python -m rltrain.bench.release                          # CPU, three model sizes
    python -m rltrain.bench.release --device cuda --hidden 1024 2048 4096

For each model size (Qwen2-shaped, random weights, built locally): one optimizer step so AdamW
has its state, then
  disk: checkpoint save (DCP + manifest + verify) | release | create + load the checkpoint
  host: snapshot to host memory (pinned on GPU)    | release | create + restore the snapshot
next to the limits measured in the same run on the same bytes: raw write+fsync and read of the
checkpoint directory's size, and a raw copy of the state's size device -> host -> device (pinned
host buffers on GPU; a plain memory copy on CPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch


def _raw_disk(path: Path, nbytes: int) -> tuple[float, float]:
    buf = os.urandom(1 << 24)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(buf[: min(left, len(buf))])
            left -= len(buf)
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - t0
    # No cache dropping: the re-create reads a just-written checkpoint too, so both reads are
    # served as the OS serves them (largely from the page cache on a machine with spare RAM).
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    read = time.perf_counter() - t0
    path.unlink()
    return nbytes / write / 1e9, nbytes / read / 1e9


def pinned_copy_gbps(nbytes: int, device: torch.device) -> tuple[float, float]:
    """GB/s of one copy of `nbytes` device -> host and host -> device (pinned host memory on GPU)."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    host = torch.empty(n, pin_memory=device.type == "cuda")
    for _ in range(2):
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        down = time.perf_counter() - t0
        t0 = time.perf_counter()
        src.copy_(host, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        up = time.perf_counter() - t0
    return nbytes / down / 1e9, nbytes / up / 1e9


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, nargs="*", default=[256, 512, 1024])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir on the run disk)")
    a = ap.parse_args(argv)

    from rltrain.batch import TrainBatch
    from rltrain.bench.models import build_model
    from rltrain.checkpoint import Checkpointer
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.world import World
    from rltrain.trainer.fsdp import FSDPTrainer

    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(k, None)
    device = torch.device(a.device)
    world = World(backend="nccl" if device.type == "cuda" else "gloo", timeout=600)
    dtype_name: Literal["bfloat16", "float32"] = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    print(
        f"# rltrain.bench.release  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  device={device} "
        f"({torch.cuda.get_device_name() if device.type == 'cuda' else f'{os.cpu_count()} cpus'})"
    )
    print(
        f"{'params':>8s} {'state GB':>8s} | {'save s':>7s} {'release s':>9s} {'from disk s':>11s} {'ckpt GB/s':>9s}"
        f" | {'snapshot s':>10s} {'from host s':>11s} {'snap GB/s':>9s}"
        f" | {'raw disk w/r GB/s':>17s} {'raw copy d2h/h2d GB/s':>21s}"
    )
    root = Path(a.dir or tempfile.mkdtemp(prefix="rltrain-bench-release-"))
    try:
        for hidden in a.hidden:
            model = build_model(root / f"model{hidden}", hidden, a.layers, 32000, dtype)
            t = FSDPTrainer(
                TrainerConfig(lr=1e-5, micro_batch_size=8, dtype=dtype_name),
                AlgoConfig(),
                str(model),
                device,
            )
            t.create()
            B, L = 8, 64
            tokens = torch.randint(1, 32000, (B, L))
            batch = TrainBatch(
                tokens, torch.ones(B, L, dtype=torch.long), torch.ones(B, L), advantages=torch.randn(B, L)
            )
            batch.old_logp, _ = t.logprobs(batch)
            t.train_step(batch)
            assert t.model is not None
            params = sum(p.numel() for p in t.model.parameters())
            state_bytes = sum(p.numel() * p.element_size() for p in t.model.parameters()) * 3
            ck = Checkpointer(root / f"ck{hidden}", world, keep_last=1)

            t0 = time.perf_counter()
            saved = ck.save(1, t, "1", {})
            save_s = time.perf_counter() - t0
            ckpt_bytes = _dir_bytes(saved)
            t0 = time.perf_counter()
            t.release()
            release_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            t.create(load_weights=False)
            ck.load(saved, t, restore_rank_state=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            disk_s = time.perf_counter() - t0

            t0 = time.perf_counter()
            snap = t.snapshot()
            snap_s = time.perf_counter() - t0
            t.release()
            t0 = time.perf_counter()
            t.restore_snapshot(snap)
            if device.type == "cuda":
                torch.cuda.synchronize()
            host_s = time.perf_counter() - t0
            del snap
            t.release()

            dw, dr = _raw_disk(root / "raw.bin", ckpt_bytes)
            cd, cu = pinned_copy_gbps(state_bytes, device)
            print(
                f"{params / 1e6:7.0f}M {state_bytes / 1e9:8.2f} | {save_s:7.2f} {release_s:9.3f} {disk_s:11.2f} "
                f"{ckpt_bytes / (save_s + disk_s) / 1e9 * 2:9.2f} | {snap_s:10.2f} {host_s:11.2f} "
                f"{state_bytes / (snap_s + host_s) / 1e9 * 2:9.2f} | {dw:8.2f}/{dr:<8.2f} {cd:10.2f}/{cu:<10.2f}",
                flush=True,
            )
            shutil.rmtree(root / f"ck{hidden}", ignore_errors=True)
    finally:
        world.close()
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        "\nckpt GB/s and snap GB/s: bytes moved out and back in over the time of both directions "
        "(includes model construction on re-create)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
