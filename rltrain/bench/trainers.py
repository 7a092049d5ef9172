"""Benchmark: one GRPO step per trainer backend — tokens/s and GPU memory per phase.

    python -m rltrain.bench.trainers --device cuda                       # both backends, Qwen3-1.7B shape
    python -m rltrain.bench.trainers --backends megatron --shape 0.6b
    python -m rltrain.bench.trainers --backends fsdp,fsdp-packed --response 64-1024 --samples 64

`--response LO-HI`: responses of lengths uniform in [LO, HI] after a `--prompt`-token prompt (an
RL batch), right-padded as the loop pads them; `fsdp-packed` is the fsdp backend padding-free
(`trainer.max_tokens_per_micro_batch` = micro-batch x the longest sequence: the padded path's
tokens per forward). Rates and MFU count real tokens only, so padding is counted as lost time.

One rank (a one-rank world: FSDP2 over one rank for `fsdp`, TP=1 for `megatron`), a
Qwen3-shaped model with random weights built locally, bf16 on GPU. Per backend: create, old
log-probs, a train step (one optimizer step over the batch), offload, onload — each timed, with
the GPU memory in use after it (`torch.cuda.mem_get_info`: everything the process holds,
including the CUDA context) and allocated by torch. The limits measured in the same run: the
bf16 matmul rate (for MFU: 6 x params x tokens per train step, 2 x for log-probs) and the
pinned host<->device copy bandwidth (what offload/onload move at best).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from rltrain.bench.models import QWEN3_SHAPES, build

if TYPE_CHECKING:
    from rltrain.batch import TrainBatch
    from rltrain.trainer.fsdp import FSDPTrainer
    from rltrain.trainer.megatron.trainer import MegatronTrainer

T = TypeVar("T")


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * n**3 / (time.perf_counter() - t0) / 1e12


def batch(n: int, L: int, vocab: int, prompt: int = 0, response: tuple[int, int] | None = None) -> TrainBatch:
    """n sequences of L tokens (a prompt quarter), or of `prompt` + a response length uniform in
    `response` (right-padded to the longest)."""
    from rltrain.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    if response is None:
        lengths, prompts = [L] * n, [L // 4] * n
    else:
        lo, hi = response
        lengths = [prompt + int(x) for x in torch.randint(lo, hi + 1, (n,), generator=g)]
        prompts, L = [prompt] * n, max(lengths)
    tokens = torch.randint(1, vocab - 1, (n, L), generator=g)
    attn = torch.zeros(n, L, dtype=torch.long)
    loss = torch.zeros(n, L)
    for i, (length, p) in enumerate(zip(lengths, prompts)):
        attn[i, :length] = 1
        loss[i, p:length] = 1.0
    adv = torch.randn(n, 1, generator=g).expand(n, L) * loss
    return TrainBatch(tokens, attn, loss, advantages=adv.contiguous())


@contextlib.contextmanager
def profiled(into: dict[str, str], name: str, top: int) -> Iterator[None]:
    """Under torch.profiler: the `top` kernels by GPU time into `into[name]`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) or 1
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    lines = [f"{'share':>6s} {'ms':>9s} {'calls':>6s}  kernel (GPU busy {total / 1e3:.1f} ms in all)"]
    for e in events[:top]:
        t = e.self_device_time_total
        lines.append(f"{t / total:6.1%} {t / 1e3:9.2f} {e.count:6d}  {e.key[:110]}")
    into[name] = "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", default="fsdp,megatron")
    ap.add_argument("--shape", default="1.7b", choices=sorted(QWEN3_SHAPES))
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens, with --response")
    ap.add_argument("--response", default="", help="LO-HI: variable response lengths (default: --seq tokens each)")
    ap.add_argument("--attention", default="auto", help="trainer.attention of the fsdp backend")
    ap.add_argument("--budget", type=int, default=0, help="packed: tokens per micro-batch (0: micro x longest)")
    ap.add_argument(
        "--compile",
        default="off",
        choices=["off", "on", "both"],
        help="trainer.compile of the fsdp backend (both: each fsdp backend twice, eager then compiled)",
    )
    ap.add_argument("--profile", type=int, default=0, help="print the N kernels that took most GPU time per phase")
    a = ap.parse_args(argv)
    response = tuple(int(x) for x in a.response.split("-")) if a.response else None

    from rltrain.bench.release import pinned_copy_gbps
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.world import World

    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(k, None)
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type != "cuda":
        raise SystemExit("this benchmark measures GPU memory and matmul rates: run it with --device cuda")
    torch.cuda.set_device(device)
    world = World(backend="nccl", timeout=600)
    root = Path(tempfile.mkdtemp(prefix="rltrain-bench-trainers-"))
    path = build(root / "model", a.shape, device)
    vocab = QWEN3_SHAPES[a.shape].vocab
    tflops = matmul_tflops(device)
    lengths = f"{a.prompt} + {response[0]}-{response[1]}" if response else f"{a.seq}"
    print(
        f"# rltrain.bench.trainers  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  "
        f"{torch.cuda.get_device_name()}  shape {a.shape}  {a.samples} x {lengths} tokens  micro-batch {a.micro}  bf16"
    )
    print(f"# limits: bf16 matmul {tflops:.0f} TFLOP/s (8192^3); pinned copy measured per backend below")
    runs = []
    for name in a.backends.split(","):
        modes = {"off": [False], "on": [True], "both": [False, True]}[a.compile]
        runs += [(name, c) for c in (modes if name.startswith("fsdp") else [False])]
    for name, compiled in runs:
        backend = name.removesuffix("-packed")
        b = batch(a.samples, a.seq, vocab, a.prompt, response)  # type: ignore[arg-type]
        budget = (a.budget or a.micro * b.tokens.shape[1]) if name.endswith("-packed") else 0
        cfg = TrainerConfig(
            backend=backend,
            dtype="bfloat16",
            lr=1e-6,
            micro_batch_size=a.micro,
            max_tokens_per_micro_batch=budget,
            attention=a.attention if backend == "fsdp" else "auto",
            compile=compiled,
        )
        algo = AlgoConfig()
        tokens = int(b.attention_mask.sum())  # real tokens: padding computed is time lost
        rows: list[tuple[str, float, float, float]] = []  # (phase, seconds, GPU used GiB, allocated GiB)

        profiles: dict[str, str] = {}

        def phase(name: str, fn: Callable[[], T]) -> T:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
            free, total = torch.cuda.mem_get_info()
            rows.append((name, s, (total - free) / 2**30, torch.cuda.memory_allocated() / 2**30))
            return out

        if backend == "megatron":
            from rltrain.trainer.megatron.trainer import MegatronTrainer

            t: MegatronTrainer | FSDPTrainer = MegatronTrainer(cfg, algo, str(path), device, world)
        else:
            from rltrain.trainer.fsdp import FSDPTrainer

            t = FSDPTrainer(cfg, algo, str(path), device)
        phase("create", t.create)
        assert t.model is not None
        params = sum(n.numel() for n in t.model.parameters())
        for _ in range(2):  # the first round warms kernels up (and compiles); the second is reported
            rows.clear()
            lp, _ = phase("logprobs", functools.partial(t.logprobs, b))
            b.old_logp = lp
            stats = phase("train", functools.partial(t.train_step, b))
            phase("offload", t.offload)
            phase("onload", t.onload)
        if a.profile:  # a third round, untimed, under the profiler
            t.onload()
            with profiled(profiles, "logprobs", a.profile):
                t.logprobs(b)
            with profiled(profiles, "train", a.profile):
                t.train_step(b)
        state_bytes = params * (2 + 4 + 4 + 4)  # bf16 weights + fp32 main copy / Adam moments (upper bound)
        down, up = pinned_copy_gbps(min(state_bytes, 4 << 30), device)
        shape = f"{tokens:,} real tokens in {b.tokens.numel():,} padded ({tokens / b.tokens.numel():.0%})"
        packing = f"packed, <= {budget} tokens per micro-batch" if budget else f"padded, micro-batch {a.micro}"
        packing += f", attention {cfg.attention}" + (", compiled blocks" if compiled else "")
        print(f"\n## {name}: {params / 1e9:.2f} B parameters; {shape}; {packing}; grad_norm {stats['grad_norm']:.3g}")
        print(f"{'phase':>10s} {'s':>8s} {'GPU used GiB':>13s} {'allocated GiB':>14s}  rate")
        for name, s, used, alloc in rows:
            rate = ""
            if name == "logprobs":
                rate = f"{tokens / s:,.0f} tok/s, MFU {2 * params * tokens / s / 1e12 / tflops:.0%}"
            elif name == "train":
                # forward for the loss + backward: 6 x params x tokens (no recompute)
                rate = f"{tokens / s:,.0f} tok/s, MFU {6 * params * tokens / s / 1e12 / tflops:.0%}"
            print(f"{name:>10s} {s:8.3f} {used:13.2f} {alloc:14.2f}  {rate}")
        print(f"pinned copy d->h {down:.1f} GB/s, h->d {up:.1f} GB/s")
        for phase_name, table in profiles.items():
            print(f"GPU time by kernel, {phase_name} (a third, untimed round under the profiler)\n{table}")
        print("parts of the last offload/onload: " + ", ".join(f"{k} {v:.3f}s" for k, v in t.timings.items()))
        t.release()
        del t
        torch.cuda.empty_cache()
    world.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
