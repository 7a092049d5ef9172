"""Benchmark: rollout throughput of the engines against a plain transformers `generate` loop.

    python -m rltrain.bench.engine --sglang-pythonpath tests/sglang_shim    # CPU: embedded, SGLang, HF
    python -m rltrain.bench.engine --device cuda --hidden 2048 --layers 8 --prompts 256
    python -m rltrain.bench.engine --device cuda --engine sglang embedded --sglang-args "--attention-backend triton"
    python -m rltrain.bench.engine --device cuda --shape 1.7b --prompts 512 --prompt-len 24 40 --new-tokens 256 \
        --engine embedded embedded-hf                       # #30's shape: the paged path against the plain one

A Qwen2-shaped model (or with --shape a Qwen3 one of bench.models' shapes) with random weights
is built locally (no downloads). Every engine gets the same prompts and sampling settings
(temperature 1, fixed output length); the baseline is transformers' own batched `generate` with
its static KV cache on the same model and device in the same run (the baseline each engine is
compared with). `embedded` is the embedded engine as configured by default (on CUDA its paged,
graph-replayed path), `embedded-hf` the same engine on transformers' own cache (`--decode hf`),
`embedded-paged` the paged path whatever the device (on the CPU: torch attention, no graphs),
`embedded-serial` the paged path with its overlap off (`--disable-overlap-schedule`: each step's
tokens read before the next step is queued). For the embedded engines the scheduler's host time
per decode step is printed from the engine's own counters (queuing a step, reading its tokens,
rebuilding the batch, admitting requests, and the time the host waited for the device): with the
overlap the host's share hides behind the device's step, without it the two add up.
On CUDA the decode memory-bandwidth limit of the workload is computed from the model and the
device's copy bandwidth measured in the same run (`rltrain.bench.limits`).
Then each engine's release/resume latency, as the loop does it (every region, after a pause),
and the memory it frees (RSS on CPU; on CUDA the device's, read through
NVML as the loop's ledger reads it).

On a CPU-only machine SGLang imports only with the repository's test-only import shim on its
path: pass `--sglang-pythonpath tests/sglang_shim` (from the repository root).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import psutil
import torch

from rltrain.bench.models import QWEN3_SHAPES, build, build_model
from rltrain.config import EmbeddedEngineConfig, EngineConfig
from rltrain.engine.client import EngineClient
from rltrain.engine.command import server_command
from rltrain.engine.launcher import NodeEngine
from rltrain.engine.process import EngineProcess
from rltrain.generation import SamplingParams
from rltrain.runtime.net import free_port


def hf_generate(path: Path, prompts: list[list[int]], new_tokens: int, device: str, dtype: torch.dtype) -> float:
    """Tokens/s of transformers' batched sampling on the same prompts (left-padded, static KV cache)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()  # type: ignore[arg-type]  # (transformers' .to: bench.models.save_random_qwen2 says why)
    L = max(map(len, prompts))
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :] = torch.tensor(p)
        mask[i, L - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(
        cache_implementation="static",
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        _sync(device)
        dt = time.perf_counter() - t0
    del model
    return (out.shape[1] - L) * len(prompts) / dt


def engine_rollout(client: EngineClient, prompts: list[list[int]], new_tokens: int, repeats: int) -> tuple[float, int]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    client.generate(prompts[:2], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
    best = 0.0
    failed = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = client.generate(prompts, params)
        dt = time.perf_counter() - t0
        failed += sum(not c.ok for c in out)
        best = max(best, sum(len(c.output_ids) for c in out if c.ok) / dt)
    return best, failed


def _engine_side(log: Path) -> float | None:
    """Tokens/s of the embedded engine's paged scheduler over its last run (its own log line:
    from taking the request to answering it, without HTTP or JSON), or None."""
    found = re.findall(r"decoded \d+ tokens in [\d.]+ s \((\d+) tokens/s", log.read_text(errors="replace"))
    return float(found[-1]) if found else None


# The paged scheduler's counters (paged.py's stats) per decode step, and their columns.
HOST_PARTS = {
    "step": "step",
    "launch_s": "queue",
    "collect_s": "read",
    "batch_state_s": "rebuild",
    "admit_s": "admit",
    "wait_s": "wait dev",
}


def _decode_stats(client: EngineClient) -> dict[str, float] | None:
    """The embedded engine's paged-path counters (None: another engine, or its plain path)."""
    stats = client.server_info().get("decode_stats")
    return dict(stats) if stats else None


def _per_step(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds per decode step of each of HOST_PARTS between two readings (step: the serve
    loop's wall time over its decode steps, prefills included)."""
    steps = max(after["decode_steps"] - before["decode_steps"], 1)
    per = {k: (after[k] - before[k]) / steps for k in HOST_PARTS if k != "step"}
    per["step"] = (after["serve_s"] - before["serve_s"]) / steps
    return per


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _start(
    kind: str,
    model: Path,
    device: Literal["cpu", "cuda"],
    dtype: Literal["bfloat16", "float32"],
    log_dir: Path,
    max_batch: int,
    a: argparse.Namespace,
) -> tuple[EngineProcess, EngineClient]:
    cfg = EngineConfig(
        backend="sglang" if kind == "sglang" else "embedded",  # (embedded-hf / -paged: its HF cache / paged path)
        device=device,
        dtype=dtype,
        embedded=EmbeddedEngineConfig(max_batch_size=max_batch),
        startup_timeout_s=600,
        prompts_per_request=max_batch,
        max_inflight=8,
    )
    env: dict[str, str | None] = {}
    if kind == "sglang" and a.sglang_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([a.sglang_pythonpath, os.environ.get("PYTHONPATH", "")])
    if kind == "sglang" and device != "cpu":
        cfg.mem_fraction_static = a.mem_fraction
        cfg.extra_args = shlex.split(a.sglang_args)
    if kind in ("embedded-hf", "embedded-paged"):
        cfg.extra_args = ["--decode", kind.removeprefix("embedded-")]
    if kind == "embedded-serial":
        cfg.extra_args = ["--decode", "paged", "--disable-overlap-schedule"]
    if kind.startswith("embedded"):
        cfg.extra_args = [*cfg.extra_args, *shlex.split(getattr(a, "engine_args", ""))]
    if kind == "sglang" and device == "cpu":
        cfg.mem_fraction_static = 0.1
        cfg.extra_args = ["--max-total-tokens", "65536"]
    port = free_port()
    proc = EngineProcess.start(
        server_command(cfg, str(model), port), f"http://127.0.0.1:{port}", log_dir / f"{kind}.log", env
    )
    client = EngineClient(proc.url, prompts_per_request=max_batch, max_inflight=8, request_timeout_s=1800)
    try:
        client.wait_healthy(600, alive=lambda: proc.alive)
    except Exception:
        print(proc.log_tail(), file=sys.stderr)
        proc.stop()
        raise
    return proc, client


def _process_memory(pid: int, device: str) -> float:
    """MiB: the whole device's memory in use (NVML) on CUDA, the engine's RSS on CPU."""
    if device.startswith("cuda"):
        from rltrain.runtime.ledger import device_used

        return device_used(torch.device(device)) / 2**20
    p = psutil.Process(pid)
    return sum(c.memory_info().rss for c in [p, *p.children(recursive=True)]) / 2**20


def release_cycle(kind: str, proc: EngineProcess, client: EngineClient, device: str) -> tuple[float, ...]:
    """The loop's release and resume of every region (SGLang: after a pause; resumed weights
    first, then KV cache and CUDA graphs): seconds each, and the memory before, released, resumed."""
    before = _process_memory(proc.proc.pid, device)
    t0 = time.perf_counter()
    if kind == "sglang":
        client.pause("abort")
        client.release(NodeEngine.REGIONS)
    else:
        client.release(["weights", "kv_cache", "cuda_graph"])
    t_rel = time.perf_counter() - t0
    after = _process_memory(proc.proc.pid, device)
    t0 = time.perf_counter()
    if kind == "sglang":
        client.resume(["weights"])
        client.resume(["kv_cache", "cuda_graph"])
        client.continue_generation()
    else:
        client.resume(["weights", "kv_cache", "cuda_graph"])
    t_res = time.perf_counter() - t0
    return t_rel, t_res, before, after, _process_memory(proc.proc.pid, device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--engine",
        "--engines",
        dest="engines",
        nargs="+",
        default=["embedded", "sglang"],
        choices=["embedded", "embedded-hf", "embedded-paged", "embedded-serial", "sglang"],
    )
    ap.add_argument("--shape", default=None, choices=sorted(QWEN3_SHAPES), help="a Qwen3 shape (bench.models)")
    ap.add_argument("--sglang-args", default="", help="extra SGLang server flags on CUDA, one string")
    ap.add_argument("--mem-fraction", type=float, default=0.5, help="SGLang's --mem-fraction-static on CUDA")
    ap.add_argument(
        "--sglang-pythonpath",
        default="",
        help="put first on SGLang's PYTHONPATH (on a CPU-only machine: tests/sglang_shim, the test-only import shim)",
    )
    a = ap.parse_args(argv)
    device: Literal["cpu", "cuda"] = "cuda" if a.device == "cuda" else "cpu"
    dtype_name: Literal["bfloat16", "float32"] = "bfloat16" if device == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, a.vocab - 1) for _ in range(rng.randint(*a.prompt_len))] for _ in range(a.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        if a.shape:
            a.vocab = QWEN3_SHAPES[a.shape].vocab
            prompts = [[rng.randrange(1, a.vocab - 1) for _ in range(len(p))] for p in prompts]
            model = build(Path(tmp) / "model", a.shape, torch.device(a.device), dtype)
        else:
            model = build_model(Path(tmp) / "model", a.hidden, a.layers, a.vocab, dtype)
        n_params = (
            sum(f.stat().st_size for f in model.glob("*.safetensors")) / torch.tensor([], dtype=dtype).element_size()
        )
        print(
            f"# rltrain.bench.engine  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  device={a.device} "
            f"({torch.cuda.get_device_name() if a.device.startswith('cuda') else f'{os.cpu_count()} cpus'})"
        )
        print(
            f"model: {f'Qwen3 {a.shape}' if a.shape else f'Qwen2-shaped, hidden {a.hidden}, {a.layers} layers'}, "
            f"vocab {a.vocab}, "
            f"{n_params / 1e6:.1f}M params, {dtype_name}; {a.prompts} prompts of {a.prompt_len[0]}-{a.prompt_len[1]} "
            f"tokens, {a.new_tokens} new tokens each"
        )
        rows = [
            (
                "transformers generate, static cache (baseline)",
                hf_generate(model, prompts, a.new_tokens, a.device, dtype),
                0,
            )
        ]
        release_rows = []
        host_rows: list[tuple[str, dict[str, float]]] = []
        for kind in a.engines:
            if kind == "sglang":
                import importlib.util

                if importlib.util.find_spec("sglang") is None:
                    rows.append(("sglang: not installed", float("nan"), 0))
                    continue
            proc, client = _start(kind, model, device, dtype_name, Path(tmp), a.prompts, a)
            try:
                before = _decode_stats(client)
                tps, failed = engine_rollout(client, prompts, a.new_tokens, a.repeats)
                if before is not None:
                    host_rows.append((kind, _per_step(before, _decode_stats(client) or before)))
                rows.append((f"{kind} engine over HTTP", tps, failed))
                inside = _engine_side(Path(tmp) / f"{kind}.log")
                if inside is not None:  # the embedded engine's scheduler, from its log
                    rows.append((f"  {kind}: its scheduler, no HTTP", inside, 0))
                if a.device != "cpu" or kind != "sglang":  # SGLang releases memory on CUDA only
                    release_rows.append((kind, *release_cycle(kind, proc, client, a.device)))
                    engine_rollout(client, prompts[:4], 4, 1)  # and generates after it
            finally:
                client.close()
                proc.stop()
        limit = None
        if a.device.startswith("cuda"):
            from rltrain.bench.limits import decode_limit, device_read_gbps

            mean_prompt = sum(map(len, prompts)) / len(prompts)
            limit = decode_limit(
                model, a.prompts, mean_prompt + a.new_tokens / 2, device_read_gbps(torch.device(a.device))
            )
    print(f"\n{'rollout':44s} {'tokens/s':>10s} {'vs HF':>9s} {'of limit':>9s} {'failed':>7s}")
    base = rows[0][1]
    for name, tps, failed in rows:
        share = f"{tps / limit.tokens_per_s:9.1%}" if limit is not None else f"{'':9s}"
        print(f"{name:44s} {tps:10.0f} {tps / base:9.2f} {share} {failed:7d}")
    if limit is not None:
        print(f"{'decode limit (same run)':44s} {limit.tokens_per_s:10.0f}   {limit.describe()}")
    if host_rows:
        print(f"\n{'scheduler, ms per decode step':44s} " + " ".join(f"{h:>9s}" for h in HOST_PARTS.values()))
        for kind, per in host_rows:
            print(f"{kind:44s} " + " ".join(f"{per[k] * 1e3:9.3f}" for k in HOST_PARTS))
    mem = "device MiB used (NVML, whole GPU)" if a.device.startswith("cuda") else "engine RSS MiB"
    for kind, t_rel, t_res, before, after, resumed in release_rows:
        print(
            f"\n{kind} release (every region): {t_rel * 1e3:.0f} ms, resume: {t_res * 1e3:.0f} ms; "
            f"{mem}: {before:.0f} before, {after:.0f} released ({before - after:.0f} freed), {resumed:.0f} resumed"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
