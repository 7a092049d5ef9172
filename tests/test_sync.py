"""Weight sync: the plan (coverage, buckets, expert routing) and every transport against live
engines on real processes — after a sync the engine serves exactly the trainer's weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import answering_server, start_engine
from models import engine_greedy, hf_greedy, make_model, make_moe_model
from multiproc import run_ranks, values
from rltrain.sync.plan import EngineTopology, SyncPlanError, WeightSpec, build_plan

PROMPTS = [[1, 2, 3], [5, 6, 7, 8], [9]]
F32 = torch.float32


def spec(name: str, numel: int, dtype: torch.dtype = F32) -> WeightSpec:
    return WeightSpec(name, (numel,), dtype)


# --------------------------------------------------------------------------- the plan


def test_plan_coverage_names_missing_duplicated_and_unexpected_weights():
    weights = [spec("a", 4), spec("b", 4), spec("b", 4), spec("extra", 4)]
    with pytest.raises(SyncPlanError) as e:
        build_plan(weights, EngineTopology(), 1 << 20, engine_names={"a", "b", "c"})
    msg = str(e.value)
    assert "sent twice: ['b']" in msg and "['c']" in msg and "['extra']" in msg
    # A tied head the trainer holds once is covered by its alias.
    plan = build_plan(
        [spec("embed", 4)], EngineTopology(), 1 << 20, engine_names={"embed", "lm_head"}, aliases={"lm_head": "embed"}
    )
    assert [w.name for w in plan.weights] == ["embed"]


def test_buckets_are_first_fit_decreasing_per_dtype_under_the_limit():
    weights = [
        spec("w7", 7),
        spec("w5", 5),
        spec("w4", 4),
        spec("w3", 3),
        spec("w1", 1),
        spec("huge", 40),
        spec("h2", 2, torch.bfloat16),
        spec("h3", 3, torch.bfloat16),
    ]
    limit = 10 * 4  # ten float32 elements
    plan = build_plan(weights, EngineTopology(), limit)
    f32 = [sorted(b.names) for b in plan.buckets if b.dtype == F32]
    # FFD by bytes: huge alone (over the limit), then 7+3, 5+4+1.
    assert sorted(f32) == sorted([["huge"], ["w3", "w7"], ["w1", "w4", "w5"]])
    assert [sorted(b.names) for b in plan.buckets if b.dtype == torch.bfloat16] == [["h2", "h3"]]
    assert sorted(n for b in plan.buckets for n in b.names) == sorted(w.name for w in weights)
    assert all(b.nbytes <= limit or len(b.weights) == 1 for b in plan.buckets)


def moe_weights(experts: int = 8) -> list[WeightSpec]:
    dense = [spec("model.embed_tokens.weight", 100), spec("model.layers.0.mlp.gate.weight", 10)]
    expert = [
        spec(f"model.layers.0.mlp.experts.{e}.{p}.weight", 50)
        for e in range(experts)
        for p in ("gate_proj", "up_proj", "down_proj")
    ]
    return dense + expert


def test_experts_are_routed_in_contiguous_blocks_to_their_ep_rank():
    plan = build_plan(moe_weights(8), EngineTopology((2,), 8), 1 << 20)
    assert plan.routed and plan.fallback_reason is None
    assert plan.targets["model.layers.0.mlp.experts.3.up_proj.weight"] == (0,)
    assert plan.targets["model.layers.0.mlp.experts.4.up_proj.weight"] == (1,)
    assert plan.targets["model.embed_tokens.weight"] == (0, 1)
    dense, per_rank_experts = 110 * 4, 4 * 3 * 50 * 4
    assert plan.bytes_to(0) == plan.bytes_to(1) == dense + per_rank_experts
    unrouted = build_plan(moe_weights(8), EngineTopology((1,), 8), 1 << 20)
    assert plan.bytes_moved == 2 * dense + 2 * per_rank_experts < 2 * unrouted.bytes_moved


@pytest.mark.parametrize(
    "topology,names,reason",
    [
        (EngineTopology((2, 4), 8), None, "homogeneous"),
        (EngineTopology((3,), 8), None, "do not divide"),
        (EngineTopology((2,), 0), None, "no routed experts"),
        (EngineTopology((2,), 8), ["model.layers.0.mlp.experts.gate_up_proj"], "fused"),
    ],
)
def test_routing_falls_back_to_broadcast_with_the_reason(topology, names, reason, caplog):
    weights = moe_weights(8) if names is None else [spec(n, 10) for n in names]
    plan = build_plan(weights, topology, 1 << 20)
    assert not plan.routed and reason in plan.fallback_reason
    assert all(t == tuple(range(topology.ep_size)) for t in plan.targets.values())
    assert reason in caplog.text


# --------------------------------------------------------------------------- transports


def _sync_rank(
    rank: int,
    world_size: int,
    trainer_model: str,
    engine_model: str,
    urls: list[str],
    transport: str,
    weights_dir: str,
    fault: str | None,
) -> dict:
    from rltrain.config import AlgoConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.runtime.world import World
    from rltrain.sync import weight_sync
    from rltrain.trainer.fsdp import FSDPTrainer

    world = World(backend="gloo", timeout=60)
    clients = [EngineClient(u, request_timeout_s=120) for u in urls]
    overrides = [
        f"model.path={trainer_model}",
        "data.path=synthetic:addition",
        f"sync.transport={transport}",
        "sync.bucket_mb=1",
        f"sync.weights_dir={weights_dir}",
        "sync.delta_full_every=3",
    ]
    if transport == "delta":
        overrides.append("loop.colocate=false")
    cfg = load_config(None, overrides)
    sync = None
    try:
        t = FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), trainer_model, torch.device("cpu"))
        t.create()
        sync = weight_sync.WeightSync(cfg, world, t, clients, engine_model)
        out = {
            "v1": sync.push("1"),
            "buckets": len(sync.plan.buckets),
            "routed": sync.plan.routed,
            "bytes_to": [sync.plan.bytes_to(r) for r in range(len(urls))],
            "moved": sync.plan.bytes_moved,
            "slotted": getattr(sync.transport, "slotted", False),
        }
        if transport == "delta" or fault:
            with torch.no_grad():  # a sparse update: 1% of one matrix
                w = t.model.get_input_embeddings().weight.to_local()
                w.view(-1)[::100] += 0.5
            if fault == "corrupt":
                from rltrain.sync import disk

                real = disk.publish

                def corrupting(target, keep, write):  # storage corrupts a byte after a good write
                    out = real(target, keep, write)
                    f = max(
                        (p for p in out.iterdir() if p.suffix in (".safetensors", ".bin")),
                        key=lambda p: p.stat().st_size,
                    )
                    data = bytearray(f.read_bytes())
                    data[len(data) // 2] ^= 0xFF
                    f.write_bytes(bytes(data))
                    return out

                disk.publish = corrupting
            if fault == "full" and world.rank == 0:  # the disk fills up while version 2 is written
                import resource
                import signal

                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
                soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
                try:
                    sync.push("2")
                except Exception as e:  # noqa: BLE001 - reported to the test
                    out["v2_error"] = f"{type(e).__name__}: {e}"
                finally:
                    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
                return out
            if fault == "readonly":  # the weights' filesystem turns read-only before version 2
                if world.rank == 0:
                    import subprocess

                    subprocess.run(["mount", "-o", "remount,ro", weights_dir], check=True, capture_output=True)
                world.bridge.barrier(phase="test remount")
                try:
                    sync.push("2")
                except Exception as e:  # noqa: BLE001 - reported to the test
                    out["v2_error"] = f"{type(e).__name__}: {e}"
                return out
            if fault == "full":
                try:
                    sync.push("2")
                except Exception as e:  # noqa: BLE001 - reported to the test
                    out["v2_error"] = f"{type(e).__name__}: {e}"
                return out
            if fault == "tamper":  # the engine ends up with other weights than the trainer sent
                from rltrain.weights import bucket as tensor_payload
                from rltrain.weights.checksum import entry

                sums = {n: entry(x) for n, x in t.export_weights()}  # a collective: both ranks
                if world.rank == 0:
                    name = "model.norm.weight"
                    bad = tensor_payload.serialize(
                        tensor_payload.flatten_bucket([(name, torch.full(sums[name][1], 3.0))])
                    )
                    clients[0].update_weights_from_tensor([bad], weight_version="1")
                try:
                    sync._verify("1", sums)
                except Exception as e:  # noqa: BLE001 - reported to the test
                    out["verify_error"] = f"{type(e).__name__}: {e}"
                return out
            if fault in ("refuse", "refuse_begin") and world.rank == 0:  # the second bucket, or the session
                from rltrain.engine.client import EngineError

                client, calls = clients[0], []
                name = "update_weights_from_tensor" if transport == "tensor" else "update_weights_from_distributed"
                nth = 2
                if fault == "refuse_begin":  # SGLang's explicit session (the embedded engine opens it inline)
                    name, nth = "begin_weight_update", 1
                    sync.transport.inline_sessions = False
                real_update = getattr(client, name)

                def refusing(*a, **k):
                    calls.append(1)
                    if len(calls) == nth:
                        raise EngineError(f"/{name}", "refused by the test", 400)
                    return real_update(*a, **k)

                setattr(client, name, refusing)
                real_end = client.end_weight_update
                ends = out["session_ends"] = []
                client.end_weight_update = lambda *a, **k: ends.append(1) or real_end(*a, **k)
            try:
                out["v2"] = sync.push("2")
            except Exception as e:  # noqa: BLE001 - reported to the test
                out["v2_error"] = f"{type(e).__name__}: {e}"
        t.save_pretrained(f"{weights_dir}/trainer_now")  # a collective; rank 0 writes
        return out
    finally:
        if sync is not None:
            sync.close()
        world.close()


@pytest.fixture(scope="module")
def big_a(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("big_a"), seed=11, vocab=2048, hidden=128)


@pytest.fixture(scope="module")
def big_b(tmp_path_factory):
    """The trainer's model: with a tokenizer, which every published version must carry."""
    from rltrain.rollout import synthetic

    path = make_model(tmp_path_factory.mktemp("big_b"), seed=12, vocab=2048, hidden=128)
    synthetic.build_tokenizer(synthetic.addition_words()).save_pretrained(path)
    return path


