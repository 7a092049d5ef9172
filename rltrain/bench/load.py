"""Benchmark: an HF checkpoint loaded into the FSDP2 trainer on N ranks, per rank, against its limits.

    python -m rltrain.bench.load                               # CPU: 4 gloo ranks, 4b shape cut to 4 layers
    python -m rltrain.bench.load --shape 8b --layers 8 --ranks 2
    python -m rltrain.bench.load --shape 8b                    # GPUs: one NCCL rank per GPU

A Qwen3-shaped checkpoint with random weights is built locally (`bench.models.build`; kept under
`--dir` and reused). Each path then runs on N fresh processes with torchrun's environment (gloo
on the CPU; NCCL, one GPU each), forked from one server that has imported torch, transformers
and the trainer, so that the figures hold the load alone:
  full read, then shard   what the trainer did before #50, reproduced here: transformers'
                          `from_pretrained` of the whole model on every rank, moved to the
                          device, then FSDP2's `shard`
  trainer create()        `FSDPTrainer.create()` as the loop calls it (no reference model): the
                          trainer's own load, whatever it does today
Per rank: the peak host RSS that loading added (VmHWM, reset through /proc/self/clear_refs just
before; of it the anonymous memory, sampled), the peak device memory (GPU), seconds, and whether
its shards equal the full read's. Before each path the checkpoint files are evicted from the page
cache (`--cache cold`: fsync, then posix_fadvise DONTNEED) or read once (`--cache warm`).

The limits, in the same run: the time to read every checkpoint file once with safetensors'
`safe_open` (one process, the same cache state) and the model's bytes / N. The goals (#50): added
host RSS per rank <= 1.5 x (model bytes / N) + 1 GiB; device memory <= the rank's shard plus one
layer (the largest decoder layer, or the largest tensor outside the layers: the embedding); load
time <= 1.2 x the read time.

Megatron's load is not measured here: on the CPU it runs only under the tests' shim, and its
`create()` builds the optimizer's fp32 main parameters with the model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rltrain.bench.models import QWEN3_SHAPES, build, cut
from rltrain.runtime.internals import local_shard

GiB = 1 << 30
PATHS = {"full": "full read, then shard", "trainer": "trainer create()"}
PRELOAD = ["torch", "torch.distributed", "transformers", "safetensors.torch", "rltrain.trainer.fsdp"]
SAMPLE_S = 0.005  # the anonymous-memory sampler's period


# ---------------------------------------------------------------------------- in each rank


def _status_bytes(key: str) -> int:
    """A size line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key} line: this benchmark reads Linux's process status")


