"""The torch-native trainer: data-parallel equivalence on real processes, HF loading paths, schedule."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

from models import make_model
from multiproc import run_ranks, values
from rltrain.batch import TrainBatch
from rltrain.config import AlgoConfig, TrainerConfig
from rltrain.trainer import rl_update
from rltrain.trainer.fsdp import FSDPTrainer


def fixed_batch(B: int = 8, L: int = 10, vocab: int = 256) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab, (B, L), generator=g)
    attn = torch.ones(B, L, dtype=torch.long)
    attn[::3, -2:] = 0  # some right padding
    loss_mask = torch.zeros(B, L)
    loss_mask[:, 4:] = 1.0
    loss_mask *= attn
    adv = torch.randn(B, 1, generator=g).expand(B, L) * loss_mask
    return TrainBatch(tokens, attn, loss_mask, advantages=adv)


def make_trainer(path, micro: int, steps: int = 10) -> FSDPTrainer:
    cfg = TrainerConfig(lr=1e-2, micro_batch_size=micro, grad_clip=1e9)
    t = FSDPTrainer(cfg, AlgoConfig(entropy_coef=0.01), str(path), torch.device("cpu"), total_steps=steps)
    t.create()
    return t


def one_step(t: FSDPTrainer, batch: TrainBatch) -> dict:
    batch.old_logp, _ = t.logprobs(batch)
    return t.train_step(batch)


def _no_to_local(*_: object, **__: object) -> torch.Tensor:
    raise AssertionError("a DTensor read through to_local()'s autograd function")


def _dp_rank(
    rank: int, world_size: int, path: str, steps: int, cycle: bool, rebinds: bool = True, park: bool = False
) -> dict:
    from torch.distributed.tensor import DTensor

    from rltrain.runtime.internals import local_shard as local
    from rltrain.runtime.world import World

    world = World(backend="gloo", timeout=60)
    try:
        t = make_trainer(path, micro=1 + rank)  # unequal micro-batch counts per rank: idle passes
        t.rebinds = rebinds  # False: fresh modules re-sharded after every rebuild (megatron's way; the fallback)
        full = fixed_batch()
        mine = full.slice(slice(rank * 4, rank * 4 + 4))  # uneven token counts per rank (padding)
        embed = t.model.get_input_embeddings().weight
        assert isinstance(embed, DTensor) and embed.to_local().shape[0] == embed.shape[0] // 2  # FSDP2 shards
        norms, groups = [], {id(t._group)}
        for _ in range(steps):
            if cycle and park:  # the optimizer state's shards to host memory and back, the weights' kept
                t.parks_on_cpu = True
                held = t.held_tensors()
                storages = {local(w).untyped_storage().data_ptr(): local(w).untyped_storage() for w in held["weights"]}
                keep = sum(s.nbytes() for s in storages.values())
                # The offload's walk over the state reads each DTensor's local shard as it is,
                # never through to_local()'s autograd function (~15 us a tensor: a thousand of them
                # made a tenth of an H100's offload).
                with mock.patch.object(DTensor, "to_local", _no_to_local):
                    t.stage_offload(keep)
                    t.offload(keep)
                assert t._park.kept == keep and t.offloaded == bool(norms)  # (no Adam state before a step)
            if cycle:
                world.destroy()
                world.rebuild()
                model = t.model
                t.onload()  # re-binds (or re-shards) onto the rebuilt group
                assert (t.model is model) == rebinds and not t._rebind_refused
                groups.add(id(t._group))
            norms.append(one_step(t, mine)["grad_norm"])
        return {"weights": {k: v.clone() for k, v in t.export_weights()}, "grad_norm": norms, "groups": len(groups)}
    finally:
        world.close()


@pytest.mark.parametrize(
    "steps,cycle,rebinds,park",
    [(1, False, True, False), (3, True, True, False), (3, True, False, False), (3, True, True, True)],
    ids=["one-step", "world-cycles-between-steps", "world-cycles-fresh-modules", "world-cycles-state-parked-in-part"],
)
def test_two_sharded_ranks_with_half_batches_equal_one_rank_with_the_full_batch(tmp_path, steps, cycle, rebinds, park):
    path = make_model(tmp_path / "m", seed=5)
    ranks = values(run_ranks(_dp_rank, 2, str(path), steps, cycle, rebinds, park, deadline_s=180))
    single = make_trainer(path, micro=3)  # different micro-batching too: accumulation must not matter
    norms = [one_step(single, fixed_batch())["grad_norm"] for _ in range(steps)]
    ref = single.model.state_dict()
    for r in ranks:
        assert r["groups"] == (steps + 1 if cycle else 1)  # a fresh group after every rebuild
        assert r["grad_norm"] == pytest.approx(norms, rel=1e-4)
        assert set(r["weights"]) == set(ref)
        for k, v in ref.items():
            # Adam's first step is ~lr * sign(g): where g is ~0, rounding may move it; 1% of lr is allowed.
            torch.testing.assert_close(r["weights"][k], v, rtol=1e-4, atol=1e-4)
    moved = sum(float((ref[k] - AutoModelForCausalLM.from_pretrained(path).state_dict()[k]).abs().sum()) for k in ref)
    assert moved > 0  # the step changed the weights


def test_a_refused_rebind_re_shards_fresh_modules_and_says_so_once(tmp_path, monkeypatch, caplog):
    """Where `sharding.rebind` cannot re-bind (another torch's FSDP2 internals), onload falls back
    to fresh modules filled from the local shards, logs why once, and trains on the same."""
    import rltrain.trainer.fsdp as fsdp
    from rltrain.runtime.world import World
    from rltrain.trainer.sharding import rebind

    path = make_model(tmp_path / "m", seed=5)
    assert rebind(AutoModelForCausalLM.from_pretrained(path), None) == "no FSDP2 parameter groups"
    monkeypatch.setattr(fsdp, "rebind", lambda model, group: "refused by this test")
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    world = World(backend="gloo", timeout=60)
    try:
        t = make_trainer(path, micro=4)
        norms = []
        with caplog.at_level("WARNING", logger="rltrain.trainer"):
            for _ in range(3):
                model = t.model
                world.destroy()
                world.rebuild()
                t.onload()
                assert t.model is not model and t._group is fsdp.current_group()
                norms.append(one_step(t, fixed_batch())["grad_norm"])
        weights = dict(t.export_weights())
    finally:
        world.close()
    assert [r.getMessage() for r in caplog.records].count(
        "trainer: re-sharding fresh modules after each world rebuild (slower): refused by this test"
    ) == 1
    plain = make_trainer(path, micro=4)
    assert norms == pytest.approx([one_step(plain, fixed_batch())["grad_norm"] for _ in range(3)], rel=1e-5)
    for k, v in plain.model.state_dict().items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_loads_hf_checkpoints_and_matches_their_logprobs(tmp_path, arch):
    path = make_model(tmp_path / arch, seed=7, arch=arch)
    t = make_trainer(path, micro=3)
    batch = fixed_batch()
    logp, ent = t.logprobs(batch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    valid = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(logp[:, 1:][valid], ref[valid], rtol=1e-4, atol=1e-5)
    assert (ent[:, 1:][valid] > 0).all()
    names = [n for n, _ in t.export_weights()]
    assert set(names) == set(hf.state_dict())
    t.save_pretrained(str(tmp_path / "out"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for k, v in again.state_dict().items():
        torch.testing.assert_close(v, hf.state_dict()[k])


def test_offload_is_a_noop_on_cpu_and_training_continues(tmp_path):
    path = make_model(tmp_path / "m", seed=5)
    t = make_trainer(path, micro=4)
    one_step(t, fixed_batch())
    t.offload()
    t.onload()
    assert one_step(t, fixed_batch())["grad_norm"] > 0


def test_lr_schedule_warmup_then_cosine(tmp_path):
    path = make_model(tmp_path / "m", seed=5)
    cfg = TrainerConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    from rltrain.trainer.rl_update import lr_factor

    assert [round(lr_factor(cfg, 6, s), 4) for s in range(7)] == [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1]
    t = FSDPTrainer(cfg, AlgoConfig(), str(path), torch.device("cpu"), total_steps=6)  # the trainer's schedule is it
    t.create()
    lrs = []
    for _ in range(7):
        lrs.append(round(t.scheduler.get_last_lr()[0], 4))
        t.scheduler.step()
    assert lrs == [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1]


def _empty_rank(rank: int, world_size: int, path: str) -> dict:
    from rltrain.rollout.collect import build_batch
    from rltrain.runtime.world import World

    world = World(backend="gloo", timeout=60)
    try:
        t = make_trainer(path, micro=2)
        if rank == 0:
            batch = fixed_batch()
            batch.old_logp, _ = t.logprobs(batch)
        else:
            batch, rewards = build_batch([], pad_id=0)  # every group of this rank was dropped
            assert len(batch) == 0 and rewards.shape == (0, 0)
            batch.old_logp, _ = t.logprobs(batch)  # joins rank 0's forward passes
            assert batch.old_logp.shape == (0, 1)
        stats = t.train_step(batch)
        return {"weights": {k: v.clone() for k, v in t.export_weights()}, "grad_norm": stats["grad_norm"]}
    finally:
        world.close()


def test_a_rank_without_samples_still_steps_in_sync(tmp_path):
    path = make_model(tmp_path / "m", seed=5)
    r0, r1 = values(run_ranks(_empty_rank, 2, str(path), deadline_s=180))
    assert r0["grad_norm"] == r1["grad_norm"] > 0
    for k in r0["weights"]:
        assert torch.equal(r0["weights"][k], r1["weights"][k])


def _gathered_rank(rank: int, world_size: int, path: str) -> dict:
    from torch.distributed.tensor import DTensor

    from rltrain.runtime.world import World
    from rltrain.weights.checksum import combine, entry

    world = World(backend="gloo", timeout=60)
    try:
        t = make_trainer(path, micro=2)
        batch = fixed_batch().slice(slice(rank * 4, rank * 4 + 4))
        one_step(t, batch)
        names = [n for n, _ in t.export_weights()][1::2]  # a subset, as a sync bucket asks
        apart = {k: v.clone() for k, v in t.export_weights()}
        apart_some = {k: v.clone() for k, v in t.export_weights(names)}
        apart_logp = t.logprobs(batch)[0]
        gathers = []  # every all-gather FSDP2 and `full_tensors` may call, counted
        real = {n: getattr(torch.distributed, n) for n in ("all_gather_single", "all_gather_into_tensor", "all_gather")}
        for n, f in real.items():
            setattr(torch.distributed, n, lambda *a, f=f, **k: gathers.append(1) or f(*a, **k))
        try:
            with t.gathered():
                inside = type(t.model.get_input_embeddings().weight)
                before = len(gathers)
                together = {k: v.clone() for k, v in t.export_weights()}
                sums = {k: entry(v) for k, v in t.export_weights()}  # the sync checksums what it sends
                together_some = {k: v.clone() for k, v in t.export_weights(names)}
                together_logp = t.logprobs(batch)[0]
                for _ in range(rank):  # no collective inside: rank 1 scores once more, alone
                    t.logprobs(batch)
                gathered_inside = len(gathers) - before
        finally:
            for n, f in real.items():
                setattr(torch.distributed, n, f)
        after = type(t.model.get_input_embeddings().weight)
        grad_norm = one_step(t, batch)["grad_norm"]  # the sharded module trains on after it
        return {
            "same": all(torch.equal(apart[k], together[k]) for k in apart) and list(apart) == list(together),
            "same_some": list(apart_some) == list(together_some) == names
            and all(torch.equal(apart_some[k], together_some[k]) for k in names),
            "same_logp": torch.equal(apart_logp, together_logp),
            "same_sums": combine(sums) == combine({k: entry(v) for k, v in apart.items()}),
            "inside": inside is not DTensor,
            "after": after is DTensor,
            "gathers_inside": gathered_inside,
            "gathers_entering": before,
            "grad_norm": grad_norm,
        }
    finally:
        world.close()


def test_weights_gathered_once_export_and_score_as_apart_with_no_collective_inside(tmp_path):
    """A sync exports every weight and scores its probe inside `gathered()`: one all-gather on
    entry, none after, the same tensors and log-probs as each gathering its own, and the module
    sharded again on leaving (it trains on)."""
    path = make_model(tmp_path / "m", seed=5)
    r0, r1 = values(run_ranks(_gathered_rank, 2, str(path), deadline_s=180))
    for r in (r0, r1):
        assert r["same"] and r["same_some"] and r["same_logp"] and r["same_sums"]
        assert r["inside"] and r["after"]
        assert r["gathers_entering"] >= 1 and r["gathers_inside"] == 0
    assert r0["grad_norm"] == r1["grad_norm"] > 0


def _gather_rank(rank: int, world_size: int, device: str = "cpu") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rltrain.runtime.world import World
    from rltrain.trainer.sharding import full_tensors

    world = World(backend="gloo" if device == "cpu" else "nccl", timeout=60)
    try:
        mesh = init_device_mesh(device, (world_size,))
        g = torch.Generator().manual_seed(0)  # the same whole tensors on every rank
        # Rows that split evenly, unevenly, and fewer rows than ranks (empty shards); mixed dtypes.
        shapes = [
            ((6, 4), torch.float32),
            ((5, 3), torch.bfloat16),
            ((1, 7), torch.float32),
            ((7,), torch.float32),
            ((2, 3, 2), torch.int64),
        ]
        whole = [(torch.randn(s, generator=g) * 100).to(d).to(world.device) for s, d in shapes]
        tensors = [distribute_tensor(w, mesh, [Shard(0)]) for w in whole] + [whole[0]]  # and a plain one
        got = full_tensors(tensors)
        return {
            "equal": [torch.equal(a, b) for a, b in zip(got, whole + [whole[0]])],
            "dtypes": [a.dtype == b.dtype for a, b in zip(got, whole)],
            "shards": [t.to_local().shape[0] for t in tensors[:5]],
        }
    finally:
        world.close()


def test_full_tensors_gathers_uneven_and_empty_row_shards_in_one_collective():
    """sharding.full_tensors (export_weights on GPUs: a chunk of parameters with one all-gather)
    rebuilds every whole tensor from the ranks' row shards."""
    rows_per_rank = [[2, 2, 2], [2, 2, 1], [1, 0, 0], [3, 3, 1], [1, 1, 0]]  # ceil(rows / 3), the last short or empty
    for rank, r in enumerate(values(run_ranks(_gather_rank, 3, deadline_s=120))):
        assert r["shards"] == [x[rank] for x in rows_per_rank]
        assert all(r["equal"]) and all(r["dtypes"]), r


def _varied_batch(B: int = 10, L: int = 24, vocab: int = 256) -> TrainBatch:
    """Right-padded sequences of 6..24 tokens: prompts of 3-5, responses of the rest."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, vocab, (B, L), generator=g)
    attn = torch.zeros(B, L, dtype=torch.long)
    loss_mask = torch.zeros(B, L)
    for b in range(B):
        n = int(torch.randint(6, L + 1, (1,), generator=g))
        p = int(torch.randint(3, 6, (1,), generator=g))
        attn[b, :n] = 1
        loss_mask[b, p:n] = 1.0
        tokens[b, n:] = 0
    adv = torch.randn(B, 1, generator=g).expand(B, L) * loss_mask
    return TrainBatch(tokens, attn, loss_mask, advantages=adv)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_padding_free_packed_micro_batches_equal_the_padded_path(tmp_path, arch):
    """trainer.max_tokens_per_micro_batch: sequences packed into one row per micro-batch with
    per-sequence position ids give the padded path's log-probs, entropies, loss and step (float
    tolerance), with other micro-batch boundaries; no token sees another sequence."""

    path = make_model(tmp_path / "m", seed=3, arch=arch)
    batch = _varied_batch()
    padded = make_trainer(path, micro=3)
    packed_cfg = TrainerConfig(lr=1e-2, micro_batch_size=3, grad_clip=1e9, max_tokens_per_micro_batch=40)
    packed = FSDPTrainer(packed_cfg, AlgoConfig(entropy_coef=0.01), str(path), torch.device("cpu"), total_steps=10)
    packed.create()
    bounds = rl_update.micro_batch_bounds(batch, packed_cfg)
    lengths = batch.attention_mask.sum(1).tolist()
    assert len(bounds) > 1 and all(sum(lengths[a:b]) <= 40 or b - a == 1 for a, b in bounds)
    assert bounds != rl_update.micro_batch_bounds(batch, padded.cfg)
    mask = batch.loss_mask.bool()
    lp_a, ent_a = padded.logprobs(batch)
    lp_b, ent_b = packed.logprobs(batch)
    assert torch.allclose(lp_a[mask], lp_b[mask], atol=1e-5) and torch.allclose(ent_a[mask], ent_b[mask], atol=1e-5)
    # A sequence alone scores the same as packed among others (nothing crosses a boundary).
    alone, _ = packed.logprobs(batch.slice(slice(4, 5)))
    assert torch.allclose(alone[0][mask[4]], lp_b[4][mask[4]], atol=1e-5)
    sa, sb = one_step(padded, batch), one_step(packed, batch)
    for k in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-6), k
    wa, wb = dict(padded.export_weights()), dict(packed.export_weights())
    # One Adam step at lr 1e-2: a wrong or missing gradient moves a weight by ~1e-2; summation
    # order alone moved a few by ~2e-5 (Adam normalises near-zero gradients).
    bad = {n: float((wa[n] - wb[n]).abs().max()) for n in wa if not torch.allclose(wa[n], wb[n], atol=1e-4)}
    assert not bad, bad


def test_the_megatron_backend_refuses_padding_free_micro_batches_saying_why():
    from rltrain.config import ConfigError

    with pytest.raises(ConfigError, match="Transformer Engine"):
        TrainerConfig(backend="megatron", max_tokens_per_micro_batch=4096).check()


def test_compiled_blocks_give_the_eager_log_probs_and_step_with_one_graph_for_every_length(tmp_path):
    """trainer.compile: every transformer block's forward compiled (dynamic shapes) scores and
    steps as eager does; packed micro-batches of every length and every block reuse the compiled
    graphs (no recompilation per block or per length)."""
    import torch._dynamo

    from rltrain.trainer.causal_lm import compile_blocks

    path = make_model(tmp_path / "m", seed=3, arch="qwen3")
    batch = _varied_batch()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    results = []
    for compiled in (False, True):
        cfg = TrainerConfig(lr=1e-2, grad_clip=1e9, max_tokens_per_micro_batch=40, compile=compiled)
        t = FSDPTrainer(cfg, AlgoConfig(entropy_coef=0.01), str(path), torch.device("cpu"), total_steps=10)
        t.create()
        lp, ent = t.logprobs(batch)
        stats = one_step(t, batch)
        results.append((lp, ent, stats, dict(t.export_weights())))
    (lp_a, ent_a, sa, wa), (lp_b, ent_b, sb, wb) = results
    mask = batch.loss_mask.bool()
    assert torch.allclose(lp_a[mask], lp_b[mask], atol=1e-5) and torch.allclose(ent_a[mask], ent_b[mask], atol=1e-5)
    for k in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-6), k
    bad = {n: float((wa[n] - wb[n]).abs().max()) for n in wa if not torch.allclose(wa[n], wb[n], atol=1e-4)}
    assert not bad, bad
    # Micro-batches of several packed lengths went through both blocks, with and without
    # gradients: a graph per grad mode and per mask kind (None for a lone sequence, a mask for
    # several), 4 at most; a block or a length that recompiled would add more.
    lengths = rl_lengths(batch, 40)
    assert len(set(lengths)) > 2, lengths
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 4, dict(torch._dynamo.utils.counters["stats"])
    with pytest.raises(ValueError, match="no transformer blocks"):
        compile_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def rl_lengths(batch: TrainBatch, budget: int) -> list[int]:
    """The packed lengths of `batch`'s micro-batches under a token budget."""

    lengths = batch.attention_mask.sum(1).tolist()
    cfg = TrainerConfig(max_tokens_per_micro_batch=budget)
    return [sum(lengths[a:b]) for a, b in rl_update.micro_batch_bounds(batch, cfg)]