@pytest.fixture
def engines(tmp_path):
    """`engines(model, log_dir=tmp_path, **kw)` starts an embedded engine serving `model` (the
    keywords: `start_engine`'s); every engine started is stopped after the test."""
    started = []

    def start(model: Path, log_dir: Path | None = None, **kw):
        eng = start_engine("embedded", model, tmp_path if log_dir is None else log_dir, **kw)
        started.append(eng)
        return eng

    yield start
    for eng in started:
        eng.client.close()
        eng.process.stop()


def sync_ranks(trainer: Path, engine: Path, urls: list[str], transport: str, weights_dir: Path, fault=None, **kw):
    """Every rank's `_sync_rank` outcome: two trainer ranks of `trainer`'s weights syncing to the
    engines at `urls` (which serve `engine`), with `fault`; `kw`: `run_ranks`'."""
    args = (str(trainer), str(engine), urls, transport, str(weights_dir), fault)
    return values(run_ranks(_sync_rank, 2, *args, **kw))


def assert_a_whole_readable_checkpoint(version: Path, trainer_now: Path, tokenizer_from: Path) -> None:
    """A published version loads with transformers alone, tokenizer included, readable by every
    user, and scores as the trainer's weights do."""
    import stat

    from transformers import AutoModelForCausalLM, AutoTokenizer

    for f in [version, *version.iterdir()]:
        assert f.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH) == stat.S_IRGRP | stat.S_IROTH, f
    text = "3 + 4 ="
    assert (
        AutoTokenizer.from_pretrained(version)(text).input_ids
        == AutoTokenizer.from_pretrained(tokenizer_from)(text).input_ids
    )
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(version, dtype=torch.float32)(ids).logits
        want = AutoModelForCausalLM.from_pretrained(trainer_now, dtype=torch.float32)(ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("transport", ["tensor", "disk", "distributed", "delta"])
def test_after_sync_the_engine_generates_exactly_as_the_trainer(tmp_path, engines, big_a, big_b, transport):
    """Two FSDP ranks hold model B, the engine serves model A; after the sync (several buckets)
    the engine's greedy output is the trainer's and its checksum matched (else push raises)."""
    eng = engines(big_a)
    assert engine_greedy(eng.client, PROMPTS, 6) != hf_greedy(big_b, PROMPTS, 6)
    r0, r1 = sync_ranks(big_b, big_a, [eng.process.url], transport, tmp_path / "w", deadline_s=240)
    assert "v2_error" not in r0, r0.get("v2_error")
    assert eng.client.weight_version() == ("2" if transport == "delta" else "1")
    assert engine_greedy(eng.client, PROMPTS, 6) == hf_greedy(tmp_path / "w" / "trainer_now", PROMPTS, 6)
    if transport in ("tensor", "distributed"):
        assert r0["buckets"] >= 3
    if transport == "tensor":  # the engine keeps the 3 buffers by slot: from the 4th bucket on, slots only
        assert r0["slotted"] and r0["buckets"] >= 4, r0["buckets"]
        assert r0["v1"]["sync_bytes"] == r0["bytes_to"][0]
        assert eng.client.weights_checksum()["bytes_loaded"] == r0["bytes_to"][0]
    if transport == "delta":
        assert r0["v2"]["sync_bytes"] < 0.05 * r0["v1"]["sync_bytes"]  # 1% of one matrix changed
    if transport == "disk":  # (the version the trainer's state now matches: 1, as loaded)
        assert_a_whole_readable_checkpoint(tmp_path / "w" / "weight_v000001", tmp_path / "w" / "trainer_now", big_b)


@pytest.mark.parametrize("transport", ["disk", "delta"])
def test_a_corrupted_version_is_refused_and_the_engine_keeps_serving_the_previous(tmp_path, engines, big_a, transport):
    eng = engines(big_a)
    r0, _ = sync_ranks(big_a, big_a, [eng.process.url], transport, tmp_path / "w", "corrupt", deadline_s=240)
    assert "checksum" in r0["v2_error"] and "keeps" in r0["v2_error"], r0["v2_error"]
    assert eng.client.weight_version() == "1"
    assert engine_greedy(eng.client, PROMPTS, 6) == hf_greedy(big_a, PROMPTS, 6)


@pytest.mark.parametrize(
    "transport,fault",
    [("tensor", "refuse"), ("distributed", "refuse"), ("tensor", "refuse_begin")],
    ids=["tensor-bucket", "distributed-bucket", "tensor-session"],
)
def test_a_refused_bucket_fails_the_sync_on_every_rank_without_hanging(tmp_path, engines, big_a, transport, fault):
    """The engine refuses one bucket in the middle (the sender thread of `tensor`, the broadcast of
    `distributed`), or the weight-update session (begun on a sender thread while the first bucket
    is gathered): every rank raises, nobody waits for the timeout, the old version stays served;
    a session never begun is not ended."""
    eng = engines(big_a)
    r0, r1 = sync_ranks(big_a, big_a, [eng.process.url], transport, tmp_path / "w", fault, deadline_s=120)
    for r in (r0, r1):
        assert "v2_error" in r and "SyncError" in r["v2_error"], r.get("v2_error")
    assert "refused by the test" in r0["v2_error"] + r1["v2_error"]
    if transport == "tensor":
        assert r0["session_ends"] == ([] if fault == "refuse_begin" else [1])
    assert eng.client.weight_version() == "1"


def test_a_full_disk_during_publish_fails_the_sync_and_keeps_the_previous_version(tmp_path, engines, big_a):
    """Rank 0's writes fail past 4 KiB (EFBIG) while version 2 is published: every rank raises a
    SyncError naming the failure, no part of version 2 is left, and version 1 stays served."""
    eng = engines(big_a)
    r0, r1 = sync_ranks(big_a, big_a, [eng.process.url], "disk", tmp_path / "w", "full", deadline_s=120)
    for r in (r0, r1):
        assert "SyncError" in r.get("v2_error", "") and "File too large" in r["v2_error"], r.get("v2_error")
    assert sorted(p.name for p in (tmp_path / "w").iterdir() if p.name.startswith(("weight_v", ".weight_v"))) == [
        "weight_v000001"
    ]
    assert eng.client.weight_version() == "1"


def test_a_read_only_weights_directory_fails_the_sync_and_keeps_the_previous_version(tmp_path, engines, big_a):
    """The weights directory's filesystem turns read-only (a real tmpfs remounted ro) before
    version 2 is published: every rank raises a SyncError with the reason, version 1 stays
    whole and served."""
    from readonly import tmpfs

    eng = engines(big_a, tmp_path / "logs")
    with tmpfs(tmp_path / "w"):
        r0, r1 = sync_ranks(big_a, big_a, [eng.process.url], "disk", tmp_path / "w", "readonly", deadline_s=120)
        for r in (r0, r1):
            assert "SyncError" in r.get("v2_error", "") and "Read-only file system" in r["v2_error"], r.get("v2_error")
        assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["weight_v000001"]
        assert (tmp_path / "w" / "weight_v000001" / "rltrain_version.json").is_file()
        assert eng.client.weight_version() == "1"


def test_moe_experts_reach_only_their_ep_rank_and_match(tmp_path, engines):
    """A tiny Qwen3-MoE (4 experts) synced to two engines that are EP ranks 0 and 1: each gets the
    dense weights and its own two experts (bytes counted on both sides), and each one's checksum
    over what it owns equals the trainer's."""
    a = make_moe_model(tmp_path / "moe_a", seed=1)
    b = make_moe_model(tmp_path / "moe_b", seed=2)
    ep = [engines(a, tmp_path / f"ep{r}", extra_args=["--ep-size", "2", "--ep-rank", str(r)]) for r in range(2)]
    r0, _ = sync_ranks(b, a, [e.process.url for e in ep], "distributed", tmp_path / "w", deadline_s=240)
    assert r0["routed"]
    for r, e in enumerate(ep):
        rep = e.client.weights_checksum()  # push already compared it with the trainer's
        assert rep["weight_version"] == "1" and rep["bytes_loaded"] == r0["bytes_to"][r]
    assert r0["v1"]["sync_bytes"] == r0["moved"] == sum(r0["bytes_to"])
    # Without routing each EP rank would receive all four experts of every layer.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(b)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    experts = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if ".experts." in n)
    assert r0["bytes_to"] == [total - experts // 2] * 2
    assert r0["moved"] == 2 * total - experts < 2 * total


def test_a_fused_expert_moe_model_syncs_by_checkpoint_names(tmp_path, engines):
    """transformers keeps Qwen3-MoE experts fused; the engine receives per-expert checkpoint
    names and still generates exactly as the trainer's weights."""
    a = make_moe_model(tmp_path / "moe_a", seed=1)
    b = make_moe_model(tmp_path / "moe_b", seed=2)
    eng = engines(a)
    sync_ranks(b, a, [eng.process.url], "tensor", tmp_path / "w", deadline_s=240)
    assert engine_greedy(eng.client, PROMPTS, 6) == hf_greedy(b, PROMPTS, 6)


def test_an_engine_holding_other_weights_fails_the_checksum_on_every_rank(tmp_path, engines, big_a):
    eng = engines(big_a)
    ranks = sync_ranks(big_a, big_a, [eng.process.url], "tensor", tmp_path / "w", "tamper", deadline_s=240)
    for r in ranks:
        assert r["verify_error"].startswith("WeightMismatchError") and "checksum" in r["verify_error"]


def _probe_rank(
    rank: int, world_size: int, trainer_model: str, url: str | list[str], engine_model: str | list[str], awake: bool
) -> dict:
    from rltrain.config import AlgoConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.runtime.world import World
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer
    from rltrain.weights.checksum import WeightMismatchError

    world = World(backend="gloo", timeout=60)
    cfg = load_config(None, [f"model.path={trainer_model}", "data.path=synthetic:addition", "sync.transport=tensor"])
    t = FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), trainer_model, torch.device("cpu"))
    t.create()
    layout = None
    if isinstance(url, list):  # an engine per rank
        from rltrain.engine.layout import EngineLayout

        url, engine_model = url[rank], engine_model[rank]
        layout = EngineLayout(local_rank=rank, local_world_size=world_size, node_rank=0, gpus_per_engine=1)
    assert isinstance(engine_model, str)
    client = EngineClient(url, request_timeout_s=120)
    sync = WeightSync(cfg, world, t, [client], engine_model, layout, awake=awake)
    out: dict = {}
    asked = []
    real_score = client.score
    client.score = lambda *a, **k: asked.append(1) or real_score(*a, **k)
    try:
        try:
            out["push"] = sync.push("1")
        except WeightMismatchError as e:
            out["push_error"] = str(e)
        try:
            out["probe"] = sync.probe_engines()
        except WeightMismatchError as e:
            out["probe_error"] = str(e)
        out["end_report"] = sync.transport.ends.reports  # consumed by the verification
        out["end_probes"] = sync.transport.ends.probes  # the same
        out["scored_as_session_ended"] = not asked
        return out
    finally:
        sync.close()
        world.close()


