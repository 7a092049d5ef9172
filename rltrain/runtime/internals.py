"""Every private torch, megatron-core and transformers internal rltrain relies on, in one place.

Each use is an `Internal`: its dotted name, where rltrain uses it and why, and the versions it
was checked against. Module-level internals are reached through `get(name)` (or the names
resolved below), which refuses an unregistered name and, when this install lacks a registered
one, raises `InternalMissing` naming it and the versions it was checked with. Instance fields
(`field=True`) are read where they are used, by code that checks them first; the registry lists
them so that `tests/test_architecture.py` can check every one against the installed libraries and
fail, naming the attribute, when an upgrade removes it.

Policy for code that touches any of these (the model is trainer/sharding.py:`rebind`): check every
assumption first, change nothing if one fails, fall back to a public path, and say so once in
the log. Where no public path exists (SGLang's weight-update group layout), fail with the name.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class InternalMissing(RuntimeError):
    """A private internal rltrain relies on is not in this install (an upgrade removed it)."""


@dataclass(frozen=True)
class Internal:
    name: str  # dotted: module path, then attributes (for a field: the class, then the field)
    used_by: str
    why: str
    checked: str  # versions it was checked against
    field: bool = False  # an attribute instances get (in __init__ or later), not a module attribute
    needs: str | None = None  # "cuda": exists only in CUDA builds of torch; "megatron": megatron-core installed


_TORCH = "torch 2.11 (H200), 2.13 (CPU), 2.14.1 (its CUDA build, on the CPU in CI)"
_FSDP = "torch.distributed.fsdp._fully_shard"
_MCORE = "megatron-core 0.16.1, 0.19.2"

REGISTRY: dict[str, Internal] = {
    i.name: i
    for i in [
        # torch
        Internal(
            "torch._foreach_copy_",
            "weights/bucket.py, engine/embedded/writer.py, runtime/memory.py, trainer/sharding.py",
            "one fused copy per group of tensors instead of one launch each",
            _TORCH,
        ),
        Internal(
            "torch._C._cuda_clearCublasWorkspaces",
            "runtime/memory.py: free_cuda_caches",
            "cuBLAS workspaces (allocated through the caching allocator) go back with the cache; without it they stay",
            _TORCH,
            needs="cuda",
        ),
        Internal(
            "torch.distributed.distributed_c10d._new_process_group_helper",
            "runtime/weight_group.py",
            "SGLang builds its weight-update group this way; the embedded engine's end must match it",
            _TORCH,
        ),
        Internal(
            "torch.distributed.distributed_c10d._world",
            "runtime/weight_group.py, runtime/kept_groups.py",
            "registers the weight-update group's rank map, as SGLang does; takes gloo subgroups out of the "
            "registry before the world's destroy and puts them back after its rebuild",
            _TORCH,
        ),
        Internal(
            "torch.distributed.distributed_c10d._register_process_group",
            "runtime/kept_groups.py: attach",
            "a kept group's name back in the C++ registry (functional collectives look groups up by name)",
            _TORCH,
        ),
        Internal(
            "torch.distributed.ProcessGroupNCCL.Options._timeout",
            "runtime/weight_group.py: UnregisteredGroup",
            "the NCCL weight-update group's timeout (no public setter)",
            _TORCH,
            field=True,
            needs="cuda",
        ),
        Internal(
            "torch.distributed.tensor.DTensor._local_tensor",
            "runtime/internals.py: local_shard (the ledger, the host park, sharding, the sharded reader)",
            "a DTensor's local shard without to_local()'s autograd function (~15 us a call: the ledger after "
            "every phase and the offload's choosing walk every parameter and optimizer state, ~1k DTensors)",
            _TORCH,
            field=True,
        ),
        Internal(
            "torch.nn.Module._parameters",
            "weights/names.py: module_weights",
            "parameters in state_dict order without state_dict()'s FSDP2 hooks",
            _TORCH,
            field=True,
        ),
        Internal("torch.nn.Module._buffers", "weights/names.py: module_weights", "as _parameters", _TORCH, field=True),
        Internal(
            "torch.nn.Module._non_persistent_buffers_set",
            "weights/names.py: module_weights",
            "which buffers a checkpoint holds",
            _TORCH,
            field=True,
        ),
        Internal(
            "torch.nn.Module._forward_pre_hooks",
            "trainer/sharding.py: free_storage",
            "FSDP2's hooks hold its state in a reference cycle with the module; cleared with the other hook "
            "dicts so that dropping the module frees it at once",
            _TORCH,
            field=True,
        ),
        Internal(
            f"{_FSDP}._fsdp_state.FSDPState._fsdp_param_group",
            "trainer/sharding.py: rebind",
            "re-binding kept FSDP2 modules to the rebuilt group (rebind checks every field first)",
            _TORCH,
            field=True,
        ),
        Internal(f"{_FSDP}._fully_shard.FSDPModule._get_fsdp_state", "trainer/sharding.py: rebind", "as above", _TORCH),
        Internal(
            f"{_FSDP}._fsdp_param_group.FSDPParamGroup.fsdp_params",
            "trainer/sharding.py: rebind",
            "as above",
            _TORCH,
            field=True,
        ),
        Internal(
            f"{_FSDP}._fsdp_param_group.FSDPParamGroup.mesh_info",
            "trainer/sharding.py: rebind",
            "as above",
            _TORCH,
            field=True,
        ),
        Internal(
            f"{_FSDP}._fsdp_param_group.FSDPParamGroup.post_forward_mesh_info",
            "trainer/sharding.py: rebind",
            "as above",
            _TORCH,
            field=True,
        ),
        Internal(
            f"{_FSDP}._fsdp_param_group.FSDPParamGroup._all_gather_process_group",
            "trainer/sharding.py: rebind",
            "rebind's check that the groups now resolve to the new one",
            _TORCH,
        ),
        Internal(
            f"{_FSDP}._fsdp_common.FSDPMeshInfo.shard_process_group",
            "trainer/sharding.py: rebind",
            "as above",
            _TORCH,
            field=True,
        ),
        Internal(
            f"{_FSDP}._fsdp_common.FSDPMeshInfo.shard_mesh_size",
            "trainer/sharding.py: rebind",
            "as above",
            _TORCH,
            field=True,
        ),
        Internal(
            f"{_FSDP}._fsdp_common.FSDPMeshInfo.shard_mesh_rank",
            "trainer/sharding.py: rebind",
            "as above",
            _TORCH,
            field=True,
        ),
        Internal(
            "torch.distributed.device_mesh.DeviceMesh._dim_group_names",
            "trainer/sharding.py: rebind",
            "a mesh finds its group by name; pointed at the rebuilt group's",
            _TORCH,
            field=True,
        ),
        Internal(
            "torch.distributed.device_mesh.DeviceMesh._pg_registry",
            "trainer/sharding.py: rebind",
            "newer torch keeps the mesh's groups by name here (set when present)",
            _TORCH,
            field=True,
        ),
        Internal(
            "torch._dynamo.config",
            "engine/embedded/paged.py: PagedDecoder",
            "allow_unspec_int_on_nn_module: the compiled blocks pass their layer index to the paged cache; "
            "without it dynamo compiles one graph per layer and stops at its recompile limit",
            _TORCH,
        ),
        # transformers
        Internal(
            "transformers.PreTrainedConfig._attn_implementation",
            "engine/embedded/paged.py: PagedDecoder._forward",
            "the paged path's attention for its own forwards only (set and restored around each): "
            "set_attn_implementation would switch the model for every caller",
            "transformers 5.17, 5.19",
            field=True,
        ),
        Internal(
            "transformers.core_model_loading.revert_weight_conversion",
            "weights/names.py",
            "checkpoint names and layouts of module tensors (fused MoE experts), as save_pretrained writes them; "
            "absent before transformers 5, where checkpoints and modules share the layout",
            "transformers 5.17, 5.19",
        ),
        Internal(
            "transformers.PreTrainedModel._init_weights",
            "weights/hf_sharded.py: compute_buffers",
            "recomputes a module's non-persistent buffers (rotary inv_freq) after to_empty, as from_pretrained does "
            "(each model's own override; checked by the buffers' tensor versions, refused where it writes none)",
            "transformers 5.19",
            field=True,
        ),
        Internal(
            "torch.Tensor._version",
            "weights/hf_sharded.py: compute_buffers",
            "whether _init_weights wrote a buffer in place",
            _TORCH,
            field=True,
        ),
        Internal(
            "transformers.initialization.no_init_weights",
            "trainer/fsdp.py: _build",
            "building a model whose state is restored next without initialising it",
            "transformers 5.17, 5.19 (transformers.modeling_utils before 5)",
        ),
        # megatron-core
        Internal(
            "megatron.core.parallel_state._GLOBAL_MEMORY_BUFFER",
            "trainer/megatron/model.py: build_gpt",
            "the local attention's scratch buffer, which megatron's own initialisation would make",
            _MCORE,
            needs="megatron",
        ),
        Internal(
            "megatron.core.parallel_state._set_global_memory_buffer",
            "trainer/megatron/model.py: build_gpt",
            "as above",
            _MCORE,
            needs="megatron",
        ),
        Internal(
            "megatron.core.transformer.moe.moe_utils.te_general_gemm",
            "trainer/megatron/model.py",
            "megatron-core 0.16.1 tests it without defining it when Transformer Engine is absent: rltrain defines "
            "it as None (what the test means by 'no TE'), the one attribute of megatron it sets",
            _MCORE,
            field=True,
            needs="megatron",
        ),
        Internal(
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.shard_fp32_groups",
            "trainer/megatron/optimizer.py: optimizer_state",
            "the distributed optimizer's shard of fp32 main parameters, which its state_dict leaves out",
            _MCORE,
            field=True,
            needs="megatron",
        ),
        Internal(
            "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.shard_fp32_from_float16_groups",
            "trainer/megatron/optimizer.py: optimizer_state",
            "as above, for bf16 models",
            _MCORE,
            field=True,
            needs="megatron",
        ),
    ]
}


def get(name: str) -> Any:
    """The module-level internal `name` (registered here), resolved in this install."""
    entry = REGISTRY.get(name)
    if entry is None or entry.field:
        raise KeyError(f"{name} is not a registered module-level internal (runtime/internals.py)")
    return _resolve(name, entry)


def _resolve(name: str, entry: Internal) -> Any:
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise InternalMissing(
        f"{name} is missing from this install (used by {entry.used_by} to {entry.why}; checked "
        f"against {entry.checked}): the upgrade changed it, see runtime/internals.py"
    )


def missing(entry: Internal) -> str | None:
    """Why `entry` does not hold in this install (None: it does). A field is looked for on its
    class and in the source of the class and its bases (where instances get it)."""
    if not entry.field:
        try:
            _resolve(entry.name, entry)
        except InternalMissing as e:
            return str(e)
        return None
    owner_name, attr = entry.name.rsplit(".", 1)
    try:
        owner = _resolve(owner_name, entry)
    except InternalMissing as e:
        return str(e)
    if not inspect.isclass(owner):  # a module attribute (megatron's te_general_gemm): read or defined by rltrain
        return None if hasattr(owner, attr) or attr in inspect.getsource(owner) else f"{entry.name} is not in {owner}"
    if hasattr(owner, attr):
        return None
    for cls in owner.__mro__:  # set in __init__ (or unpacked from a tuple there), or declared
        with contextlib.suppress(OSError, TypeError):
            if re.search(rf"self\.{re.escape(attr)}\b", inspect.getsource(cls)):
                return None
    return (
        f"{entry.name}: no instance of {owner.__name__} gets {attr!r} in this install (used by {entry.used_by}; "
        f"checked against {entry.checked})"
    )


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, the tensor it keeps (`DTensor._local_tensor`), not a view made by
    `to_local()`'s autograd function; any other tensor itself. The same storage either way: for
    walks over a model's state, and reads and in-place writes of its values outside autograd.
    Where the field is gone, `to_local()` (and the registry's check names the field)."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return local
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


@contextlib.contextmanager
def no_init_weights() -> Any:
    """transformers' context that skips weight initialisation (its module moved in transformers 5)."""
    try:
        ctx = get("transformers.initialization.no_init_weights")
    except InternalMissing:
        import transformers.modeling_utils  # noqa: PLC0415 - transformers < 5 only

        ctx = transformers.modeling_utils.no_init_weights  # type: ignore[attr-defined]
    with ctx():
        yield


foreach_copy_ = get("torch._foreach_copy_")
