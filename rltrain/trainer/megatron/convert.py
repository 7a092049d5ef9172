"""HF <-> megatron-core weights for dense decoder models (Llama, Qwen2, Qwen3), with TP sharding.

megatron-bridge was considered first; it is not on PyPI for the megatron-core that Python 3.11
resolves here (0.16.1), so the conversion is written out, for the three dense families only, and
pinned by exact round-trip tests (HF -> megatron shards -> HF, bit for bit, at TP=1 and TP=2).

Layouts (megatron-core's local layer spec, names of `GPTModel.state_dict()`):

    embedding.word_embeddings.weight                  model.embed_tokens.weight       vocab-parallel (dim 0)
    decoder.layers.i.input_layernorm.weight           ...input_layernorm.weight       replicated
    decoder.layers.i.self_attention.linear_qkv.weight q_proj, k_proj, v_proj          column-parallel, per query group
    decoder.layers.i.self_attention.linear_qkv.bias   q/k/v biases (Qwen2)            column-parallel, per query group
    decoder.layers.i.self_attention.q_layernorm.weight ...self_attn.q_norm.weight     replicated (Qwen3)
    decoder.layers.i.self_attention.k_layernorm.weight ...self_attn.k_norm.weight     replicated (Qwen3)
    decoder.layers.i.self_attention.linear_proj.weight ...self_attn.o_proj.weight     row-parallel (dim 1)
    decoder.layers.i.pre_mlp_layernorm.weight         ...post_attention_layernorm     replicated
    decoder.layers.i.mlp.linear_fc1.weight            gate_proj, up_proj              column-parallel, gate/up split
    decoder.layers.i.mlp.linear_fc2.weight            ...mlp.down_proj.weight         row-parallel (dim 1)
    decoder.layers.i.mlp.router.weight                ...mlp.gate.weight              replicated (MoE)
    decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight  ...mlp.experts.e.gate_proj, up_proj (MoE)
    decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight  ...mlp.experts.e.down_proj      (MoE)
    decoder.final_layernorm.weight                    model.norm.weight               replicated
    output_layer.weight                               lm_head.weight                  vocab-parallel (absent when tied)

The fused QKV weight holds, per query group g, that group's query heads, then its key head, then
its value head: [g0: q.. k v | g1: q.. k v | ...]. A TP rank holds a contiguous run of groups, so
the number of query groups must divide by TP. The fused fc1 weight on a TP rank is [gate shard;
up shard], so it is sharded gate and up apart. The vocabulary is padded to a multiple of TP (the
padding rows are zero and their logits are masked); export drops the padding.

MoE (Qwen3-MoE, every layer sparse; Mixtral, whose experts are w1/w3/w2 under block_sparse_moe):
expert names here use the *global* expert index; a model holding a block of experts (expert
parallel) maps them to its local indices. Experts are not tensor-parallel sharded yet (MoE needs
TP=1). HF's `norm_topk_prob` (renormalise the top-k probabilities) is megatron's top-k before the
softmax (`moe_router_pre_softmax=False`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# HF names of an MoE layer per family: (MLP module, router, gate / up / down projection of an expert)
_MOE_NAMES = {
    "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# megatron suffix within a layer -> HF suffix within a layer (one-to-one weights)
_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


class ConversionError(ValueError):
    """The HF model cannot be mapped onto megatron-core's GPT model (architecture, sizes, names)."""


@dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    experts: int = 0  # 0: dense
    topk: int = 0
    moe_ffn: int = 0
    norm_topk: bool = False
    moe_family: str = ""  # a key of _MOE_NAMES