@pytest.mark.parametrize("awake", [True, False], ids=["probed-in-the-push", "probed-once-awake"])
def test_an_engine_that_computes_otherwise_fails_the_probe_on_every_rank(tmp_path, engines, big_a, awake):
    """The engine holds exactly the trainer's weights (the checksum agrees) but runs another
    model (its config's norm epsilon): the probe fails the sync on every rank. Engines that keep
    their memory score it in the push, while the trainer does; the others once awake."""
    import json
    import shutil

    served = tmp_path / "served"
    shutil.copytree(big_a, served)
    config = json.loads((served / "config.json").read_text())
    config["rms_norm_eps"] = 0.5
    (served / "config.json").write_text(json.dumps(config))
    eng = engines(served)
    ranks = values(run_ranks(_probe_rank, 2, str(big_a), eng.process.url, str(served), awake, deadline_s=240))
    for r in ranks:
        error = r["push_error"] if awake else r["probe_error"]
        assert "log-probs of the probe sequence differ" in error and "node0-engine0" in error, r
        assert ("probe_error" not in r and r["probe"] == {}) if awake else "push_error" not in r, r
        assert r["end_report"] == {} and r["end_probes"] == {}
    # Awake, the engine scored the probe as its weight-update session ended (rank 0 sends to it):
    # no request of its own.
    assert ranks[0]["scored_as_session_ended"] == awake
    # The checksum passed: the weights were right, the model around them was not.
    assert "checksum" not in (ranks[0]["push_error"] if awake else ranks[0]["probe_error"])


