"""The trainer's offload while the world's teardown runs in the background (GPU only: offload is a
no-op on the CPU).

The loop destroys the world (NCCL teardown in a background thread: runtime/world.py) and puts the
trainer away at once. Whether `dist.is_initialized()` still reads True at that moment is a race
the loop cannot control, so nothing the offload does may depend on it.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_offload_after_the_teardown_won_the_race_still_frees_the_gathered_parameters(tmp_path, monkeypatch):
    """A forward without backward leaves the FSDP2 root's parameters gathered (what offload
    reshards for); the teardown finishes before the offload (the race's one outcome, made certain here): the
    offload must still free them, not park them beside the shards, leave no trainer tensor on the
    GPU, and bring the trainer back on the rebuilt world with the same weights."""
    from models import make_model, random_batch
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.world import World
    from rltrain.trainer.fsdp import FSDPTrainer

    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    path = make_model(tmp_path / "m", seed=3, vocab=8192, hidden=512, layers=2)
    batch = random_batch()
    world = World(backend="nccl", timeout=60)
    try:
        torch.cuda.synchronize()
        base_alloc = torch.cuda.memory_allocated()
        cfg = TrainerConfig(lr=1e-3, micro_batch_size=4, dtype="float32")
        t = FSDPTrainer(cfg, AlgoConfig(), str(path), world.device)
        t.create()
        batch.old_logp, _ = t.logprobs(batch)
        t.train_step(batch)
        state = sum(p.to_local().numel() * p.element_size() for p in t.model.parameters()) * 3
        before, _ = t.logprobs(batch)
        with torch.no_grad():  # a forward without backward: the FSDP2 root keeps its parameters gathered
            t.model(input_ids=batch.tokens.to(world.device))
        world.destroy(block=True)  # the teardown is over before the put-away starts
        t.offload()
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - base_alloc
        assert left < 0.01 * state, f"{left} bytes of the trainer stay on the GPU after offload (state: {state})"
        # What is parked is the state (sharded weights, Adam's two moments) and no gathered copy.
        assert t._park is not None
        parked = sum(n for *_, n in t._park.parked)
        assert parked <= 1.01 * state, f"{parked} bytes parked for a state of {state}: a gathered copy went too"
        world.rebuild()
        t.onload()
        after, _ = t.logprobs(batch)
        torch.testing.assert_close(after, before, rtol=0, atol=0)
        assert t.train_step(batch)["grad_norm"] > 0
    finally:
        world.close()