def test_an_attention_kept_outside_the_compiled_blocks_scores_as_it_does_inside(tmp_path):
    """`outside_graphs`: the attention registered under its own name, run between the compiled
    halves of each block (how flex attention runs with trainer.compile on a GPU), gives the
    logits of the plain model."""
    from transformers import AutoModelForCausalLM

    from rltrain.trainer.causal_lm import compile_blocks, outside_graphs

    path = make_model(tmp_path / "m", seed=4, arch="qwen3")
    tokens = torch.randint(1, 255, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    split = AutoModelForCausalLM.from_pretrained(path, attn_implementation=outside_graphs("sdpa"))
    assert split.config._attn_implementation == "rltrain_uncompiled_sdpa"
    compile_blocks(split)
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=tokens).logits, split(input_ids=tokens).logits, atol=1e-5)


@pytest.mark.parametrize("loss", ["ppo", "cispo", "gspo"])
def test_old_log_probs_from_the_training_forward_give_the_separate_pass_loss_and_step_exactly(tmp_path, loss):
    """With one optimizer step per batch the old log-probs are the training forward's, detached
    (no separate pass): loss, statistics, gradient norm and the updated weights are the ones the
    separate old-log-prob pass gives, bit for bit; the engine distance is measured there too."""
    path = make_model(tmp_path / "m", seed=6)
    algo = AlgoConfig(
        entropy_coef=0.01,
        policy_loss="cispo" if loss == "cispo" else "ppo",
        importance_level="sequence" if loss == "gspo" else "token",
    )
    assert algo.old_logp_from_training
    batch = fixed_batch()
    out = []
    for fused in (False, True):
        t = FSDPTrainer(TrainerConfig(lr=1e-2, micro_batch_size=3, grad_clip=1e9), algo, str(path), torch.device("cpu"))
        t.create()
        b = batch.slice(slice(0, len(batch)))
        b.rollout_logp = t.logprobs(b)[0] + 0.01 * b.loss_mask  # an engine 0.01 nats off on every loss token
        if not fused:
            b.old_logp, _ = t.logprobs(b)
        stats = t.train_step(b)
        out.append((stats, dict(t.export_weights())))
    (sa, wa), (sb, wb) = out
    for k in ("loss", "pg_loss", "entropy", "grad_norm", "clip_frac", "approx_kl_old"):
        assert sa[k] == sb[k], (k, sa[k], sb[k])
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    assert "logp_diff_engine_trainer" not in sa and sb["logp_diff_engine_trainer"] == pytest.approx(0.01, abs=1e-5)
    assert not AlgoConfig(ppo_epochs=2).old_logp_from_training and not AlgoConfig(kl_coef=0.1).old_logp_from_training