def test_one_rank_scores_the_probe_for_the_trainer_and_every_rank_judges_every_engine(tmp_path, engines, big_a):
    """With its weights gathered on every rank, the trainer's probe forward is no collective:
    rank 0 takes it for all, and every rank judges every rank's engine against it. Rank 1's own
    engine runs another model: both ranks fail the sync naming rank 1's engine, not rank 0's."""
    import json
    import shutil

    served = tmp_path / "served"
    shutil.copytree(big_a, served)
    config = json.loads((served / "config.json").read_text())
    config["rms_norm_eps"] = 0.5
    (served / "config.json").write_text(json.dumps(config))
    right, wrong = engines(big_a, tmp_path / "a"), engines(served, tmp_path / "b")
    urls, models = [right.process.url, wrong.process.url], [str(big_a), str(served)]
    ranks = values(run_ranks(_probe_rank, 2, str(big_a), urls, models, True, deadline_s=240))
    for r in ranks:
        error = r["push_error"]
        assert error.startswith("rank 1: version 1: node0-engine1"), r
        assert "log-probs of the probe sequence differ" in error, r
        assert "rank 0" not in error and "engine0" not in error and "checksum" not in error, r


def _ride_rank(rank: int, world_size: int, model: str, url: str, engine_model: str, awake: bool) -> dict:
    """Two versions pushed with `ride`: the push runs no trainer forward; the next training
    step's first micro-batch carries the probe and judges it before its optimizer step."""
    from rltrain.config import AlgoConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.runtime.world import World
    from rltrain.sync.verify import WeightMismatchError
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer
    from test_trainer import fixed_batch

    world = World(backend="gloo", timeout=60)
    cfg = load_config(None, [f"model.path={model}", "data.path=synthetic:addition", "sync.transport=tensor"])
    t = FSDPTrainer(TrainerConfig(dtype="float32", micro_batch_size=2), AlgoConfig(), model, torch.device("cpu"))
    t.create()
    sync = WeightSync(cfg, world, t, [EngineClient(url, request_timeout_s=120)], engine_model, awake=awake)
    forwards = []
    real = sync._trainer_probe
    sync._trainer_probe = lambda *a: forwards.append(1) or real(*a)  # type: ignore[method-assign]
    out: dict = {"rides": t.rides_probe}
    batch = fixed_batch(B=4, L=40).slice(slice(0, 3))  # rows longer than the probe, one micro-batch short
    try:
        for version in ("1", "2"):
            out[f"push{version}"] = sync.push(version, ride=True)
            out[f"awake{version}"] = sync.probe_engines()
            ride = sync.ride()
            out[f"forwards{version}"] = len(forwards)
            assert ride is not None and sync.ride() is None  # taken once
            standalone = real()  # what a forward of its own gives, for the comparison below
            seen = []
            judge = ride.judge
            ride = type(ride)(ride.tokens, lambda logp: seen.append(logp.clone()) or judge(logp))
            before = t.model.get_input_embeddings().weight.full_tensor().clone()
            try:
                out[f"train{version}"] = t.train_step(batch, ride)
            except WeightMismatchError as e:
                out[f"error{version}"] = str(e)
                out["unchanged"] = torch.equal(before, t.model.get_input_embeddings().weight.full_tensor())
                break
            out[f"row_vs_own{version}"] = float((seen[0] - standalone).abs().max())
        return out
    finally:
        sync.close()
        world.close()


