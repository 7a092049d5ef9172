"""Giving memory back: to the CUDA driver and to the OS, after a phase has released its tensors."""

from __future__ import annotations

import torch


def free_cuda_caches() -> None:
    """Return the caching allocator's free blocks to the driver, cuBLAS workspaces (allocated
    through the caching allocator, ~64 MiB on an H200) included."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def trim_host_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps small freed blocks otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