class HostPeak:
    """This process's peak host memory from construction on: VmHWM (reset to the current RSS
    through /proc/self/clear_refs) and the anonymous memory, sampled on a thread (file-backed
    pages, such as a mapped checkpoint's, count in RSS as well)."""

    def __init__(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")
        self.base = _status_bytes("VmHWM")
        self.base_anon = self.peak_anon = _status_bytes("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak_anon = max(self.peak_anon, _status_bytes("RssAnon"))

    def stop(self) -> tuple[int, int]:
        """(peak RSS added, peak anonymous memory added), bytes."""
        self._stop.set()
        self._thread.join(timeout=10)
        self.peak_anon = max(self.peak_anon, _status_bytes("RssAnon"))
        return _status_bytes("VmHWM") - self.base, self.peak_anon - self.base_anon


def _fingerprint(model: torch.nn.Module) -> list[tuple[int, float]]:
    """The rank's parameter shards as (elements, float64 sum), sorted: equal for equal shards
    whatever the module's names (the trainer wraps its LM head)."""
    return sorted((p.numel(), float(local_shard(p).detach().sum(dtype=torch.float64))) for p in model.parameters())


def _load(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    import gc

    import torch.distributed as dist
    import transformers
    from transformers.utils import logging as hf_logging

    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.dtypes import resolve_dtype
    from rltrain.runtime.memory import trim_host_heap
    from rltrain.trainer.fsdp import FSDPTrainer
    from rltrain.trainer.sharding import shard

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cuda = job["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(job["threads"])
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=timedelta(seconds=job["timeout"]), device_id=device if cuda else None
    )
    dtype = resolve_dtype(job["dtype"], device)
    path = job["model"]
    # What any first load pays once per process (transformers' lazy imports of the model class,
    # the config), outside the measurement.
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)
    gc.collect()
    trim_host_heap()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    device_base = torch.cuda.memory_allocated(device) if cuda else 0
    dist.barrier()
    meter = HostPeak()
    t0 = time.perf_counter()
    if job["path"] == "full":
        full = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model: torch.nn.Module = full.to(device)  # type: ignore[arg-type]  # (bench.models.save_random_qwen2 says why)
        shard(model, device)
    else:
        trainer = FSDPTrainer(TrainerConfig(dtype=job["dtype"]), AlgoConfig(kl_coef=0.0), path, device)
        trainer.create()
        assert trainer.model is not None
        model = trainer.model
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    host, anon = meter.stop()
    shard_bytes = sum(local_shard(t).nbytes for t in (*model.parameters(), *model.buffers()))
    result = {
        "rank": rank,
        "seconds": seconds,
        "host": host,
        "anon": anon,
        "device": (torch.cuda.max_memory_allocated(device) - device_base) if cuda else None,
        "shard": shard_bytes,
        "fingerprint": _fingerprint(model),
    }
    dist.barrier()
    dist.destroy_process_group()
    return result


def _rank(rank: int, ranks: int, port: int, env: dict[str, str], job: dict[str, Any], out: str) -> None:
    """One rank of a path (a forked process): its figures to rank<k>.json, or its error to rank<k>.error."""
    from rltrain.runtime.env import single_node_variables

    os.environ.clear()  # the fork server's environment is the driver's when the server started
    os.environ.update(env)
    os.environ.update(single_node_variables(rank, ranks, port))
    try:
        Path(out, f"rank{rank}.json").write_text(json.dumps(_load(rank, job)))
        code = 0
    except BaseException:  # noqa: BLE001 - said to the driver, which reports the first error
        Path(out, f"rank{rank}.error").write_text(traceback.format_exc())
        code = 1
    # No interpreter teardown: a rank whose peers failed may hold gloo state whose destructors block.
    os._exit(code)


# ---------------------------------------------------------------------------- the driver


@dataclass(frozen=True)
class Checkpoint:
    files: list[Path]
    nbytes: int  # every tensor's bytes in the files (tied weights once, as the files hold them)
    params: int  # elements of those tensors
    layer_params: int  # of the largest decoder layer, or of the largest tensor outside the layers


def _evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages not mapped by any process: fsync
    first; the ranks of the last path have exited)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def _prepare_cache(files: list[Path], cache: str) -> None:
    (_evict if cache == "cold" else _warm)(files)


def read_checkpoint(model: Path, cache: str) -> tuple[float, Checkpoint]:
    """Seconds to read every tensor of every safetensors file once with `safe_open` (in this
    process, after `_prepare_cache`), and what the reading saw. On the CPU `get_tensor` maps the
    file without reading it: each tensor is copied into one reused buffer, which reads its pages."""
    from safetensors import safe_open

    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{model} holds no *.safetensors file: expected a checkpoint bench.models.build wrote")
    _prepare_cache(files, cache)
    sizes: dict[str, tuple[int, int]] = {}  # name -> (bytes, elements)
    buffer = torch.empty(0, dtype=torch.uint8)
    t0 = time.perf_counter()
    for f in files:
        with safe_open(f, "pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                t = fh.get_tensor(name)
                sizes[name] = (t.nbytes, t.numel())
                if t.nbytes > buffer.numel():
                    buffer = torch.empty(t.nbytes, dtype=torch.uint8)
                buffer[: t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
                del t
    seconds = time.perf_counter() - t0
    layers: dict[str, int] = {}
    largest_other = 0
    for name, (_, n) in sizes.items():
        m = re.match(r"(.*\.layers\.\d+)\.", name)
        if m:
            layers[m.group(1)] = layers.get(m.group(1), 0) + n
        else:
            largest_other = max(largest_other, n)
    return seconds, Checkpoint(
        files=files,
        nbytes=sum(b for b, _ in sizes.values()),
        params=sum(n for _, n in sizes.values()),
        layer_params=max([largest_other, *layers.values()]),
    )


def _fork_server() -> Any:
    """The context whose processes fork from one server that has imported `PRELOAD` (started at
    the first process; where one runs already, as under the tests, that one)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run_path(ctx: Any, path: str, ranks: int, job: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """One path on `ranks` fresh processes; their figures by rank, or SystemExit with the first error."""
    from rltrain.runtime.net import free_port

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.*"):  # a kept --dir's earlier run
        old.unlink()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    job = {**job, "path": path}
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, env, job, str(out))) for r in range(ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + job["timeout"]
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    late = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in late:
        procs[r].kill()
        procs[r].join(timeout=10)
    errors = sorted(out.glob("rank*.error"), key=lambda f: f.stat().st_mtime)
    if errors:  # the first to fail says why; the others mostly lost their peer
        raise SystemExit(f"{PATHS[path]}: {errors[0].stem} failed:\n{errors[0].read_text()}")
    if late:
        raise SystemExit(f"{PATHS[path]}: ranks {late} still loading after --timeout {job['timeout']} s (killed)")
    missing = [r for r in range(ranks) if not (out / f"rank{r}.json").is_file()]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise SystemExit(f"{PATHS[path]}: ranks {missing} ended without a result (exit codes {codes})")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _gib(n: float) -> str:
    return f"{n / GiB:.3f}"


def _verdict(value: float, goal: float) -> str:
    return "meets" if value <= goal else "misses"


def run(
    shape: str,
    layers: int | None,
    ranks: int,
    device: str,
    dtype: str,
    cache: str,
    root: Path,
    paths: list[str],
    timeout: float,
) -> list[str]:
    """Build (or reuse) the checkpoint under `root`, measure the read and every path; the table's lines."""
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise SystemExit(f"--paths {','.join(unknown)}: expected some of {','.join(PATHS)}")
    if device == "cuda" and ranks > torch.cuda.device_count():
        raise SystemExit(
            f"--ranks {ranks}: NCCL takes one GPU per rank and this machine has {torch.cuda.device_count()}"
        )
    from rltrain.runtime.dtypes import resolve_dtype

    sized = cut(QWEN3_SHAPES[shape], layers)
    itemsize = resolve_dtype(dtype, torch.device(device)).itemsize  # of the model the trainer holds
    model = root / f"model-{shape}-{sized.layers}layers"
    ctx = _fork_server()
    if not (model / "config.json").is_file():
        builder = ctx.Process(target=_build, args=(str(model), shape, device, layers))
        builder.start()
        builder.join(timeout=timeout)
        if builder.is_alive():
            builder.kill()
            builder.join(timeout=10)
        if builder.exitcode != 0:
            raise SystemExit(f"building the {shape} checkpoint in {model} failed (exit {builder.exitcode})")
    read_s, ckpt = read_checkpoint(model, cache)
    warm_s = read_checkpoint(model, "warm")[0] if cache == "cold" else read_s
    job = {
        "model": str(model),
        "device": device,
        "dtype": dtype,
        "timeout": timeout,
        "threads": max(1, (os.cpu_count() or 1) // ranks),
    }
    results = {}
    for p in paths:
        _prepare_cache(ckpt.files, cache)
        results[p] = _run_path(ctx, p, ranks, job, root / f"ranks-{p}")
    model_bytes, layer_bytes = ckpt.params * itemsize, ckpt.layer_params * itemsize
    per_rank = model_bytes / ranks
    host_goal = 1.5 * per_rank + GiB
    time_goal = 1.2 * read_s
    what = "cpu" if device == "cpu" else torch.cuda.get_device_name()
    lines = [
        f"# rltrain.bench.load  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  {what} "
        f"({os.cpu_count()} cpus)  {ranks} ranks, {'nccl' if device == 'cuda' else 'gloo'}",
        f"# model: {shape} shape, {sized.layers} of {QWEN3_SHAPES[shape].layers} layers ({ckpt.params / 1e9:.3f} B "
        f"parameters, random weights), checkpoint bf16: {ckpt.nbytes / GiB:.3f} GiB in {len(ckpt.files)} file(s); "
        f"trainer dtype {dtype} ({resolve_dtype(dtype, torch.device(device))}): model {_gib(model_bytes)} GiB, "
        f"largest layer {_gib(layer_bytes)} GiB",
        f"# limits (same run): every file read once with safe_open, one process, {cache} cache"
        + (
            " (evicted: fsync + posix_fadvise DONTNEED; a hypervisor's cache below may still serve it)"
            if cache == "cold"
            else ""
        )
        + f": {read_s:.3f} s ({ckpt.nbytes / read_s / 1e9:.2f} GB/s)"
        + (f"; warm: {warm_s:.3f} s ({ckpt.nbytes / warm_s / 1e9:.2f} GB/s)" if cache == "cold" else "")
        + f"; model bytes / {ranks} ranks: {_gib(per_rank)} GiB",
        f"# goals: added host RSS per rank <= 1.5 x {_gib(per_rank)} + 1 GiB = {_gib(host_goal)} GiB; "
        f"device <= the rank's shard + {_gib(layer_bytes)} GiB; load <= 1.2 x {read_s:.3f} s = {time_goal:.3f} s",
        f"{'path':>22s} {'rank':>4s} {'host RSS GiB':>12s} {'of it anon':>10s} {'device GiB':>10s} "
        f"{'shard GiB':>9s} {'seconds':>8s}  shards",
    ]
    reference = {r["rank"]: r["fingerprint"] for r in results.get("full", [])}
    summary = []
    for p, rows in results.items():
        for r in rows:
            same = (
                "-"
                if not reference or p == "full"
                else ("= full" if r["fingerprint"] == reference[r["rank"]] else "DIFFER")
            )
            lines.append(
                f"{PATHS[p]:>22s} {r['rank']:>4d} {_gib(r['host']):>12s} {_gib(r['anon']):>10s} "
                f"{'-' if r['device'] is None else _gib(r['device']):>10s} {_gib(r['shard']):>9s} "
                f"{r['seconds']:8.2f}  {same}"
            )
        host = max(r["host"] for r in rows)
        slowest = max(r["seconds"] for r in rows)
        text = (
            f"{PATHS[p]:>22s}: host RSS (most of any rank) {_gib(host)} GiB = {host / per_rank:.2f}x model/N "
            f"({_verdict(host, host_goal)} <= {_gib(host_goal)}); slowest rank {slowest:.2f} s = "
            f"{slowest / read_s:.2f}x the read ({_verdict(slowest, time_goal)} <= 1.2x)"
        )
        if device == "cuda":
            worst = max(rows, key=lambda r: r["device"] / (r["shard"] + layer_bytes))
            bound = worst["shard"] + layer_bytes
            text += (
                f"; device (rank {worst['rank']}) {_gib(worst['device'])} GiB "
                f"({_verdict(worst['device'], bound)} <= {_gib(bound)})"
            )
        summary.append(text)
    return [*lines, *summary]


def _build(path: str, shape: str, device: str, layers: int | None) -> None:
    """In a child process: the checkpoint in bf16, as models are released (random init on GPU 0
    where there is one)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    build(Path(path), shape, torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"), layers=layers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="4b", choices=list(QWEN3_SHAPES))
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="keep the shape's first LAYERS layers (default: all on a GPU, 4 on the CPU)",
    )
    ap.add_argument("--ranks", type=int, default=None, help="processes (default: 4 on the CPU, one per GPU)")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="trainer.dtype (auto: bf16 on a GPU, fp32 on the CPU); the checkpoint is bf16",
    )
    ap.add_argument("--cache", default="cold", choices=["cold", "warm"], help="the checkpoint's pages before each read")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"some of {','.join(PATHS)}")
    ap.add_argument(
        "--dir", default=None, help="where the checkpoint is built and kept (default: a new temporary directory)"
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a path's ranks may take, and a collective")
    a = ap.parse_args(argv)
    ranks = a.ranks or (4 if a.device == "cpu" else torch.cuda.device_count())
    layers = a.layers if a.layers is not None or a.device == "cuda" else min(4, QWEN3_SHAPES[a.shape].layers)
    root = Path(a.dir or tempfile.mkdtemp(prefix="rltrain-bench-load-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        lines = run(a.shape, layers, ranks, a.device, a.dtype, a.cache, root, a.paths.split(","), a.timeout)
    except ValueError as e:  # a cut the shape cannot take
        raise SystemExit(str(e)) from None
    print("\n".join(lines))
    print(f"\ncheckpoint and per-rank results: {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