@pytest.mark.parametrize("awake", [True, False], ids=["probed-in-the-push", "probed-once-awake"])
def test_the_trainers_probe_rides_the_next_training_step_and_is_judged_before_its_optimizer_step(
    tmp_path, engines, big_a, awake
):
    """`push(version, ride=True)`: no trainer forward in the sync; the next training step's first
    micro-batch carries the probe as one more row (the loss never sees it) and judges it before
    its optimizer step. Against the engine that serves the trainer's model: two versions pass,
    the row's log-probs are those of a forward of its own. Against one that runs another model:
    the step raises WeightMismatchError on every rank, naming the engine, and nothing moved."""
    import json
    import shutil

    eng = engines(big_a, tmp_path / "right")
    ranks = values(run_ranks(_ride_rank, 2, str(big_a), eng.process.url, str(big_a), awake, deadline_s=240))
    for r in ranks:
        assert r["rides"] and r["forwards1"] == r["forwards2"] == 0, r
        for version in ("1", "2"):
            assert "sync_probe_diff" not in r[f"push{version}"] and r[f"awake{version}"] == {}, r
            assert r[f"train{version}"]["sync_probe_worst"] < 1e-3, r
            assert r[f"row_vs_own{version}"] < 1e-4, r
    served = tmp_path / "served"
    shutil.copytree(big_a, served)
    config = json.loads((served / "config.json").read_text())
    config["rms_norm_eps"] = 0.5
    (served / "config.json").write_text(json.dumps(config))
    wrong = engines(served, tmp_path / "wrong")
    ranks = values(run_ranks(_ride_rank, 2, str(big_a), wrong.process.url, str(served), awake, deadline_s=240))
    for r in ranks:
        assert "push1" in r and "train1" not in r, r  # the checksums agree: the push passes
        assert "log-probs of the probe sequence differ" in r["error1"] and "node0-engine0" in r["error1"], r
        assert r["unchanged"], "judged before the optimizer step"


def _ride_unanswered_rank(rank: int, world_size: int, model: str, url: str, engine_pid: int) -> dict:
    """A push with `ride`, then the engine stops answering (SIGSTOP) before it is asked the probe
    once awake: asking does not wait (the answers come during the rollout), and the next training
    step's judge gives up on the answer after its bound and fails on every rank, naming it."""
    import os
    import signal
    import time

    from rltrain.config import AlgoConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.runtime.world import World
    from rltrain.sync import weight_sync
    from rltrain.sync.verify import WeightMismatchError
    from rltrain.trainer.fsdp import FSDPTrainer
    from test_trainer import fixed_batch

    weight_sync.PROBE_ANSWER_S = 3.0
    world = World(backend="gloo", timeout=60)
    cfg = load_config(None, [f"model.path={model}", "data.path=synthetic:addition", "sync.transport=tensor"])
    t = FSDPTrainer(TrainerConfig(dtype="float32", micro_batch_size=2), AlgoConfig(), model, torch.device("cpu"))
    t.create()
    sync = weight_sync.WeightSync(cfg, world, t, [EngineClient(url, request_timeout_s=120)], model, awake=False)
    out: dict = {}
    try:
        sync.push("1", ride=True)
        if rank == 0:
            os.kill(engine_pid, signal.SIGSTOP)
        world.bridge.barrier("engine stopped")
        t0 = time.perf_counter()
        out["awake"] = sync.probe_engines()
        out["asked_s"] = time.perf_counter() - t0
        ride = sync.ride()
        assert ride is not None
        t0 = time.perf_counter()
        try:
            t.train_step(fixed_batch(B=4, L=40), ride)
        except WeightMismatchError as e:
            out["error"] = str(e)
        out["judged_s"] = time.perf_counter() - t0
        return out
    finally:
        if rank == 0:
            os.kill(engine_pid, signal.SIGCONT)  # (its pending answer comes, and the pool can close)
        sync.close()
        world.close()


