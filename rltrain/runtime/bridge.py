"""The Gloo bridge: a CPU process group that outlives every destroy/rebuild of the world.

`destroy_process_group()` shuts down every group registered in torch's `_world`, so a bridge
made with `dist.new_group` would die with the default group. The bridge is therefore a
`ProcessGroupGloo` built directly on its own `PrefixStore("rltrain/bridge/", base_store)` and
never registered with torch.distributed: it is driven through the backend's own methods.
It carries barriers, object scatter/gather/broadcast and small tensor reductions while the
default (NCCL) group is down. Every wait has a timeout and fails with the phase it was in.
"""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, BroadcastOptions, ProcessGroupGloo, ReduceOp, ScatterOptions


def restart_attempt() -> int:
    """torchrun's restart attempt of this job (0 for the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


# all_gather_object's slot: an 8-byte size, then the object; it starts at 1 KiB and widens to
# the largest object gathered so far, up to 64 KiB (beyond, a second collective per call).
_HEADER, _SLOT_MIN, _SLOT_MAX = 8, 1 << 10, 1 << 16


class BridgeError(RuntimeError):
    """A bridge operation failed or timed out; names the phase and the rank."""


class Bridge:
    """Persistent CPU group over Gloo. All ranks must call each method in the same order."""

    STORE_PREFIX = "rltrain/bridge"

    def __init__(self, base_store: dist.Store, rank: int, world_size: int, timeout: timedelta, name: str = ""):
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._base_store = base_store
        self._name = name
        self._slot = _SLOT_MIN  # all_gather_object's, agreed by every rank (the same sizes seen)
        # Per torchrun attempt: a restarted job shares the agent's store with the attempt that
        # died, whose peer addresses would otherwise be read back (a restarted rank would
        # connect to the dead rank 0's port).
        self._prefix = f"{self.STORE_PREFIX}/{restart_attempt()}" + (f"/{name}" if name else "")
        self._store = dist.PrefixStore(self._prefix, base_store)
        try:
            # (Any: torch's stubs do not declare the backend's collectives)
            self._pg: Any = ProcessGroupGloo(self._store, rank, world_size, timeout)
        except RuntimeError as e:
            raise BridgeError(f"rank {rank}: could not connect the Gloo bridge within {timeout}: {e}") from e

    # ------------------------------------------------------------------ primitives

    def _wait(self, work: Any, what: str, phase: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise BridgeError(
                f"rank {self.rank}: bridge {what} failed during phase {phase!r} "
                f"(timeout {self.timeout.total_seconds():.0f}s; a peer rank probably died or is stuck): {e}"
            ) from e

    @property
    def pg(self) -> Any:
        if self._pg is None:
            raise BridgeError(f"rank {self.rank}: the bridge was closed")
        return self._pg

    def barrier(self, phase: str = "barrier") -> float:
        """Block until every rank arrives; returns seconds waited."""
        t0 = time.perf_counter()
        # A one-element allreduce rather than gloo's barrier: its wait honours our timeout.
        self.all_reduce(torch.zeros(1), phase=phase)
        return time.perf_counter() - t0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", phase: str = "all_reduce") -> torch.Tensor:
        """In-place reduction of a CPU tensor across ranks (op: sum, max, min, product)."""
        opts = AllreduceOptions()
        ops: dict[str, Any] = {
            "sum": ReduceOp.SUM,
            "max": ReduceOp.MAX,
            "min": ReduceOp.MIN,
            "product": ReduceOp.PRODUCT,
        }
        opts.reduceOp = ops[op]
        opts.timeout = self.timeout
        self._wait(self.pg.allreduce([tensor], opts), f"all_reduce({op})", phase)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int, phase: str = "broadcast") -> torch.Tensor:
        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        self._wait(self.pg.broadcast([tensor], opts), "broadcast", phase)
        return tensor

    # ------------------------------------------------------------------ objects

    def all_gather_object(self, obj: Any, phase: str = "all_gather_object") -> list[Any]:
        """Every rank's object, in rank order. One collective while every object fits the slot
        (each rank's size travels in its slot's header); a larger one is sent in a second, as
        wide as the largest, and widens the slot for the next calls. Every rank sees the same
        sizes, so all agree on the slot without a word."""
        payload = _to_bytes(obj)
        n = payload.numel()
        width = self._slot
        mine = torch.zeros(_HEADER + width, dtype=torch.uint8)
        mine[:_HEADER] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
        if n <= width:
            mine[_HEADER : _HEADER + n] = payload
        out = [torch.empty(_HEADER + width, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(self.pg.allgather([out], [mine]), "all_gather_object", phase)
        sizes = [int(t[:_HEADER].view(torch.int64)) for t in out]
        biggest = max(sizes)
        if biggest <= width:
            return [_from_bytes(t[_HEADER : _HEADER + k]) for t, k in zip(out, sizes)]
        self._slot = min(max(width, 1 << (biggest - 1).bit_length()), _SLOT_MAX)
        mine = torch.zeros(biggest, dtype=torch.uint8)
        mine[:n] = payload
        out = [torch.empty(biggest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(self.pg.allgather([out], [mine]), "all_gather_object", phase)
        return [_from_bytes(t[:k]) for t, k in zip(out, sizes)]

    def broadcast_object(self, obj: Any, src: int = 0, phase: str = "broadcast_object") -> Any:
        """`obj` from rank `src` on every rank."""
        payload = _to_bytes(obj) if self.rank == src else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self.broadcast(size, src, phase=phase)
        buf = payload if self.rank == src else torch.empty(int(size), dtype=torch.uint8)
        self.broadcast(buf, src, phase=phase)
        return obj if self.rank == src else _from_bytes(buf)

    def scatter_object(self, objs: list[Any] | None, src: int = 0, phase: str = "scatter_object") -> Any:
        """Rank `src` passes one object per rank; each rank gets its own."""
        if self.rank == src:
            if objs is None or len(objs) != self.world_size:
                raise BridgeError(
                    f"rank {self.rank}: scatter_object needs exactly {self.world_size} objects on the source rank, "
                    f"got {None if objs is None else len(objs)}"
                )
            payloads = [_to_bytes(o) for o in objs]
            sizes = torch.tensor([p.numel() for p in payloads], dtype=torch.int64)
        else:
            sizes = torch.zeros(self.world_size, dtype=torch.int64)
        self.broadcast(sizes, src, phase=phase)
        width = int(sizes.max()) if self.world_size else 0
        out = torch.empty(width, dtype=torch.uint8)
        opts = ScatterOptions()
        opts.rootRank = src
        opts.timeout = self.timeout
        if self.rank == src:
            padded = []
            for p in payloads:
                t = torch.zeros(width, dtype=torch.uint8)
                t[: p.numel()] = p
                padded.append(t)
            work = self.pg.scatter([out], [padded], opts)
        else:
            work = self.pg.scatter([out], [], opts)
        self._wait(work, "scatter_object", phase)
        return _from_bytes(out[: int(sizes[self.rank])])

    def gather_object(self, obj: Any, dst: int = 0, phase: str = "gather_object") -> list[Any] | None:
        """Every rank's object on rank `dst` (others get None)."""
        gathered = self.all_gather_object(obj, phase=phase)
        return gathered if self.rank == dst else None

    def subgroup(self, members: list[int], name: str) -> Bridge:
        """A bridge among `members` (global ranks, this rank one of them) under its own store
        prefix: only they call it, and its ranks are their places in `members`. Called by the
        members only (no collective on this bridge)."""
        if self.rank not in members:
            raise BridgeError(f"rank {self.rank} is not one of the members {members} of bridge subgroup {name!r}")
        inner = f"{self._name}/{name}" if self._name else name
        return Bridge(self._base_store, members.index(self.rank), len(members), self.timeout, name=inner)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Shut the Gloo backend down. Call on every rank after a final barrier."""
        if self._pg is not None:
            pg, self._pg = self._pg, None
            pg.shutdown()
            del pg


def _to_bytes(obj: Any) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _from_bytes(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())
