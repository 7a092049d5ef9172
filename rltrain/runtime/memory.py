"""Giving memory back: to the CUDA driver and to the OS, after a phase has released its tensors."""

from __future__ import annotations

import mmap
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from rltrain.runtime import internals

_registered: dict[int, int] = {}  # address -> bytes, of the host buffers `pinned_empty` page-locked


def free_cuda_caches() -> None:
    """Return the caching allocator's free blocks to the driver, cuBLAS workspaces (allocated
    through the caching allocator, ~64 MiB on an H200) included."""
    if torch.cuda.is_available():
        internals.get("torch._C._cuda_clearCublasWorkspaces")()
    torch.cuda.empty_cache()


def trim_host_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps small freed blocks otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of `nbytes`, page-locked, holding no more than the whole pages it needs.

    torch's `pin_memory=True` rounds every allocation up to a power of two and keeps it cached
    once freed: an 11.4 GiB offload held 16 GiB of page-locked memory that way, plus the 4 GiB
    of an earlier, smaller buffer. This maps anonymous memory and registers it with the CUDA
    driver (what `cudaHostAlloc` does, without the rounding); the registration and the mapping go
    when the last tensor on the buffer is gone."""
    size = round_up(max(nbytes, 1), mmap.PAGESIZE)
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    buf = torch.frombuffer(mem, dtype=torch.uint8)
    addr = buf.data_ptr()
    err = int(torch.cuda.cudart().cudaHostRegister(addr, size, 0))
    if err:
        raise RuntimeError(f"cannot page-lock {size / 2**30:.2f} GiB of host memory: cudaHostRegister returned error {err}")
    _registered[addr] = size
    # Runs when the mapping is released (every tensor on it is gone), before it is unmapped.
    weakref.finalize(mem, _unregister, addr)
    return buf[:nbytes]


def pinned_like(tensors: list[torch.Tensor], align: int = 512) -> list[torch.Tensor]:
    """Empty page-locked host tensors shaped as `tensors`, carved out of one `pinned_empty` buffer."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += round_up(t.numel() * t.element_size(), align)
    buf = pinned_empty(total)
    return [buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, tensors)]


def _unregister(addr: int) -> None:
    _registered.pop(addr, None)
    torch.cuda.cudart().cudaHostUnregister(addr)


def pinned_host_bytes() -> int:
    """Page-locked host bytes held by `pinned_empty` buffers (torch's own allocator reports the rest)."""
    return sum(_registered.values())


def all_pinned_host_bytes() -> int:
    """This process's page-locked host bytes: torch's pinned allocator's and `pinned_empty`'s."""
    stats = torch.cuda.host_memory_stats()
    return stats.get("allocated_bytes.current", stats.get("allocation.current", 0)) + pinned_host_bytes()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class PinnedUpload:
    """Host-to-device copies out of pageable memory (a memory-mapped weight file) through a ring
    of page-locked buffers: host threads fill one buffer while the GPU drains the others. A
    pageable copy is staged by the driver piece by piece on the calling thread: the engine loaded
    a 8.8 GB version at 5.6 GB/s that way on the H200's machine, where a pinned copy runs at 55."""

    def __init__(self, buffers: int = 3, size: int = 64 << 20, threads: int = 8, piece: int = 8 << 20):
        self.size, self.piece = size, piece
        self._buffers: list[torch.Tensor] = []
        self._done: list[torch.cuda.Event | None] = [None] * buffers
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="rltrain-upload")

    @staticmethod
    def suits(dst: torch.Tensor, src: torch.Tensor) -> bool:
        return (dst.is_cuda and src.device.type == "cpu" and not src.is_pinned() and dst.dtype == src.dtype
                and dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel())

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue `dst.copy_(src)` for each pair (see `suits`) on the current stream; returns once
        every host byte has been read (the device copies may still run)."""
        if not self._buffers:
            self._buffers = [torch.empty(self.size, dtype=torch.uint8, pin_memory=True) for _ in self._done]
        k, used, batch = 0, 0, []  # buffer, bytes filled, (device slice, buffer slice, host slice)
        self._wait(k)
        for dst, src in pairs:
            d, s = dst.view(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
            start = 0
            while start < s.numel():
                if used == self.size:
                    self._send(k, batch)
                    k, used, batch = (k + 1) % len(self._buffers), 0, []
                    self._wait(k)
                n = min(s.numel() - start, self.size - used)
                batch.append((d[start:start + n], self._buffers[k][used:used + n], s[start:start + n]))
                start, used = start + n, used + n
        if batch:
            self._send(k, batch)

    def _wait(self, k: int) -> None:
        if self._done[k] is not None:
            self._done[k].synchronize()

    def _send(self, k: int, batch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        jobs = [(buf[i:i + self.piece], host[i:i + self.piece]) for _, buf, host in batch
                for i in range(0, host.numel(), self.piece)]
        list(self._threads.map(lambda job: job[0].copy_(job[1]), jobs))  # torch copies release the GIL
        internals.foreach_copy_([d for d, _, _ in batch], [b for _, b, _ in batch], non_blocking=True)
        self._done[k] = torch.cuda.Event()
        self._done[k].record()
