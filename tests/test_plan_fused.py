"""The sync plan keeps together the weights an engine fuses inside one load call.

SGLang 0.5.23 writes an MLA layer's `fused_qkv_a_proj_with_mqa` (DeepSeek-V2/V3/R1, Kimi-K2,
GLM-4.7-Flash: `q_lora_rank` set) only when its `q_a_proj` and `kv_a_proj_with_mqa` arrive in the
same `load_weights` call, i.e. the same request, i.e. the same bucket. Every other weight of the
architectures below is loaded by SGLang weight by weight, or shard by shard into a stacked
parameter (q/k/v, gate/up, experts), and may travel in any bucket.

Each model is built on the meta device from its real HF config's shapes (written here; nothing is
downloaded), and its names and shapes are what the trainer sends (`checkpoint_specs`). Which
weights pair is read off the names here, not from the plan's own table.
"""

from __future__ import annotations

import functools
import random
import re

import pytest
import torch
import transformers

from rltrain.sync.plan import EngineParallelism, EngineTopology, SyncPlan, SyncPlanError, WeightSpec, build_plan
from rltrain.weights.names import checkpoint_specs

MIB = 1 << 20

# name -> (model class, config class, the shapes of the model's HF config.json, its MLA layers)
MODELS = {
    "DeepSeek-V3": (  # deepseek-ai/DeepSeek-V3 (DeepSeek-R1: the same shapes)
        transformers.DeepseekV3ForCausalLM,
        transformers.DeepseekV3Config,
        dict(
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=256,
            n_shared_experts=1,
            first_k_dense_replace=3,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            vocab_size=129280,
        ),
        61,
    ),
    "Kimi-K2": (  # moonshotai/Kimi-K2-Instruct: DeepseekV3ForCausalLM with 384 experts
        transformers.DeepseekV3ForCausalLM,
        transformers.DeepseekV3Config,
        dict(
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=64,
            num_key_value_heads=64,
            n_routed_experts=384,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            vocab_size=163840,
        ),
        61,
    ),
    "GLM-4.7-Flash": (  # zai-org/GLM-4.7-Flash: Glm4MoeLiteForCausalLM, MLA
        transformers.Glm4MoeLiteForCausalLM,
        transformers.Glm4MoeLiteConfig,
        dict(
            hidden_size=2048,
            intermediate_size=10240,
            moe_intermediate_size=1536,
            num_hidden_layers=47,
            num_attention_heads=20,
            num_key_value_heads=20,
            n_routed_experts=64,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=768,
            kv_lora_rank=512,
            qk_nope_head_dim=192,
            qk_rope_head_dim=64,
            v_head_dim=256,
            vocab_size=154880,
        ),
        47,
    ),
    "GLM-4.5-Air": (  # zai-org/GLM-4.5-Air: Glm4MoeForCausalLM, grouped-query attention
        transformers.Glm4MoeForCausalLM,
        transformers.Glm4MoeConfig,
        dict(
            hidden_size=4096,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=46,
            num_attention_heads=96,
            num_key_value_heads=8,
            head_dim=128,
            n_routed_experts=128,
            n_shared_experts=1,
            first_k_dense_replace=1,
            attention_bias=True,
            vocab_size=151552,
        ),
        0,
    ),
    "Qwen3-8B": (
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config,
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=False,
        ),
        0,
    ),
    "Qwen3-30B-A3B": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig,
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            vocab_size=151936,
        ),
        0,
    ),
    "Llama-3.1-8B": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
        0,
    ),
    "gpt-oss-20b": (  # one tensor for all experts of a layer: nothing paired, nothing routed by name
        transformers.GptOssForCausalLM,
        transformers.GptOssConfig,
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            vocab_size=201088,
        ),
        0,
    ),
}

PAIR = re.compile(r"^(.*\.self_attn\.)(q_a_proj|kv_a_proj_with_mqa)(\..+)$")


