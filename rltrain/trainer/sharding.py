"""FSDP2 over the world's current default group, following it across destroy/rebuild.

`fully_shard` binds a module to the process group of its mesh, and the world destroys that
group between steps. The modules follow the rebuilt group in one of two ways:
- `rebind` points the kept modules at the new group (same ranks, same order, so every rank keeps
  its dim-0 slice of every parameter). It touches private fields of FSDP2 and checks them first.
- Where it cannot, the state is captured as plain local tensors (`capture`: the rank's shard of
  every parameter, the replicated buffers, the optimizer state), the module is dropped, and a
  fresh module is sharded onto the rebuilt group and filled from those tensors (`load`). The same
  capture serves the host snapshot of release-train and the megatron trainer's offload.
Offload keeps the modules and empties their storages into page-locked host memory (host_park.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from rltrain.runtime import internals
from rltrain.runtime.memory import round_up
from rltrain.runtime.pinned import pinned_like


def current_group() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_initialized() else None


def one_unit(device: torch.device) -> bool:
    """Whether `shard` makes the whole model one FSDP unit on `device` (the CPU), not a unit per
    block: see the reason there."""
    return device.type == "cpu"


def shard(model: torch.nn.Module, device: torch.device) -> None:
    """`fully_shard` every transformer block (HF `_no_split_modules`) and then the root, over a
    1-D mesh of the current default group; on the CPU the root alone. Gradients are *summed*
    over ranks: the loss is already normalised by the global token count, so a mean would
    divide twice."""

    world = dist.group.WORLD
    assert world is not None, "shard: the default process group is not initialised"
    mesh = DeviceMesh.from_group(world, device.type)
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    # On the CPU the whole model is one unit: one gloo all-gather per forward and one
    # reduce-scatter per backward, where per-block units cost one of each per block (a gloo
    # collective costs more there than the memory it saves; a quickstart train step is faster with
    # blocks kept gathered from forward to backward). On GPUs each block is a unit
    # whose parameters are freed after its forward, for memory.
    if not one_unit(device):
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def reshard(model: torch.nn.Module) -> None:
    """Free the all-gathered parameters FSDP2 keeps after a forward without backward (the root's)."""

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def free_storage(model: torch.nn.Module) -> None:
    """Return the memory of a module being dropped, now. FSDP2 modules sit in reference cycles
    (hooks <-> state): dropping the last reference frees nothing until a gc pass, which is dear
    with transformers loaded — and until then the GPU memory stays taken.
    The module must not be used afterwards."""

    if not isinstance(model, FSDPModule):
        return  # a plain module is freed by reference counting (and may hold mmapped storage)
    reshard(model)
    for t in list(model.parameters()) + list(model.buffers()) + [p.grad for p in model.parameters()]:
        storage = None if t is None else internals.local_shard(t).untyped_storage()
        if storage is not None and storage.resizable():
            storage.resize_(0)
    # Break the module <-> FSDP state cycle (through the hooks) so that dropping the module frees
    # it, and with it the destroyed group its mesh holds, by reference counting: a destroyed Gloo
    # group keeps its sockets and threads until it is freed.
    for module in model.modules():
        for hooks in (
            module._forward_pre_hooks,
            module._forward_hooks,
            module._backward_pre_hooks,
            module._backward_hooks,
            module._state_dict_pre_hooks,
            module._state_dict_hooks,
            module._load_state_dict_pre_hooks,
            module._load_state_dict_post_hooks,
        ):
            hooks.clear()


def capture(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, to_host: bool, pin: bool
) -> dict[str, Any]:
    """The rank's part of the model (and optimizer) as plain tensors keyed by name.
    `to_host=False` keeps references to the live storage (no copy); `to_host` copies to host
    memory, with `pin` into one page-locked buffer of exactly their size."""
    sd = optimizer.state_dict() if optimizer is not None else None
    # Where each captured tensor goes: (section, name) of the model, (index, key) of the optimizer.
    slots: list[tuple[str, Any, Any]] = [("params", n, None) for n, _ in model.named_parameters()]
    slots += [("buffers", n, None) for n, _ in model.named_buffers()]
    live = [internals.local_shard(t).detach() for t in (*model.parameters(), *model.buffers())]
    if sd is not None:
        for i, st in sd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    slots.append(("optim", i, k))
                    live.append(internals.local_shard(v).detach())
    if to_host:
        hosts = pinned_like(live) if pin else [torch.empty(t.shape, dtype=t.dtype) for t in live]
        for h, t in zip(hosts, live):
            h.copy_(t, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        live = hosts
    state: dict[str, Any] = {"params": {}, "buffers": {}}
    optim_state = {i: dict(st) for i, st in sd["state"].items()} if sd is not None else {}
    for (section, a, b), t in zip(slots, live):
        if section == "optim":
            optim_state[a][b] = t
        else:
            state[section][a] = t
    if sd is not None:
        state["optim"] = {"param_groups": sd["param_groups"], "state": optim_state}
    return state


@torch.no_grad()
def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    """Copy captured tensors into a module of the same architecture and sharding; load the
    optimizer state onto its parameters. Names and shapes are checked before anything is copied."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for kind, have, want in (("parameter", params, state["params"]), ("buffer", buffers, state["buffers"])):
        if set(have) != set(want):
            raise ValueError(
                f"captured {kind}s do not match the model: missing {sorted(set(have) - set(want))[:5]}, "
                f"unexpected {sorted(set(want) - set(have))[:5]}"
            )
        for n, t in want.items():
            if internals.local_shard(have[n]).shape != t.shape:
                raise ValueError(
                    f"{kind} {n}: captured shard {tuple(t.shape)} but the model's is "
                    f"{tuple(internals.local_shard(have[n]).shape)} (different world size or rank order?)"
                )
    for n, t in state["params"].items():
        internals.local_shard(params[n]).copy_(t, non_blocking=True)
    for n, t in state["buffers"].items():
        buffers[n].copy_(t, non_blocking=True)
    if optimizer is not None and "optim" in state:
        ordered = list(model.parameters())
        sd = {"param_groups": state["optim"]["param_groups"], "state": {}}
        for i, s in state["optim"]["state"].items():
            p = ordered[i]
            sd["state"][i] = {
                k: (_like(p, v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in s.items()
            }
        optimizer.load_state_dict(sd)


def _like(param: torch.Tensor, local_value: torch.Tensor) -> torch.Tensor:
    """A local optimizer-state shard as the parameter's kind of tensor, on its device."""
    if isinstance(param, DTensor):
        value = local_value.to(internals.local_shard(param).device, non_blocking=True)
        return DTensor.from_local(
            value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
        )
    return local_value.to(param.device, non_blocking=True)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather for a sharded one: every rank must call)."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() == 1:
        return internals.local_shard(t)  # one rank holds it all: no gather, no copy
    return t.full_tensor()


def _row_sharded(t: torch.Tensor) -> TypeGuard[DTensor]:
    """A DTensor split by rows over a mesh of several ranks (FSDP2's layout)."""

    return (
        isinstance(t, DTensor)
        and t.device_mesh.ndim == 1
        and t.device_mesh.size() > 1
        and tuple(t.placements) == (Shard(0),)
        and t.dim() > 0
    )


def full_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`full_tensor` of each, with ONE all-gather for all the row-sharded ones of a mesh (every rank
    calls with the same list). Gathering parameter by parameter costs a collective each, several
    times the bytes' own time for a model of ~400 parameters. The shards go into one buffer, a
    rank's block after another's; rank r holds rows [r*c, (r+1)*c) of each tensor (c = ceil(rows /
    ranks), the last ones short or empty, as FSDP2 and DTensor split), so each tensor is the
    concatenation of its rows from every rank's block. On the CPU the staging buffers' fresh pages
    cost more than gloo's per-tensor calls, so callers use this for CUDA tensors
    (`export_weights`)."""
    first = next((t for t in tensors if isinstance(t, DTensor)), None)
    if (
        first is None
        or first.device_mesh.size() == 1
        and all(not isinstance(t, DTensor) or t.device_mesh is first.device_mesh for t in tensors)
    ):
        # Nothing to gather (one rank holds every tensor): no DTensor properties to read per
        # tensor, on every bucket of every sync.
        return [internals.local_shard(t) for t in tensors]
    sharded = {i: t for i, t in enumerate(tensors) if _row_sharded(t)}
    out: dict[int, torch.Tensor] = {i: full_tensor(t) for i, t in enumerate(tensors) if i not in sharded}
    if len(sharded) <= 1:  # nothing to batch: DTensor's own gather
        out.update((i, full_tensor(t)) for i, t in sharded.items())
        return [out[i] for i in range(len(tensors))]
    mesh = next(iter(sharded.values())).device_mesh
    if any(t.device_mesh != mesh for t in sharded.values()):
        raise ValueError("full_tensors: tensors on different meshes")
    ranks, me = mesh.size(), mesh.get_local_rank()
    # (index, rows each rank holds, bytes per row, slot offset, this rank's shard)
    layout: list[tuple[int, list[int], int, int, torch.Tensor]] = []
    size = 0
    for i, t in sharded.items():
        per_rank = -(-t.shape[0] // ranks)
        held = [max(0, min(per_rank, t.shape[0] - r * per_rank)) for r in range(ranks)]
        row_bytes = math.prod(t.shape[1:]) * t.element_size()  # shapes only: no DTensor op
        shard = internals.local_shard(t)
        if shard.shape[0] != held[me]:
            raise RuntimeError(
                f"rank {me}: a shard of {tuple(shard.shape)} of a {tuple(t.shape)} tensor is not the "
                f"row split full_tensors assumes (ceil(rows / {ranks}) rows per rank)"
            )
        layout.append((i, held, row_bytes, size, shard))
        size += round_up(per_rank * row_bytes, 16)  # 16-byte aligned slots
    device = layout[0][4].device
    send = torch.empty(size, dtype=torch.uint8, device=device)
    # Copies in each tensor's own dtype (byte-wise ones are several times slower on the CPU).
    copies = [
        (send[off : off + m.numel() * m.element_size()].view(m.dtype), m.reshape(-1))
        for *_, off, m in layout
        if m.numel()
    ]
    internals.foreach_copy_([d for d, _ in copies], [m for _, m in copies])
    recv = torch.empty(ranks * size, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(recv, send, group=mesh.get_group())
    blocks = recv.view(ranks, size)
    for i, held, row_bytes, off, _ in layout:
        t = sharded[i]
        # Each rank's slot holds its rows: side by side, the whole tensor.
        out[i] = torch.cat(
            [blocks[r, off : off + n * row_bytes].view(t.dtype).view(n, *t.shape[1:]) for r, n in enumerate(held) if n]
        )
    return [out[i] for i in range(len(tensors))]


def rebind(model: torch.nn.Module, group: dist.ProcessGroup) -> str | None:
    """Point a module that FSDP2 sharded over a destroyed default group at `group`, the
    rebuilt one (same ranks, same order: every rank keeps its rows). Returns None once done, or
    why it cannot (then nothing was changed, and the caller re-shards a fresh module instead).

    Rebuilding the modules for every world (`fully_shard` of every block, the model built on `meta`,
    `to_empty`, the optimizer re-wrapped) costs about as much as the copy. FSDP2 keeps its process
    group in the mesh infos of its parameter groups (`shard_process_group`); the DeviceMesh finds
    its group by name, and the rebuilt default group has the old one's name. These are private
    fields of torch, so every reference to a process group in those objects is checked first: one
    this function does not know (another torch version, HSDP, a separate reduce-scatter group) stops
    it."""

    pg_type = dist.ProcessGroup
    try:
        states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
        param_groups = [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]
        # (the parameter groups and their parameters: private classes of torch, both with mesh infos)
        owners: list[Any] = [owner for pg in param_groups for owner in (pg, *pg.fsdp_params)]
        infos = {
            id(i): i
            for owner in owners
            for i in (owner.mesh_info, getattr(owner, "post_forward_mesh_info", None))
            if i is not None
        }
        meshes = {id(i.mesh): i.mesh for i in infos.values()}
    except AttributeError as e:
        return f"FSDP2's internals differ from what rebind knows ({e})"
    if not infos:
        return "no FSDP2 parameter groups"
    for info in infos.values():
        if type(info).__name__ != "FSDPMeshInfo":
            return f"mesh info {type(info).__name__} (only FSDPMeshInfo: one shard dimension, no replication)"
        if getattr(info, "reduce_scatter_process_group", None) is not None:
            return "a separate reduce-scatter group"
        if info.shard_mesh_size != group.size() or info.shard_mesh_rank != group.rank():
            return (
                f"the new group has rank {group.rank()} of {group.size()}, the module was sharded as "
                f"rank {info.shard_mesh_rank} of {info.shard_mesh_size}"
            )
    for mesh in meshes.values():
        if mesh.ndim != 1 or getattr(mesh, "_dim_group_names", None) is None:
            return "a mesh of more than one dimension, or one without group names"
    known = {"shard_process_group", "_pg_registry"}  # the two set below
    for obj in (
        *states,
        *param_groups,
        *(fp for pg in param_groups for fp in pg.fsdp_params),
        *infos.values(),
        *meshes.values(),
    ):
        for name, value in vars(obj).items():
            values = (
                value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            )
            if name not in known and any(isinstance(v, pg_type) for v in values):
                return f"{type(obj).__name__}.{name} holds a process group rebind does not know"
    for mesh in meshes.values():
        mesh._dim_group_names = [group.group_name]
        if hasattr(mesh, "_pg_registry"):
            mesh._pg_registry = {group.group_name: group}
    for info in infos.values():
        info.shard_process_group = group
    broken = [pg for pg in param_groups if pg._all_gather_process_group is not group]
    broken += [m for m in meshes.values() if m.get_group() is not group]
    if broken:  # cannot be undone: the old group is gone
        raise RuntimeError(f"rebind: {len(broken)} FSDP2 groups or meshes still resolve to the destroyed group")
    return None


def gather_chunks(sources: list[str], tensors: dict[str, torch.Tensor], budget: int) -> Iterator[list[str]]:
    """`sources` in order, in runs of at most `budget` bytes of whole tensors (one tensor at least,
    so budget 0 gives one run per tensor): the same runs on every rank, from the global shapes."""
    run: list[str] = []
    size = 0
    for src in sources:
        t = tensors[src]
        nbytes = t.numel() * t.element_size()
        if run and size + nbytes > budget:
            yield run
            run, size = [], 0
        run.append(src)
        size += nbytes
    if run:
        yield run
