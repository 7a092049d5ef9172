"""A trainer's state parked in host memory while the engines have the device, in place.

`HostPark` moves the device storages of a module's tensors (weights, optimizer state) into one
page-locked host buffer and frees them on the device: each storage is resized to 0 and back, so
every tensor and view on it — FSDP2's padded shards, DTensors, the optimizer's state — stays valid
and refills in place. The buffer is kept for the next offload while the sizes match (pinning GBs
afresh costs seconds). Storages that cannot be resized stay where they are.

What moves is chosen, not all of it (`stage`): the storages come in groups, in the order they
should go (the optimizer state first, the policy's weights last), and whole groups move, the
fewest that leave at most `keep` bytes on the device. Each group comes back as one block of the
caching allocator (`unpark`), so that a group that moves again frees whole segments that the
driver gets back (a group split between moving and staying would hold its segments). The first
`ahead` groups — the optimizer state, which nothing reads or writes between one optimizer step
and the next — go early and come back late:

    stage(groups, keep, ahead)   after the optimizer step: what moves is chosen and laid out in the
                                 buffer, its copies planned (runs of storages, `runs`), and the
                                 `ahead` groups' copy out starts on a side stream (beside the
                                 checkpoint and the sync); nothing is freed yet
    park()                       at the put-away: the rest is copied, every copy waited for, every
                                 chosen storage freed
    unpark(overlap=True)         at the onload: every storage re-allocated; the others copied back
                                 first (the caller's stream waits for them only), the `ahead`
                                 groups behind them on the side stream (beside the forward and backward)
    settle()                     before anything reads the optimizer state again (its step, a
                                 checkpoint): the caller's stream waits for those copies

On the CPU (`device_type="cpu"`: the tests of the order) the same steps run with plain host
memory: `stage` copies the early groups at once and `settle` copies the late ones back; until
then they hold NaN bytes, so a step that reads that state before `settle` shows it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch

from rltrain.runtime.internals import local_shard
from rltrain.runtime.memory import free_cuda_caches, round_up
from rltrain.runtime.pinned import PinnedArena
from rltrain.trainer.state import held

log = logging.getLogger("rltrain.trainer")

# An offload that kept part of the state: freed bytes the caching allocator may keep (in segments
# shared with what stayed) before the rest moves too.
STRANDED_BYTES = 512 << 20
LARGE = 1 << 20  # the caching allocator's large pool: requests from 1 MiB
# Who copies the state back onto the device: a copy engine (`copy_`, the default), or the SMs
# reading the pinned buffer over the bus (kernels/triton_copy.py; `bench.hostcopy --after-free`
# compares them right after the engine's memory was freed, where the copy engines run slow).
ONLOAD_COPIES = ("engine", "kernel")


def leaving_order(
    model: torch.nn.Module | None, reference: torch.nn.Module | None, optimizer: object
) -> list[list[torch.Tensor]]:
    """A trainer's state in the order it leaves the device: the optimizer state (read by the
    optimizer step only), the reference's weights (by the reference log-probs), the policy's last."""
    policy, ref = held((model,), None), held((reference,), None)["weights"]
    weights = {local_shard(t).untyped_storage().data_ptr() for t in (*policy["weights"], *ref)}
    # (the optimizer's parameter groups hold the policy's weights: those leave with them)
    state = [t for t in held((), optimizer)["optimizer"] if local_shard(t).untyped_storage().data_ptr() not in weights]
    return [state, ref, policy["weights"] + policy["grads"]]


class Parked(NamedTuple):
    storage: torch.UntypedStorage
    offset: int  # where its bytes sit in the host buffer
    group: int  # which of `stage`'s groups it came from
    nbytes: int


class HostPark:
    """One module's state in and out of host memory (see the module's docstring)."""

    def __init__(self, device_type: str = "cuda", pinned: str | None = None, onload: str | None = None) -> None:
        self.device_type = device_type
        # How the onload copies (`ONLOAD_COPIES`; None: `RLTRAIN_ONLOAD_COPY`'s, for benchmarks)
        self.onload = onload or os.environ.get("RLTRAIN_ONLOAD_COPY", "engine")
        if self.onload not in ONLOAD_COPIES:
            raise ValueError(f"onload copy {self.onload!r}: expected one of {', '.join(ONLOAD_COPIES)}")
        self._arena = PinnedArena(pin=device_type == "cuda", kind=pinned)
        self.parked: list[Parked] = []  # on the host now, freed on the device
        self.staged: list[Parked] = []  # chosen to move at the next `park`, still on the device
        self.ahead = 0  # the groups that went early, and come back late
        self.kept = 0  # bytes of the last `stage`'s storages that stay on the device
        self.total = 0  # bytes of the last `stage`'s storages
        self.allocate_s = 0.0  # seconds the last `unpark` took to re-allocate the storages
        self.copies_out = 0  # copies the last offload took (one per run of storages: `runs`)
        self.copies_in = 0  # and the last onload
        # The last `park`'s copies on the device, from the first's start to the last's end, in
        # seconds (the early groups' copies, begun by `stage`, not among them).
        self.device_s = 0.0
        self.strandings = 0  # offloads whose kept part stranded freed memory (`all_if_stranded`)
        self._early: list[Parked] = []  # staged, copy out begun
        self._planned: list[tuple[torch.Tensor, int, int]] = []  # the copies `park` queues (`runs` of the rest)
        self._late: list[Parked] = []  # re-allocated, copy back not yet waited for (CPU: not yet made)
        self._out_done: torch.cuda.Event | None = None
        self._in_done: torch.cuda.Event | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def buffer(self) -> torch.Tensor | None:
        """The host buffer (kept between offloads; it holds the state while parked)."""
        return self._arena.buffer

    @property
    def copying(self) -> bool:
        """Whether copies run on the side stream now (out: staged; in: not yet settled)."""
        return self._out_done is not None or self._in_done is not None

    @property
    def unsettled(self) -> bool:
        """Whether storages came back whose copies `settle` has not yet waited for."""
        return bool(self._late) or self._in_done is not None

    def stage(self, groups: Sequence[list[torch.Tensor]], keep: int | None = None, ahead: int = 0) -> None:
        """Choose what moves: whole groups of `groups` in order, until at most `keep` bytes stay
        (None: all move). Lay them out in the host buffer and begin copying those of the first
        `ahead` groups, behind the work queued on the current stream so far. Nothing is freed
        until `park`; until then those storages must not be written."""
        assert not self.parked, "stage: the state is parked already"
        self.settle()
        if self._out_done is not None:  # an earlier stage's copies, into the buffer about to be laid out again
            self._out_done.synchronize()
            self._out_done = None
        found: list[tuple[int, torch.UntypedStorage]] = []
        seen: set[int] = set()
        for g, tensors in enumerate(groups):
            for t in tensors:
                s = local_shard(t).untyped_storage()
                if s.device.type != self.device_type or s.nbytes() == 0 or not s.resizable():
                    continue
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    found.append((g, s))
        # Within a group the allocator's large pool's storages (>= 1 MiB) first, the small pool's
        # after: each pool carves a group's storages in order out of one block (see `unpark`), and
        # the host buffer is laid out in the same order, so runs of them move as one copy.
        found.sort(key=lambda gs: (gs[0], gs[1].nbytes() < LARGE))
        self.total = sum(s.nbytes() for _, s in found)
        must = self.total if keep is None else max(self.total - keep, 0)
        chosen: list[Parked] = []
        moved = offset = 0
        for g, s in found:
            if moved >= must and (not chosen or chosen[-1].group != g):
                break  # (a group moves whole)
            chosen.append(Parked(s, offset, g, s.nbytes()))
            moved += s.nbytes()
            offset += round_up(s.nbytes(), PinnedArena.ALIGN)
        self.kept = self.total - moved
        # Grown when the state grew (the first offload, before any step, parks no Adam state).
        buffer = self._arena.reserve(offset)
        self.staged, self.ahead, self.copies_out = chosen, ahead, 0
        self._early = [p for p in chosen if p.group < ahead]
        # (the spans own no memory: the storages they cover live until `park` frees them)
        self._planned = list(runs([p for p in chosen if p.group >= ahead]))
        if not self._early:
            return
        if self.device_type != "cuda":
            self._copy_out(self._early, buffer)
            return
        after = torch.cuda.Event()
        after.record()  # the optimizer step that wrote them
        with torch.cuda.stream(self._side()):
            torch.cuda.current_stream().wait_event(after)
            self._copy_out(self._early, buffer)
            self._out_done = torch.cuda.Event()
            self._out_done.record()

    def park(self, groups: Sequence[list[torch.Tensor]] | None = None, keep: int | None = None) -> None:
        """Move what `stage` chose (or, given `groups`, what `stage(groups, keep)` chooses now):
        the rest of the copies, a wait for every one, the storages freed."""
        if groups is not None:
            self.stage(groups, keep)
        buffer = self.buffer
        assert buffer is not None or not self.staged
        rest = [p for p in self.staged if p.group >= self.ahead]
        cuda = self.device_type == "cuda"
        marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda and rest else None
        if rest:
            assert buffer is not None
            if marks:
                marks[0].record()
            self._copy_planned(buffer)
            if marks:
                marks[1].record()
        if cuda:
            # Their storages are freed while the copies run (the host's ~1k frees hidden behind
            # them): the caching allocator hands a block out again only to work queued behind
            # its copy on this stream, and nothing allocates before the wait below. The early
            # ones (copied on the side stream) after it.
            for p in rest:
                p.storage.resize_(0)
            torch.cuda.synchronize()  # every stream: the early copies too
        for p in self._early if cuda else self.staged:
            p.storage.resize_(0)
        self.device_s = marks[0].elapsed_time(marks[1]) / 1e3 if marks else 0.0
        self.parked, self.staged, self._early, self._out_done = self.staged, [], [], None

    def unpark(self, overlap: bool = False) -> None:
        """Re-allocate every parked storage and copy it back (the caller synchronizes its stream).
        `overlap`: the groups that went ahead come back behind the others, to be waited for by
        `settle`; the caller's stream waits for the others only.

        Each group's storages are carved out of one block, allocated and returned to the
        caching allocator first: it splits a cached block for later requests, so the group lives
        in one segment, and the next offload hands it back to the driver with one cudaFree
        instead of one per storage (hundreds, for a model with Adam)."""
        if not self.parked:
            return
        t0, self.copies_in = time.perf_counter(), 0
        for g in sorted({p.group for p in self.parked}):
            group = [p for p in self.parked if p.group == g]
            large = [p.nbytes for p in group if p.nbytes >= LARGE]
            if large and self.device_type == "cuda":
                # Each request is rounded up to 512 bytes, as the allocator rounds it.
                block = torch.empty(
                    sum(round_up(n, 512) for n in large), dtype=torch.uint8, device=group[0].storage.device
                )
                del block
            for p in group:
                p.storage.resize_(p.nbytes)
        self.allocate_s = time.perf_counter() - t0
        buffer = self.buffer
        assert buffer is not None, "parked storages without their host buffer"
        late = [p for p in self.parked if overlap and p.group < self.ahead]
        now = [p for p in self.parked if not (overlap and p.group < self.ahead)]
        self.parked = []
        if self.device_type != "cuda":
            self._copy_in(now, buffer)
            for p in late:  # NaN bytes until `settle`: a read before it shows
                _bytes(p.storage).fill_(0xFF)
            self._late = late
            return
        if not late:
            self._copy_in(now, buffer)
            return
        start = torch.cuda.Event()
        start.record()
        caller = torch.cuda.current_stream()
        # One stream, in order: what the forward needs first at the full copy rate, then the rest.
        with torch.cuda.stream(self._side()):
            torch.cuda.current_stream().wait_event(start)
            self._copy_in(now, buffer)
            first = torch.cuda.Event()
            first.record()
            self._copy_in(late, buffer)
            self._in_done = torch.cuda.Event()
            self._in_done.record()
        caller.wait_event(first)

    def settle(self) -> None:
        """The storages that came back late hold their values for what the current stream runs next."""
        if self._in_done is not None:
            torch.cuda.current_stream().wait_event(self._in_done)
            self._in_done = None
        if self._late:
            buffer = self.buffer
            assert buffer is not None
            self._copy_in(self._late, buffer)
            self._late = []

    def all_if_stranded(self, groups: Sequence[list[torch.Tensor]], device: torch.device) -> bool:
        """After an offload that kept part of the state: where the caching allocator holds more
        than `STRANDED_BYTES` freed bytes it could not hand back to the driver (in segments shared
        with what stayed: not the engines'), the rest of `groups` moves too. Whether it did. The
        first time, that offload only (`refuses_keep` stays False): state the step made on the
        device (the optimizer's moments, born among the freed gradients) shares their segments,
        and the next onload lays the state out anew in its own. From the second, every offload
        (`refuses_keep`). Said each time it happens, which."""
        stranded = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if stranded <= STRANDED_BYTES:
            return False
        self.strandings += 1
        log.warning(
            "trainer: %.2f GiB freed by the offload stay with the caching allocator (segments shared with the "
            "%.2f GiB of state kept on the device): the whole state moves %s",
            stranded / 2**30,
            self.kept / 2**30,
            "at every offload from now on"
            if self.refuses_keep
            else "this time (its next onload lays it out in segments of its own; a second time, at every offload)",
        )
        self.unpark()
        self.park(groups)
        free_cuda_caches()
        return True

    @property
    def refuses_keep(self) -> bool:
        """Whether kept parts stranded freed memory twice: every offload moves the whole state."""
        return self.strandings > 1

    def drain(self) -> None:
        """Every copy in flight done (before the storages or this object, with its buffer, go)."""
        self.settle()
        if self._out_done is not None:
            self._out_done.synchronize()
            self._out_done = None

    def _side(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _copy_out(self, parked: list[Parked], buffer: torch.Tensor) -> None:
        self._queue_out(runs(parked), buffer)

    def _copy_planned(self, buffer: torch.Tensor) -> None:
        planned, self._planned = self._planned, []
        self._queue_out(planned, buffer)

    def _queue_out(self, copies: Iterable[tuple[torch.Tensor, int, int]], buffer: torch.Tensor) -> None:
        for device, offset, nbytes in copies:
            buffer[offset : offset + nbytes].copy_(device, non_blocking=self.device_type == "cuda")
            self.copies_out += 1

    def _copy_in(self, parked: list[Parked], buffer: torch.Tensor) -> None:
        by_kernel = self.onload == "kernel" and self.device_type == "cuda"
        if by_kernel:
            from rltrain.kernels.triton_copy import sm_copy  # noqa: PLC0415 - Triton on CUDA
        for device, offset, nbytes in runs(parked):
            if by_kernel:
                sm_copy(device, buffer[offset : offset + nbytes])
            else:
                device.copy_(buffer[offset : offset + nbytes], non_blocking=self.device_type == "cuda")
            self.copies_in += 1


def runs(parked: Sequence[Parked]) -> Iterator[tuple[torch.Tensor, int, int]]:
    """`parked` as copies: (device bytes, host offset, bytes), one per run of storages that lie
    back to back both on the device and in the host buffer (no byte between them on either side)
    and, on a GPU, in one allocation of the driver (a copy may not cross from one into the next,
    even where their addresses meet)."""
    bases = [_allocation(p.storage) for p in parked]
    i = 0
    while i < len(parked):
        j, start = i + 1, parked[i].storage.data_ptr()
        while (
            j < len(parked)
            and parked[j].storage.data_ptr() == parked[j - 1].storage.data_ptr() + parked[j - 1].nbytes
            and parked[j].offset == parked[j - 1].offset + parked[j - 1].nbytes
            and bases[j] == bases[i]
        ):
            j += 1
        if j == i + 1:
            yield _bytes(parked[i].storage), parked[i].offset, parked[i].nbytes
        else:
            nbytes = parked[j - 1].offset + parked[j - 1].nbytes - parked[i].offset
            yield device_span(start, nbytes, parked[i].storage.device), parked[i].offset, nbytes
        i = j


def _allocation(storage: torch.UntypedStorage) -> int:
    """Where the driver's allocation that holds `storage` starts (a CUDA storage; 0 elsewhere)."""
    if storage.device.type != "cuda":
        return 0
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    err = _libcuda().cuMemGetAddressRange_v2(
        ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(storage.data_ptr())
    )
    if err:
        raise RuntimeError(f"cuMemGetAddressRange failed ({err}) for a storage at {storage.data_ptr():#x}")
    return base.value


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def device_span(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over `nbytes` of memory at `address` it does not own (storages that lie back
    to back, held by the caller while it is used)."""
    if device.type == "cuda":
        interface = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}
        return torch.as_tensor(_CudaArray(interface), device=device)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


class _CudaArray:
    def __init__(self, interface: dict[str, object]) -> None:
        self.__cuda_array_interface__ = interface
