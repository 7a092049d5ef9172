"""Benchmark: weight sync per transport, next to the limit of its link measured in the same run.

    python -m rltrain.bench.sync                                   # CPU: every transport, small model
    python -m rltrain.bench.sync --device cuda --transports tensor --shape 4b    # H200: ~8.8 GB bf16
    torchrun --nproc-per-node=2 -m rltrain.bench.sync --transports tensor,distributed   # across 2 GPUs

One process is the trainer (a one-rank world: FSDP2 over one rank), the embedded engine is a
second process on the same device serving a model of the same architecture. Under torchrun
with several ranks (tensor and distributed) the trainer is FSDP2-sharded over every GPU: rank 0
gathers each bucket from all ranks and sends it, as in the loop; the limit of `tensor` is then a
raw NCCL all-gather of the same bytes plus the CUDA IPC floor, both measured in the same run. Per transport,
`--cycles` rounds of three modes, each a warm-up push, then timed pushes of new versions (steady
state), each mode's fastest push over all rounds taken (the modes alternate, so that drift of
the machine falls on all three): unverified; verified with the
trainer's side of the probe scored in the push; verified with it riding the next training step
(the loop's way, `WeightSync.ride`), whose whole cost adds asking the engines' probe once awake
and their answers (timed alone: in the loop they answer on a thread, their scoring taking its
turn with the rollout's decoding under each engine's lock), the probe's row in a training
micro-batch (`--micro` x `--micro-tokens`, forward and backward, with and without it) and its
judge. The limits, on the same bytes:
  tensor       device-to-device copy in one process (the receiver's copy is the floor)
  disk, delta  raw safetensors write (+fsync) and read of the same tensors
  distributed  raw broadcast of the same bytes between two processes (gloo on CPU; NCCL between
               two GPUs, the engine on the second, when the machine has two)
and, without tensors, the bytes a MoE model (Qwen3-30B-A3B shape) sends to each engine EP rank
with and without expert routing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from rltrain.bench.models import QWEN3_30B_A3B, SYNC_SHAPES, qwen3_config
from rltrain.bench.verification import ride_cost, synchronize, verification_alone

if TYPE_CHECKING:
    from multiprocessing.queues import Queue


def build(path: Path, shape: str, dtype: torch.dtype, device: torch.device) -> Path:
    import transformers

    from rltrain.weights.hf_files import write_checkpoint
    from rltrain.weights.names import module_weights

    cfg = qwen3_config(SYNC_SHAPES[shape])
    with device:
        model = transformers.Qwen3ForCausalLM(cfg).to(dtype)  # type: ignore[arg-type]  # (transformers' .to: bench.models.save_random_qwen2 says why)
    cfg.save_pretrained(path)
    write_checkpoint(path, path, module_weights(model))  # tied weights once, as a checkpoint holds them
    del model
    return path


def raw_copy_gbps(nbytes: int, device: torch.device, chunk: int = 512 << 20) -> float:
    src = torch.empty(chunk, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(2):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(max(1, nbytes // chunk)):
            dst.copy_(src)
        synchronize(device)
        s = time.perf_counter() - t0
    return max(1, nbytes // chunk) * chunk / s / 1e9


def _ipc_receiver(jobs: Queue[torch.Tensor | None], done: Queue[int], chunk: int) -> None:
    dst = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    while (item := jobs.get()) is not None:
        dst.copy_(item)
        torch.cuda.synchronize()
        del item
        done.put(1)


def raw_ipc_seconds(nbytes: int, chunk: int = 512 << 20) -> tuple[float, float]:
    """Two processes on one GPU: buckets of `chunk` bytes passed as CUDA IPC handles and copied
    by the receiver. Returns seconds for `nbytes` with a fresh buffer per bucket (what a sync
    that frees its buffers pays: the receiver maps each new allocation) and with one reused
    buffer (steady state: the receiver's mapping is cached)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    jobs, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(jobs, done, chunk))
    proc.start()
    n = max(1, nbytes // chunk)
    reused = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    out = []
    for fresh in (True, False):
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                buf = torch.empty(chunk, dtype=torch.uint8, device="cuda") if fresh else reused
                jobs.put(buf)
                done.get()
                del buf
            s = time.perf_counter() - t0
        out.append(s * nbytes / (n * chunk))
    jobs.put(None)
    proc.join(60)
    return out[0], out[1]


def raw_safetensors_gbps(tensors: dict[str, torch.Tensor], path: Path) -> tuple[float, float]:
    from safetensors.torch import load_file, save_file

    from rltrain.runtime.files import fsync_file

    host = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    nbytes = sum(v.numel() * v.element_size() for v in host.values())
    t0 = time.perf_counter()
    save_file(host, str(path))
    fsync_file(path)
    write = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = load_file(str(path))
    read = time.perf_counter() - t0
    del back
    path.unlink()
    return nbytes / write / 1e9, nbytes / read / 1e9


def _broadcast_rank(rank: int, port: int, nbytes: int, out: str, backend: str) -> None:
    from rltrain.runtime.weight_group import UnregisteredGroup

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    g = UnregisteredGroup("127.0.0.1", port, rank, 2, "raw", backend, timeout_s=300)
    chunk = min(nbytes, 512 << 20)
    buf = torch.empty(chunk, dtype=torch.uint8, device=device)
    for _ in range(3):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(max(1, nbytes // chunk)):
            g.broadcast(buf, src=0)
        synchronize(device)
        s = time.perf_counter() - t0
    if rank == 0:
        Path(out).write_text(str(max(1, nbytes // chunk) * chunk / s / 1e9))


def raw_all_gather_seconds(nbytes: int, world_size: int, device: torch.device, chunk: int = 512 << 20) -> float:
    """Seconds for every rank to all-gather `nbytes` over the default group in `chunk`-byte
    buckets (each rank contributing its 1/world_size), steady state: the gather half of a sync."""
    import torch.distributed as dist

    part = chunk // world_size
    mine = torch.empty(part, dtype=torch.uint8, device=device).random_()
    out = torch.empty(part * world_size, dtype=torch.uint8, device=device)
    n = max(1, nbytes // (part * world_size))
    for _ in range(2):
        synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_gather_into_tensor(out, mine)
        synchronize(device)
        s = time.perf_counter() - t0
    return s * nbytes / (n * part * world_size)


def raw_broadcast_gbps(nbytes: int, backend: str = "gloo") -> float:
    import torch.multiprocessing as mp

    from rltrain.runtime.net import free_port

    port = free_port()
    with tempfile.NamedTemporaryFile() as f:
        procs = [
            mp.get_context("spawn").Process(target=_broadcast_rank, args=(r, port, nbytes, f.name, backend))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        return float(Path(f.name).read_text())


def _engine_breakdown(log_path: Path) -> None:
    """Median per-bucket times from the embedded engine's DEBUG log (--profile)."""
    import re

    rows: dict[str, list[float]] = {}
    for line in log_path.read_text().splitlines():
        if "update_weights_from_tensor:" in line:
            for key, value in re.findall(
                r"([a-z]+) ([0-9.]+)(?: ms)?", line.split("update_weights_from_tensor:", 1)[1]
            ):
                rows.setdefault(key, []).append(float(value))
        elif "POST /update_weights_from_tensor handled in" in line:
            rows.setdefault("handled", []).append(float(line.rsplit("handled in", 1)[1].split()[0]))
    print(
        "engine per bucket, ms (median / max): "
        + ", ".join(f"{k} {statistics.median(v):.2f} / {max(v):.2f}" for k, v in rows.items())
    )


def routing_table() -> list[tuple[int, float, float]]:
    """(ep, GB to each EP rank routed, unrouted) for a Qwen3-30B-A3B-shaped MoE, from metadata."""
    import transformers

    from rltrain.sync.plan import EngineTopology, WeightSpec, build_plan
    from rltrain.weights.names import checkpoint_specs

    cfg = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B.config_kwargs())
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]  # (transformers' .to: bench.models.save_random_qwen2 says why)
    weights = [WeightSpec(n, tuple(s), d) for n, _, s, d in checkpoint_specs(model)]
    rows = []
    for ep in (2, 4, 8):
        routed = build_plan(weights, EngineTopology((ep,), QWEN3_30B_A3B.experts), 512 << 20)
        assert routed.routed
        rows.append((ep, routed.bytes_to(0) / 1e9, sum(w.nbytes for w in weights) / 1e9))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--transports", default="tensor,disk,delta,distributed")
    ap.add_argument(
        "--shape", default=None, help=f"model shape, one of {sorted(SYNC_SHAPES)} (default: small on CPU, 4b on GPU)"
    )
    ap.add_argument("--disk-shape", default=None, help="shape for disk/delta (default: --shape)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--cycles",
        type=int,
        default=3,
        help="rounds of the three modes (unverified, verified, riding), each a warm-up and --repeats pushes: "
        "each mode's fastest push over all rounds (drift falls on every mode alike)",
    )
    ap.add_argument("--bucket-mb", type=int, default=512, help="sync.bucket_mb")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--micro", type=int, default=4, help="rows of the training micro-batch the probe rides")
    ap.add_argument("--micro-tokens", type=int, default=389, help="tokens per row of that micro-batch")
    ap.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help="the engine's engine.mem_fraction_static (its KV pool's share of the GPU; default: the engine's own): "
        "on an 80 GB GPU at the 4B shape the default leaves the trainer too little for the probe's micro-batch",
    )
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one push per transport")
    ap.add_argument(
        "--verify-parts",
        action="store_true",
        help="also time each part of the verification alone, against the engine after the verified pushes",
    )
    a = ap.parse_args(argv)

    from torch.distributed.tensor import DTensor
    from transformers.utils import logging as hf_logging

    from rltrain.config import AlgoConfig, EngineConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.engine.command import server_command
    from rltrain.engine.process import EngineProcess
    from rltrain.runtime.net import free_port
    from rltrain.runtime.world import World
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer

    hf_logging.disable_progress_bar()
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # > 1 under torchrun: the trainer sharded over the GPUs
    if ranks == 1:
        for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            os.environ.pop(k, None)
    elif set(a.transports.split(",")) - {"tensor", "distributed"}:
        raise SystemExit("several ranks: only --transports tensor,distributed (disk and delta are measured on one)")
    device = torch.device(a.device)
    dtype_name: Literal["bfloat16", "float32"] = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    world = World(backend="nccl" if device.type == "cuda" else "gloo", timeout=600)
    device = world.device if device.type == "cuda" else device
    first = world.rank == 0
    say = print if first else (lambda *x, **k: None)
    root = Path(
        world.bridge.broadcast_object(a.dir or (tempfile.mkdtemp(prefix="rltrain-bench-sync-") if first else None))
    )
    shape = a.shape or ("4b" if device.type == "cuda" else "small")
    say(
        f"# rltrain.bench.sync  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  device={device.type} "
        f"({torch.cuda.get_device_name() if device.type == 'cuda' else f'{os.cpu_count()} cpus'})  {dtype}  "
        f"trainer ranks {ranks}"
    )
    say(
        f"{'transport':>11s} {'model':>6s} {'GB':>6s} | {'sync s':>7s} {'GB/s':>7s} {'+verify s':>9s} | "
        f"{'limit':>28s} {'GB/s':>7s} | {'of limit':>8s}"
    )
    two_gpus = device.type == "cuda" and torch.cuda.device_count() >= 2
    for transport in a.transports.split(","):
        if transport == "distributed" and device.type == "cuda" and not two_gpus:
            say(f"{transport:>11s}  skipped: NCCL needs a second GPU (one rank per device)")
            continue
        # distributed on GPU: the engine on the second GPU (NCCL refuses two ranks on one device)
        engine_env: dict[str, str | None] | None = (
            {"CUDA_VISIBLE_DEVICES": "1"} if transport == "distributed" and two_gpus else None
        )
        s = (a.disk_shape or shape) if transport in ("disk", "delta") else shape
        path = root / f"model_{s}"
        if first and not (path / "config.json").exists():
            build(path, s, dtype, device)
        world.bridge.barrier("model built")
        trainer = FSDPTrainer(TrainerConfig(dtype=dtype_name), AlgoConfig(), str(path), device)
        trainer.create()
        proc = None
        if first:
            port = free_port()
            ecfg = EngineConfig(
                backend="embedded",
                device="cuda" if device.type == "cuda" else "cpu",
                dtype=dtype_name,
                extra_args=["--log-level", "DEBUG"] if a.profile else [],
            )
            if a.mem_fraction is not None:
                ecfg.mem_fraction_static = a.mem_fraction
            proc = EngineProcess.start(
                server_command(ecfg, str(path), port),
                f"http://127.0.0.1:{port}",
                root / f"engine_{transport}.log",
                env=engine_env,
            )
        client = EngineClient(world.bridge.broadcast_object(proc.url if proc else None), request_timeout_s=600)
        try:
            if proc is not None:  # (the first rank's)
                client.wait_healthy(600, alive=lambda: proc.alive)
            world.bridge.barrier("engine up")
            # (verify, ride) -> (fastest push s, bytes): unverified; verified with the trainer's
            # probe forward in the push; verified with it riding the next training step
            results: dict[tuple[bool, bool], tuple[float, float]] = {}
            awake_s: list[float] = []  # the engines' probe after a ridden push (the loop's sync_probe)
            answer_s: list[float] = []  # the engines' answers to it alone (in the loop, beside the rollout)
            judge_s: list[float] = []  # the ridden probe's judge (a gather over the bridge)
            pushes: dict[tuple[bool, bool], list[float]] = {}  # each mode's timed pushes, over every round
            row_s: tuple[float, float] | None = None
            modes = [(False, False), (True, False), (True, True)]
            for n, (verify, ride) in enumerate(modes * max(a.cycles, 1)):
                cfg = load_config(
                    None,
                    [
                        f"model.path={path}",
                        "data.path=synthetic:addition",
                        f"sync.transport={transport}",
                        f"sync.verify={str(verify).lower()}",
                        f"sync.weights_dir={root / 'weights' / transport}",
                        "sync.delta_full_every=1000000",
                        f"sync.bucket_mb={a.bucket_mb}",
                        f"loop.colocate={str(transport != 'delta').lower()}",
                    ],
                )
                ws = WeightSync(cfg, world, trainer, [client], str(path))
                times = []
                for i in range(a.repeats + 1):
                    if transport == "delta":  # a sparse update between versions: 1% of one matrix
                        assert trainer.model is not None
                        embedding = trainer.model.get_input_embeddings().weight
                        assert isinstance(embedding, DTensor)  # (FSDP2 shards it, over one rank or more)
                        with torch.no_grad():
                            embedding.to_local().view(-1)[i::100] += 1
                    version = str(n * 100 + i + 1)
                    synchronize(device)
                    t0 = time.perf_counter()
                    stats = ws.push(version, ride=ride)
                    times.append(time.perf_counter() - t0)
                    if ride:  # the engines' side once awake, then the judge the next step would run
                        t0 = time.perf_counter()
                        ws.verifier.scores(version)  # what the engines' answers take (beside the rollout, in the loop)
                        answer_s.append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        ws.probe_engines()  # (asks them on a thread: the judge takes the answers)
                        awake_s.append(time.perf_counter() - t0)
                        ridden = ws.ride()
                        assert ridden is not None
                        logp = ws._trainer_probe()  # (the training step's row stands in for it)
                        t0 = time.perf_counter()
                        ridden.judge(logp)
                        judge_s.append(time.perf_counter() - t0)
                if not verify:
                    timings = dict(ws.timings)  # of the last timed push
                if a.profile and not verify and first:
                    import cProfile
                    import pstats

                    prof = cProfile.Profile()
                    prof.runcall(ws.push, str(n * 100 + 99))
                    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
                elif a.profile and not verify:
                    ws.push(str(n * 100 + 99))
                if verify and not ride:  # of the last timed push: the reset and what follows the send
                    verify_s = ws.timings["verify"]
                    parts = {k.removeprefix("verify: "): v for k, v in ws.timings.items() if k.startswith("verify: ")}
                    if a.verify_parts and transport == "tensor" and ranks == 1:
                        verification_alone(ws, trainer, client, device)
                if ride and row_s is None:
                    row_s = ride_cost(trainer, ws.probe or list(range(1, 34)), device, a.micro, a.micro_tokens)
                ws.close()
                pushes.setdefault((verify, ride), []).extend(times[1:])
                results[verify, ride] = (min(pushes[verify, ride]), stats["sync_bytes"])
            assert row_s is not None
            nbytes = sum(w.nbytes for w in ws.plan.weights)
            best, sent = results[False, False]
            if a.profile:
                say(
                    "trainer side of the last timed push, s: "
                    + ", ".join(f"{k} {v:.4f}" for k, v in timings.items())
                    + (
                        "  (wait: for the previous bucket's request, on a sender thread)"
                        if transport == "tensor"
                        else ""
                    )
                )
            if a.profile and transport == "tensor" and first:
                _engine_breakdown(root / f"engine_{transport}.log")
            gather_s = raw_all_gather_seconds(nbytes, ranks, device) if ranks > 1 else 0.0
            if not first:
                limit_name, limit = "", 0.0
            elif transport == "tensor" and device.type == "cuda":
                fresh_s, steady_s = raw_ipc_seconds(nbytes, a.bucket_mb << 20)
                print(
                    f"{'':>11s} raw CUDA IPC, 2 procs, {a.bucket_mb} MiB buckets: fresh buffers {fresh_s:.3f} s, "
                    f"one reused buffer {steady_s:.3f} s; "
                    f"device copy {nbytes / raw_copy_gbps(nbytes, device) / 1e9:.3f} s"
                    + (f"; all-gather over {ranks} ranks {gather_s:.3f} s" if ranks > 1 else "")
                )
                if a.bucket_mb != 512:  # the floor the goal is stated with
                    print(f"{'':>11s} raw CUDA IPC, 512 MiB buckets: fresh buffers {raw_ipc_seconds(nbytes)[0]:.3f} s")
                if ranks > 1:
                    limit_name, limit = f"all-gather x{ranks} + CUDA IPC", nbytes / (gather_s + fresh_s) / 1e9
                else:
                    limit_name, limit = "CUDA IPC, fresh buffers", nbytes / fresh_s / 1e9
            elif transport == "tensor":
                limit_name, limit = "memory copy", raw_copy_gbps(nbytes, device)
            elif transport == "distributed":
                backend = "nccl" if device.type == "cuda" else "gloo"
                bcast = raw_broadcast_gbps(nbytes, backend)
                if ranks > 1:
                    print(
                        f"{'':>11s} all-gather over {ranks} ranks {gather_s:.3f} s; raw broadcast "
                        f"{nbytes / bcast / 1e9:.3f} s"
                    )
                    limit_name, limit = (
                        f"all-gather x{ranks} + broadcast",
                        nbytes / (gather_s + nbytes / bcast / 1e9) / 1e9,
                    )
                else:
                    limit_name, limit = f"raw {backend} broadcast, 2 procs", bcast
            else:
                w, r = raw_safetensors_gbps(dict(trainer.export_weights()), root / "raw.safetensors")
                limit_name, limit = f"safetensors w {w:.2f} + r {r:.2f}", 1 / (1 / w + 1 / r)
            if first:
                gbps = nbytes / best / 1e9
                print(
                    f"{transport:>11s} {s:>6s} {nbytes / 1e9:6.2f} | {best:7.3f} {gbps:7.2f} "
                    f"{results[True, False][0] - best:9.3f} | "
                    f"{limit_name:>28s} {limit:7.2f} | {gbps / limit:8.0%}"
                    + (f"  (delta wrote {sent / 1e6:.1f} MB)" if transport == "delta" else "")
                )
                extra = results[True, False][0] - best
                print(
                    f"{'':>11s} verification, the trainer's probe in the sync: {extra:.3f} s = {extra / best:.0%} of "
                    f"the sync's own time: inside the send and its end (both ends' checksums, the probe) "
                    f"{extra - verify_s:.3f} s, after it {verify_s:.3f} s ("
                    + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items())
                    + ")"
                )
                in_sync = results[True, True][0] - best
                awake, judged = statistics.median(awake_s[1:]), statistics.median(judge_s[1:])
                answer = statistics.median(answer_s[1:])
                row = row_s[1] - row_s[0]
                whole = in_sync + awake + answer + judged + row
                print(
                    f"{'':>11s} verification, the trainer's probe riding the next step (the loop's way): in the "
                    f"sync {in_sync:.3f} s = {in_sync / best:.0%} of the sync's own time (goal <= 50%); whole "
                    f"{whole:.3f} s = {whole / best:.0%}: + the engines' probe asked once awake {awake:.3f} s + "
                    f"their answers {answer:.3f} s (engine time: in the loop they take their turn with the "
                    f"rollout's decoding) + the probe's row in a training micro-batch of {a.micro} x "
                    f"{a.micro_tokens} tokens, forward and backward {row_s[1]:.3f} s against {row_s[0]:.3f} s "
                    f"without it ({row:+.3f} s) + its judge {judged:.3f} s"
                )
            world.bridge.barrier(f"{transport} measured")
        finally:
            client.close()
            if proc is not None:
                proc.stop()
            trainer.release()
    if not first:
        world.close()
        return 0
    print("\n# expert routing, Qwen3-30B-A3B shape (128 experts, bf16), GB received per engine EP rank")
    print(f"{'ep':>3s} {'routed':>8s} {'unrouted':>9s} {'saved':>6s}")
    for ep, routed, unrouted in routing_table():
        print(f"{ep:>3d} {routed:8.2f} {unrouted:9.2f} {1 - routed / unrouted:6.0%}")
    world.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
