"""The memory ledger: where each rank's device and host memory is, after every phase.

Every figure is measured, none is assumed:

    device_used        the whole GPU in use (NVML, as the contexts below; else cudaMemGetInfo)
    trainer_weights    the trainer's parameters and buffers on the device   \\  its tensors,
    trainer_grads      its gradients (megatron's main_grad buffers too)      } each storage
    trainer_optimizer  its optimizer state (megatron's fp32 main params too) /  counted once
    trainer_other      the rest of what this process's allocator hands out (activations, staging)
    allocator_cached   blocks this process's allocator holds free (reserved - allocated)
    nccl               what building the NCCL communicators took, measured by the world at its
                       rebuild (device memory outside the allocator, before vs. after); 0 when down
    cuda_context       this process's CUDA context, measured when the process first touched the GPU
    device_baseline    what the device had in use before that and no process held (the driver's
                       own reservation; with any other process that was there where NVML cannot
                       tell processes apart)
    engine_*           the engine's own report (weights, KV cache, other, the blocks its allocator
                       holds free, its context), on the rank whose GPU the engine uses
    engine_outside     what NVML sees of that engine's process beyond its report: CUDA graphs,
                       kernel code, library workspaces outside its allocator (with NVML per process)
    other_processes    every other process's device memory on this GPU, read per process through
                       NVML (an engine without its own report, as SGLang: its scheduler's
                       context, weights, KV cache and allocator cache, its other processes'
                       contexts); the engine that reports itself is not counted twice. Absent
                       where NVML cannot tell processes apart (another PID namespace)
    unexplained        device_used minus all of the above: shown, never hidden
    rss, host_pinned   this process's resident memory and its page-locked host allocations
    trainer_host       the trainer's tensors in host memory (offloaded weights and optimizer state)
    engine_rss         the engine process's resident memory
    engine_pinned      its page-locked host memory (the backup of its released weights, upload buffers)

Figures are GiB. A CPU run has the host part only (and the trainer's tensors under trainer_host).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import psutil
import torch

from rltrain.runtime.internals import local_shard
from rltrain.runtime.pinned import all_pinned_host_bytes

# Every tensor a trainer holds, by kind ("weights", "grads", "optimizer", "spare"), wherever it is
HeldTensors = dict[str, list[torch.Tensor]]

GIB = 2**30
DEVICE_PARTS = (
    "trainer_weights",
    "trainer_grads",
    "trainer_optimizer",
    "trainer_other",
    "allocator_cached",
    "nccl",
    "cuda_context",
    "engine_weights",
    "engine_kv_cache",
    "engine_other",
    "engine_cached",
    "engine_context",
    "engine_outside",
    "other_processes",
    "device_baseline",
)


ENGINE_REPORTED = ("engine_weights", "engine_kv_cache", "engine_other", "engine_cached", "engine_context")


def device_used(device: torch.device) -> int:
    """Bytes in use on the whole device (every process), read the way the contexts and the
    baseline are (NVML), else through cudaMemGetInfo (whose "total" counts differently)."""
    used = _nvml_used(device.index or 0)
    if used is not None:
        return used
    free, total = torch.cuda.mem_get_info(device)
    return total - free


_NVML: dict[int, Any] = {}  # device index -> NVML handle (None: NVML cannot read it)


def _nvml_used(index: int) -> int | None:
    """Device memory in use read through NVML, which needs no CUDA context (None without it)."""
    if index not in _NVML:
        try:
            import pynvml  # noqa: PLC0415 - NVML comes with CUDA builds of torch only

            pynvml.nvmlInit()
            visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            physical = visible[index] if visible else str(index)
            _NVML[index] = (
                pynvml.nvmlDeviceGetHandleByIndex(int(physical))
                if physical.isdigit()
                else pynvml.nvmlDeviceGetHandleByUUID(physical)
            )
        except Exception:  # noqa: BLE001 - no NVML, no driver, an index NVML does not know: not measured
            _NVML[index] = None
    if _NVML[index] is None:
        return None
    import pynvml  # noqa: PLC0415 - NVML comes with CUDA builds of torch only

    return int(pynvml.nvmlDeviceGetMemoryInfo(_NVML[index]).used)


def process_device_bytes(device: torch.device) -> dict[int, int] | None:
    """Device memory per process on `device` (pid -> bytes), through NVML; None where NVML cannot
    read it or its pids are not this namespace's (this process, holding a context, not among them)."""
    if device.type != "cuda" or _nvml_used(device.index or 0) is None:
        return None
    import pynvml  # noqa: PLC0415 - NVML comes with CUDA builds of torch only

    try:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(_NVML[device.index or 0])
    except pynvml.NVMLError:
        return None
    used = {int(p.pid): int(p.usedGpuMemory or 0) for p in procs}
    if torch.cuda.is_initialized() and os.getpid() not in used:
        return None
    return used


