"""A sync that misses a weight fails loudly, with one engine: a test-only fault drops a weight
from what the trainer sends (after checksumming it, as a sender that believes it sent it would)
and the first sync fails, naming the engine. Real SGLang on CPU and the embedded engine.

SGLang's weights are reset to random values before every sync (its /weights_checker), so what a
sync misses is garbage, never last version's copy: a parameter no request wrote still hashes as
the reset left it (named), and a fused weight written only in part (a layer's q_proj dropped
from its qkv_proj) scores the probe far off the trainer's. The embedded engine's checksum over
what it holds differs from the trainer's over what was sent. Capability checks touch no weight."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import SGLANG_CPU_MEM_FRACTION, SGLANG_SHIM
from multiproc import run_ranks, run_torchrun, values

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
ONE = "model.layers.1.mlp.down_proj.weight"  # a weight no engine fuses with another
HALF = "model.layers.0.self_attn.q_proj.weight"  # one third of the qkv_proj SGLang fuses


def _missing_rank(rank: int, world_size: int, model: str, url: str, dropped: str) -> dict:
    """One trainer rank holding `model`, as the engine at `url` does: the probe measured at
    start-up as the setup does, then one training step's worth of change (every weight moves
    by 1e-5, as an Adam step at that learning rate) synced without `dropped`."""
    from rltrain.config import AlgoConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.runtime.world import World
    from rltrain.sync.calibration import probe_at_start
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer

    world = World(backend="gloo", timeout=120)
    client = EngineClient(url, request_timeout_s=120)
    cfg = load_config(None, [f"model.path={model}", "data.path=synthetic:addition", "sync.transport=tensor"])
    t = FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), model, torch.device("cpu"))
    t.create()
    start = probe_at_start(cfg, world, [client], None, PROMPT)
    sync = WeightSync(cfg, world, t, [client], model, awake=True, start=start)
    out: dict = {"caps": sync.checks}
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in t.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(1e-5 * torch.randn(local.shape, generator=g).sign())
    real = sync._tensors
    sync._tensors = lambda names, sums: ((n, x) for n, x in real(names, sums) if n != dropped)
    try:
        out["push"] = sync.push("1")
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        sync.close()
        world.close()
    return out


@pytest.mark.parametrize("dropped", [ONE, HALF], ids=["one-weight", "half-of-a-fused-weight"])
def test_a_sync_that_misses_a_weight_fails_with_one_engine_naming_it(server, model_a, dropped):
    before = server.client.weight_version()
    try:
        (r,) = values(run_ranks(_missing_rank, 1, str(model_a), server.process.url, dropped, deadline_s=240))
    finally:  # the session's engine serves model A again
        server.client.update_weights_from_disk(str(model_a), weight_version=before)
    assert "push" not in r, r
    error = r["error"]
    assert error.startswith("WeightMismatchError: ") and "node0-engine0" in error, error
    if server.kind == "embedded":  # its checksum over what it holds is not the trainer's
        assert "with weight checksum" in error and "the trainer's is" in error, error
    elif dropped == ONE:  # left as the reset made it, named in SGLang's own name (not fused)
        assert "1 parameter(s) not written by the sync of version 1" in error and ONE in error, error
    else:  # q rows of layer 0's qkv_proj random: the probe is off the trainer's
        assert "parameter(s) not written" not in error, error
        assert "log-probs of the probe sequence differ" in error, error


def _refused_reset_rank(rank: int, world_size: int, model: str, url: str) -> str:
    """Two trainer ranks, one engine led by rank 0, whose reset before the sync is refused."""
    from rltrain.config import AlgoConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient, EngineError
    from rltrain.runtime.world import World
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer

    world = World(backend="gloo", timeout=120)
    client = EngineClient(url, request_timeout_s=120)
    cfg = load_config(None, [f"model.path={model}", "data.path=synthetic:addition", "sync.transport=tensor"])
    t = FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), model, torch.device("cpu"))
    t.create()
    sync = WeightSync(cfg, world, t, [client], model, awake=True)

    def refused() -> None:
        raise EngineError("/weights_checker", "refused by the test", 400)

    client.reset_weights = refused
    try:
        sync.push("1")
        return "synced"
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    finally:
        sync.close()
        world.close()


def test_a_refused_reset_fails_the_sync_on_every_rank_before_anything_is_sent(server, model_a):
    if server.kind != "sglang":
        pytest.skip("the embedded engine has no /weights_checker: nothing is reset")
    before = server.client.weight_version()
    ranks = values(run_ranks(_refused_reset_rank, 2, str(model_a), server.process.url, deadline_s=120))
    for r in ranks:
        assert r.startswith("SyncError: rank 0: node0-engine0 could not reset its weights before version 1"), r
        assert "refused by the test" in r, r
    assert server.client.weight_version() == before  # nothing was sent


def test_the_loop_fails_at_the_first_step_when_its_sync_misses_half_of_a_fused_weight(tmp_path):
    """The whole path on one rank and one SGLang engine: the probe made from the first data
    prompt and calibrated at start-up, SGLang's weights reset before the first sync; a sync
    without layer 0's q_proj (SGLang fuses it into qkv_proj with k and v) fails step 1."""
    path = os.pathsep.join([str(HERE / "faults"), str(SGLANG_SHIM), os.environ.get("PYTHONPATH", "")])
    r = run_torchrun(
        tmp_path,
        ["-m", "rltrain"],
        [
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            f"run.dir={tmp_path}",
            f"model.path={tmp_path / 'base_model'}",
            "loop.steps=2",
            "data.prompts_per_step=4",
            "rollout.n=2",
            "metrics.progress_bar=false",
            "metrics.plot=false",
            "engine.backend=sglang",
            "engine.device=cpu",
            "engine.dtype=float32",
            f"engine.mem_fraction_static={SGLANG_CPU_MEM_FRACTION}",
            "engine.extra_args=[--max-total-tokens,4096]",
        ],
        nproc=1,
        env={"PYTHONPATH": path, "RLTRAIN_TEST_SYNC_DROP": HALF},
    )
    assert r.returncode != 0, r.stderr[-4000:]
    assert "sync probe: 32 tokens" in r.stderr and "calibrated at start-up" in r.stderr, r.stderr[-4000:]
    assert "WeightMismatchError" in r.stderr and "node0-engine0" in r.stderr, r.stderr[-4000:]
    assert "log-probs of the probe sequence differ" in r.stderr and "version 1" in r.stderr, r.stderr[-4000:]
    metrics = tmp_path / "quickstart" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step was recorded


def test_capabilities_are_asked_without_touching_a_weight(server, model_a):
    """SGLang answers the capability check's unknown action with HTTP 400 before it looks at any
    weight (no checksum computed: safe on weights its memory saver has unmapped); the embedded
    engine has no /weights_checker (404) and says in /server_info that it checksums what it owns,
    also while its weights are released (a checksum asked of it then is refused: the sync lost
    its checksums wherever the engines were released before it asked)."""
    log = server.process.log_path
    seen = log.stat().st_size
    caps = server.client.capabilities()
    if server.kind == "sglang":
        assert caps.weights_checker and not caps.checksums
        text = log.read_bytes()[seen:].decode(errors="replace")
        assert "Unsupported action" in text and "checksum computed" not in text, text[-2000:]
        return
    assert caps.checksums and caps.dtype == "float32" and not caps.weights_checker
    before = server.client.weight_version()
    server.client.release(["weights"])
    try:
        assert server.client.capabilities() == caps
    finally:
        server.client.resume(["weights"])  # (without a backup: garbage until loaded again)
        server.client.update_weights_from_disk(str(model_a), weight_version=before)
