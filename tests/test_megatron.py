"""The megatron-core trainer backend, on CPU through the test-only shim (tests/megatron_shim.py).

Real processes on gloo: tensor parallel 2 and data parallel 2, against the HF model's log-probs,
a GRPO step, world destroy/rebuild, and a weight sync to a real embedded engine checked by its
checksum. Conversion is checked exactly, in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.models import make_model
from tests.multiproc import run_ranks, values

pytest.importorskip("megatron.core")


def _hf_state(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize(
    "arch,vocab,tied",
    [("qwen2", 256, False), ("qwen3", 255, False), ("llama", 256, True)],
    ids=["qwen2-qkv-bias", "qwen3-qk-norm-odd-vocab", "llama-tied"],
)
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_round_trip_is_exact(tmp_path, arch, vocab, tied, tp):
    import transformers

    from rltrain.trainer.megatron.convert import dims, from_mcore, hf_to_mcore_shards, tp_unshard

    path = make_model(tmp_path / "m", seed=3, arch=arch, vocab=vocab)
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg.tie_word_embeddings = tied
    hf = _hf_state(path)
    if tied:
        hf.pop("lm_head.weight")
    d = dims(cfg, tp)
    shards = [hf_to_mcore_shards(hf, d, r, tp) for r in range(tp)]
    assert ("output_layer.weight" in shards[0]) is not tied
    if tp > 1:  # column-parallel weights really are split, replicated ones are not
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        assert shards[0][qkv].shape[0] * tp == (d.heads + 2 * d.groups) * d.head_dim
        assert not torch.equal(shards[0][qkv], shards[1][qkv])
        assert torch.equal(shards[0]["decoder.final_layernorm.weight"], shards[1]["decoder.final_layernorm.weight"])
    back = {}
    for name in shards[0]:
        for hf_name, t in from_mcore(name, tp_unshard(name, [s[name] for s in shards]), d):
            back[hf_name] = t
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_moe_round_trip_is_exact(tmp_path):
    import transformers

    from rltrain.trainer.megatron.convert import dims, from_mcore, hf_to_mcore_shards
    from tests.models import make_moe_model

    path = make_moe_model(tmp_path / "moe", seed=2)
    hf = _hf_state(path)
    d = dims(transformers.AutoConfig.from_pretrained(path), 1)
    assert d.experts == 4 and d.topk == 2
    mc = hf_to_mcore_shards(hf, d, 0, 1)
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in mc
    back = {k: v for name, t in mc.items() for k, v in from_mcore(name, t, d)}
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def _make_mixtral(path):
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=255,
        bos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(5)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    return path


def _mixtral_rank(rank: int, world_size: int, path: str) -> dict:
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.world import World
    from rltrain.trainer.megatron.trainer import MegatronTrainer
    from tests.megatron_shim import megatron_on_cpu

    world = World(backend="gloo", timeout=120)
    try:
        with megatron_on_cpu():
            t = MegatronTrainer(
                TrainerConfig(backend="megatron", expert_parallel_size=2, lr=1e-3, micro_batch_size=2, dtype="float32"),
                AlgoConfig(),
                path,
                torch.device("cpu"),
                world,
            )
            t.create()
            mine = _batch(3, n=4).slice(slice(rank * 2, rank * 2 + 2))
            lp, _ = t.logprobs(mine)
            return {"lp": lp, "weights": dict(t.export_weights())}
    finally:
        world.close()


def test_mixtral_round_trips_and_matches_hf_with_experts_split(tmp_path):
    import transformers

    from rltrain.trainer.megatron.convert import dims, from_mcore, hf_to_mcore_shards

    path = _make_mixtral(tmp_path / "mix")
    hf = _hf_state(path)
    d = dims(transformers.AutoConfig.from_pretrained(path), 1)
    assert d.experts == 4 and d.norm_topk and not d.qk_norm
    back = {k: v for name, t in hf_to_mcore_shards(hf, d, 0, 1).items() for k, v in from_mcore(name, t, d)}
    assert set(back) == set(hf) and all(torch.equal(back[n], t) for n, t in hf.items())
    ranks = values(run_ranks(_mixtral_rank, 2, str(path), deadline_s=200))
    full = _batch(3, n=4)
    ref = _hf_logprobs(path, full)
    for rank, r in enumerate(ranks):
        assert_rows_match(r, "lp", rank, full, ref)
        assert set(r["weights"]) == set(hf) and all(torch.equal(r["weights"][n], t) for n, t in hf.items())


def test_conversion_refuses_what_it_cannot_map(tmp_path):
    import transformers

    from rltrain.trainer.megatron.convert import ConversionError, dims, hf_to_mcore_shards

    path = make_model(tmp_path / "m", seed=3)
    cfg = transformers.AutoConfig.from_pretrained(path)
    with pytest.raises(ConversionError, match="must divide"):
        dims(cfg, 4)  # 2 key/value heads
    hf = _hf_state(path)
    hf.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ConversionError, match="up_proj"):
        hf_to_mcore_shards(hf, dims(cfg, 1), 0, 1)
    moe = transformers.Qwen3MoeConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ConversionError, match="tensor_parallel_size=1"):
        dims(moe, 2)
    moe.mlp_only_layers = [0]
    with pytest.raises(ConversionError, match="dense layers"):
        dims(moe, 1)
    with pytest.raises(ConversionError, match="supports"):
        dims(transformers.GPT2Config(), 1)
    jitter = transformers.MixtralConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, router_jitter_noise=0.1
    )
    with pytest.raises(ConversionError, match="jitter"):
        dims(jitter, 1)


# ---------------------------------------------------------------------- real processes


def _batch(seed: int, n: int = 4, L: int = 12, vocab: int = 256):
    from rltrain.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab - 1, (n, L), generator=g)
    attn = torch.ones(n, L, dtype=torch.long)
    for b in range(n):  # right padding, uneven lengths
        attn[b, L - b :] = 0
        tokens[b, L - b :] = 0
    loss = attn.float()
    loss[:, :4] = 0
    adv = torch.randn(n, 1, generator=g).expand(n, L) * loss
    return TrainBatch(tokens, attn, loss, advantages=adv.contiguous())


@contextlib.contextmanager
def megatron_world(device: str) -> Iterator[Any]:
    """The rank's world and megatron's surroundings: gloo and the test-only CPU shim on CPU; NCCL,
    one GPU per rank and megatron unpatched on GPUs (tests/test_gpu_multi.py runs these ranks there)."""
    from rltrain.runtime.world import World

    if device == "cpu":
        from tests.megatron_shim import megatron_on_cpu

        world, around = World(backend="gloo", timeout=120), megatron_on_cpu()
    else:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity with the HF model on the CPU
        world, around = World(backend="nccl", timeout=120), contextlib.nullcontext()
    try:
        with around:
            yield world
    finally:
        world.close()


def _trainer(path: str, world, tp: int, lr: float = 1e-3, dist_opt: bool = False, pp: int = 1):
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.trainer.megatron.trainer import MegatronTrainer

    t = MegatronTrainer(
        TrainerConfig(
            backend="megatron",
            tensor_parallel_size=tp,
            lr=lr,
            micro_batch_size=2,
            dtype="float32",
            distributed_optimizer=dist_opt,
            pipeline_parallel_size=pp,
        ),
        AlgoConfig(),
        path,
        world.device,
        world,
    )
    t.create()
    return t


def _megatron_rank(
    rank: int,
    world_size: int,
    path: str,
    tp: int,
    engine_url: str | None,
    weights_dir: str,
    dist_opt: bool = False,
    pp: int = 1,
    device: str = "cpu",
) -> dict:
    with megatron_world(device) as world:
        t = _trainer(path, world, tp, dist_opt=dist_opt, pp=pp)
        dp_rank = rank // tp
        full = _batch(0, n=8)
        # Each rank brings its own samples; a TP group pools them.
        mine = full.slice(slice(rank * 2, rank * 2 + 2))
        lp_before, _ = t.logprobs(mine)
        mine.old_logp = lp_before
        stats = t.train_step(mine)
        lp_after, _ = t.logprobs(mine)
        world.destroy()
        world.rebuild()
        t.onload()  # modules, DDP and optimizer rebuilt over the new groups
        lp_cycled, _ = t.logprobs(mine)
        stats2 = t.train_step(mine)  # every group still works
        exported = {k: v.clone() for k, v in t.export_weights()}
        synced = None
        if engine_url:
            from rltrain.config import load_config
            from rltrain.engine.client import EngineClient
            from rltrain.sync.weight_sync import WeightSync

            cfg = load_config(
                None,
                [
                    f"model.path={path}",
                    "data.path=synthetic:addition",
                    "sync.transport=disk",
                    f"sync.weights_dir={weights_dir}",
                ],
            )
            client = EngineClient(engine_url, request_timeout_s=120)
            ws = WeightSync(cfg, world, t, [client], path)
            ws.push("7")  # raises on a checksum mismatch
            synced = client.weight_version()
            ws.close()
            client.close()
        return _cpu(
            {
                "lp_before": lp_before,
                "lp_after": lp_after,
                "lp_cycled": lp_cycled,
                "stats": stats,
                "stats2": stats2,
                "weights": exported,
                "dp_rank": dp_rank,
                "synced": synced,
                "held": sorted(n for n, _ in t.model.module.named_parameters()),
            }
        )


def _cpu(obj: Any) -> Any:
    """A rank's results with every tensor on the host (what crosses back to the test process)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def assert_rows_match(r: dict, key: str, rank: int, full, ref: torch.Tensor, atol: float = 2e-5) -> None:
    """A rank's log-probs (`r[key]`, of its two rows of `full`) equal the HF model's `ref` on the
    real tokens."""
    mine = slice(rank * 2, rank * 2 + 2)
    mask = full.attention_mask[mine].bool()
    assert torch.allclose(r[key][mask], ref[mine][mask], atol=atol), (key, rank)