def _ride_then_release_rank(rank: int, world_size: int, model: str, url: str) -> dict:
    """The loop's order around a ridden probe where engines release their memory: asked once
    awake (on a thread), answered before the release (`probe_answered`, at engine_release), the
    engine released at once after it, then judged in the next training step: it passes."""
    from rltrain.config import AlgoConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.runtime.world import World
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer
    from test_trainer import fixed_batch

    world = World(backend="gloo", timeout=60)
    cfg = load_config(None, [f"model.path={model}", "data.path=synthetic:addition", "sync.transport=tensor"])
    t = FSDPTrainer(TrainerConfig(dtype="float32", micro_batch_size=2), AlgoConfig(), model, torch.device("cpu"))
    t.create()
    client = EngineClient(url, request_timeout_s=120)
    sync = WeightSync(cfg, world, t, [client], model, awake=False)
    try:
        sync.push("1", ride=True)
        sync.probe_engines()
        sync.probe_answered()
        if rank == 0:
            client.release(["kv_cache", "weights"])  # what engine_release does next
        world.bridge.barrier("released")
        ride = sync.ride()
        assert ride is not None
        stats = t.train_step(fixed_batch(B=4, L=40), ride)
        if rank == 0:
            client.resume(["weights", "kv_cache"])
        return {"worst": stats["sync_probe_worst"]}
    finally:
        sync.close()
        world.close()


def test_the_ridden_probes_answers_are_in_before_the_engines_release_their_memory(tmp_path, engines, big_a):
    """`probe_answered` (the loop calls it at engine_release) waits for the engines' answers to a
    ridden probe: an engine released right after it has answered from its weights, and the next
    step's judge passes (asked while the engine was released, it would have been refused)."""
    eng = engines(big_a, tmp_path / "released")
    for r in values(run_ranks(_ride_then_release_rank, 2, str(big_a), eng.process.url, deadline_s=240)):
        assert r["worst"] < 1e-3, r


def test_the_engines_answer_the_ridden_probe_during_the_rollout_and_a_silent_one_fails_the_step(
    tmp_path, engines, big_a
):
    """Where the probe rides the next training step, the engines are asked once awake on a thread
    (the loop's `sync_probe` waits for nothing: they answer while the rollout starts) and the step's
    judge takes their answers. An engine that never answers fails that step on every rank within
    the judge's bound (`PROBE_ANSWER_S`), naming it, instead of passing or hanging."""
    eng = engines(big_a, tmp_path / "silent")
    ranks = values(
        run_ranks(_ride_unanswered_rank, 2, str(big_a), eng.process.url, eng.process.proc.pid, deadline_s=240)
    )
    for r in ranks:
        assert r["awake"] == {} and r["asked_s"] < 1.0, r
        assert "node0-engine0" in r["error"] and "no answer to the probe within 3 s" in r["error"], r
        assert r["judged_s"] < 60, r


def _one_rank_per_block_units(rank: int, world_size: int, model: str, url: str) -> dict:
    """A trainer of one rank whose blocks are FSDP units of their own (as on GPUs: `gathered()`
    changes nothing, its forward all-gathers per block): its probe forward runs on a thread
    during the push, while the weights are exported and sent."""
    import threading

    from rltrain.config import AlgoConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.runtime.world import World
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer import fsdp, sharding
    from rltrain.weights.checksum import checksum

    sharding.one_unit = fsdp.one_unit = lambda device: False  # type: ignore[assignment]  # per-block units
    world = World(backend="gloo", timeout=60)
    cfg = load_config(None, [f"model.path={model}", "data.path=synthetic:addition", "sync.transport=tensor"])
    t = fsdp.FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), model, torch.device("cpu"))
    t.create()
    sync = WeightSync(cfg, world, t, [EngineClient(url, request_timeout_s=120)], model, awake=True)
    threads = []
    real = sync._trainer_probe
    sync._trainer_probe = lambda *a: threads.append(threading.current_thread().name) or real(*a)  # type: ignore[method-assign]
    out: dict = {}
    try:
        with t.gathered():
            out["sharded"] = t.sharded
        for version in ("1", "2"):
            with torch.no_grad():  # a step's update
                t.model.get_input_embeddings().weight.to_local().view(-1)[:: 50 + int(version)] += 0.25
            out[version] = sync.push(version)
        out["threads"] = threads
        out["checksum"] = checksum(t.export_weights())
        out["engine"] = sync.receivers[0].weights_checksum()["checksum"]
        return out
    finally:
        sync.close()
        world.close()


def test_a_one_rank_trainer_scores_its_probe_on_a_thread_during_the_push(tmp_path, engines, big_a):
    """Where the trainer's world is one rank, its probe forward has no peer to keep in step with:
    it runs on a thread while the weights go out, also where the forward all-gathers (FSDP2 units
    per block, as on GPUs). Two pushes of updated weights pass every check, and the engine then
    holds exactly the trainer's weights."""
    eng = engines(big_a)
    (r,) = values(run_ranks(_one_rank_per_block_units, 1, str(big_a), eng.process.url, deadline_s=240))
    assert r["sharded"], "per-block units: the forward is the FSDP2 one, all-gathers included"
    assert r["threads"] and all(name.startswith("rltrain-probe") for name in r["threads"]), r["threads"]
    for version in ("1", "2"):
        assert r[version]["sync_digests_compared"] == 1 and r[version]["sync_probe_worst"] < 1e-3, r
    assert r["engine"] == r["checksum"]


