"""Expert routing's classification of every weight, on the checkpoint names of real architectures.

Each model is a tiny transformers model of that architecture; its checkpoint names are what the
trainer sends (`checkpoint_specs`: transformers' own conversion back from its fused layout).
Every name is classified routed expert / shared expert / fused / dense; a shared expert goes to
every engine rank; an expert name the sync does not know is an error that names it.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
import transformers

from models import NARROW
from rltrain.sync.plan import EngineTopology, WeightSpec, build_plan
from rltrain.weights.names import UnknownWeightName, checkpoint_specs, classify


def _qwen3_moe():
    return (
        transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **replace(NARROW, head_dim=8).config_kwargs(),
                moe_intermediate_size=8,
                num_experts=4,
                num_experts_per_tok=2,
                mlp_only_layers=[],
            )
        ),
        4,
        0,
    )


def _mixtral():
    return (
        transformers.MixtralForCausalLM(
            transformers.MixtralConfig(
                **replace(NARROW, intermediate=8).config_kwargs(), num_local_experts=4, num_experts_per_tok=2
            )
        ),
        4,
        0,
    )


def _deepseek_v3():
    """Shared experts and a dense first layer (first_k_dense_replace), MLA attention."""
    cfg = transformers.DeepseekV3Config(
        **replace(NARROW, layers=3).config_kwargs(),
        moe_intermediate_size=8,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
    )
    return transformers.DeepseekV3ForCausalLM(cfg), 4, 1


def _qwen2_moe():
    """A shared expert and its gate."""
    cfg = transformers.Qwen2MoeConfig(
        **replace(NARROW, tied=True).config_kwargs(),
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.Qwen2MoeForCausalLM(cfg), 4, 0


ARCHS = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "deepseek_v3": _deepseek_v3, "qwen2_moe": _qwen2_moe}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_checkpoint_name_of_a_moe_architecture_is_classified(arch):
    torch.manual_seed(0)
    model, experts, dense_layers = ARCHS[arch]()
    names = [ck for ck, _, _, _ in checkpoint_specs(model)]
    kinds = {n: classify(n) for n in names}
    routed = {n: k.expert for n, k in kinds.items() if k.kind == "expert"}
    shared = [n for n, k in kinds.items() if k.kind == "shared"]
    layers = model.config.num_hidden_layers
    # Every routed expert of every MoE layer, three matrices each, indices 0..E-1.
    assert len(routed) == (layers - dense_layers) * experts * 3, sorted(routed)[:6]
    assert set(routed.values()) == set(range(experts))
    # The dense first layers (DeepSeek's first_k_dense_replace) have no expert weight at all.
    for layer in range(dense_layers):
        assert not any(re.search(rf"\.layers\.{layer}\.", n) for n in {*routed, *shared}), layer
    has_shared = arch in ("deepseek_v3", "qwen2_moe")
    assert bool(shared) == has_shared, shared
    assert not any(k.kind == "fused_experts" for k in kinds.values())
    # Everything else (attention, norms, routers, embeddings) is dense.
    dense = [n for n, k in kinds.items() if k.kind == "dense"]
    assert any(n.endswith("embed_tokens.weight") for n in dense)
    assert any(".mlp.gate." in n or "block_sparse_moe.gate." in n for n in dense)  # the routers
    # Tied embeddings: the head is the embedding, sent once.
    assert ("lm_head.weight" in names) == (not model.config.tie_word_embeddings)

    # Routed over two engine EP ranks: each expert to its owner, shared and dense to both.
    specs = [WeightSpec(ck, tuple(shape), dtype) for ck, _, shape, dtype in checkpoint_specs(model)]
    plan = build_plan(specs, EngineTopology((2,), experts), 1 << 20)
    assert plan.routed, plan.fallback_reason
    for n in names:
        k = kinds[n]
        assert plan.targets[n] == ((k.expert // (experts // 2),) if k.kind == "expert" else (0, 1)), n
    for b in plan.buckets:  # a bucket goes to one set of ranks: never an expert beside another's
        assert {plan.targets[n] for n in b.names} == {b.targets}


def test_dense_models_tied_and_untied_are_all_dense():
    for tied in (True, False):
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**replace(NARROW, layers=1, tied=tied).config_kwargs())
        )
        names = [ck for ck, _, _, _ in checkpoint_specs(model)]
        assert {classify(n).kind for n in names} == {"dense"}
        assert ("lm_head.weight" in names) == (not tied)


def test_an_expert_name_the_sync_does_not_know_is_an_error_naming_it_where_experts_are_routed():
    for name in ("model.layers.0.mlp.expert_scale", "model.layers.0.mlp.Experts3.w1.weight"):
        with pytest.raises(UnknownWeightName, match=re.escape(repr(name))):
            classify(name)
    specs = [
        WeightSpec("model.embed_tokens.weight", (4, 2), torch.float32),
        WeightSpec("model.layers.0.mlp.experts.0.w1.weight", (2, 2), torch.float32),
        WeightSpec("model.layers.0.mlp.experts.1.w1.weight", (2, 2), torch.float32),
        WeightSpec("model.layers.0.mlp.expert_scale", (4,), torch.float32),
    ]
    with pytest.raises(UnknownWeightName, match="expert_scale"):
        build_plan(specs, EngineTopology((2,), 2), 1 << 20)  # EP 2: never silently dense
    # At EP 1 nothing is routed: every engine rank takes every weight, whatever its name.
    plan = build_plan(specs, EngineTopology((1,), 2), 1 << 20)
    assert not plan.routed and all(plan.targets[s.name] == (0,) for s in specs)


def test_a_routers_expert_bias_is_dense_at_every_ep_size():
    """Bailing/Ling's `mlp.gate.expert_bias` (SGLang's BailingMoEGate) is the router's per-expert
    score bias: every rank's router reads it (it was refused even at EP 1)."""
    name = "model.layers.0.mlp.gate.expert_bias"
    assert classify(name).kind == "dense"
    specs = [
        WeightSpec("model.layers.0.mlp.gate.weight", (2, 4), torch.float32),
        WeightSpec(name, (2,), torch.float32),
        WeightSpec("model.layers.0.mlp.experts.0.w1.weight", (2, 2), torch.float32),
        WeightSpec("model.layers.0.mlp.experts.1.w1.weight", (2, 2), torch.float32),
    ]
    for ep in (1, 2):
        plan = build_plan(specs, EngineTopology((ep,), 2), 1 << 20)
        assert plan.targets[name] == tuple(range(ep)) and plan.routed == (ep > 1)