def _hf_logprobs(path, batch) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory):
    """TP=2 (with a weight sync to a real engine) and DP=2, each on 4 gloo... 2 ranks."""
    from rltrain.config import EngineConfig
    from rltrain.engine.command import server_command
    from rltrain.engine.process import EngineProcess
    from rltrain.runtime.net import free_port

    root = tmp_path_factory.mktemp("megatron")
    path = make_model(root / "m", seed=11, arch="qwen3")
    port = free_port()
    proc = EngineProcess.start(
        server_command(EngineConfig(backend="embedded", device="cpu", dtype="float32"), str(path), port),
        f"http://127.0.0.1:{port}",
        root / "engine.log",
    )
    try:
        from rltrain.engine.client import EngineClient

        EngineClient(proc.url, request_timeout_s=120).wait_healthy(180, alive=lambda: proc.alive)
        tp2 = values(run_ranks(_megatron_rank, 2, str(path), 2, proc.url, str(root / "w"), deadline_s=400))
        dp2 = values(run_ranks(_megatron_rank, 2, str(path), 1, None, str(root / "w2"), deadline_s=400))
        dist_opt = values(run_ranks(_megatron_rank, 2, str(path), 1, None, str(root / "w3"), True, deadline_s=400))
        pp2 = values(run_ranks(_megatron_rank, 2, str(path), 1, proc.url, str(root / "w4"), False, 2, deadline_s=400))
    finally:
        proc.stop()
    return path, tp2, dp2, dist_opt, pp2