def _stale_rank(rank: int, world_size: int, model: str, url: str) -> str:
    from rltrain.config import AlgoConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.runtime.world import World
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer
    from rltrain.weights.checksum import entry

    world = World(backend="gloo", timeout=60)
    cfg = load_config(None, [f"model.path={model}", "data.path=synthetic:addition", "sync.transport=tensor"])
    t = FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), model, torch.device("cpu"))
    t.create()
    sync = WeightSync(cfg, world, t, [EngineClient(url, request_timeout_s=120)], model, awake=True)
    try:
        sync.push("1")
        with torch.no_grad():  # the trainer moves on; version 2 never reaches the engine
            t.model.get_input_embeddings().weight.to_local().view(-1)[::100] += 0.5
        sums = {n: entry(x) for n, x in t.export_weights()}
        try:
            sync._verify("2", sums)
        except Exception as e:  # noqa: BLE001 - reported to the test
            return f"{type(e).__name__}: {e}"
        return "verified"
    finally:
        sync.close()
        world.close()


def test_a_stale_engine_is_reported_stale_even_where_the_probe_runs_in_the_push(tmp_path, engines, big_a):
    """An engine at the previous version also scores the probe otherwise: the sync names the
    stale version (StaleWeightsError), as where the probe runs once the engines are awake."""
    eng = engines(big_a)
    ranks = values(run_ranks(_stale_rank, 2, str(big_a), eng.process.url, deadline_s=240))
    for r in ranks:
        assert r.startswith("StaleWeightsError") and "serves weight version '1' after loading '2'" in r, r
        assert "probe" not in r


def test_shards_written_here_read_back_by_safetensors_with_the_digest_of_their_bytes(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from rltrain.runtime.files import file_digest
    from rltrain.weights.hf_files import write_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "b": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "a": torch.randn(7, generator=g),
        "mask": torch.rand(4, 2, generator=g) > 0.5,
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "half": torch.randn(1, generator=g).half(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(4, 6, generator=g)[:, ::2],  # not contiguous
    }
    digest = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    assert digest == file_digest(tmp_path / "x.safetensors")
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(TypeError, match="complex64"):
        write_safetensors(tmp_path / "y.safetensors", {"c": torch.zeros(2, dtype=torch.complex64)})


def test_weight_files_are_read_mapped_and_checked_against_their_manifest(tmp_path):
    """The engine's disk load: every tensor back bit for bit from memory-mapped shards; a published
    version's files are checked against its manifest as they are read (corrupt, missing or extra
    file: refused); a file whose header does not describe its data is a clear error."""
    from rltrain.weights.hf_files import HostStaging, map_safetensors, write_checkpoint, write_safetensors
    from rltrain.weights.versions import CorruptWeightsError, publish, read_weights

    g = torch.Generator().manual_seed(0)
    tensors = {
        "b": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(6).reshape(2, 3),
        "mask": torch.rand(4, 2, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
    }
    digest = write_safetensors(tmp_path / "x.safetensors", tensors)
    for check in (None, digest):
        back = map_safetensors(tmp_path / "x.safetensors", check)
        assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in tensors.items())
    state = {f"w{i}": torch.randn(64, 32, generator=g) for i in range(9)}
    src = make_model(tmp_path / "cfg", seed=0)

    def write(tmp):  # three shards, each written while the next is gathered (two stagings)
        digests = {}
        write_checkpoint(
            tmp,
            src,
            state.items(),
            shard_bytes=3 * 64 * 32 * 4,
            staging=[HostStaging(0), HostStaging(0)],
            digests=digests,
        )
        return {"kind": "full", "version": "1", "digests": digests}

    version = publish(tmp_path / "weight_v000001", None, write)
    shards = sorted(version.glob("*.safetensors"))
    assert len(shards) == 3
    back = read_weights(version)
    assert set(back) == set(state) and all(torch.equal(back[n], t) for n, t in state.items())
    data = bytearray(shards[1].read_bytes())
    data[-5] ^= 0x01
    shards[1].write_bytes(bytes(data))
    with pytest.raises(CorruptWeightsError, match=f"{shards[1].name} does not match its checksum.*keeps"):
        read_weights(version)
    shards[1].unlink()
    with pytest.raises(CorruptWeightsError, match="not the manifest's"):
        read_weights(version)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes((tmp_path / "x.safetensors").read_bytes()[:-3])
    with pytest.raises(ValueError, match="cannot read weight file .*does not fit"):
        read_weights(plain)


def test_a_sparse_delta_is_small_strictly_ordered_and_checksummed(tmp_path):
    from rltrain.weights.delta import DeltaOrderError, DeltaPublisher, reconstruct
    from rltrain.weights.versions import CorruptWeightsError, publish

    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(256, 256, generator=g) for i in range(16)}
    src = make_model(tmp_path / "cfg", seed=0)  # only its config files are copied
    pub = DeltaPublisher(full_every=10)

    def put(version: str) -> dict:
        out = publish(
            tmp_path / f"weight_v{int(version):06d}", 10, lambda tmp: pub.write(tmp, version, state.items(), str(src))
        )
        pub.commit()
        return {
            "dir": out,
            "bytes": sum(f.stat().st_size for f in out.iterdir() if f.suffix in (".safetensors", ".bin")),
        }

    v1 = put("1")
    total = sum(t.numel() for t in state.values())
    changed = torch.randperm(total, generator=g)[: total // 100]  # 1% of all parameters
    flat = torch.cat([t.reshape(-1) for t in state.values()])
    flat[changed] += torch.randn(len(changed), generator=g)
    state = dict(zip(state, flat.split(256 * 256)))
    state = {k: v.reshape(256, 256) for k, v in state.items()}
    v2 = put("2")
    assert v2["bytes"] <= 0.02 * v1["bytes"]
    reconstruct(v2["dir"], v1["dir"], tmp_path / "rebuilt")
    from safetensors.torch import load_file

    rebuilt = load_file(str(tmp_path / "rebuilt" / "model.safetensors"))
    assert all(torch.equal(rebuilt[k], state[k]) for k in state)
    v3 = put("3")
    with pytest.raises(DeltaOrderError, match="skipped or reordered"):
        reconstruct(v3["dir"], v1["dir"], tmp_path / "wrong_base")  # v3 applies to v2
    blob = v3["dir"] / "delta.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x55
    blob.write_bytes(bytes(data))
    rebuilt_v2 = publish(
        tmp_path / "node" / "weight_v000002",
        2,
        lambda tmp: (reconstruct(v2["dir"], v1["dir"], tmp), {"version": "2", "kind": "full"})[1],
    )
    with pytest.raises(CorruptWeightsError):
        reconstruct(v3["dir"], rebuilt_v2, tmp_path / "from_corrupt")


def _server_sync_rank(
    rank: int, world_size: int, url: str, engine_model: str, models: list[str], transport: str, weights_dir: str
) -> list[list[list[int]]]:
    """One rank: push each model in turn to the live server; greedy output after each push."""
    from models import engine_greedy as greedy
    from rltrain.config import AlgoConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.runtime.world import World
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer

    world = World(backend="gloo", timeout=120)
    client = EngineClient(url, request_timeout_s=120)
    outs = []
    try:
        for i, model in enumerate(models):
            cfg = load_config(
                None,
                [
                    f"model.path={model}",
                    "data.path=synthetic:addition",
                    f"sync.transport={transport}",
                    f"sync.weights_dir={weights_dir}",
                ],
            )
            t = FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), model, torch.device("cpu"))
            t.create()
            sync = WeightSync(cfg, world, t, [client], engine_model)
            try:
                sync.push(str(100 + i))
                outs.append(greedy(client, PROMPTS, 6))
            finally:
                sync.close()
        return outs
    finally:
        world.close()