def dims(hf_config: PretrainedConfig, tp: int, pp: int = 1) -> Dims:
    arch = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
    model_type = getattr(hf_config, "model_type", "")
    if arch not in SUPPORTED and model_type not in ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"):
        raise ConversionError(
            f"trainer.backend=megatron supports {', '.join(SUPPORTED)}; this model is {arch} ({model_type})"
        )
    experts = 0
    if model_type == "qwen3_moe":
        experts = int(getattr(hf_config, "num_experts", 0) or 0)
    elif model_type == "mixtral":
        experts = int(hf_config.num_local_experts)
        if getattr(hf_config, "router_jitter_noise", 0.0):
            raise ConversionError("Mixtral with router_jitter_noise > 0 is not converted (the router would differ)")
    if experts:
        if getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
            raise ConversionError(
                "Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) is not "
                "converted yet: every layer must be sparse"
            )
        if tp > 1 or pp > 1:
            raise ConversionError(
                f"MoE models need trainer.tensor_parallel_size=1 and pipeline_parallel_size=1 for "
                f"now (got {tp} and {pp}): expert weights are not sharded over them yet"
            )
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if groups % tp or heads % tp:
        raise ConversionError(
            f"tensor parallel size {tp} must divide the attention heads ({heads}) and key/value heads ({groups})"
        )
    if pp < 1 or hf_config.num_hidden_layers % pp:
        raise ConversionError(f"pipeline parallel size {pp} must divide the {hf_config.num_hidden_layers} layers")
    if hf_config.intermediate_size % tp:
        raise ConversionError(f"tensor parallel size {tp} must divide intermediate_size {hf_config.intermediate_size}")
    vocab = hf_config.vocab_size
    return Dims(
        layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        heads=heads,
        groups=groups,
        head_dim=head_dim,
        ffn=hf_config.intermediate_size,
        vocab=vocab,
        padded_vocab=-(-vocab // tp) * tp,
        qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        experts=experts,
        topk=int(getattr(hf_config, "num_experts_per_tok", 0) or 0) if experts else 0,
        moe_ffn=int(getattr(hf_config, "moe_intermediate_size", 0) or hf_config.intermediate_size) if experts else 0,
        # Mixtral always renormalises its top-k routing weights
        norm_topk=(model_type == "mixtral" or bool(getattr(hf_config, "norm_topk_prob", False))) if experts else False,
        moe_family=model_type if experts else "",
    )


def transformer_config_kwargs(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The megatron `TransformerConfig` fields that describe the HF architecture."""
    d = dims(hf_config, 1)
    kw = dict(
        num_layers=d.layers,
        hidden_size=d.hidden,
        num_attention_heads=d.heads,
        num_query_groups=d.groups,
        kv_channels=d.head_dim,
        ffn_hidden_size=d.ffn,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=d.qkv_bias,
        qk_layernorm=d.qk_norm,
        layernorm_epsilon=hf_config.rms_norm_eps,
    )
    if d.experts:
        # No load-balancing loss: RL fine-tuning keeps the router as trained (as the HF forward does
        # without output_router_logits).
        kw.update(
            num_moe_experts=d.experts,
            moe_router_topk=d.topk,
            moe_ffn_hidden_size=d.moe_ffn,
            moe_router_pre_softmax=not d.norm_topk,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
        )
    return kw


def mcore_names(d: Dims) -> list[str]:
    """Every weight name of the (unsharded) megatron model, in module order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(d.layers):
        p = f"decoder.layers.{i}."
        names.append(p + "input_layernorm.weight")
        names.append(p + "self_attention.linear_qkv.weight")
        if d.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if d.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight"]
        if d.experts:
            names.append(p + "mlp.router.weight")
            for e in range(d.experts):
                names += [
                    p + f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                    p + f"mlp.experts.local_experts.{e}.linear_fc2.weight",
                ]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not d.tied:
        names.append("output_layer.weight")
    return names


# ---------------------------------------------------------------------- HF -> megatron (full)


def hf_names_of(name: str, d: Dims) -> list[str]:
    """The HF checkpoint names a megatron weight is made of."""
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    if name == "output_layer.weight":
        return ["lm_head.weight"]
    m = _LAYER.match(name)
    if not m:
        raise ConversionError(f"unknown megatron weight {name!r}")
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest in _SIMPLE:
        return [p + _SIMPLE[rest]]
    if rest == "self_attention.linear_qkv.weight":
        return [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
    if rest == "self_attention.linear_qkv.bias":
        return [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    if rest == "mlp.linear_fc1.weight":
        return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    if d.experts:
        mlp, router, (gate, up, down) = _MOE_NAMES[d.moe_family]
        if rest == "mlp.router.weight":
            return [p + f"{mlp}.{router}.weight"]
        e = _EXPERT.match(rest)
        if e and e.group(2) == "linear_fc1":
            return [p + f"{mlp}.experts.{e.group(1)}.{gate}.weight", p + f"{mlp}.experts.{e.group(1)}.{up}.weight"]
        if e:
            return [p + f"{mlp}.experts.{e.group(1)}.{down}.weight"]
    raise ConversionError(f"unknown megatron weight {name!r}")


def to_mcore(name: str, parts: list[torch.Tensor], d: Dims) -> torch.Tensor:
    """The full megatron tensor `name` from its HF parts (in `hf_names_of` order)."""
    rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        q, k, v = parts
        per = d.heads // d.groups * d.head_dim
        tail = q.shape[1:]
        fused = torch.cat(
            [
                q.reshape(d.groups, per, *tail),
                k.reshape(d.groups, d.head_dim, *tail),
                v.reshape(d.groups, d.head_dim, *tail),
            ],
            dim=1,
        )
        return fused.reshape(-1, *tail)
    if rest == "mlp.linear_fc1.weight" or rest.endswith(".linear_fc1.weight"):
        return torch.cat(parts, dim=0)
    (t,) = parts
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") and d.padded_vocab != d.vocab:
        t = torch.cat([t, t.new_zeros(d.padded_vocab - d.vocab, *t.shape[1:])])
    return t


def from_mcore(name: str, full: torch.Tensor, d: Dims) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of a full megatron tensor."""
    hf = hf_names_of(name, d)
    rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        per = d.heads // d.groups * d.head_dim
        tail = full.shape[1:]
        g = full.reshape(d.groups, per + 2 * d.head_dim, *tail)
        q, k, v = g.split([per, d.head_dim, d.head_dim], dim=1)
        return [(hf[0], q.reshape(-1, *tail)), (hf[1], k.reshape(-1, *tail)), (hf[2], v.reshape(-1, *tail))]
    if rest == "mlp.linear_fc1.weight" or rest.endswith(".linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return [(hf[0], gate), (hf[1], up)]
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = full[: d.vocab]
    return [(hf[0], full)]


def full_shape(name: str, d: Dims) -> tuple[int, ...]:
    """The shape of a (global, unsharded) megatron weight."""
    rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    qkv_rows = (d.heads + 2 * d.groups) * d.head_dim
    return {
        "embedding.word_embeddings.weight": (d.padded_vocab, d.hidden),
        "output_layer.weight": (d.padded_vocab, d.hidden),
        "decoder.final_layernorm.weight": (d.hidden,),
        "input_layernorm.weight": (d.hidden,),
        "pre_mlp_layernorm.weight": (d.hidden,),
        "self_attention.linear_qkv.weight": (qkv_rows, d.hidden),
        "self_attention.linear_qkv.bias": (qkv_rows,),
        "self_attention.q_layernorm.weight": (d.head_dim,),
        "self_attention.k_layernorm.weight": (d.head_dim,),
        "self_attention.linear_proj.weight": (d.hidden, d.heads * d.head_dim),
        "mlp.linear_fc1.weight": (2 * d.ffn, d.hidden),
        "mlp.linear_fc2.weight": (d.hidden, d.ffn),
        "mlp.router.weight": (d.experts, d.hidden),
    }.get(rest) or {"linear_fc1": (2 * d.moe_ffn, d.hidden), "linear_fc2": (d.hidden, d.moe_ffn)}[rest.split(".")[-2]]


# ---------------------------------------------------------------------- TP sharding


def tp_shard(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This TP rank's part of a full megatron tensor."""
    if tp == 1:
        return full
    rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if rest == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if rest in _ROW_PARALLEL:
        return full.chunk(tp, dim=1)[rank]
    if rest.startswith("self_attention.linear_qkv") or name in (
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    ):
        return full.chunk(tp, dim=0)[rank]
    return full  # replicated (norms)


def tp_unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor from every TP rank's part (in TP rank order)."""
    if len(parts) == 1:
        return parts[0]
    rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if rest == "mlp.linear_fc1.weight":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if rest in _ROW_PARALLEL:
        return torch.cat(parts, dim=1)
    if rest.startswith("self_attention.linear_qkv") or name in (
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    ):
        return torch.cat(parts, dim=0)
    return parts[0]


def tp_partition_dim(name: str) -> int:
    rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    return 1 if rest in _ROW_PARALLEL else 0


def is_tp_sharded(name: str) -> bool:
    rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    return (
        rest == "mlp.linear_fc1.weight"
        or rest in _ROW_PARALLEL
        or rest.startswith("self_attention.linear_qkv")
        or name in ("embedding.word_embeddings.weight", "output_layer.weight")
    )


def expert_of(name: str) -> int | None:
    """The global expert index of a megatron expert weight name (None: not an expert weight)."""
    rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    m = _EXPERT.match(rest)
    return int(m.group(1)) if m else None


def local_expert_name(name: str, local: int) -> str:
    """`name` with its (global) expert index replaced by a local one."""
    return re.sub(r"local_experts\.\d+\.", f"local_experts.{local}.", name)


def hf_to_mcore_shards(
    hf: dict[str, torch.Tensor], d: Dims, rank: int, tp: int, ep_rank: int = 0, ep: int = 1
) -> dict[str, torch.Tensor]:
    """This rank's megatron state (its TP shard; with expert parallel, its block of experts under
    local indices) from a full HF state dict. Every HF weight must be used by some rank."""
    out, used = {}, set()
    per_rank = d.experts // ep if d.experts else 0
    for name in mcore_names(d):
        srcs = hf_names_of(name, d)
        missing = [s for s in srcs if s not in hf]
        if missing:
            raise ConversionError(f"HF checkpoint lacks {missing} (needed for {name})")
        used.update(srcs)
        e = expert_of(name)
        if e is not None:
            if e // per_rank != ep_rank:
                continue  # another expert-parallel rank's expert
            out[local_expert_name(name, e % per_rank)] = to_mcore(name, [hf[s] for s in srcs], d)
            continue
        out[name] = tp_shard(name, to_mcore(name, [hf[s] for s in srcs], d), rank, tp)
    unused = sorted(set(hf) - used - ({"lm_head.weight"} if d.tied else set()))
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ConversionError(f"HF weights with no megatron counterpart: {unused[:5]}")
    return out


def stage_of(name: str, d: Dims, pp: int) -> int:
    """The pipeline stage that holds a (global) megatron weight."""
    if name == "embedding.word_embeddings.weight":
        return 0
    if name in ("decoder.final_layernorm.weight", "output_layer.weight"):
        return pp - 1
    m = _LAYER.match(name)
    if not m:
        raise ConversionError(f"unknown megatron weight {name!r}")
    return int(m.group(1)) // (d.layers // pp)


def stage_name(name: str, d: Dims, pp: int) -> str:
    """A global megatron weight name as its stage's model names it (layers numbered from 0)."""
    m = _LAYER.match(name)
    if pp == 1 or not m:
        return name
    return f"decoder.layers.{int(m.group(1)) % (d.layers // pp)}.{m.group(2)}"


def to_stage(state: dict[str, torch.Tensor], d: Dims, pp: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """The part of a (TP-sharded) megatron state that pipeline stage `pp_rank` holds, under its
    local names. With tied embeddings the last stage holds its own copy of the output head."""
    if pp == 1:
        return state
    out = {stage_name(n, d, pp): t for n, t in state.items() if stage_of(n, d, pp) == pp_rank}
    if d.tied and pp_rank == pp - 1:
        out["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    return out
