"""Experts routed inside one engine (CPU): `--tp-size 2 --ep-size 2`, a tiny Qwen3-MoE; real
SGLang, and the embedded engine laid out as SGLang is.

Two trainer ranks, one engine over both (its TP ranks 0 and 1 are EP ranks 0 and 1). The plan
reads the engine's layout from its /server_info and routes inside it: each rank's payload holds
the dense weights and its own EP rank's experts only. SGLang loads what each TP rank was sent;
its own per-rank sha256 of its parameters (`/weights_checker`) must then equal its sha256 after
loading the same model from disk.

SGLang 0.5.23 cannot *generate* with a MoE at EP > 1 on CPU (the standard dispatcher asks
`get_device()`, which has no CPU answer; its CPU MoE kernel then indexes with the -1 ids EP gives
non-local experts), so the server starts without its warm-up, its /health does not generate,
and the check is SGLang's own checksum, not log-probs. The embedded engine over two TP ranks
takes the same per-rank payloads, refuses an expert sent to a rank that does not hold it, and
generates: there the check is also the log-probs after the sync.
"""

from __future__ import annotations

import os

import pytest

from conftest import HAVE_SGLANG, SGLANG_CPU_MEM_FRACTION, SGLANG_SHIM, SKIP_SGLANG, start_server
from models import make_moe_model
from multiproc import run_ranks, values

needs_sglang = pytest.mark.skipif(
    not HAVE_SGLANG and SKIP_SGLANG, reason="SGLang not installed and RLTRAIN_SKIP_SGLANG=1"
)


def _routed_rank(
    rank: int,
    world_size: int,
    trainer_model: str,
    engine_model: str,
    url: str,
    backend: str = "sglang",
    misroute: bool = False,
) -> dict:
    import torch

    from rltrain.config import AlgoConfig, EngineConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.engine.layout import EngineLayout
    from rltrain.runtime.world import World
    from rltrain.sync import weight_sync
    from rltrain.trainer.fsdp import FSDPTrainer

    world = World(backend="gloo", timeout=120)
    cfg = load_config(
        None,
        [
            f"model.path={trainer_model}",
            "data.path=synthetic:addition",
            "sync.transport=tensor",
            "sync.bucket_mb=1",
            # SGLang cannot generate at EP > 1 on CPU (module docstring); the embedded engine can.
            f"sync.probe_tokens={0 if backend == 'sglang' else 12}",
        ],
    )
    layout = EngineLayout.of(EngineConfig(gpus_per_engine=2), backend, world.env, None)
    client = EngineClient(url, request_timeout_s=120)
    sync = None
    try:
        t = FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), trainer_model, torch.device("cpu"))
        t.create()
        sync = weight_sync.WeightSync(cfg, world, t, [client], engine_model, engine=layout)
        if misroute:  # a broken router: each TP rank is sent the other EP rank's experts
            sync.plan.engine_ep_ranks = (1, 0)
            try:
                sync.push("misrouted")
            except weight_sync.SyncError as e:
                return {"error": str(e), "version": client.weight_version()}
            return {"error": None}
        stats = sync.push("routed")
        probe = sync.probe_engines() if backend == "embedded" else {}
        return {
            "stats": stats,
            "probe": probe,
            "engine": client.weights_checksum() if backend == "embedded" else None,
            "routed": sync.plan.routed,
            "reason": sync.plan.fallback_reason,
            "ep_ranks": sync.plan.engine_ep_ranks,
            "rank_bytes": dict(getattr(sync.transport, "rank_bytes", {})),
            "planned": [sync.plan.rank_bytes(k) for k in range(2)],
            "full": sum(w.nbytes for w in sync.plan.weights),
            "version": client.weight_version(),
        }
    finally:
        if sync is not None:
            sync.close()
        client.close()
        world.close()


