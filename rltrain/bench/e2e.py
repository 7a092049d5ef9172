"""Benchmark: the colocated loop end to end on one GPU, with its limits measured in the same run.

    python -m rltrain.bench.e2e                        # Qwen3-1.7B shape, 4 steps (the first warms up)
    python -m rltrain.bench.e2e --shape 0.6b --steps 3 --max-new-tokens 256
    python -m rltrain.bench.e2e --shape 0.6b --nproc 2    # the trainer sharded over two GPUs
    python -m rltrain.bench.e2e --shape 0.6b --engine sglang embedded   # both engines, same prompts
    python -m rltrain.bench.e2e --packing padded packed --stop-tokens 300 --max-new-tokens 1024
                                          # variable response lengths, the trainer padded and padding-free
    python -m rltrain.bench.e2e --staleness 0 1 --steps 6   # not colocated: the engine beside the trainer
                                          # on the same GPU, synchronous, then its rollout ahead of training
    python -m rltrain.bench.e2e --offload move auto     # the trainer's state out and back every step, then
                                          # kept where the rollout (its KV pool sized to it) leaves room

A Qwen3-shaped model with random weights is built locally (no downloads) with the synthetic
task's tokenizer. The real loop runs under torchrun on one rank (or --nproc, one per GPU, FSDP2
over all of them, the prompts split between the ranks): the engine on the GPU (the embedded
one, SGLang, or each of them in turn on the same model, prompts and seed: `--engine`), the
torch-native trainer (bf16), weight sync by `tensor` (CUDA IPC), colocated. Then, in this
process (so that its own CUDA context is not on the GPU during the loop), the limits: the bf16
matmul rate, the pinned host<->device copy rates, the decode memory-bandwidth limit of the
rollout (weights + KV bytes per decode step over the device's measured copy bandwidth,
`rltrain.bench.limits`) and the raw CUDA-IPC floor of the model's bytes (`rltrain.bench.sync`).

With `--staleness K ...` each run is not colocated (`loop.colocate=false`: the engine keeps its
memory beside the trainer's, `--mem-fraction` of the GPU for the embedded engine's KV pool too)
with `loop.max_staleness=K`: at 1 the next step's rollout runs while this step trains. On one GPU
the two share its SMs and memory bandwidth: a check of the overlap and its correctness (samples
one version behind, corrected), not a speed claim; on engines of their own GPUs (`engine.gpus`)
the rollout would not slow training.

Reported, averaged over the steps after the first: rollout and train tokens/s with MFU (6 x
parameters x tokens per train step, 2 x for the log-prob passes), each phase switch as a share
of the step, offload/onload bandwidth against the pinned copy, and from the memory ledger the GPU
memory the trainer holds while the engine generates and the engine holds while the trainer trains.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rltrain.bench.first_error import failed_run_report

SWITCHES = (
    "engine_release",
    "world_rebuild",
    "trainer_onload",
    "engine_resume_weights",
    "sync",
    "world_destroy",
    "trainer_offload",
    "engine_resume_kv",
    "sync_probe",
)
PROMPT_TOKENS = 8  # room for the synthetic task's prompts (5 tokens) in a packed micro-batch's budget
PROMPT_BOUND = 64  # data.max_prompt_tokens: the synthetic prompts' bound, as a user sets it for their data
TRAINER_DEVICE = ("trainer_weights", "trainer_grads", "trainer_optimizer", "trainer_other", "allocator_cached", "nccl")
ENGINE_DEVICE = ("engine_weights", "engine_kv_cache", "engine_other", "engine_cached")
GOALS = (
    "phase switches <= 5% of the step or <= 1.2x the floor of the bytes they move; offload/onload >= 90% of pinned "
    "copy; trainer while generating and "
    "engine while training <= 1 GiB beyond their CUDA contexts"
)


def _build(path: str, shape: str, layers: int | None = None) -> None:
    """In a child process: the model (on the GPU, then saved) and the task's tokenizer."""
    from rltrain.bench.models import build
    from rltrain.rollout import synthetic

    build(Path(path), shape, torch.device("cuda", 0), layers=layers)
    synthetic.build_tokenizer(synthetic.addition_words()).save_pretrained(path)