def _parity_rank(rank: int, world_size: int, path: str) -> dict:
    from rltrain.runtime.world import World
    from tests.megatron_shim import megatron_on_cpu

    world = World(backend="gloo", timeout=120)
    try:
        with megatron_on_cpu():
            t = _trainer(path, world, 2)
            mine = _batch(1, n=4, vocab=255).slice(slice(rank * 2, rank * 2 + 2))
            lp, _ = t.logprobs(mine)
            return {"lp": lp, "weights": dict(t.export_weights())}
    finally:
        world.close()


def test_tied_embeddings_and_a_padded_vocabulary_at_tp2(tmp_path):
    """Llama with tied embeddings and an odd vocabulary (255, padded to 256 for TP=2)."""
    import transformers

    path = make_model(tmp_path / "m", seed=4, arch="llama", vocab=255)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.save_pretrained(path)
    ranks = values(run_ranks(_parity_rank, 2, str(path), deadline_s=200))
    full = _batch(1, n=4, vocab=255)
    ref = _hf_logprobs(path, full)
    hf = _hf_state(path)
    assert "lm_head.weight" not in hf
    for rank, r in enumerate(ranks):
        assert_rows_match(r, "lp", rank, full, ref)
        assert set(r["weights"]) == set(hf)  # exported as the checkpoint holds them: the head once
        for n, t in hf.items():
            assert torch.equal(r["weights"][n], t), n