def test_fused_expert_tensors_are_not_routed_and_the_reason_names_one():
    specs = [
        WeightSpec("model.layers.0.mlp.experts.gate_up_proj", (4, 8, 2), torch.float32),
        WeightSpec("model.layers.0.mlp.gate.weight", (4, 2), torch.float32),
    ]
    plan = build_plan(specs, EngineTopology((2,), 4), 1 << 20)
    assert not plan.routed and "experts.gate_up_proj" in (plan.fallback_reason or "")
    assert all(t == (0, 1) for t in plan.targets.values())


# --------------------------------------------------------------------------- the engines' own layouts


def _moe_specs(experts: int = 8) -> list[WeightSpec]:
    dense = [WeightSpec("model.embed_tokens.weight", (16, 4), torch.float32)]
    return dense + [
        WeightSpec(f"model.layers.0.mlp.experts.{e}.{p}.weight", (4, 4), torch.float32)
        for e in range(experts)
        for p in ("gate_proj", "up_proj", "down_proj")
    ]


SGLANG_INFO = {  # the fields of SGLang 0.5.23's /server_info the router reads (seen on CPU)
    "tp_size": 2,
    "ep_size": 2,
    "dp_size": 1,
    "enable_eplb": False,
    "ep_num_redundant_experts": 0,
    "moe_a2a_backend": "none",
    "moe_runner_backend": "auto",
    "enable_dp_attention": False,
}


@pytest.mark.parametrize(
    "infos,reason",
    [
        ([{**SGLANG_INFO, "enable_eplb": True}], "EPLB"),
        ([{**SGLANG_INFO, "ep_num_redundant_experts": 2}], "redundant experts"),
        ([{**SGLANG_INFO, "moe_a2a_backend": "deepep"}], "deepep"),
        ([{"ep_size": 2, "ep_rank": r, "moe_dp_size": 2} for r in (0, 1)], "--moe-dp-size 2"),
        ([{"ep_size": 2, "ep_rank": r, "ep_join_rank_offset": 4} for r in (0, 1)], "rank offset 4"),
        ([SGLANG_INFO], "inside each engine"),
        ([{"ep_size": 2, "ep_rank": 0}, {"ep_size": 4, "ep_rank": 1}], "layouts differ"),
        ([{"ep_size": 2, "ep_rank": 1}, {"ep_size": 2, "ep_rank": 0}], "receiver 0 reports EP rank 1 of 2"),
        ([{}, {}], "not EP ranks"),  # engines that say nothing of themselves are not taken as EP ranks
    ],
)
def test_routing_follows_what_the_engines_report_and_says_why_not(infos, reason, caplog):
    from rltrain.sync.plan import EngineParallelism

    layouts = tuple(EngineParallelism.from_server_info(i) for i in infos)
    caplog.set_level("INFO", logger="rltrain.sync")
    plan = build_plan(_moe_specs(), EngineTopology((len(infos),), 8, layouts), 1 << 20)
    assert not plan.routed and reason in (plan.fallback_reason or ""), plan.fallback_reason
    assert all(t == tuple(range(len(infos))) for t in plan.targets.values())
    said = [r for r in caplog.records if "expert routing off" in r.getMessage()]
    assert len(said) == 1 and reason in said[0].getMessage()  # one line, naming the reason


def test_receivers_that_report_themselves_as_the_ranks_of_one_ep_group_are_routed():
    from rltrain.sync.plan import EngineParallelism

    layouts = tuple(EngineParallelism.from_server_info({"ep_size": 2, "ep_rank": r}) for r in (0, 1))
    plan = build_plan(_moe_specs(), EngineTopology((2,), 8, layouts), 1 << 20)
    assert plan.routed and plan.targets["model.layers.0.mlp.experts.5.up_proj.weight"] == (1,)