def _parameters(path: Path) -> int:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def stop_token_ids(vocab: int, count: int) -> list[int]:
    """`count` token ids spread over the vocabulary (none of the tokenizer's own, which sit at the
    start): a random-weight model samples one of them after ~vocab/count tokens on average, so
    response lengths vary as an RL batch's do (a geometric spread, cut at max_new_tokens)."""
    if count <= 0:
        return []
    return [vocab - 2 - k * ((vocab // 2) // count) for k in range(count)]


def run_loop(
    root: Path,
    model: Path,
    a: argparse.Namespace,
    engine: str = "embedded",
    packed: bool = False,
    staleness: int | None = None,
    offload: str = "auto",
) -> Path | None:
    """One loop run under torchrun; its run directory, or None (said, with its first error) if it
    failed. Each run begins again (run.start_over: a kept directory's earlier run is renamed
    aside, not reported as this one), and an earlier log is kept beside."""
    label = _label(engine, packed, staleness, offload)
    repo = Path(__file__).resolve().parents[2]
    config = repo / "configs" / "quickstart.yaml"
    overrides = [
        f"run.dir={root}",
        f"run.name=e2e-{label}",
        f"engine.backend={engine}",
        f"model.path={model}",
        "model.build=none",
        "world.backend=nccl",
        "engine.device=cuda",
        "engine.dtype=bfloat16",
        f"engine.embedded.max_batch_size={a.prompts * a.n}",
        "trainer.dtype=bfloat16",
        "trainer.lr=1e-6",
        f"trainer.micro_batch_size={a.micro}",
        f"data.prompts_per_step={a.prompts}",
        f"data.max_prompt_tokens={PROMPT_BOUND}",  # (what engine.max_total_tokens=auto sizes each row's prompt by)
        f"rollout.n={a.n}",
        f"rollout.max_new_tokens={a.max_new_tokens}",
        f"loop.steps={a.steps}",
        "checkpoint.interval=0",
        "run.start_over=true",
        f"sync.transport={a.transport}",
        "metrics.progress_bar=false",
        "metrics.plot=true",
    ]
    if staleness is not None:  # the engine beside the trainer, its memory kept (and bounded)
        overrides += ["loop.colocate=false", f"loop.max_staleness={staleness}"]
        if staleness:
            overrides.append(f"loop.in_flight_update={a.in_flight}")
        if engine == "embedded":
            overrides.append(f"engine.mem_fraction_static={a.mem_fraction}")
    if offload == "move":  # the whole state out and back every step
        overrides.append("loop.offload_trainer=true")
    elif offload != "auto":
        overrides.append(f"loop.offload_trainer={offload}")
    if packed:  # the padded path's tokens per forward, cut by real tokens instead of rows
        overrides.append(f"trainer.max_tokens_per_micro_batch={a.micro * (PROMPT_TOKENS + a.max_new_tokens)}")
    if a.compile:
        overrides.append("trainer.compile=true")
    stops = stop_token_ids(_vocab(model), a.stop_tokens)
    if stops:
        overrides.append(f"rollout.stop_token_ids=[{','.join(map(str, stops))}]")
    if engine == "sglang":
        args = ",".join(shlex.split(a.sglang_args))
        overrides += [f"engine.mem_fraction_static={a.mem_fraction}", f"engine.extra_args=[{args}]"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={a.nproc}",
        "-m",
        "rltrain",
        "--config",
        str(config),
        *overrides,
    ]
    log = root / f"loop-{label}.log"
    if log.exists():  # an earlier run's (a failed one's first error may be in it)
        log.rename(log.with_name(f"{log.name}.before-{time.strftime('%Y%m%d-%H%M%S')}"))
    print(f"the loop {label} runs under torchrun; its log: {log}", flush=True)
    with open(log, "w") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root)
    if r.returncode != 0:  # said, and the other runs still reported
        print(failed_run_report(f"the loop {label}", r.returncode, log), flush=True)
        return None
    return root / f"e2e-{label}"


def _label(engine: str, packed: bool, staleness: int | None, offload: str = "auto") -> str:
    return (
        engine
        + ("-packed" if packed else "")
        + (f"-k{staleness}" if staleness is not None else "")
        + (f"-offload-{offload}" if offload != "auto" else "")
    )


def _vocab(path: Path) -> int:
    import transformers

    return int(transformers.AutoConfig.from_pretrained(path).vocab_size)


def _rows(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, (rows[1:] if len(rows) > 1 else rows)


def _mean(steady: list[dict], f: Any) -> float:
    return sum(f(r) for r in steady) / len(steady)


def _engine_gib(parts: dict[str, float], context: bool = True) -> float:
    """What the engine holds on the device in a ledger entry: its own report (the embedded
    engine; its CUDA context included or not) or every other process on the GPU (SGLang, whose
    contexts cannot be told apart from the rest)."""
    own_context = ("engine_context",) if context else ()
    return sum(parts.get(k, 0.0) for k in (*ENGINE_DEVICE, *own_context, "other_processes"))


def compare(
    runs: dict[str, Path], params: int, tflops: float, limit: Any, ipc_floor_s: float, a: argparse.Namespace
) -> list[str]:
    """The runs side by side on the same model, prompts and seed (steps after the first): engines,
    and the trainer padded or padding-free (`-packed`)."""
    cols: dict[str, dict[str, str]] = {}
    for engine, run_dir in runs.items():
        rows, steady = _rows(run_dir)
        m = lambda f, s=steady: _mean(s, f)  # noqa: E731
        step_s = m(lambda r: r["time"]["step"])
        rollout_s = m(lambda r: r["time"]["rollout"])
        # A rollout ahead (loop.max_staleness): its own seconds, beside training; "rollout" is then
        # only what the step still waited for it.
        generated_s = m(lambda r: max(r.get("rollout_ahead_s", 0.0), r["time"]["rollout"]))
        tps = m(lambda r: r["response_length"] * r["samples_trained"]) / generated_s
        switches = sum(m(lambda r, p=p: r["time"].get(p, 0.0)) for p in SWITCHES)
        resume = m(lambda r: r["time"].get("engine_resume_weights", 0.0) + r["time"].get("engine_resume_kv", 0.0))
        sync_s = m(lambda r: r["time"].get("sync", 0.0))
        mem = [r["memory"]["rank0"] for r in steady]
        freed = sum(
            x["rollout"].get("device_used", 0.0) - x["engine_release"].get("device_used", 0.0) for x in mem
        ) / len(mem)
        held = sum(_engine_gib(x["rollout"]) for x in mem) / len(mem)
        training = max(_engine_gib(x["train"]) for x in mem)
        train_s, lp_s = m(lambda r: r["time"]["train"]), m(lambda r: r["time"]["logprobs"])
        train_tokens = m(lambda r: r["train_tokens_per_s"]) * train_s  # real tokens, padding not counted
        cols[engine] = {
            "step": f"{step_s:.2f} s",
            "rollout": f"{rollout_s:.2f} s",
            "  waiting for the answers": f"{m(lambda r: r.get('rollout_time', {}).get('generate_s', 0.0)):.3f} s",
            "  decoding and scoring them": f"{m(lambda r: r.get('rollout_time', {}).get('score_s', 0.0)):.3f} s",
            "response tok/s (own time)": f"{tps:,.0f}",
            "mean response length": f"{m(lambda r: r['response_length']):.0f}",
            "log-probs MFU (real tokens)": "fused into train"
            if _old_logp_fused(run_dir)
            else f"{2 * params * train_tokens / lp_s / 1e12 / tflops:.0%}",
            "train MFU (real tokens)": f"{6 * params * train_tokens / train_s / 1e12 / tflops:.0%}",
            "of the decode limit": f"{tps / limit.tokens_per_s:.1%}",
            "engine GPU while generating": f"{held:.2f} GiB",
            "engine_release": f"{m(lambda r: r['time'].get('engine_release', 0.0)):.3f} s",
            "device memory freed by release": f"{freed:.2f} GiB",
            "engine GPU while training": f"{training:.2f} GiB",
            "engine resume (weights + KV)": f"{resume:.3f} s",
            "sync": f"{sync_s:.3f} s",
            "sync / raw CUDA-IPC floor": f"{sync_s / ipc_floor_s:.1f}x",
            "all phase switches": f"{switches:.3f} s",
            "phase switches, share of step": f"{switches / step_s:.1%}",
            "probe log-prob difference": f"{m(lambda r: r.get('sync_probe_diff', float('nan'))):.4f}",
            "reward (all steps)": f"{_mean(rows, lambda r: r['reward_mean']):.4f}",
            "samples by lag (all steps)": _lags(rows),
            "rollout ahead, beside training": f"{m(lambda r: r.get('rollout_ahead_s', 0.0)):.3f} s",
            "waiting for it before the sync": f"{m(lambda r: r['time'].get('rollout_ahead_wait', 0.0)):.3f} s",
            "importance weight (mean)": f"{m(lambda r: r.get('is_weight', 1.0)):.4f}",
            "engine-trainer log-prob gap": f"{m(lambda r: r.get('logp_diff_engine_trainer', float('nan'))):.4f}",
            "failed generations (all steps)": f"{sum(r['generation_failed'] for r in rows):.0f}",
            "rows cut by updates, continued": f"{sum(r.get('in_flight_cut', 0) for r in rows):.0f}, "
            f"{sum(r.get('in_flight_continued', 0) for r in rows):.0f}",
            "tokens by lag (all steps)": _lags(rows, "staleness_tokens"),
        }
    names = list(cols)
    lines = [
        f"# engines side by side, same model ({params / 1e9:.2f} B), prompts and seed; steps 2..{a.steps} averaged",
        f"# {limit.describe()}",
        f"# raw CUDA-IPC floor of the model's {params * 2 / 1e9:.2f} GB (2 processes, 512 MiB buckets, fresh "
        f"buffers): {ipc_floor_s:.3f} s",
        f"{'':>32s} " + " ".join(f"{n:>14s}" for n in names),
    ]
    for key in cols[names[0]]:
        lines.append(f"{key:>32s} " + " ".join(f"{cols[n][key]:>14s}" for n in names))
    return lines


def _lags(rows: list[dict], key: str = "staleness") -> str:
    """Samples (or tokens) trained per weight-version lag over the run ("0:512 1:2560")."""
    total: dict[str, float] = {}
    for r in rows:
        for lag, count in r.get(key, {}).items():
            total[lag] = total.get(lag, 0.0) + count
    return " ".join(f"{lag}:{count:.0f}" for lag, count in sorted(total.items())) or "-"


def report(
    run_dir: Path,
    params: int,
    tflops: float,
    h2d: float,
    d2h: float,
    a: argparse.Namespace,
    engine: str = "embedded",
    ipc_floor_s: float = 0.0,
) -> list[str]:
    rows, steady = _rows(run_dir)
    mean = lambda f: _mean(steady, f)  # noqa: E731
    step_s = mean(lambda r: r["time"]["step"])
    lines = [
        f"# rltrain.bench.e2e  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'} x {a.nproc}",
        f"# engine {engine}; {a.shape} shape ({params / 1e9:.2f} B parameters, random weights), bf16, {a.prompts} "
        f"prompts x {a.n} samples x {a.max_new_tokens} new tokens, micro-batch {a.micro}, sync {a.transport}; "
        f"steps 2..{len(rows)} averaged",
        f"# limits (same run): bf16 matmul {tflops:.0f} TFLOP/s; pinned copy h->d {h2d:.1f} GB/s, d->h {d2h:.1f} GB/s",
        f"# goals: {GOALS}",
        "",
    ]
    rollout_s, train_s, lp_s = (mean(lambda r, p=p: r["time"].get(p, 0.0)) for p in ("rollout", "train", "logprobs"))
    rollout_s = max(rollout_s, mean(lambda r: r.get("rollout_ahead_s", 0.0)))  # (a rollout ahead: its own seconds)
    response = mean(lambda r: r["response_length"] * r["samples_trained"])
    train_tps = mean(lambda r: r["train_tokens_per_s"])
    train_tokens = train_tps * train_s
    lines += [
        f"{'what':>28s} {'value':>14s}  note",
        f"{'step':>28s} {step_s:13.2f}s",
        f"{'rollout':>28s} {rollout_s:13.2f}s  {response / rollout_s:,.0f} response tok/s",
        f"{'log-probs (old)':>28s} {lp_s:13.2f}s  "
        + (
            "fused into the training forward (one optimizer step per batch): no pass of its own"
            if _old_logp_fused(run_dir)
            else f"{train_tokens / lp_s:,.0f} tok/s per GPU, MFU {2 * params * train_tokens / lp_s / 1e12 / tflops:.0%}"
        ),
        f"{'train':>28s} {train_s:13.2f}s  {train_tps:,.0f} tok/s per GPU, "
        f"MFU {6 * params * train_tokens / train_s / 1e12 / tflops:.0%}",
    ]
    # Offload/onload move each rank's shard at once: the bandwidth is rank 0's shard over the phase
    # (where the trainer keeps part or all of its state, what its rows say moved).
    resident = any("offload_kept_gib" in r for r in steady)  # loop.offload_trainer auto (fsdp) or fit
    if resident:
        out = [r.get("offload_moved_gib", 0.0) * 2**30 for r in rows]
    else:
        out = [r["memory"]["rank0"]["trainer_offload"].get("trainer_host", 0.0) * 2**30 for r in rows]
    # A step's onload brings back what the step before put away (step 2's: step 1's, which may
    # move what later steps keep).
    first = len(rows) - len(steady)
    by_phase = {  # (bytes moved, the step's row) of each step averaged
        "trainer_offload": [(out[i], rows[i]) for i in range(first, len(rows))],
        "trainer_onload": [(out[max(i - 1, 0)], rows[i]) for i in range(first, len(rows))],
    }
    moved = {p: sum(b for b, _ in steps) / len(steady) for p, steps in by_phase.items()}
    # The bytes each switch moves and the floor of that copy (the rate measured in this run).
    floors = {
        "trainer_offload": (moved["trainer_offload"], moved["trainer_offload"] / d2h / 1e9),
        "trainer_onload": (moved["trainer_onload"], moved["trainer_onload"] / h2d / 1e9),
        "sync": (params * 2, ipc_floor_s),
    }
    total = floor = 0.0
    for p in SWITCHES:
        s = mean(lambda r, p=p: r["time"].get(p, 0.0))
        total += s
        line = f"{p:>28s} {s:13.3f}s  {s / step_s:6.1%} of the step"
        if p in floors:
            nbytes, f = floors[p]
            floor += f
            line += f"; moves {nbytes / 2**30:.2f} GiB, floor {f:.3f}s"
        lines.append(line)
    against = (
        f"{total / floor:.1f}x the floor of the bytes that move ({floor:.3f}s: "
        f"{'meets' if total <= 1.2 * floor else 'misses'} <= 1.2x)"
        if floor > 0
        else "no floor measured for the bytes that move"
    )
    lines.append(
        f"{'all phase switches':>28s} {total:13.3f}s  {total / step_s:6.1%} of the step "
        f"({'meets' if total / step_s <= 0.05 else 'misses'} <= 5%); {against}"
    )
    # Step by step (the mean hides a one-time cost: step 2's onload of what step 1 moved).
    by_step = [(r["step"], sum(r["time"].get(p, 0.0) for p in SWITCHES), r["time"]["step"]) for r in rows]
    lines.append(
        f"{'phase switches, each step':>28s} " + ", ".join(f"{n}: {s:.3f}s {s / t:.1%}" for n, s, t in by_step)
    )
    probe = mean(lambda r: r.get("sync_probe_diff", float("nan")))
    worst = mean(lambda r: r.get("sync_probe_worst", float("nan")))
    lines.append(
        f"{'probe log-prob difference':>28s} {probe:13.4f}   engine vs trainer, mean |diff| over the probe "
        f"(worst position {worst:.4f}; bf16; bounds calibrated at start-up, in the log)"
    )
    fit = _offload_mode(run_dir) == "fit"
    # The rate over the steps that moved state (a mean over all steps would divide one step's bytes
    # by every step's time, the re-binds of steps that moved nothing included), the phase whole
    # and its copy part (the trainer's timing) beside it.
    copy_part = {"trainer_offload": "offload_copy_to_host_s", "trainer_onload": "onload_copy_to_device_s"}
    for p, limit in (("trainer_offload", d2h), ("trainer_onload", h2d)):
        moving = [(b, r) for b, r in by_phase[p] if b >= 2**20]
        if not moving:
            lines.append(f"{p + ' bandwidth':>28s} {'-':>13s}  nothing moved: the whole state stayed on the device")
            continue
        nbytes = sum(b for b, _ in moving)
        s = sum(r["time"].get(p, 0.0) for _, r in moving)
        rate = nbytes / s / 1e9 if s > 0 else 0.0
        copy_s = sum(r.get(copy_part[p], 0.0) for _, r in moving)
        copy_rate = nbytes / copy_s / 1e9 if copy_s > 0 else 0.0
        copy = f"; its copy alone {copy_rate:.1f} GB/s, {copy_rate / limit:.1%}" if copy_rate else ""
        device_s = sum(r.get("offload_copies_on_the_device_s", 0.0) for _, r in moving)
        if p == "trainer_offload" and device_s > 0 and not fit:  # (the device's span of the queued copies)
            copy += f", on the device {nbytes / device_s / 1e9:.1f} GB/s, {nbytes / device_s / 1e9 / limit:.1%}"
        lines.append(
            f"{p + ' bandwidth':>28s} {rate:11.1f}GB/s  {rate / limit:6.1%} of pinned copy "
            f"({nbytes / len(moving) / 2**30:.2f} GiB of trainer state, the phase whole, over the {len(moving)} of "
            f"{len(steady)} steps that moved it{copy}"
            + ("; fit: the optimizer state's copies overlap other phases, so not a copy rate)" if fit else ")")
        )
    parts = sorted({k for r in steady for k in r if k.startswith(("onload_", "offload_")) and k.endswith("_s")})
    if parts:  # where the switch's time goes (the allocation beside the copy: note 3 of BENCHMARKS.md)
        lines.append(
            f"{'trainer onload/offload parts':>28s} "
            + ", ".join(f"{k} {mean(lambda r, k=k: r.get(k, 0.0)):.3f}s" for k in parts)
        )
    if any("world_destroy_wait_s" in r for r in steady):
        lines.append(
            f"{'engine_resume_kv waits':>28s} {mean(lambda r: r.get('world_destroy_wait_s', 0.0)):13.3f}s  for the "
            "world's NCCL teardown (in the background since world_destroy) before the KV cache maps"
        )
    kept = 0.0  # GiB of trainer state kept on the device on purpose (auto with room for all of it, fit)
    if resident:
        kept, went = (mean(lambda r, k=k: r.get(k, 0.0)) for k in ("offload_kept_gib", "offload_moved_gib"))
        lines.append(
            f"{'trainer state kept / moved':>28s} {kept:8.2f} / {went:.2f} GiB  "
            f"(loop.offload_trainer={_offload_mode(run_dir)}: what the last rollout left room for)"
        )
    mem = [m for r in steady for m in r["memory"].values()]  # every rank of every step
    held = max(sum(m["rollout"].get(k, 0.0) for k in TRAINER_DEVICE) for m in mem)
    beyond = held - kept  # (what it holds beyond what it chose to keep)
    engine_held = max(_engine_gib(m["train"], context=False) for m in mem)
    ctx = rows[-1]["memory"]["rank0"]["rollout"].get("cuda_context", 0.0)
    ectx = rows[-1]["memory"]["rank0"]["rollout"].get("engine_context", 0.0)
    lines += [
        f"{'trainer GPU while generating':>28s} {held:12.3f}GiB  beyond its CUDA context ({ctx:.2f} GiB)"
        + (f", of it {kept:.2f} GiB kept on purpose (room left by the rollout); the rest" if kept else ",")
        + f" {'meets' if beyond <= 1 else 'misses'} <= 1 GiB (most of any rank)",
        f"{'engine GPU while training':>28s} {engine_held:12.3f}GiB  beyond its CUDA context ({ectx:.2f} GiB; "
        "SGLang: every other process on the GPU, contexts included), "
        f"{'meets' if engine_held <= 1 else 'misses'} <= 1 GiB",
        "",
    ]
    from rltrain.runtime.ledger import format_ledger

    lines.append(format_ledger(rows[-1]["memory"], rows[-1]["step"]))
    return lines


def _offload_mode(run_dir: Path) -> str:
    """The run's loop.offload_trainer, as its config says."""
    from rltrain.config import load_config

    return str(load_config(run_dir / "config.yaml").loop.offload_trainer).lower()


def _old_logp_fused(run_dir: Path) -> bool:
    """Whether the run took its old log-probs from the training forward (no separate pass to
    rate: its log-prob phase is bookkeeping only)."""
    from rltrain.config import load_config

    return load_config(run_dir / "config.yaml").algo.old_logp_from_training


def main(argv: list[str] | None = None) -> int:
    from rltrain.bench.models import QWEN3_SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.7b", choices=list(QWEN3_SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="build the shape's first LAYERS layers only")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--transport", default="tensor", choices=["tensor", "disk", "distributed"])
    ap.add_argument("--nproc", type=int, default=1, help="ranks, one per GPU")
    ap.add_argument("--engine", nargs="+", default=["embedded"], choices=["embedded", "sglang"])
    ap.add_argument(
        "--packing",
        nargs="+",
        default=["padded"],
        choices=["padded", "packed"],
        help="the trainer's micro-batches: padded (trainer.micro_batch_size) and/or padding-free "
        "(trainer.max_tokens_per_micro_batch = micro x (prompt + max new tokens)); each is its own loop run",
    )
    ap.add_argument(
        "--stop-tokens",
        type=int,
        default=0,
        help="this many vocabulary ids end a response (rollout.stop_token_ids), so response lengths vary "
        "(about vocab / count on average, cut at --max-new-tokens); 0: every response runs to the limit",
    )
    ap.add_argument("--compile", action="store_true", help="trainer.compile=true")
    ap.add_argument("--sglang-args", default="", help="extra SGLang server flags, one string")
    ap.add_argument(
        "--mem-fraction",
        type=float,
        default=0.5,
        help="SGLang's --mem-fraction-static; with --staleness the embedded engine's too (engine.mem_fraction_static)",
    )
    ap.add_argument(
        "--staleness",
        type=int,
        nargs="+",
        default=None,
        help="not colocated, the engine beside the trainer on the GPU: one run per loop.max_staleness given",
    )
    ap.add_argument(
        "--in-flight",
        choices=["wait", "continue", "requeue"],
        default="wait",
        help="loop.in_flight_update for the --staleness runs above 0 (a bound above 1 needs continue or requeue)",
    )
    ap.add_argument(
        "--offload",
        nargs="+",
        default=["auto"],
        choices=["auto", "move", "fit"],
        help="loop.offload_trainer for the colocated runs: auto (the whole state stays on the device where the "
        "last rollout left room for it, the engines' KV pool sized to the rollout; else all of it moves), move "
        "(true: the whole state out and back every step), fit (the part the rollout leaves room for stays; the "
        "copies overlapped); each is its own loop run",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="run no loop: report the runs kept in --keep (e2e-<engine>/metrics.jsonl, model/config.json), "
        "with the limits measured now",
    )
    ap.add_argument("--keep", default="", help="keep the run directory here (metrics, ledger plots, logs)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark runs the loop on a GPU")
    root = Path(a.keep or tempfile.mkdtemp(prefix="rltrain-bench-e2e-"))
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    import torch.multiprocessing as mp

    if a.report_only and not a.keep:
        raise SystemExit("--report-only reports the runs of --keep DIR")
    if not a.report_only and not (model / "config.json").is_file():
        p = mp.get_context("spawn").Process(target=_build, args=(str(model), a.shape, a.layers))
        p.start()
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"building the model failed (exit {p.exitcode})")
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(k, None)
    bounds: list[int | None] = list(a.staleness) if a.staleness else [None]
    labels = [(e, p == "packed", k, o) for e in a.engine for p in a.packing for k in bounds for o in a.offload]
    if a.report_only:
        runs = {_label(*x): root / f"e2e-{_label(*x)}" for x in labels}
    else:
        done = {_label(*x): run_loop(root, model, a, *x) for x in labels}
        runs = {label: d for label, d in done.items() if d is not None}
        if not runs:
            raise SystemExit("every loop run failed")
    from rltrain.bench.limits import decode_limit, device_read_gbps
    from rltrain.bench.release import pinned_copy_gbps
    from rltrain.bench.sync import raw_ipc_seconds
    from rltrain.bench.trainers import matmul_tflops

    device = torch.device("cuda", 0)
    params = _parameters(model)
    tflops = matmul_tflops(device)
    d2h, h2d = pinned_copy_gbps(2 << 30, device)
    _, steady = _rows(next(iter(runs.values())))
    context = _mean(steady, lambda r: r.get("prompt_length", 0.0) + r["response_length"] / 2)
    limit = decode_limit(model, a.prompts * a.n, context, device_read_gbps(device))
    ipc_floor_s, _ = raw_ipc_seconds(params * 2)
    for engine, run_dir in runs.items():
        print("\n".join(report(run_dir, params, tflops, h2d, d2h, a, engine, ipc_floor_s)))
        print(f"\nrun directory: {run_dir}\n")
    print("\n".join(compare(runs, params, tflops, limit, ipc_floor_s, a)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