@functools.cache
def _specs(model: str) -> tuple[WeightSpec, ...]:
    """The trainer's checkpoint names and shapes of `model`, in bf16 (the router's score bias in
    fp32, as the checkpoints keep it)."""
    model_cls, config_cls, shapes, _ = MODELS[model]
    with torch.device("meta"):
        module = model_cls(config_cls(**shapes))
    return tuple(
        WeightSpec(n, tuple(s), torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16)
        for n, _, s, _ in checkpoint_specs(module)
    )


def _pairs(specs: tuple[WeightSpec, ...]) -> dict[str, set[str]]:
    """Each MLA layer's q_a_proj / kv_a_proj_with_mqa names, by what they share."""
    pairs: dict[str, set[str]] = {}
    for w in specs:
        if m := PAIR.match(w.name):
            pairs.setdefault(f"{m.group(1)}*{m.group(3)}", set()).add(w.name)
    return pairs


def _travels_with(name: str) -> str:
    """What `name` must share a bucket with: its pair, its expert's other matrices, or nothing."""
    if m := PAIR.match(name):
        return f"{m.group(1)}*{m.group(3)}"
    if m := re.match(r"^(.*\.experts\.\d+)\.", name):
        return m.group(1)
    return name


def _split_pairs(plan: SyncPlan, pairs: dict[str, set[str]]) -> list[str]:
    home = {n: i for i, b in enumerate(plan.buckets) for n in b.names}
    return sorted(k for k, names in pairs.items() if len({home[n] for n in names}) > 1)


@pytest.mark.parametrize("bucket_mb", [512, 64, 16, 1])
@pytest.mark.parametrize("model", list(MODELS))
def test_no_weight_pair_an_engine_fuses_in_one_call_is_split_between_buckets(model, bucket_mb):
    """At the default bucket size and at sizes below a pair's own (a DeepSeek-V3 pair is 30 MiB):
    every MLA layer's q_a_proj and kv_a_proj_with_mqa share a bucket; every weight is sent once."""
    specs = _specs(model)
    pairs = _pairs(specs)
    assert len(pairs) == MODELS[model][3] and all(len(p) == 2 for p in pairs.values())
    plan = build_plan(specs, EngineTopology(), bucket_mb * MIB)
    split = _split_pairs(plan, pairs)
    assert not split, f"{len(split)} of {len(pairs)} layers' pairs split between buckets: {split[:3]}"
    assert sorted(n for b in plan.buckets for n in b.names) == sorted(w.name for w in specs)


def test_a_fused_pair_larger_than_the_bucket_limit_gets_a_bucket_of_its_own():
    """DeepSeek-V3 at 16 MiB: a pair (21 + 8 MiB) is never split to honour the limit; its bucket
    holds the pair and nothing else. Every bucket that holds more than one thing is in the limit."""
    specs = _specs("DeepSeek-V3")
    plan = build_plan(specs, EngineTopology(), 16 * MIB)
    for names in _pairs(specs).values():
        assert [sorted(b.names) for b in plan.buckets if names & set(b.names)] == [sorted(names)]
    for b in plan.buckets:
        assert b.nbytes <= 16 * MIB or len({_travels_with(n) for n in b.names}) == 1, b.names


def test_deepseek_v3_on_one_engine_over_eight_gpus_keeps_its_pairs_while_routing_experts():
    """The production layout: one SGLang engine at TP 8 with EP 8 inside it, per-TP-rank payloads.
    Experts are routed per rank (the plan's per-rank proof holds) and no pair is split."""
    specs = _specs("DeepSeek-V3")
    layout = EngineParallelism(tp_size=8, ep_size=8)
    plan = build_plan(specs, EngineTopology((1,), 256, (layout,), per_rank_payloads=True), 512 * MIB)
    assert plan.routed and plan.engine_ep_ranks == tuple(range(8))
    assert not _split_pairs(plan, _pairs(specs))