def measure_cuda_context(device: torch.device) -> tuple[int | None, int | None]:
    """Create this process's CUDA context on `device`: (what the context took, what the device
    had in use before it), both read through NVML before and after. Call it before the process
    touches the GPU otherwise; (None, None) when NVML cannot read the device or the context
    already existed."""
    if device.type != "cuda" or torch.cuda.is_initialized():
        return None, None
    before = _nvml_used(device.index or 0)
    others = process_device_bytes(device)
    torch.cuda.set_device(device)
    torch.cuda.init()
    torch.zeros(1, device=device)  # the context is created lazily, by the first real use
    torch.cuda.synchronize(device)
    after = _nvml_used(device.index or 0)
    if before is None or after is None:
        return None, None
    context = max(after - before - torch.cuda.memory_reserved(device), 0)
    # Other processes already on the device are counted as they are then (`other_processes`)
    # where NVML tells processes apart: the baseline is what no process held.
    if others is not None and process_device_bytes(device) is not None:
        before -= sum(others.values())
    return context, before


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[int, int]]) -> dict[str, int]:
    """Bytes of the distinct storages behind `tensors`, by where they live (device / pinned /
    host); storages in `seen` are skipped and added to it (a view or a tied weight counts once).
    Read after every phase of every step: a few attribute reads per tensor, nothing more."""
    out = {"device": 0, "pinned": 0, "host": 0}
    for t in tensors:
        if t is None:
            continue
        t = local_shard(t)
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr == 0:  # an emptied storage (offloaded in place), or a meta tensor
            continue
        key = (t.get_device(), ptr)  # -1 on the host
        if key in seen:
            continue
        seen.add(key)
        where = "device" if not t.is_cpu else ("pinned" if t.is_pinned() else "host")
        out[where] += s.nbytes()
    return out


class MemoryLedger:
    """Reads the ledger of this rank from one report per component, each optional:

    trainer       () -> the trainer's tensors by kind (`Trainer.held_tensors`)
    engine        () -> the engine's own figures in bytes (`NodeEngine.memory_report`: weight_bytes,
                  kv_cache_bytes, other_bytes, context_bytes, rss_bytes, host_pinned_bytes, device)
    communicators () -> bytes the world's NCCL communicators hold now (`World.communicator_bytes`)
    cuda_context  (what this process's CUDA context took, what the device held before it)
    """

    def __init__(
        self,
        device: torch.device,
        trainer: Callable[[], HeldTensors] | None = None,
        engine: Callable[[], dict[str, Any]] | None = None,
        communicators: Callable[[], int] | None = None,
        cuda_context: tuple[int | None, int | None] = (None, None),
    ):
        self.device, self.trainer, self.engine, self.communicators = device, trainer, engine, communicators
        self.cuda_context, self.device_baseline = cuda_context
        self.process = psutil.Process()

    def read(self) -> dict[str, float]:
        parts: dict[str, float] = {}
        held = self.trainer() if self.trainer is not None else {}
        seen: set[tuple[int, int]] = set()
        sizes = {kind: storage_bytes(held.get(kind, ()), seen) for kind in ("weights", "grads", "optimizer")}
        cuda = self.device.type == "cuda"
        if cuda:
            allocated = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            for kind, size in sizes.items():
                parts[f"trainer_{kind}"] = size["device"]
            parts["trainer_other"] = allocated - sum(s["device"] for s in sizes.values())
            parts["allocator_cached"] = reserved - allocated
            parts["nccl"] = self.communicators() if self.communicators is not None else 0
            parts["cuda_context"] = self.cuda_context or 0
            parts["device_baseline"] = self.device_baseline or 0
        spare = storage_bytes(held.get("spare", ()), seen)  # host buffers kept for the next offload
        parts["trainer_host"] = sum(s["host"] + s["pinned"] for s in (*sizes.values(), spare))
        engine = self.engine() if self.engine is not None else {}
        if cuda and engine.get("device") == str(self.device):
            parts["engine_weights"] = engine.get("weight_bytes", 0)
            parts["engine_kv_cache"] = engine.get("kv_cache_bytes", 0)
            parts["engine_other"] = engine.get("other_bytes", 0)
            parts["engine_cached"] = engine.get("cached_bytes", 0)
            parts["engine_context"] = engine.get("context_bytes") or 0
        if cuda:
            per_process = process_device_bytes(self.device)
            if per_process is not None:
                mine = {os.getpid()}
                if "weight_bytes" in engine:  # the engine's own report has its process already
                    mine.add(engine.get("pid", -1))
                    if "engine_weights" in parts and engine.get("pid", -1) in per_process:
                        # What NVML sees of the engine beyond its report: its CUDA graphs, kernel
                        # code and library workspaces, outside its allocator.
                        reported = sum(parts[k] for k in ENGINE_REPORTED)
                        parts["engine_outside"] = max(0, per_process[engine["pid"]] - reported)
                parts["other_processes"] = sum(b for pid, b in per_process.items() if pid not in mine)
        out = {k: v / GIB for k, v in parts.items()}
        if cuda:
            used = device_used(self.device)
            out["device_used"] = used / GIB
            out["unexplained"] = (used - sum(parts.get(k, 0) for k in DEVICE_PARTS)) / GIB
        out["rss"] = self.process.memory_info().rss / GIB
        if cuda:
            out["host_pinned"] = all_pinned_host_bytes() / GIB
        if "rss_bytes" in engine:
            out["engine_rss"] = engine["rss_bytes"] / GIB
        if "host_pinned_bytes" in engine:
            out["engine_pinned"] = engine["host_pinned_bytes"] / GIB
        return out


def format_ledger(memory: dict[str, dict[str, dict[str, float]]], step: int | None = None) -> str:
    """The table of one metrics row's "memory": a row per (rank, phase), a column per part."""
    columns: list[str] = []
    for phases in memory.values():
        for parts in phases.values():
            columns += [k for k in parts if k not in columns]
    head = f"{'rank':>6s} {'after phase':>22s} " + " ".join(f"{c[:17]:>17s}" for c in columns)
    lines = [f"memory ledger (GiB){f' of step {step}' if step is not None else ''}", head]
    for rank, phases in memory.items():
        for phase, parts in phases.items():
            lines.append(
                f"{rank:>6s} {phase:>22s} "
                + " ".join(f"{parts[c]:17.3f}" if c in parts else f"{'':>17s}" for c in columns)
            )
    return "\n".join(lines)