def test_the_optimizer_state_is_made_before_the_first_forward_and_trains_bitwise_as_made_at_the_first_step(
    tmp_path, monkeypatch
):
    """AdamW makes its moments at its first step, among the blocks the backward freed (on a GPU
    they would share, and strand, those segments): the trainer makes them before the first
    step's forward instead, by a step at learning rate 0 on zero gradients with its count set
    back. Training is bitwise the same as with the moments made lazily, and the first forward
    already finds them."""
    path = make_model(tmp_path / "m", seed=5)
    batches = [fixed_batch(), fixed_batch(B=6, L=12)]

    def run(first: bool) -> tuple[dict, list[dict], list[int]]:
        cfg = TrainerConfig(lr=1e-2, micro_batch_size=4, grad_clip=1e9, weight_decay=0.1)  # (decay at lr 0: x1)
        t = FSDPTrainer(cfg, AlgoConfig(entropy_coef=0.01), str(path), torch.device("cpu"), total_steps=10)
        t.create()
        if not first:  # the moments made by AdamW's own first step
            monkeypatch.setattr(rl_update, "make_optimizer_state", lambda opt: None)
        found: list[int] = []  # the optimizer's state entries at each forward of the first train step
        out = []
        for b in batches:
            b.old_logp, _ = t.logprobs(b)
            hook = t.model.register_forward_pre_hook(lambda m, a: found.append(len(t.optimizer.state)))
            out.append(t.train_step(b))
            hook.remove()
        return {k: v.clone() for k, v in t.export_weights()}, out, found

    first_w, first_m, found = run(True)
    lazy_w, lazy_m, lazy_found = run(False)
    monkeypatch.undo()
    assert found[0] > 0 and lazy_found[0] == 0  # at the first step's first forward: made / not yet
    for a, b in zip(first_m, lazy_m):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
    assert first_w.keys() == lazy_w.keys()
    for k in first_w:
        assert torch.equal(first_w[k], lazy_w[k]), k
    t = make_trainer(path, micro=4)
    one_step(t, fixed_batch())
    assert {int(s["step"]) for s in t.optimizer.state.values()} == {1}  # one step counted, not two