def test_the_plan_table_pairs_what_sglang_fuses_in_one_call_and_nothing_it_loads_by_shard():
    """q_a_proj pairs with kv_a_proj_with_mqa of the same layer and suffix (a scale pairs with the
    other's scale, as SGLang pairs them by name); SGLang's stacked parameters, whose shards its
    `weight_loader(param, w, shard_id)` writes into their own slices in any call, stay alone."""
    from rltrain.weights.names import fused_group

    layer = "model.layers.7.self_attn."
    for tail in (".weight", ".weight_scale_inv"):
        q, kv = f"{layer}q_a_proj{tail}", f"{layer}kv_a_proj_with_mqa{tail}"
        q_group, kv_group = fused_group(q), fused_group(kv)
        assert q_group is not None and kv_group is not None
        assert q_group[:2] == kv_group[:2] and q_group[1] == (q, kv)
    assert fused_group(f"{layer}q_a_proj.weight") != fused_group("model.layers.8.self_attn.q_a_proj.weight")
    alone = [
        f"{layer}{m}.weight"
        for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "kv_b_proj", "q_a_layernorm", "kv_a_layernorm")
    ] + [
        "model.layers.7.mlp.gate_proj.weight",
        "model.layers.7.mlp.up_proj.weight",
        "model.layers.7.mlp.experts.3.gate_proj.weight",
        "model.layers.7.mlp.shared_experts.up_proj.weight",
        "model.layers.7.mlp.experts.gate_up_proj",
    ]
    assert [n for n in alone if fused_group(n) is not None] == []


def _mla_layer(layer: int, dtype: torch.dtype = torch.bfloat16) -> list[WeightSpec]:
    return [
        WeightSpec(f"model.layers.{layer}.self_attn.q_a_proj.weight", (1536, 7168), dtype),
        WeightSpec(f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight", (576, 7168), dtype),
        WeightSpec(f"model.layers.{layer}.self_attn.o_proj.weight", (7168, 16384), dtype),
    ]


def test_a_fused_pair_the_trainer_sends_only_half_of_is_refused_naming_it():
    """Without the engine's names to compare (engine_names None), a q_a_proj without its
    kv_a_proj_with_mqa would leave the engine's fused weight stale: refused, named."""
    specs = _mla_layer(0) + _mla_layer(1)
    del specs[4]  # layer 1's kv_a_proj_with_mqa
    with pytest.raises(SyncPlanError) as e:
        build_plan(specs, EngineTopology(), 512 * MIB)
    msg = str(e.value)
    assert "model.layers.1.self_attn.q_a_proj.weight" in msg and "model.layers.1.self_attn.kv_a_proj_with_mqa" in msg
    assert "layers.0" not in msg and "fused_qkv_a_proj_with_mqa" in msg


def test_a_fused_pair_in_two_dtypes_is_refused_a_bucket_holds_one():
    specs = _mla_layer(0)
    specs[1] = WeightSpec(specs[1].name, specs[1].shape, torch.float32)
    with pytest.raises(SyncPlanError, match=r"kv_a_proj_with_mqa.weight \(torch.float32"):
        build_plan(specs, EngineTopology(), 512 * MIB)


def test_buckets_are_filled_first_fit_the_same_as_a_scan_of_every_bucket():
    """The packer finds each unit's bucket through a tree (a DeepSeek-V3 has tens of thousands of
    units): the same bucket as scanning the buckets in order for the first with room."""
    from rltrain.sync.plan import _first_fit

    rng = random.Random(0)
    for limit in (1, 10, 100):
        sizes = [rng.randrange(0, 120) for _ in range(500)]
        used: list[int] = []
        scanned = []
        for size in sizes:
            i = next((i for i, u in enumerate(used) if u + size <= limit), len(used))
            if i == len(used):
                used.append(0)
            used[i] += size
            scanned.append(i)
        assert _first_fit(sizes, limit) == scanned
