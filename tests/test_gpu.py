"""GPU-only checks (run on the lent H200): NCCL world cycles, embedded engine on CUDA, CUDA IPC updates."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from conftest import start_engine
from models import hf_greedy
from rltrain.engine import tensor_payload
from rltrain.engine.protocol import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[1, 2, 3], [5, 6, 7, 8]]


def test_nccl_world_destroy_rebuild_with_subgroups(monkeypatch):
    from rltrain.runtime.world import World

    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    world = World(backend="nccl", timeout=60)
    try:
        g = world.new_group([0], description="tp")
        cpu = world.new_group([0], backend="gloo", description="tp-gloo")
        for _ in range(3):
            world.destroy()
            world.wait_destroyed()
            world.rebuild()
            x = torch.full((4,), 2.0, device="cuda")
            dist.all_reduce(x, group=g.pg)
            y = torch.ones(2)
            dist.all_reduce(y, group=cpu.pg)
            assert x.sum().item() == 8.0 and y.sum().item() == 2.0
    finally:
        world.close()


@pytest.fixture(scope="module")
def cuda_native(model_a, tmp_path_factory):
    srv = start_engine("native", model_a, tmp_path_factory.mktemp("gpu_native"), device="cuda")
    yield srv
    srv.client.close()
    srv.process.stop()


def greedy(client):
    out = client.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    assert all(c.ok for c in out), [c.error for c in out]
    return [c.output_ids for c in out]


def test_cuda_engine_release_frees_device_memory_and_resume_restores(cuda_native, model_a):
    before = greedy(cuda_native.client)
    assert before == hf_greedy(model_a, PROMPTS, 6)
    m0 = cuda_native.client._request("GET", "/memory").json()
    cuda_native.client.release()
    m1 = cuda_native.client._request("GET", "/memory").json()
    assert m1["cuda_allocated"] < m0["cuda_allocated"] and m1["cuda_reserved"] <= m0["cuda_reserved"]
    cuda_native.client.resume()
    assert greedy(cuda_native.client) == before


def test_cuda_ipc_flattened_bucket_update(cuda_native, model_a, model_b):
    state = sorted(load_file(str(model_b / "model.safetensors"), device="cuda").items())
    bucket = tensor_payload.flatten_bucket(state)
    try:
        cuda_native.client.update_weights_from_tensor([tensor_payload.serialize(bucket)], weight_version="ipc-b")
        assert greedy(cuda_native.client) == hf_greedy(model_b, PROMPTS, 6)
    finally:
        del bucket
        cuda_native.client.update_weights_from_disk(str(model_a), weight_version="default")
