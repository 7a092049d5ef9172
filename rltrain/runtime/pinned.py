"""Page-locked host memory of exactly the size asked for: one arena for every pinned buffer.

torch's `pin_memory=True` rounds every allocation up to a power of two and keeps it cached once
freed: an offload then holds up to twice its size in page-locked memory, plus every earlier,
smaller buffer. `pinned_empty` maps anonymous memory and registers it with the CUDA driver (what
`cudaHostAlloc` does, without the rounding); the registration and the mapping go when the last
tensor on the buffer is gone. Every page-locked buffer rltrain keeps comes from a `PinnedArena`
(one such buffer, carved into aligned pieces, reused while it is large enough) or is one
`pinned_empty` buffer allocated once:

    the trainer's offload buffer             trainer/sharding.py  HostPark
    megatron's host mirror of its state      trainer/megatron/host_mirror.py  HostMirror
    the trainer's host snapshot              trainer/sharding.py  capture
    the engine's backup of released weights  engine/embedded/residency.py
    the engine's disk-load upload ring       PinnedUpload (below)
    the disk sync's shard staging            weights/hf_files.py  HostStaging
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from rltrain.runtime import internals
from rltrain.runtime.memory import round_up

_registered: dict[int, int] = {}  # address -> bytes, of the host buffers `pinned_empty` page-locked


# How `pinned_empty` gets its page-locked memory (`RLTRAIN_PINNED` picks one, for benchmarks):
#   register  anonymous memory in 4 KiB pages, registered with the driver (cudaHostRegister)
#   hugepage  the same in 2 MiB transparent huge pages where the kernel gives them (madvise):
#             fewer translations for the device's DMA to walk
#   driver    the driver's own allocation (cudaHostAlloc, what torch's pinned allocator calls),
#             exactly the size asked for
KINDS = ("register", "hugepage", "driver")
HUGE_PAGE = 2 << 20


def default_kind() -> str:
    kind = os.environ.get("RLTRAIN_PINNED", "register")
    if kind not in KINDS:
        raise ValueError(f"RLTRAIN_PINNED={kind!r}: expected one of {', '.join(KINDS)}")
    return kind


def pinned_empty(nbytes: int, kind: str | None = None) -> torch.Tensor:
    """A uint8 host tensor of `nbytes`, page-locked, holding no more than the whole pages it needs.

    torch's `pin_memory=True` rounds every allocation up to a power of two and keeps it cached
    once freed: an offload then holds up to twice its size in page-locked memory, plus every
    earlier, smaller buffer. This maps anonymous memory and registers it with the CUDA
    driver (what `cudaHostAlloc` does, without the rounding), or asks the driver for exactly
    `nbytes` (`kind`, see `KINDS`); the registration and the memory go when the last tensor on
    the buffer is gone."""
    kind = kind or default_kind()
    if kind == "driver":
        return _driver_alloc(nbytes)
    page = HUGE_PAGE if kind == "hugepage" else mmap.PAGESIZE
    size = round_up(max(nbytes, 1), page)
    if kind == "hugepage":
        # Mapped one huge page larger, to start the buffer on a huge-page boundary; the pages
        # are made when the driver pins them, after the advice.
        mem = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mem.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(mem, dtype=torch.uint8)
        skip = -whole.data_ptr() % HUGE_PAGE
        buf = whole[skip : skip + size]
    else:
        mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        buf = torch.frombuffer(mem, dtype=torch.uint8)
    addr = buf.data_ptr()
    err = int(torch.cuda.cudart().cudaHostRegister(addr, size, 0))
    if err:
        raise RuntimeError(
            f"cannot page-lock {size / 2**30:.2f} GiB of host memory: cudaHostRegister returned error {err}"
        )
    _registered[addr] = size
    # Runs when the mapping is released (every tensor on it is gone), before it is unmapped.
    weakref.finalize(mem, _unregister, addr)
    return buf[:nbytes]


def _driver_alloc(nbytes: int) -> torch.Tensor:
    lib = _cudart()
    ptr = ctypes.c_void_p()
    size = max(nbytes, 1)
    err = lib.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_uint(0))
    if err or not ptr.value:
        raise RuntimeError(
            f"cannot page-lock {size / 2**30:.2f} GiB of host memory: cudaHostAlloc returned error {err}"
        )
    mem = (ctypes.c_uint8 * size).from_address(ptr.value)
    _registered[ptr.value] = size
    weakref.finalize(mem, _free_host, lib, ptr.value)
    return torch.frombuffer(mem, dtype=torch.uint8)[:nbytes]


def footprint(nbytes: int, kind: str | None = None) -> int:
    """The page-locked bytes `pinned_empty(nbytes, kind)` holds."""
    kind = kind or default_kind()
    if kind == "driver":
        return max(nbytes, 1)
    return round_up(max(nbytes, 1), HUGE_PAGE if kind == "hugepage" else mmap.PAGESIZE)


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its path from this process's mappings)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                lib = ctypes.CDLL(line.split()[-1])
                lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
                lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
                return lib
    raise RuntimeError("the CUDA runtime library (libcudart) is not loaded in this process")


def _free_host(lib: ctypes.CDLL, addr: int) -> None:
    _registered.pop(addr, None)
    lib.cudaFreeHost(ctypes.c_void_p(addr))


class PinnedArena:
    """One `pinned_empty` buffer, reused while it is large enough and replaced (the old one let go
    first: never both page-locked at once) when a larger one is asked for. Pieces are carved at
    `ALIGN`-byte offsets. `pin=False`: plain host memory (for state that lives on the CPU); `kind`:
    how it is page-locked (`KINDS`; None: `RLTRAIN_PINNED`'s)."""

    ALIGN = 512

    def __init__(self, pin: bool = True, kind: str | None = None) -> None:
        self.buffer: torch.Tensor | None = None
        self.pin, self.kind = pin, kind

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The buffer, at least `nbytes` long (its old contents are not kept when it grows)."""
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None
            self.buffer = pinned_empty(nbytes, self.kind) if self.pin else torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer

    @classmethod
    def offsets(cls, sizes: list[int]) -> tuple[list[int], int]:
        """Where pieces of `sizes` bytes start, and the bytes they span together."""
        out, total = [], 0
        for n in sizes:
            out.append(total)
            total += round_up(n, cls.ALIGN)
        return out, total

    def like(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Empty page-locked host tensors shaped as `tensors`, carved out of the buffer."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets, total = self.offsets(sizes)
        buf = self.reserve(total)
        return [buf[o : o + n].view(t.dtype).view(t.shape) for o, n, t in zip(offsets, sizes, tensors)]


def pinned_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Empty page-locked host tensors shaped as `tensors`, carved out of one fresh buffer."""
    return PinnedArena().like(tensors)


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


class PinnedUpload:
    """Host-to-device copies out of pageable memory (a memory-mapped weight file) through a ring
    of page-locked buffers: host threads fill one buffer while the GPU drains the others. A
    pageable copy is staged by the driver piece by piece on the calling thread, at a fraction of
    the pinned-copy rate."""

    def __init__(self, buffers: int = 3, size: int = 64 << 20, threads: int = 8, piece: int = 8 << 20):
        self.size, self.piece = size, piece
        self._buffers: list[torch.Tensor] = []
        self._done: list[torch.cuda.Event | None] = [None] * buffers
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="rltrain-upload")

    @staticmethod
    def suits(dst: torch.Tensor, src: torch.Tensor) -> bool:
        return (
            dst.is_cuda
            and src.device.type == "cpu"
            and not src.is_pinned()
            and dst.dtype == src.dtype
            and dst.is_contiguous()
            and src.is_contiguous()
            and dst.numel() == src.numel()
        )

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue `dst.copy_(src)` for each pair (see `suits`) on the current stream; returns once
        every host byte has been read (the device copies may still run)."""
        if not self._buffers:
            buf = pinned_empty(self.size * len(self._done))
            self._buffers = [buf[k * self.size : (k + 1) * self.size] for k in range(len(self._done))]
        # buffer, bytes filled, (device slice, buffer slice, host slice)
        k, used, batch = 0, 0, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]()
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
                batch.append((d[start : start + n], self._buffers[k][used : used + n], s[start : start + n]))
                start, used = start + n, used + n
        if batch:
            self._send(k, batch)

    def _wait(self, k: int) -> None:
        done = self._done[k]
        if done is not None:
            done.synchronize()

    def _send(self, k: int, batch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        jobs = [
            (buf[i : i + self.piece], host[i : i + self.piece])
            for _, buf, host in batch
            for i in range(0, host.numel(), self.piece)
        ]
        list(self._threads.map(lambda job: job[0].copy_(job[1]), jobs))  # torch copies release the GIL
        internals.foreach_copy_([d for d, _, _ in batch], [b for _, b, _ in batch], non_blocking=True)
        done = self._done[k] = torch.cuda.Event()
        done.record()