@needs_sglang
def test_experts_routed_inside_one_sglang_engine_load_what_a_full_load_loads(tmp_path):
    from rltrain.config import EngineConfig

    if not HAVE_SGLANG:
        pytest.fail("SGLang is not installed: install it as the README says, or set RLTRAIN_SKIP_SGLANG=1")
    a = make_moe_model(tmp_path / "a", seed=1)
    b = make_moe_model(tmp_path / "b", seed=2)
    cfg = EngineConfig(
        backend="sglang",
        device="cpu",
        dtype="float32",
        mem_fraction_static=SGLANG_CPU_MEM_FRACTION,
        startup_timeout_s=300,
        extra_args=["--max-total-tokens", "4096", "--ep-size", "2", "--tp-size", "2", "--skip-server-warmup"],
    )
    env = {
        "PYTHONPATH": os.pathsep.join([str(SGLANG_SHIM), os.environ.get("PYTHONPATH", "")]),
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1" if (os.cpu_count() or 1) > 1 else "0|0",
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",  # its /health would generate a token
    }
    srv = start_server(cfg, a, tmp_path / "e.log", env, retries=0)
    client, proc = srv.client, srv.process
    try:
        before = client.weights_checker()
        r0, _ = values(run_ranks(_routed_rank, 2, str(b), str(a), proc.url, deadline_s=280))
        routed = client.weights_checker()
        client.update_weights_from_disk(str(b), weight_version="disk")
        full = client.weights_checker()
    finally:
        client.close()
        proc.stop()
    assert r0["routed"], r0["reason"]
    assert r0["ep_ranks"] == (0, 1) and r0["version"] == "routed"
    # Each TP rank was sent the dense weights and its own two experts only: what the plan says,
    # measured on the senders, and less than the whole model.
    assert [r0["rank_bytes"][k] for k in (0, 1)] == r0["planned"]
    assert all(b < r0["full"] for b in r0["planned"])
    # SGLang's own checksum of each TP rank's parameters: the routed payloads loaded exactly what
    # a full load of the same model loads (and not what it held before).
    assert [e["tp_size"] for e in routed] == [2, 2]
    assert routed == full != before


def test_experts_routed_inside_the_embedded_engine_laid_out_like_sglang(tmp_path):
    """The embedded engine over two TP ranks (`--tp-size 2 --ep-size 2`): the same per-rank
    protocol as SGLang's. Each rank's checksum over what it holds matches what its trainer rank
    sent (checked in push), the engine counts per rank the bytes the senders measured, the
    log-probs after the sync match the trainer's, and an expert sent to the wrong rank is refused
    with the engine's weights and version unchanged."""
    from conftest import start_engine

    a = make_moe_model(tmp_path / "a", seed=1)
    b = make_moe_model(tmp_path / "b", seed=2)
    srv = start_engine("embedded", a, tmp_path, extra_args=["--tp-size", "2", "--ep-size", "2"])
    try:
        info = srv.client.server_info()
        r0, r1 = values(run_ranks(_routed_rank, 2, str(b), str(a), srv.process.url, "embedded", deadline_s=200))
        bad, _ = values(run_ranks(_routed_rank, 2, str(a), str(a), srv.process.url, "embedded", True, deadline_s=200))
        after = srv.client.weights_checksum()
    finally:
        srv.client.close()
        srv.process.stop()
    assert (info["tp_size"], info["ep_size"], info["ep_rank"]) == (2, 2, None)
    assert r0["routed"] and r0["ep_ranks"] == (0, 1) and r0["version"] == "routed", r0["reason"]
    assert r0["stats"]["sync_routed"] == 1.0
    # What each TP rank's payloads held: the plan's figure, measured by the senders and by the
    # engine, and less than the whole model.
    ranks = r0["engine"]["ranks"]
    assert [r0["rank_bytes"][k] for k in (0, 1)] == r0["planned"] == [e["bytes_loaded"] for e in ranks]
    assert all(x < r0["full"] for x in r0["planned"]) and r0["stats"]["sync_bytes"] == sum(r0["planned"])
    assert [e["ep_rank"] for e in ranks] == [0, 1]
    assert r0["probe"]["sync_probe_diff"] < 1e-5 and r1["probe"] == r0["probe"]
    # The misrouted push: refused by the engine, naming the rank and an expert; nothing changed.
    assert bad["error"] and "was sent experts it does not hold" in bad["error"], bad
    assert bad["version"] == "routed" and after["ranks"] == ranks
