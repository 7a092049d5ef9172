"""CPU process groups kept alive across the world's destroy/rebuild.

`destroy_process_group()` shuts down every group in torch's registry (`distributed_c10d._world`),
and the world must destroy the default group (on GPUs its NCCL communicators hold device memory).
Gloo groups hold no accelerator memory, and tearing them down and connecting them again is most
of a CPU world's cycle. So before the teardown the world takes its gloo subgroups out of torch's
registry (`detach`: nothing shuts them down), and after the next `init_process_group` puts the very
same ProcessGroup objects back (`attach`): same communicator, same name, same rank map, usable
through every torch.distributed call again.

This touches torch's private registry (listed in runtime/internals.py). `unsupported()` checks
every field it relies on first; where one is missing the world keeps nothing and rebuilds every
group, as before, and says so once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rltrain.runtime.internals import get

_FIELDS = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg", "group_count")


def unsupported() -> str | None:
    """Why this torch cannot keep groups across a destroy (None: it can)."""
    try:
        world = get("torch.distributed.distributed_c10d._world")
        get("torch.distributed.distributed_c10d._register_process_group")
    except Exception as e:  # noqa: BLE001 - any failure means: do not touch the registry
        return f"{type(e).__name__}: {e}"
    lacking = [f for f in _FIELDS if not hasattr(world, f)]
    return f"torch's process-group registry has no {', '.join(lacking)}" if lacking else None


@dataclass
class Detached:
    """A group taken out of torch's registry, with every entry it had there."""

    pg: Any
    backend_store: Any  # pg_map's (backend name, store)
    name: str
    backend_config: Any
    ranks: dict[int, int] | None
    tag: str | None
    tags: list[str]  # the tags_to_pg lists it was in


def detach(pg: Any) -> Detached:
    """Take `pg` out of torch's registry: a following destroy_process_group() leaves it alone."""
    world = get("torch.distributed.distributed_c10d._world")
    tags = [t for t, pgs in world.tags_to_pg.items() if any(p is pg for p in pgs)]
    for t in tags:
        world.tags_to_pg[t] = [p for p in world.tags_to_pg[t] if p is not pg]
    return Detached(
        pg=pg,
        backend_store=world.pg_map.pop(pg),
        name=world.pg_names.pop(pg),
        backend_config=world.pg_backend_config.pop(pg),
        ranks=world.pg_group_ranks.pop(pg, None),
        tag=world.pg_to_tag.pop(pg, None),
        tags=tags,
    )


def attach(d: Detached) -> None:
    """Put a detached group back into torch's registry (after init_process_group)."""
    world = get("torch.distributed.distributed_c10d._world")
    if d.name in world.pg_names.values():
        raise RuntimeError(f"a process group named {d.name!r} exists already: cannot put the kept one back")
    world.pg_map[d.pg] = d.backend_store
    world.pg_names[d.pg] = d.name
    world.pg_backend_config[d.pg] = d.backend_config
    if d.ranks is not None:
        world.pg_group_ranks[d.pg] = d.ranks
    if d.tag is not None:
        world.pg_to_tag[d.pg] = d.tag
    for t in d.tags:
        world.tags_to_pg.setdefault(t, []).append(d.pg)
    get("torch.distributed.distributed_c10d._register_process_group")(d.name, d.pg)


def next_name() -> str:
    """The name torch gives the next group it names by its counter (`dist.new_group`'s default):
    the same on every rank, members or not, since every rank creates every group."""
    return str(get("torch.distributed.distributed_c10d._world").group_count)


def skip_names(taken: set[str]) -> None:
    """Move torch's group counter past the names in `taken`, so the next group torch names by
    the counter does not collide with a kept group's."""
    world = get("torch.distributed.distributed_c10d._world")
    while str(world.group_count) in taken:
        world.group_count += 1
