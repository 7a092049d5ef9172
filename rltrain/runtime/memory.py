"""Giving memory back: to the CUDA driver and to the OS, after a phase has released its tensors."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from collections.abc import Iterator

import numpy as np
import torch

from rltrain.runtime import internals


def free_cuda_caches() -> None:
    """Return the caching allocator's free blocks to the driver, cuBLAS workspaces (allocated
    through the caching allocator) and blocks parked after CUDA IPC included."""
    if torch.cuda.is_available():
        internals.get("torch._C._cuda_clearCublasWorkspaces")()
        torch.cuda.ipc_collect()  # blocks shared by IPC that every consumer has let go of
    torch.cuda.empty_cache()


def allocator_counts(device: torch.device) -> dict[str, float]:
    """Counters of the process's CUDA allocators since it started ({} off CUDA): the caching
    allocator's calls to the driver (cudaMalloc / cudaFree, or maps and unmaps), its retries after
    a failed cudaMalloc (each freed every cached block, synchronising the device), and the pinned
    host allocator's blocks made (cudaHostAlloc) and the milliseconds they took. A hot path that
    should allocate nothing new shows here when it does."""
    if device.type != "cuda":
        return {}
    dev, host = torch.cuda.memory_stats(device), torch.cuda.host_memory_stats()
    return {
        "cuda_mallocs": float(dev.get("num_device_alloc", 0)),
        "cuda_frees": float(dev.get("num_device_free", 0)),
        "cuda_alloc_retries": float(dev.get("num_alloc_retries", 0)),
        "pinned_host_allocs": float(host.get("num_host_alloc", 0)),
        "pinned_host_alloc_ms": float(host.get("host_alloc_time.total", 0)) / 1e3,
    }


def trim_host_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps small freed blocks otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_gc_pause = {"depth": 0, "enabled": True}
_gc_lock = threading.Lock()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic cyclic garbage collection inside (reference counting still frees at once).
    A full collection stops every thread of the process for as long as it walks the heap: an
    engine's, mid-rollout, for a visible share of the rollout (BENCHMARKS.md). What
    becomes cyclic garbage inside waits for the first collection after. Threads may overlap
    their pauses: the last one out restores the state the first one found (a caller may have
    disabled collection itself)."""
    with _gc_lock:
        if _gc_pause["depth"] == 0:
            _gc_pause["enabled"] = gc.isenabled()
            gc.disable()
        _gc_pause["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pause["depth"] -= 1
            if _gc_pause["depth"] == 0 and _gc_pause["enabled"]:
                gc.enable()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of host tensor `t` (made contiguous) as a numpy uint8 array, without a copy where
    it is contiguous, leaving its storage as it was: `Tensor.numpy()` marks a storage not
    resizable for good, and a reader must not change what it reads (FSDP2 frees the gathered
    parameters a sync exports by resizing their storage). The array keeps the tensor alive."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        raise ValueError(f"host_bytes reads host memory; this tensor is on {t.device}")
    n = t.numel() * t.element_size()
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    memory = (ctypes.c_char * n).from_address(t.data_ptr())
    memory.tensor = t  # type: ignore[attr-defined]  # alive as long as the array is
    return np.frombuffer(memory, dtype=np.uint8)
