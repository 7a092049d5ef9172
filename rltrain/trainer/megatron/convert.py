"""HF <-> megatron-core weights for Llama, Qwen2, Qwen3 and Qwen3-MoE / Mixtral, with TP sharding.

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

HF -> megatron works on a rank's part only (`mcore_state`): a `WeightSource` hands out HF tensors
or row/column slices of them, and each megatron weight of the rank's stage and experts is made
from the slices that land in its TP shard (a run of query groups of q, k and v; a block of rows of
gate and up; a block of columns of a row-parallel weight). Backed by the safetensors files
(load.py) a rank reads its share of the checkpoint and no more; backed by a dict (`DictSource`) it
converts a state held in memory, through the same code.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

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


# ---------------------------------------------------------------------- names and shapes, megatron -> HF


def _within_layer(name: str) -> str:
    """A megatron weight name without its `decoder.layers.i.` prefix (others as they are)."""
    return name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name


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


def from_mcore(name: str, full: torch.Tensor, d: Dims) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of a full megatron tensor."""
    hf = hf_names_of(name, d)
    rest = _within_layer(name)
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
    rest = _within_layer(name)
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


# ---------------------------------------------------------------------- TP, EP and PP placement


def tp_unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full megatron tensor from every TP rank's part (in TP rank order)."""
    if len(parts) == 1:
        return parts[0]
    rest = _within_layer(name)
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
    rest = _within_layer(name)
    return 1 if rest in _ROW_PARALLEL else 0


def is_tp_sharded(name: str) -> bool:
    rest = _within_layer(name)
    return (
        rest == "mlp.linear_fc1.weight"
        or rest in _ROW_PARALLEL
        or rest.startswith("self_attention.linear_qkv")
        or name in ("embedding.word_embeddings.weight", "output_layer.weight")
    )


def expert_of(name: str) -> int | None:
    """The global expert index of a megatron expert weight name (None: not an expert weight)."""
    rest = _within_layer(name)
    m = _EXPERT.match(rest)
    return int(m.group(1)) if m else None


def local_expert_name(name: str, local: int) -> str:
    """`name` with its (global) expert index replaced by a local one."""
    return re.sub(r"local_experts\.\d+\.", f"local_experts.{local}.", name)


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


# ---------------------------------------------------------------------- HF -> megatron: a rank's part


