"""Checkpoint names <-> a transformers model's own parameters.

transformers 5 keeps some weights in a different layout than its checkpoints: MoE experts live
as fused 3-D tensors (`mlp.experts.gate_up_proj` [E, 2I, H]) while the checkpoint, SGLang and
every other engine name them per expert (`mlp.experts.3.gate_proj.weight`). Weight sync speaks
checkpoint names. transformers' own `revert_weight_conversion` (what `save_pretrained` uses)
turns a module tensor into its checkpoint tensors; we use it in both directions:

- out (trainer -> engine): `to_checkpoint(model, name, tensor)` reverts one module tensor;
- in (engine): `checkpoint_index(model)` reverts a tensor of element *indices* of each converted
  parameter once, so every checkpoint tensor knows which elements of which module parameter it
  came from, and `write(param, index, tensor)` scatters it back. Exact for any conversion made of
  reshapes, slices, concatenations and transposes, with no per-architecture tables here.

Models without conversions (Llama, Qwen2/3 dense) map names one to one at no cost.

Experts: a routed expert's weights carry its index in the checkpoint name (`EXPERT`), which is
how the sync plan routes them and how an engine rank knows what it owns. `classify` sorts every
checkpoint name into routed expert / shared expert / fused experts / dense, and refuses a name
that mentions experts in no known form. `num_experts` reads the count from an HF config under any
of its spellings.

Fused in one call: some checkpoint weights are joined into one engine parameter by the engine's
loader with state that lives only inside one `load_weights` call, so they must reach the engine
in the same request (`FUSED_IN_ONE_CALL`, `fused_group`; the sync plan packs each group into one
bucket and refuses a group the trainer sends only part of). SGLang's "stacked" parameters are not
among them: `q/k/v_proj -> qkv_proj`, `gate/up_proj -> gate_up_proj` and the experts' `w1/w3 ->
w13` are written shard by shard (`weight_loader(param, w, shard_id)` copies into the shard's own
slice: `layers/linear.py: QKVParallelLinear.weight_loader, MergedColumnParallelLinear.weight_loader`,
`layers/moe/fused_moe_triton/layer.py: FusedMoE._load_w13`), so they may arrive in any requests.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from rltrain.runtime import internals

try:
    revert_weight_conversion = internals.get("transformers.core_model_loading.revert_weight_conversion")
except internals.InternalMissing:  # transformers < 5: checkpoints and modules share the layout
    revert_weight_conversion = None

EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")
SHARED_EXPERT = re.compile(r"(?:^|\.)shared_experts?(?:\.|_gate\.)")  # DeepSeek's, Qwen2-MoE's (and its gate)
# A router's per-expert score bias (Bailing/Ling's `gate.expert_bias`, AFMoE's and Hunyuan-V3's
# `expert_bias`: shape (num_experts,), SGLang 0.5.23's `models/bailing_moe.py` BailingMoEGate):
# the router on every rank reads all of it, so it is dense, not an expert's weight.
ROUTER_BIAS = re.compile(r"(?:^|\.)expert_bias$")
FUSED_EXPERTS = re.compile(r"(?:^|\.)experts\.(?!\d)")  # one tensor for all experts (gpt-oss-style checkpoints)


class UnknownWeightName(ValueError):
    """A checkpoint name that mentions experts in no form the sync knows."""


@dataclass(frozen=True)
class WeightKind:
    """What one checkpoint weight is to expert routing.

    expert          a routed expert's weight (`expert` its index): only the ranks that own it need it
    shared          a shared expert's weight (DeepSeek, Qwen2-MoE): every rank computes it
    fused_experts   all experts in one tensor: cannot be routed by name (the plan then refuses routing)
    dense           anything else (attention, norms, embeddings, routers, dense MLPs): every rank
    """

    kind: str
    expert: int | None = None


@functools.cache
def classify(name: str) -> WeightKind:
    """The routing class of checkpoint weight `name`. A name that speaks of experts in no form
    above is an error naming it: it is never guessed to be dense, never dropped. Kept per name:
    the engines ask it of every tensor of every update (a model's names are a fixed set)."""
    if m := EXPERT.search(name):
        return WeightKind("expert", int(m.group(1)))
    if SHARED_EXPERT.search(name):
        return WeightKind("shared")
    if FUSED_EXPERTS.search(name):
        return WeightKind("fused_experts")
    if ROUTER_BIAS.search(name):
        return WeightKind("dense")
    if "expert" in name.lower():
        raise UnknownWeightName(
            f"weight {name!r} mentions experts but is neither a routed expert ('...experts.<e>...'), a "
            "shared expert ('...shared_expert(s)...') nor a fused expert tensor ('...experts.<name>'): "
            "the sync cannot tell which engine ranks need it"
        )
    return WeightKind("dense")


@dataclass(frozen=True)
class FusedInOneCall:
    """Checkpoint weights that an engine's loader joins into one parameter only when all of them
    arrive in one `load_weights` call (it holds the first in a dict local to the call until the
    others come; a member sent in another request is lost with that dict, and the joined
    parameter is never written). The members' names differ only in one module name: `pattern`
    matches any member's name as `head`, `member` (one of `members`) and `tail`."""

    members: tuple[str, ...]
    pattern: re.Pattern[str]
    engine: str  # where the engine joins them, and what it makes


# Read in SGLang 0.5.23's loaders for the architectures rltrain names (DeepSeek-V2/V3/R1 and
# Kimi-K2, GLM-4.x MoE and GLM-4.7-Flash, Qwen2/3, Qwen3-MoE, Llama, GPT-OSS); everything else
# there is written weight by weight or shard by shard (see the module docstring). Left out, as no
# trainer sends those names: DeepSeek-V3.2's FP8 indexer weight with its scale (two dtypes, never
# one bucket) and GPT-OSS's original `block.<l>.mlp.mlp1_weight.{blocks,scales}`.
FUSED_IN_ONE_CALL: tuple[FusedInOneCall, ...] = (
    FusedInOneCall(
        ("q_a_proj", "kv_a_proj_with_mqa"),
        re.compile(r"^(?P<head>(?:.*\.)?)(?P<member>q_a_proj|kv_a_proj_with_mqa)(?P<tail>\..+)$"),
        "MLA with q_lora_rank set (DeepSeek-V2/V3/R1, Kimi-K2, GLM-4.7-Flash, GLM-5): SGLang writes "
        "fused_qkv_a_proj_with_mqa = cat(q_a_proj, kv_a_proj_with_mqa) once both are in one call "
        "(models/deepseek_common/deepseek_weight_loader.py: DeepseekV2WeightLoaderMixin.do_load_weights, "
        "`cached_a_proj`; models/glm4_moe_lite.py: Glm4MoeLiteForCausalLM.load_weights, the same)",
    ),
)


@functools.cache
def fused_group(name: str) -> tuple[str, tuple[str, ...], FusedInOneCall] | None:
    """The group checkpoint weight `name` must travel with (None: it may travel alone): a key
    naming the group, every member's name (`name` among them), and the table entry. Kept per
    name, as `classify`."""
    for group in FUSED_IN_ONE_CALL:
        if m := group.pattern.match(name):
            head, tail = m.group("head"), m.group("tail")
            key = f"{head}{{{','.join(group.members)}}}{tail}"
            return key, tuple(f"{head}{member}{tail}" for member in group.members), group
    return None


def num_experts(hf_config: Any) -> int:
    """Routed experts of a model (0: dense)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 0


def checkpoint_names(model_path: str) -> tuple[set[str], dict[str, str]]:
    """The weight names of an HF checkpoint directory (safetensors headers only) and, for tied
    embeddings, the alias of the output head (engine name -> the name the trainer sends)."""
    root = Path(model_path)
    names: set[str] = set()
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names.update(h.keys())
    if not names:
        raise FileNotFoundError(f"no *.safetensors in {model_path}: cannot check what the engine holds")
    aliases = {}
    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in names:
        embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
        if embed:
            aliases["lm_head.weight"] = embed
    return names, aliases


def _revert(model: Any, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if revert_weight_conversion is None:
        return named
    return revert_weight_conversion(model, named)


def to_checkpoint(
    model: Any, name: str, tensor: torch.Tensor, keep: Callable[[str], bool] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors (name, tensor) stored in module tensor `name`; with `keep`, only
    the names it keeps (the others are never made contiguous: a fused expert tensor's experts
    that no one needs cost nothing)."""
    out = _revert(model, {name: tensor})
    if list(out) == [name]:
        return [(name, tensor)] if keep is None or keep(name) else []
    return [(n, t.contiguous()) for n, t in out.items() if keep is None or keep(n)]


def checkpoint_specs(model: Any) -> list[tuple[str, str, torch.Size, torch.dtype]]:
    """(checkpoint name, module name, shape, dtype) of every weight, tied weights once, computed
    on meta tensors (no memory, no collectives)."""
    specs = []
    for name, t in module_weights(model):
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        for ck, ct in to_checkpoint(model, name, meta):
            specs.append((ck, name, ct.shape, ct.dtype))
    return specs


def module_weights(model: Any) -> list[tuple[str, torch.Tensor]]:
    """(module name, tensor) of every parameter and persistent buffer, tied parameters once, in
    state_dict order — without calling `state_dict()`, whose FSDP2 hooks are dear, and every
    bucket of every sync asks."""
    out, seen = [], set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((dot + name, p))
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out.append((dot + name, b))
    return out


def checkpoint_index(model: Any) -> dict[str, tuple[str, torch.Tensor | None, torch.Size]]:
    """checkpoint name -> (module name, flat element indices into it or None when identical,
    checkpoint shape). Index tensors exist only for converted parameters (int64: 8 bytes per element)."""
    out: dict[str, tuple[str, torch.Tensor | None, torch.Size]] = {}
    for name, t in module_weights(model):
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        reverted = to_checkpoint(model, name, meta)
        if [n for n, _ in reverted] == [name]:
            out[name] = (name, None, t.shape)
            continue
        index = torch.arange(t.numel(), dtype=torch.int64).reshape(t.shape)
        for ck, idx in to_checkpoint(model, name, index):
            out[ck] = (name, idx.reshape(-1), idx.shape)
    return out


@torch.no_grad()
def write(target: torch.Tensor, index: torch.Tensor | None, value: torch.Tensor) -> None:
    """Copy a checkpoint tensor into its module parameter (or a slice of it)."""
    if index is None:
        target.copy_(value)
    else:
        target.view(-1)[index.to(target.device)] = value.reshape(-1).to(target.dtype)
