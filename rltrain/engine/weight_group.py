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

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def open_weight_update_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
    timeout_s: float = 300.0,
) -> Any:
    """Join (rank 0: host) the group; returns the ProcessGroup. Blocks until all ranks joined."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    kwargs: dict[str, Any] = dict(
        group_size=world_size, group_rank=rank, global_ranks_in_group=[], backend=Backend(backend),
        store=store, group_name=group_name, timeout=timeout,
    )
    import inspect

    params = inspect.signature(_new_process_group_helper).parameters
    kwargs["backend_options" if "backend_options" in params else "pg_options"] = None
    pg, _ = _new_process_group_helper(**kwargs)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def close_weight_update_group(pg: Any) -> None:
    dist.destroy_process_group(pg)


def broadcast_tensors(pg: Any, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast each tensor in order (the default, non-bucketed `update_weights_from_distributed`)."""
    for t in tensors:
        dist.broadcast(t, group=pg, group_src=src)
