"""Experts routed inside one real SGLang engine (CPU): `--tp-size 2 --ep-size 2`, a tiny Qwen3-MoE.

Two trainer ranks, one engine over both (its TP ranks 0 and 1 are EP ranks 0 and 1). The plan
reads the engine's layout from its /server_info and routes inside it: each rank's payload holds
the dense weights and its own EP rank's experts only. SGLang loads what each TP rank was sent;
its own per-rank sha256 of its parameters (`/weights_checker`) must then equal its sha256 after
loading the same model from disk.

SGLang 0.5.23 cannot *generate* with a MoE at EP > 1 on CPU (the standard dispatcher asks
`get_device()`, which has no CPU answer; its CPU MoE kernel then indexes with the -1 ids EP gives
non-local experts), so the server starts without its warm-up, its /health does not generate,
and the check is SGLang's own checksum, not log-probs.
"""

from __future__ import annotations

import os

import pytest

from conftest import HAVE_SGLANG, SGLANG_SHIM, SKIP_SGLANG, start_server
from models import make_moe_model
from multiproc import run_ranks, values

pytestmark = pytest.mark.skipif(
    not HAVE_SGLANG and SKIP_SGLANG, reason="SGLang not installed and RLTRAIN_SKIP_SGLANG=1"
)


def _routed_rank(rank: int, world_size: int, trainer_model: str, engine_model: str, url: str) -> dict:
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
            "sync.probe_tokens=0",  # SGLang cannot generate at EP > 1 on CPU (module docstring)
        ],
    )
    layout = EngineLayout.of(EngineConfig(gpus_per_engine=2), "sglang", world.env, None)
    client = EngineClient(url, request_timeout_s=120)
    sync = None
    try:
        t = FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), trainer_model, torch.device("cpu"))
        t.create()
        sync = weight_sync.WeightSync(cfg, world, t, [client], engine_model, engine=layout)
        sync.push("routed")
        return {
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
        mem_fraction_static=0.1,
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