def _moe_rank(
    rank: int,
    world_size: int,
    path: str,
    ep: int,
    root: str,
    urls: list[str] | None = None,
    transport: str = "tensor",
    device: str = "cpu",
) -> dict:
    from pathlib import Path

    from rltrain.checkpoint import Checkpointer
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.trainer.megatron.trainer import MegatronTrainer

    with megatron_world(device) as world:
        t = MegatronTrainer(
            TrainerConfig(backend="megatron", expert_parallel_size=ep, lr=1e-3, micro_batch_size=2, dtype="float32"),
            AlgoConfig(),
            path,
            world.device,
            world,
        )
        t.create()
        held = sorted(n for n in dict(t.model.module.named_parameters()) if "local_experts" in n)
        routed_export = None
        if ep == 2:  # experts from the rank holding them to the ranks that need them only
            from rltrain.weights.names import classify

            def expert(name):
                return classify(name).expert

            # Rank r needs EP rank r's experts (the trainer's own: nothing moves), then the other's.
            aligned = {n for n, _ in t.export_weights(needs=lambda r, n: expert(n) is None or expert(n) // 2 == r)}
            sent_aligned = t.expert_bytes_sent
            crossed = {n for n, _ in t.export_weights(needs=lambda r, n: expert(n) is None or expert(n) // 2 != r)}
            routed_export = {"aligned": aligned, "crossed": crossed, "sent": (sent_aligned, t.expert_bytes_sent)}
        mine = _batch(2, n=4).slice(slice(rank * 2, rank * 2 + 2))
        lp, _ = t.logprobs(mine)
        mine.old_logp = lp
        stats = t.train_step(mine)
        ck = Checkpointer(Path(root) / f"ck{ep}", world)
        saved = ck.save(1, t, "1", {})
        world.destroy()
        world.rebuild()
        t.onload()
        lp_after, _ = t.logprobs(mine)
        synced = None
        if urls:  # two engines that are EP ranks 0 and 1: each gets the dense weights and its experts
            from rltrain.config import load_config
            from rltrain.engine.client import EngineClient
            from rltrain.sync.weight_sync import WeightSync

            cfg = load_config(
                None,
                [
                    f"model.path={path}",
                    "data.path=synthetic:addition",
                    f"sync.transport={transport}",
                    "sync.bucket_mb=1",
                    f"sync.weights_dir={root}/w",
                ],
            )
            clients = [EngineClient(u, request_timeout_s=120) for u in urls]
            ws = WeightSync(cfg, world, t, clients, path)
            ws.push("5")  # raises unless each engine's checksum over what it owns matches
            synced = {
                "routed": ws.plan.routed,
                "bytes_to": [ws.plan.bytes_to(r) for r in range(2)],
                "versions": [c.weight_version() for c in clients],
            }
            ws.close()
            for c in clients:
                c.close()
        t.train_step(mine)
        after_two = {k: v.clone() for k, v in t.export_weights()}
        t.release()
        t.create(load_weights=False)
        ck.load(saved, t, restore_rank_state=False)
        t.train_step(mine)
        resumed = dict(t.export_weights())
        return _cpu(
            {
                "lp": lp,
                "lp_after": lp_after,
                "stats": stats,
                "weights": after_two,
                "resumed": resumed,
                "held": held,
                "synced": synced,
                "routed_export": routed_export,
            }
        )


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    from tests.conftest import start_engine
    from tests.models import make_moe_model

    root = tmp_path_factory.mktemp("moe")
    path = make_moe_model(root / "moe", seed=2)
    engines = [
        start_engine("embedded", path, root / f"ep{r}", extra_args=["--ep-size", "2", "--ep-rank", str(r)])
        for r in range(2)
    ]
    try:
        runs = {
            1: values(run_ranks(_moe_rank, 2, str(path), 1, str(root), deadline_s=300)),
            2: values(
                run_ranks(_moe_rank, 2, str(path), 2, str(root), [e.process.url for e in engines], deadline_s=300)
            ),
        }
    finally:
        for e in engines:
            e.client.close()
            e.process.stop()
    return path, runs


def test_a_qwen3_moe_model_matches_hf_and_trains(moe_runs):
    """Qwen3-MoE (4 experts, top-2) on megatron's MoE layer at DP=2, experts replicated (EP=1) or
    split over the two ranks (EP=2): log-probs match the HF model, a GRPO step moves every weight
    (router and experts too), both layouts take the same step, and it survives a world rebuild."""
    path, runs = moe_runs
    full = _batch(2, n=4)
    ref = _hf_logprobs(path, full)
    hf = _hf_state(path)
    assert len(runs[1][0]["held"]) == 2 * 2 * 4 and len(runs[2][0]["held"]) == 2 * 2 * 2  # layers x fc1/fc2 x experts
    for ep, ranks in runs.items():
        for rank, r in enumerate(ranks):
            assert_rows_match(r, "lp", rank, full, ref)
            assert r["stats"]["grad_norm"] > 0 and not torch.equal(r["lp_after"], r["lp"])
            assert set(r["weights"]) == set(hf)
        moved = [n for n, t in hf.items() if not torch.equal(ranks[0]["weights"][n], t)]
        assert "model.layers.0.mlp.gate.weight" in moved and "model.layers.1.mlp.experts.3.down_proj.weight" in moved
        for n in hf:
            assert torch.equal(ranks[0]["weights"][n], ranks[1]["weights"][n]), (ep, n)
    assert runs[2][0]["stats"]["grad_norm"] == pytest.approx(runs[1][0]["stats"]["grad_norm"], rel=1e-5)
    for n in hf:  # two Adam steps at lr 1e-3, as in the dense TP/DP comparison
        assert (runs[2][0]["weights"][n] - runs[1][0]["weights"][n]).abs().max() < 1e-4, n


def test_an_export_routed_by_need_sends_each_expert_from_its_holder_only_where_needed(moe_runs):
    """EP=2: when each rank needs its own experts (the engine's EP ranks are the trainer's), no
    expert moves between ranks; when each needs the other's, each expert goes to the other rank
    only. Either way a rank yields the dense weights and exactly the experts it needs."""
    path, runs = moe_runs
    hf = _hf_state(path)
    expert_bytes = sum(t.numel() * t.element_size() for n, t in hf.items() if ".experts." in n)
    for rank, r in enumerate(runs[2]):
        got = r["routed_export"]
        dense = {n for n in hf if ".experts." not in n}
        own = {n for n in hf if ".experts." in n and int(n.split(".experts.")[1].split(".")[0]) // 2 == rank}
        other = {n for n in hf if ".experts." in n} - own
        assert got["aligned"] == dense | own and got["crossed"] == dense | other
        # Nothing moved for the aligned export; then this rank's half of the experts to the other.
        assert got["sent"] == (0, expert_bytes // 2), got["sent"]


def test_a_moe_checkpoint_resumes_exactly_with_experts_split(moe_runs):
    _, runs = moe_runs
    for ep, ranks in runs.items():
        for r in ranks:
            for n, w in r["weights"].items():
                assert torch.equal(r["resumed"][n], w), (ep, n)


def test_tensor_and_data_parallel_logprobs_match_the_hf_model(megatron_runs):
    path, tp2, dp2, _, pp2 = megatron_runs
    full = _batch(0, n=8)
    ref = _hf_logprobs(path, full)
    for runs in (tp2, dp2, pp2):
        for rank, r in enumerate(runs):
            assert_rows_match(r, "lp_before", rank, full, ref)


def test_a_grpo_step_changes_the_weights_identically_under_tp_and_dp(megatron_runs):
    path, tp2, dp2, _, pp2 = megatron_runs
    hf = _hf_state(path)
    for runs in (tp2, dp2, pp2):
        for r in runs:
            assert r["stats"]["grad_norm"] > 0 and torch.isfinite(torch.tensor(r["stats"]["loss"]))
            assert not torch.equal(r["lp_after"], r["lp_before"])
            changed = [n for n, t in hf.items() if not torch.equal(r["weights"][n], t)]
            assert len(changed) == len(hf)  # Adam moves every weight
        # every rank exports the same full weights
        for n in hf:
            assert torch.equal(runs[0]["weights"][n], runs[1]["weights"][n]), n
    # TP=2 on the pooled batch and DP=2 with summed gradients take the same step.
    # ... and PP=2 (two stages of one pipeline, the pooled batch through the 1F1B schedule).
    assert tp2[0]["stats"]["grad_norm"] == pytest.approx(dp2[0]["stats"]["grad_norm"], rel=1e-4)
    assert pp2[0]["stats"]["grad_norm"] == pytest.approx(dp2[0]["stats"]["grad_norm"], rel=1e-4)
    for key in ("loss", "entropy", "clip_frac"):  # statistics come back from the last stage to the first
        assert pp2[0]["stats"][key] == pytest.approx(dp2[0]["stats"][key], rel=1e-4, abs=1e-7), key
    # Two Adam steps at lr 1e-3: a wrong or missing gradient moves a weight by ~1e-3; float
    # summation order alone moved a few by ~1e-5 (Adam normalises near-zero gradients).
    for n in hf:
        for other in (tp2, pp2):
            diff = (other[0]["weights"][n] - dp2[0]["weights"][n]).abs()
            assert diff.max() < 1e-4, (n, diff.max())


def test_pipeline_stages_hold_only_their_layers(megatron_runs):
    _, _, dp2, _, pp2 = megatron_runs
    first, last = pp2[0]["held"], pp2[1]["held"]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last
    assert len(first) + len(last) == len(dp2[0]["held"])  # one layer each, together the whole model


def test_groups_keep_working_across_a_world_rebuild(megatron_runs):
    _, tp2, dp2, _, pp2 = megatron_runs
    for r in tp2 + dp2 + pp2:
        assert torch.equal(r["lp_cycled"], r["lp_after"])  # same weights, new groups and modules
        assert torch.isfinite(torch.tensor(r["stats2"]["grad_norm"]))


def test_the_distributed_optimizer_takes_the_same_steps_and_survives_a_world_rebuild(megatron_runs):
    _, _, dp2, dist_opt, _ = megatron_runs
    for plain, sharded in zip(dp2, dist_opt):
        assert sharded["stats"]["grad_norm"] == pytest.approx(plain["stats"]["grad_norm"], rel=1e-5)
        # Second step after the rebuild: the optimizer shards (Adam moments, fp32 main params) came along.
        assert sharded["stats2"]["grad_norm"] == pytest.approx(plain["stats2"]["grad_norm"], rel=1e-4)
        for n, w in plain["weights"].items():
            assert (sharded["weights"][n] - w).abs().max() < 1e-4, n


def _resume_rank(
    rank: int, world_size: int, path: str, root: str, tp: int, dist_opt: bool, pp: int = 1, device: str = "cpu"
) -> dict:
    from pathlib import Path

    from rltrain.checkpoint import Checkpointer

    with megatron_world(device) as world:
        ck = Checkpointer(Path(root) / "ck", world, keep_last=2)
        mine = [_batch(s, n=8).slice(slice(rank * 2, rank * 2 + 2)) for s in range(3)]

        def step(t, b):
            b.old_logp, _ = t.logprobs(b)
            return t.train_step(b)

        t = _trainer(path, world, tp, dist_opt=dist_opt, pp=pp)
        step(t, mine[0])
        saved = ck.save(1, t, "1", {})
        step(t, mine[1])
        step(t, mine[2])
        straight = {k: v.clone() for k, v in t.export_weights()}
        # Release-train from the checkpoint: a new trainer, architecture only, state from disk.
        t.release()
        t.create(load_weights=False)
        ck.load(saved, t, restore_rank_state=False)
        step(t, mine[1])
        snap = t.snapshot()
        # ... and from a host snapshot.
        t.release()
        t.restore_snapshot(snap)
        step(t, mine[2])
        resumed = {k: v.clone() for k, v in t.export_weights()}
        return _cpu({"straight": straight, "resumed": resumed, "steps": t.steps})


@pytest.mark.parametrize(
    "tp,dist_opt,pp", [(2, False, 1), (1, True, 1), (1, False, 2)], ids=["tp2", "dp2-distributed-optimizer", "pp2"]
)
def test_release_and_resume_from_checkpoint_and_snapshot_are_exact(tmp_path, tp, dist_opt, pp):
    path = make_model(tmp_path / "m", seed=11, arch="qwen3")
    for r in values(run_ranks(_resume_rank, 2, str(path), str(tmp_path), tp, dist_opt, pp, deadline_s=300)):
        assert r["steps"] == 3
        for n, w in r["straight"].items():
            assert torch.equal(r["resumed"][n], w), n


def test_a_weight_sync_from_the_megatron_trainer_passes_the_engine_checksum(megatron_runs):
    _, tp2, _, _, pp2 = megatron_runs
    assert [r["synced"] for r in tp2] == ["7", "7"]
    assert [r["synced"] for r in pp2] == ["7", "7"]  # weights gathered from both pipeline stages


def _megatron_loop(tmp_path, *overrides: str) -> tuple:
    """The quickstart on two ranks under torchrun through the megatron shim, tensor sync, with
    `overrides`; (the finished process, its metrics rows). Fails with the job's stderr."""
    import json
    from pathlib import Path

    from tests.multiproc import run_torchrun

    repo = Path(__file__).resolve().parents[1]
    r = run_torchrun(
        tmp_path,
        [str(repo / "tests" / "megatron_loop_script.py")],
        [
            "--config",
            str(repo / "configs" / "quickstart.yaml"),
            f"run.dir={tmp_path}",
            f"model.path={tmp_path / 'base_model'}",
            "data.prompts_per_step=8",
            "metrics.progress_bar=false",
            "metrics.plot=false",
            "sync.transport=tensor",
            *overrides,
        ],
        env={"PYTHONPATH": str(repo)},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r, [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 1), (1, 2)], ids=["tp2", "dp2", "pp2"])
def test_the_loop_trains_with_the_megatron_backend(tmp_path, tp, pp):
    """Two ranks under torchrun: rollout on the embedded engine, megatron trains, tensor sync
    with the checksum verified every step, world destroy/rebuild between phases."""
    _, rows = _megatron_loop(
        tmp_path,
        "loop.steps=4",
        "trainer.backend=megatron",
        f"trainer.tensor_parallel_size={tp}",
        f"trainer.pipeline_parallel_size={pp}",
    )
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["generation_failed"] == 0
        # The engine sampled with the weights megatron holds: its log-probs match the trainer's.
        assert r["logp_diff_engine_trainer"] < 1e-3, [(x["step"], x["logp_diff_engine_trainer"]) for x in rows]
    # Steps where every sample of a prompt scored the same have zero advantages: not all of them.
    assert any(r["grad_norm"] > 0 for r in rows), [x["grad_norm"] for x in rows]
    # The memory ledger sizes megatron's weights and its optimizer's fp32 main params and moments.
    ledger = rows[-1]["memory"]["rank0"]["train"]
    assert ledger["trainer_host"] > 0 and ledger["rss"] > ledger["trainer_host"], ledger


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_a_moe_loop_routes_experts_inside_the_engine_on_every_sync(tmp_path, backend):
    """The loop with a tiny Qwen3-MoE, one embedded engine over both ranks laid out as SGLang
    lays out `--tp-size 2 --ep-size 2`, tensor sync: every sync sends each TP rank the dense
    weights and its own experts only (megatron EP=2: from the rank holding them, which is that
    same rank), each TP rank's checksum and the probe are verified every step, and the engine
    samples with the trainer's weights."""
    r, rows = _megatron_loop(
        tmp_path,
        "model.build=tiny-addition-moe",
        "loop.steps=3",
        f"trainer.backend={backend}",
        *(["trainer.expert_parallel_size=2"] if backend == "megatron" else []),
        "engine.gpus_per_engine=2",
        "engine.extra_args=[--ep-size,2]",
    )
    assert [x["step"] for x in rows] == [1, 2, 3]
    for x in rows:
        assert x["generation_failed"] == 0 and x["sync_routed"] == 1.0, x
        assert x["logp_diff_engine_trainer"] < 1e-3 and x["sync_probe_diff"] < 1e-3, x
    assert "expert routing off" not in r.stderr + r.stdout


def test_expert_parallel_training_syncs_each_engine_ep_rank_only_its_experts(moe_runs):
    """From the EP=2 megatron trainer to two engines that are EP ranks 0 and 1 (the plan routes
    each expert to its owner; push verified each engine's checksum over what it owns)."""
    _, runs = moe_runs
    hf_total = sum(t.numel() * t.element_size() for t in _hf_state(moe_runs[0]).values())
    for r in runs[2]:
        s = r["synced"]
        assert s["routed"] and s["versions"] == ["5", "5"]
        assert s["bytes_to"][0] == s["bytes_to"][1] < hf_total  # half the experts each
