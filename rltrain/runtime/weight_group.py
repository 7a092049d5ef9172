"""The trainer<->engine weight-update process group, laid out exactly as SGLang lays it out.

SGLang's `/init_weights_update_group` joins a group over a `tcp://master_address:master_port`
rendezvous (the trainer is rank 0 and hosts the store; engine ranks are `rank_offset + tp_rank`)
with the store namespaced by the group name, and builds the backend through torch's
`_new_process_group_helper` so the group is independent of any default process group. To
interoperate with real SGLang, both rltrain sides (the trainer and the embedded engine) build
the group the same way; this relies on a private torch helper, as SGLang itself does, and is
pinned by the contract tests against a live SGLang server.
"""

from __future__ import annotations

import inspect
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig, PrefixStore

from rltrain.runtime import internals


def open_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
) -> Any:
    """Join (rank 0: host) the group; returns the ProcessGroup. Blocks until all ranks joined."""

    new_process_group_helper = internals.get("torch.distributed.distributed_c10d._new_process_group_helper")
    world = internals.get("torch.distributed.distributed_c10d._world")
    timeout = timedelta(seconds=timeout_s)
    store = PrefixStore(group_name, tcp_store(master_address, master_port, rank, world_size, timeout))
    kwargs: dict[str, Any] = dict(
        group_size=world_size,
        group_rank=rank,
        global_ranks_in_group=[],
        backend=Backend(backend),
        store=store,
        group_name=group_name,
        timeout=timeout,
    )
    params = inspect.signature(new_process_group_helper).parameters
    kwargs["backend_options" if "backend_options" in params else "pg_options"] = None
    pg, _ = new_process_group_helper(**kwargs)
    world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def tcp_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> Any:
    """Rank 0 hosts the group's TCP store, the others connect. Not `rendezvous("tcp://...")`:
    under torchrun that connects *every* rank as a client (it expects the agent's store), and the
    group would wait for a server nobody starts."""
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)


def close_weight_update_group(pg: Any) -> None:
    if isinstance(pg, UnregisteredGroup):
        pg.close()
    else:
        dist.destroy_process_group(pg)


class UnregisteredGroup:
    """The trainer's end of the weight-update group, outside torch's group registry.

    `destroy_process_group()` (which the world calls between steps) destroys every *registered*
    group; a weight-update group that must live across steps is therefore built here directly
    as a gloo/NCCL backend, on exactly the store keys `_new_process_group_helper` uses (the
    `{group_name}/` and `{device}/` prefixes), so the engine side — SGLang or the embedded engine,
    which use that helper — connects to it unchanged. Only broadcast is needed.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float = 300.0,
    ):

        self.timeout = timedelta(seconds=timeout_s)
        store = tcp_store(master_address, master_port, rank, world_size, self.timeout)
        device = next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))
        store = PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
        self._store_owner = store  # the TCP store must outlive the backend
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = self.timeout
            self.backend: Any = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            self.backend = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        self.rank, self.size, self.name = rank, world_size, group_name

    def broadcast(self, tensor: torch.Tensor, src: int = 0, give_up: Any = None) -> None:
        """`give_up()`: polled while waiting; truthy when the peers will not join (their request
        failed), which raises instead of waiting out the timeout."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = self.timeout
        work = self.backend.broadcast([tensor], opts)
        if give_up is None:
            work.wait(self.timeout)
            return
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not work.is_completed():
            reason = give_up()
            if reason:
                raise RuntimeError(
                    f"weight-update group {self.name}: broadcast abandoned, the receiver will not join: {reason}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight-update group {self.name}: broadcast not received within {self.timeout}")
            time.sleep(0.001)
        work.wait(self.timeout)

    def close(self) -> None:
        if hasattr(self.backend, "shutdown"):
            self.backend.shutdown()
        self.backend = None

    def abort(self) -> None:
        """Drop this end when the other one is gone (its engine died): nothing waits for a peer."""
        if self.backend is not None:
            getattr(self.backend, "abort", getattr(self.backend, "shutdown", lambda: None))()
        self.backend = None


def broadcast_tensors(pg: Any, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast each tensor in order (the default, non-bucketed `update_weights_from_distributed`)."""
    for t in tensors:
        dist.broadcast(t, group=pg, group_src=src)