def test_a_moe_model_at_ep_1_says_routing_is_off_once(caplog):
    caplog.set_level("INFO", logger="rltrain.sync")
    plan = build_plan(_moe_specs(), EngineTopology((1,), 8), 1 << 20)
    said = [r for r in caplog.records if "expert routing off" in r.getMessage()]
    assert not plan.routed and len(said) == 1 and said[0].levelname == "INFO"
    caplog.clear()
    build_plan([WeightSpec("model.embed_tokens.weight", (4, 4), torch.float32)], EngineTopology((1,), 0), 1 << 20)
    assert "expert routing" not in caplog.text  # a dense model has nothing to route: nothing said


def test_an_experts_weights_travel_in_one_bucket():
    """Buckets never split one expert across two requests, even when the limit would pack its
    matrices apart (three 64-byte matrices per expert, a 100-byte limit)."""
    specs = _moe_specs(4)
    plan = build_plan(specs, EngineTopology((1,), 4), 100)
    home: dict[str, int] = {}
    for i, b in enumerate(plan.buckets):
        for n in b.names:
            if (k := classify(n)).expert is not None:
                assert home.setdefault(f"{n.split('.experts.')[0]}.{k.expert}", i) == i, n
    assert len(home) == 4 and sorted(n for b in plan.buckets for n in b.names) == sorted(s.name for s in specs)


# --------------------------------------------------------------------------- routing inside one engine


@pytest.mark.parametrize("tp,ep,ranks", [(2, 2, (0, 1)), (4, 2, (0, 0, 1, 1)), (4, 4, (0, 1, 2, 3))])
def test_experts_are_routed_inside_an_engine_to_each_tp_ranks_own_ep_rank(tp, ep, ranks):
    """SGLang's EP inside one engine (TP rank k in EP rank k // (tp/ep)): each TP rank's payload
    has every dense weight and only its EP rank's experts; every request has something for
    every rank; an expert's matrices stay in one request."""
    from rltrain.sync.plan import EngineParallelism

    layout = EngineParallelism.from_server_info({**SGLANG_INFO, "tp_size": tp, "ep_size": ep})
    specs = _moe_specs(8)
    plan = build_plan(specs, EngineTopology((1,), 8, (layout,), per_rank_payloads=True), 200)
    assert plan.routed and plan.engine_ep_ranks == ranks
    dense = sum(w.nbytes for w in specs if classify(w.name).expert is None)
    experts = sum(w.nbytes for w in specs) - dense
    for k in range(tp):
        got = [n for b in plan.buckets for n in b.names if plan.needed_by(k, n)]
        owned = {classify(n).expert for n in got} - {None}
        assert owned == set(range(ranks[k] * 8 // ep, (ranks[k] + 1) * 8 // ep)), (k, owned)
        assert plan.rank_bytes(k) == dense + experts // ep
        assert all(any(plan.needed_by(k, n) for n in b.names) for b in plan.buckets)
    home: dict[int, int] = {}
    for i, b in enumerate(plan.buckets):
        for n in b.names:
            if (e := classify(n).expert) is not None:
                assert home.setdefault(e, i) == i, n


def test_a_transport_without_per_rank_payloads_falls_back_inside_an_engine_and_says_so(caplog):
    from rltrain.sync.plan import EngineParallelism

    layout = EngineParallelism.from_server_info(SGLANG_INFO)
    plan = build_plan(_moe_specs(8), EngineTopology((1,), 8, (layout,), per_rank_payloads=False), 1 << 20)
    assert not plan.routed and plan.engine_ep_ranks is None and "only `tensor`" in (plan.fallback_reason or "")
    assert all(plan.needed_by(1, w.name) for w in plan.weights)
    assert "only `tensor`" in caplog.text


def test_the_per_rank_coverage_proof_names_what_a_rank_would_miss_or_get_twice():
    from rltrain.sync import plan as plan_mod

    specs = _moe_specs(4)
    good = build_plan(
        specs,
        EngineTopology((1,), 4, (plan_mod.EngineParallelism(tp_size=2, ep_size=2),), per_rank_payloads=True),
        1 << 20,
    )
    broken = plan_mod.SyncPlan(
        specs,
        good.targets,
        [plan_mod.Bucket((0,), torch.float32, specs[:-1] + specs[:1])],
        1,
        True,
        None,
        (0, 1),
        good.expert_owner,
    )
    with pytest.raises(plan_mod.SyncPlanError, match=r"TP rank 0.*twice: \['model.embed_tokens.weight'\]"):
        plan_mod._check_rank_coverage(broken, 2)
    broken.buckets = [plan_mod.Bucket((0,), torch.float32, specs[:-1])]
    with pytest.raises(plan_mod.SyncPlanError, match=r"TP rank 1.*missing: \['model.layers.0.mlp.experts.3.down_proj"):
        plan_mod._check_rank_coverage(broken, 2)