@pytest.mark.parametrize("transport", ["tensor", "disk", "distributed"])
def test_every_transport_updates_both_engines(server, model_a, model_b, tmp_path, transport):
    """The embedded engine and real SGLang: after each push the engine generates as the pushed
    model (B, then A again, which also leaves the shared server as it was)."""
    (outs,) = values(
        run_ranks(
            _server_sync_rank,
            1,
            server.process.url,
            str(model_a),
            [str(model_b), str(model_a)],
            transport,
            str(tmp_path / "w"),
            deadline_s=240,
        )
    )
    assert outs == [hf_greedy(model_b, PROMPTS, 6), hf_greedy(model_a, PROMPTS, 6)]
    assert server.client.weight_version() == "101"


@pytest.mark.parametrize("status,has", [(400, True), (200, True), (404, False), (405, False), (500, None)])
def test_weights_checker_capability_is_asked_with_an_action_no_engine_knows(status, has):
    """A colocated SGLang is asked while its weights are released: the request names no action
    SGLang knows (it refuses it, HTTP 400, before it looks at a weight; a checksum would read
    unmapped memory). A missing endpoint (404, 405) means none; any other answer is an error
    naming what was expected. (A real HTTP server answering as such an engine.)"""
    import json

    from rltrain.engine.client import EngineError

    asked = []
    message = b'{"success": false, "message": "Unsupported action=\'rltrain-capability-check\'"}'
    with answering_server(lambda body: asked.append(json.loads(body)) or (status, message)) as client:
        if has is None:
            with pytest.raises(EngineError, match="expected HTTP 400 .* or 404"):
                client.has_weights_checker()
        else:
            assert client.has_weights_checker() is has
    assert [a["action"] for a in asked] == ["rltrain-capability-check"]
    assert asked[0]["action"] not in ("checksum", "snapshot", "reset_tensors", "compare")  # SGLang's own


@pytest.mark.parametrize("how", ["400", "success-false"])
@pytest.mark.parametrize("flush", [200, 400])
def test_an_update_whose_flush_sglang_refused_for_a_request_just_answered_flushes_once_idle(how, flush):
    """SGLang fails a weight update whose cache flush it refused while its scheduler still counts
    a request it has just answered (seen in CI: the probe's score, then the update at once): the
    weights are updated. The client asks for SGLang's deferred flush (/flush_cache?timeout=) and
    the update succeeds; if that flush fails too, the error says both. Disk and tensor updates."""
    import json

    from rltrain.engine.client import EngineError

    refused = (
        "Weights were updated, but the cache was not flushed because requests are still running or "
        "queued. Retract or finish them, then call /flush_cache."
    )

    def answer(body: bytes) -> tuple[int, bytes]:
        if not body or body == b"null":  # the flush
            return flush, (b"Cache flushed." if flush == 200 else b"Timed out waiting for idle state.")
        reply = {"success": False, "message": refused}
        return (400 if how == "400" else 200), json.dumps(reply).encode()

    for call in (
        lambda c: c.update_weights_from_disk("/m", weight_version="v1"),
        lambda c: c.update_weights_from_tensor(["payload"], flush_cache=True),
    ):
        paths: list[str] = []
        with answering_server(answer, paths=paths) as client:
            if flush == 200:
                out = call(client)
                assert out["success"] is True and "flushed once the engine was idle" in out["message"]
            else:
                with pytest.raises(EngineError, match="the flush after it.*failed too.*Timed out waiting"):
                    call(client)
        assert paths[0].startswith("/update_weights_from_") and paths[1].startswith("/flush_cache?timeout=")
        assert len(paths) == 2