class WeightSource(Protocol):
    """An HF checkpoint's tensors by name, read whole or in part: load.py's reads slices out of the
    safetensors files, `DictSource` serves tensors already in memory."""

    def names(self) -> Collection[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Rows `rows` (dim 0) and columns `cols` (dim 1) of tensor `name` (None: all of them), in
        storage of its own: never a view that keeps the whole tensor or file alive."""
        ...


class DictSource:
    """A `WeightSource` over HF tensors held in memory (a state dict)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def names(self) -> Collection[str]:
        return self.tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        t = self.tensors[name]
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        return t.clone()


@dataclass(frozen=True)
class RankPart:
    """The part of the model one rank holds: its tensor-parallel shard, its block of experts
    (expert parallel) and its pipeline stage's layers."""

    tp_rank: int = 0
    tp: int = 1
    ep_rank: int = 0
    ep: int = 1
    pp_rank: int = 0
    pp: int = 1


def hf_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Every HF weight the model is made of, at its checkpoint shape (tied: no `lm_head`)."""
    return {
        hf: tuple(t.shape)
        for name in mcore_names(d)
        for hf, t in from_mcore(name, torch.empty(full_shape(name, d), device="meta"), d)
    }


def check_source(src: WeightSource, d: Dims) -> None:
    """Refuse a checkpoint whose weight names or shapes do not fit `d`, naming every misfit.
    Reads no tensor data (shapes come from the files' headers)."""
    want = hf_shapes(d)
    have = set(src.names())
    missing = sorted(set(want) - have)
    ignored = {"lm_head.weight"} if d.tied else set()
    unknown = sorted(n for n in have - set(want) - ignored if not n.endswith("rotary_emb.inv_freq"))
    seen = {n: src.shape(n) for n in want if n in have}
    wrong = [f"{n} {list(seen[n])}, expected {list(s)}" for n, s in want.items() if n in seen and seen[n] != s]
    problems = [
        f"{len(found)} {what}: {', '.join(found[:5])}{', ...' if len(found) > 5 else ''}"
        for what, found in (
            ("weights missing", missing),
            ("weights with no megatron counterpart", unknown),
            ("weights of the wrong shape", wrong),
        )
        if found
    ]
    if problems:
        raise ConversionError(
            "the HF checkpoint does not fit the model its config.json describes (is the config the "
            "checkpoint's own?): " + "; ".join(problems)
        )


def _split(size: int, rank: int, n: int, what: str) -> slice:
    """Rank `rank`'s contiguous run of `size` items split evenly over `n` ranks."""
    if size % n:
        raise ConversionError(f"{what} ({size}) do not split evenly over tensor parallel size {n}")
    step = size // n
    return slice(rank * step, (rank + 1) * step)


def mcore_shard(name: str, src: WeightSource, d: Dims, tp_rank: int, tp: int) -> torch.Tensor:
    """Tensor-parallel rank `tp_rank`'s part of the (global) megatron weight `name`, made of the rows
    or columns of its HF tensors that land in it, read from `src` and no more."""
    hf, rest = hf_names_of(name, d), _within_layer(name)
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        # A TP rank holds a contiguous run of query groups: that run's rows of q, k and v each.
        per = d.heads // d.groups * d.head_dim
        mine = _split(d.groups, tp_rank, tp, "the key/value heads")
        q, k, v = (
            src.read(n, slice(mine.start * rows, mine.stop * rows))
            for n, rows in zip(hf, (per, d.head_dim, d.head_dim))
        )
        tail = q.shape[1:]
        grouped = [q.reshape(-1, per, *tail), k.reshape(-1, d.head_dim, *tail), v.reshape(-1, d.head_dim, *tail)]
        return torch.cat(grouped, dim=1).reshape(-1, *tail)
    if rest == "mlp.linear_fc1.weight":  # [gate shard; up shard]
        rows = _split(d.ffn, tp_rank, tp, "intermediate_size")
        return torch.cat([src.read(n, rows) for n in hf])
    if expert_of(name) is not None:  # experts are not TP-sharded: [gate; up], or down
        return torch.cat([src.read(n) for n in hf]) if len(hf) == 2 else src.read(hf[0])
    (one,) = hf
    if rest in _ROW_PARALLEL:
        return src.read(one, cols=_split(full_shape(name, d)[1], tp_rank, tp, f"the columns of {name}"))
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        # Vocabulary-parallel over the padded vocabulary: the padding rows (zeros) are not read.
        rows = _split(d.padded_vocab, tp_rank, tp, "the padded vocabulary")
        t = src.read(one, slice(min(rows.start, d.vocab), min(rows.stop, d.vocab)))
        pad = rows.stop - rows.start - t.shape[0]
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    return src.read(one)  # replicated: norms, the router


def mcore_state(src: WeightSource, d: Dims, part: RankPart) -> dict[str, torch.Tensor]:
    """A rank's megatron state from an HF checkpoint, under its stage's names: the weights of its
    pipeline stage (with tied embeddings the last stage holds its own copy of the output head), its
    block of experts under local indices, each cut to its TP shard. The checkpoint is checked whole
    first (`check_source`), then only what the rank holds is read."""
    check_source(src, d)
    if d.experts % part.ep:
        raise ConversionError(f"expert parallel size {part.ep} must divide the {d.experts} experts")
    per_rank = d.experts // part.ep
    out = {}
    for name in mcore_names(d):
        if stage_of(name, d, part.pp) != part.pp_rank:
            continue
        e = expert_of(name)
        if e is not None and e // per_rank != part.ep_rank:
            continue  # another expert-parallel rank's expert
        local = name if e is None else local_expert_name(name, e % per_rank)
        out[stage_name(local, d, part.pp)] = mcore_shard(name, src, d, part.tp_rank, part.tp)
    if d.tied and part.pp > 1 and part.pp_rank == part.pp - 1:
        out["output_layer.weight"] = mcore_shard("embedding.word_embeddings.weight", src, d, part.tp_rank, part.tp)
    return out


def hf_to_mcore_shards(
    hf: Mapping[str, torch.Tensor], d: Dims, rank: int, tp: int, ep_rank: int = 0, ep: int = 1
) -> dict[str, torch.Tensor]:
    """A rank's megatron state (one pipeline stage) from a full HF state dict held in memory."""
    return mcore_state(DictSource(hf), d, RankPart(rank, tp, ep_rank, ep))
