"""GPU-only checks (run on the lent H200): NCCL world cycles, embedded engine on CUDA, CUDA IPC updates."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from conftest import start_engine
from models import engine_greedy, hf_greedy
from rltrain.generation import SamplingParams
from rltrain.weights import bucket as tensor_payload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[1, 2, 3], [5, 6, 7, 8]]


def test_nccl_world_destroy_rebuild_with_subgroups(monkeypatch):
    """NCCL groups are torn down (their device memory freed) and rebuilt; a gloo subgroup holds
    no device memory and stays up: the same communicator across cycles, still correct."""
    from rltrain.runtime.ledger import device_used
    from rltrain.runtime.world import World

    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    world = World(backend="nccl", timeout=60)
    try:
        g = world.new_group([0], description="tp")
        cpu = world.new_group([0], backend="gloo", description="tp-gloo")
        kept, nccl = cpu.pg, g.pg
        freed = []
        for _ in range(3):
            torch.cuda.synchronize()
            before = device_used(world.device)
            world.destroy()
            world.wait_destroyed()
            freed.append(before - device_used(world.device))
            world.rebuild()
            x = torch.full((4,), 2.0, device="cuda")
            dist.all_reduce(x, group=g.pg)
            y = torch.ones(2)
            dist.all_reduce(y, group=cpu.pg)
            assert x.sum().item() == 8.0 and y.sum().item() == 2.0
            assert cpu.pg is kept and g.pg is not nccl
            nccl = g.pg
        assert all(f > 100 * 2**20 for f in freed), freed  # the communicators' memory went back
    finally:
        world.close()


@pytest.fixture(scope="module")
def cuda_native(model_a, tmp_path_factory):
    srv = start_engine("embedded", model_a, tmp_path_factory.mktemp("gpu_native"), device="cuda", weights_backup=True)
    yield srv
    srv.client.close()
    srv.process.stop()


def greedy(client):
    return engine_greedy(client, PROMPTS, 6)


def test_cuda_engine_release_frees_device_memory_and_resume_restores(cuda_native, model_a):
    before = greedy(cuda_native.client)
    assert before == hf_greedy(model_a, PROMPTS, 6)
    m0 = cuda_native.client.memory_report()
    cuda_native.client.release()
    m1 = cuda_native.client.memory_report()
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


def test_cuda_ipc_reused_buffers_are_mapped_once_and_read_afresh(cuda_native, model_a, model_b):
    """The tensor sync's two refilled buffers: the engine keeps their mappings for the session and
    copies what each holds now (the CUDA twin of the shared-memory test in test_embedded_engine)."""
    state = sorted(load_file(str(model_b / "model.safetensors"), device="cuda").items())
    half = len(state) // 2
    parts = [state[:half], state[half:], state[:half]]
    size = max(tensor_payload.bucket_layout(p)[1] for p in parts)
    ring = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(2)]
    mapped = []
    try:
        cuda_native.client.begin_weight_update()
        for i, part in enumerate(parts):
            if i == 0:  # garbage first, overwritten through the same buffer by the third bucket
                part = [(n, torch.randn_like(t)) for n, t in part]
            bucket = tensor_payload.flatten_bucket(part, out=ring[i % 2])
            rep = cuda_native.client.update_weights_from_tensor(
                [tensor_payload.serialize(bucket)], weight_version="ipc-r"
            )
            mapped.append(rep["mapped"])
        cuda_native.client.end_weight_update()
        assert mapped == [True, True, False]
        assert greedy(cuda_native.client) == hf_greedy(model_b, PROMPTS, 6)
    finally:
        cuda_native.client.update_weights_from_disk(str(model_a), weight_version="default")


def test_storages_in_separate_allocations_that_meet_move_apart_and_come_back_whole():
    """Tensors of 12 MiB each get an allocation of the driver each, often one right after the
    other in the address space: `runs` must not copy across the boundary (the driver refuses:
    invalid argument). Those of one group's onload block move as one copy. Values come back."""
    from rltrain.trainer.host_park import HostPark

    torch.cuda.empty_cache()
    tensors = [torch.randn(3 << 20, device="cuda") for _ in range(16)]  # 12 MiB each
    expected = [t.clone() for t in tensors]
    park = HostPark("cuda")
    park.park([tensors])
    assert park.copies_out == 16  # one per allocation, though they meet
    torch.cuda.empty_cache()
    park.unpark()
    torch.cuda.synchronize()
    assert park.copies_in < 16  # carved out of one block now
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    park.park([tensors])
    assert park.copies_out == park.copies_in
    park.unpark()
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))


@pytest.mark.parametrize("kind", ["register", "hugepage", "driver"])
def test_an_onload_copied_by_a_kernel_brings_back_every_byte_from_each_kind_of_buffer(kind):
    """`HostPark(onload="kernel")`: the SMs read the page-locked buffer (each kind) over the bus
    (kernels/triton_copy.py); sizes off a multiple of 4 bytes too. Values come back bitwise."""
    from rltrain.trainer.host_park import HostPark

    torch.cuda.empty_cache()
    tensors = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in (3 << 20, 1001, 7, 1 << 16)]
    expected = [t.clone() for t in tensors]
    park = HostPark("cuda", pinned=kind, onload="kernel")
    for _ in range(2):
        park.park([tensors])
        torch.cuda.empty_cache()
        park.unpark()
        torch.cuda.synchronize()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))


@pytest.mark.parametrize("kind", ["register", "hugepage", "driver"])
def test_every_kind_of_page_locked_buffer_holds_its_footprint_copies_both_ways_and_goes(kind):
    import gc

    from rltrain.runtime.pinned import footprint, pinned_empty, pinned_host_bytes

    before = pinned_host_bytes()
    buf = pinned_empty((64 << 20) + 100, kind)
    assert buf.numel() == (64 << 20) + 100 and buf.is_pinned()
    assert pinned_host_bytes() - before == footprint(buf.numel(), kind)
    src = torch.randint(0, 255, (buf.numel(),), dtype=torch.uint8, device="cuda")
    buf.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    del buf
    gc.collect()
    assert pinned_host_bytes() == before


def test_trainer_release_returns_cuda_memory_and_offload_moves_state(tmp_path):
    from models import make_model, random_batch
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.memory import free_cuda_caches
    from rltrain.runtime.pinned import footprint, pinned_host_bytes
    from rltrain.trainer.fsdp import FSDPTrainer

    path = make_model(tmp_path / "m", seed=3, vocab=8192, hidden=512, layers=2)
    torch.cuda.synchronize()
    # The baseline without what earlier tests of this process left that trim() hands back too
    # (cuBLAS workspaces, ~68 MB after the file's earlier tests): measured with them, the state
    # seemed to shrink below itself once trim() dropped them.
    gc.collect()
    free_cuda_caches()
    base_alloc = torch.cuda.memory_allocated()
    t = FSDPTrainer(TrainerConfig(lr=1e-3, micro_batch_size=8), AlgoConfig(), str(path), torch.device("cuda"))
    t.create()
    batch = random_batch()
    batch.old_logp, _ = t.logprobs(batch)
    t.train_step(batch)
    held = torch.cuda.memory_allocated() - base_alloc
    state = sum(p.numel() * p.element_size() for p in t.model.parameters()) * 3
    assert held >= state

    # The step's activations are freed but cached: whole segments with nothing allocated in them.
    # trim hands every such segment back (free pieces of segments that still hold state stay).
    def free_segments() -> int:
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if seg["allocated_size"] == 0)

    # Larger than all that is cached, so it gets a segment of its own, left whole and free.
    scratch = torch.empty(torch.cuda.memory_reserved() + (64 << 20), dtype=torch.uint8, device="cuda")
    del scratch
    assert free_segments() >= 64 << 20
    t.trim()
    assert free_segments() == 0
    assert torch.cuda.memory_allocated() - base_alloc >= state  # the state stays (cuBLAS's workspaces go)
    torch_pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    t.offload()
    assert torch.cuda.memory_allocated() - base_alloc < 0.01 * state  # params, grads, Adam state on the host
    # One page-locked buffer of exactly the parked bytes (512-byte aligned pieces), registered
    # with the driver, counted by the ledger, and not from torch's power-of-two pinned allocator.
    buf = t._park.buffer
    parked = sum(n for *_, n in t._park.parked)
    assert buf.is_pinned() and parked <= buf.numel() <= parked + 512 * len(t._park.parked)
    assert pinned_host_bytes() == footprint(buf.numel())
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == torch_pinned
    del buf
    t.onload()
    t.train_step(batch)
    t.release()
    assert pinned_host_bytes() == 0  # released: the buffer is unregistered and unmapped
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base_alloc  # stated margin: nothing of the trainer stays allocated
    assert torch.cuda.memory_reserved() <= 2 * 2**20  # and the allocator gave its cache back (<= 2 MiB kept)


def test_the_optimizer_state_made_before_the_first_forward_strands_none_of_the_steps_freed_memory(
    tmp_path, monkeypatch
):
    """AdamW's moments made at its first step come out of the blocks the backward freed: after
    the step and `trim`, the caching allocator keeps freed bytes it cannot hand back (segments
    shared with the moments), and at 4B the first put-away that meant to keep the state moved all
    of it out and back (4.39 GiB stranded, 2026-12-06). Made before the first forward (the
    trainer's default), the state strands none of it, and an offload that keeps everything keeps it;
    also where a separate old log-probs pass ran first (its activations' segments cached). (On
    2026-12-06 this test failed twice, 591 MB stranded against 585 and 610 lazily: its own defect,
    the lazy variant's patch left in place for the variant after it; a memory snapshot of the fixed
    variant: 39 MiB, in small segments of the moments and the weights.)"""
    from models import make_model, random_batch
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.memory import free_cuda_caches
    from rltrain.trainer import rl_update
    from rltrain.trainer.fsdp import FSDPTrainer

    path = make_model(tmp_path / "m", seed=3, vocab=32768, hidden=1024, layers=8)

    def stranded(first: bool) -> tuple[int, int]:
        """Freed bytes the allocator keeps after step 1 and trim; HostPark strandings of an
        offload that keeps the whole state."""
        gc.collect()
        free_cuda_caches()
        t = FSDPTrainer(TrainerConfig(lr=1e-3, micro_batch_size=8), AlgoConfig(), str(path), torch.device("cuda"))
        t.create()
        batch = random_batch(vocab=32768, rows=16, length=512)
        batch.old_logp, _ = t.logprobs(batch)
        with monkeypatch.context() as m:  # (undone before the other variant runs)
            if not first:
                m.setattr(rl_update, "make_optimizer_state", lambda opt: None)
            t.train_step(batch)
        t.trim()
        torch.cuda.synchronize()
        out = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        t.offload(keep=1 << 62)
        strandings = t._park.strandings if t._park is not None else 0
        t.release()
        return out, strandings

    lazy, _ = stranded(False)
    first, strandings = stranded(True)
    print(f"freed bytes the allocator keeps after step 1: moments first {first >> 20} MiB, lazily {lazy >> 20} MiB")
    assert lazy >= 64 << 20  # the premise: made lazily, they strand what the step freed
    assert first <= lazy // 10 and strandings == 0


def test_fsdp2_trainer_on_nccl_follows_world_cycles_with_offload(tmp_path, monkeypatch):
    """FSDP2 over a (one-rank) NCCL world: each destroy/rebuild re-binds the trainer's modules to
    the new group (this torch's FSDP2 internals are what `sharding.rebind` expects); offload
    leaves no trainer tensor on the GPU; training continues with the same result as a trainer
    that never offloads (one H200: NCCL refuses two ranks on one device)."""
    from torch.distributed.tensor import DTensor

    from models import make_model, random_batch
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.world import World
    from rltrain.trainer.fsdp import FSDPTrainer

    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    path = make_model(tmp_path / "m", seed=3, vocab=8192, hidden=512, layers=2)
    batch = random_batch()
    world = World(backend="nccl", timeout=60)
    # Bitwise comparison below: deterministic kernels (embedding backward uses atomics otherwise;
    # cuBLAS needs CUBLAS_WORKSPACE_CONFIG=:4096:8, set by the GPU run's environment).
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        torch.cuda.synchronize()
        base_alloc = torch.cuda.memory_allocated()
        cfg = TrainerConfig(lr=1e-3, micro_batch_size=4, dtype="float32")
        cycled, steady = (FSDPTrainer(cfg, AlgoConfig(kl_coef=0.01), str(path), torch.device("cuda")) for _ in range(2))
        for t in (cycled, steady):
            t.create()
            assert isinstance(t.model.get_input_embeddings().weight, DTensor)
        for _ in range(3):
            for t in (cycled, steady):
                batch.old_logp, _ = t.logprobs(batch)
                batch.ref_logp, _ = t.logprobs(batch, reference=True)
                t.train_step(batch)
            cycled.offload()
            steady_bytes = sum(p.to_local().numel() * p.element_size() for p in steady.model.parameters())
            torch.cuda.synchronize()
            # What is left is the steady trainer: params + 2 Adam moments + reference.
            assert torch.cuda.memory_allocated() - base_alloc <= 4 * steady_bytes + 8 * 2**20
            world.destroy()
            world.wait_destroyed()
            world.rebuild()
            modules = (steady.model, cycled.model)
            steady.onload()  # not offloaded: re-bound to the new group
            cycled.onload()
            assert (steady.model, cycled.model) == modules and not (steady._rebind_refused or cycled._rebind_refused)
        a, b = dict(cycled.export_weights()), dict(steady.export_weights())
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    finally:
        torch.use_deterministic_algorithms(False)
        world.close()


def _loop_on_one_gpu(tmp_path: Path, name: str, *overrides: str) -> tuple[Path, list[str], list[dict]]:
    """configs/<name>.yaml's loop on one GPU (torchrun, one rank, bf16, NCCL, no checkpoints) with
    `overrides`: its config file, all its overrides, and its metrics rows (it must succeed)."""
    import json

    from multiproc import run_torchrun

    config = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    every = [
        f"run.dir={tmp_path}",
        f"model.path={tmp_path / 'base_model'}",
        "engine.device=cuda",
        "engine.dtype=bfloat16",
        "world.backend=nccl",
        "trainer.dtype=bfloat16",
        "checkpoint.interval=0",
        *overrides,
    ]
    r = run_torchrun(tmp_path, ["-m", "rltrain"], ["--config", str(config), *every], nproc=1, timeout_s=600)
    assert r.returncode == 0, r.stderr[-6000:]
    return config, every, [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_the_colocated_loop_keeps_the_trainer_on_the_gpu_where_the_rollout_leaves_it_room(tmp_path):
    """The defaults on one GPU (the embedded engine's KV pool sized to the rollout,
    engine.max_total_tokens=auto; loop.offload_trainer=auto): after the first rollout measured
    the room, no step moves any of the trainer's state, which sits beside the engine while it
    generates, and the run trains as ever (a reward every step, no failed generation, every sync
    verified); the engine's pool is the rollout's size, not the memory fraction's."""
    from rltrain.config import load_config
    from rltrain.engine.pool import rollout_tokens

    config, overrides, rows = _loop_on_one_gpu(
        tmp_path,
        "quickstart",
        "metrics.progress_bar=false",
        "model.build_hidden=256",
        "data.max_prompt_tokens=32",
        "loop.steps=4",
    )
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["generation_failed"] == 0 and isinstance(row["reward_mean"], float)
        assert row["sync_digests_compared"] >= 1, row
        # (the first rollout ran with the state out of the way, as before any measure; it measured
        # the room, so even step 1's put-away kept everything)
        assert row["offload_moved_gib"] == 0 and row["offload_kept_gib"] > 0, row
    for row in rows[1:]:
        rollout = row["memory"]["rank0"]["rollout"]
        assert rollout["trainer_weights"] > 0 and rollout["trainer_optimizer"] > 0, rollout
    cfg = load_config(config, overrides)
    lines = [line for f in (tmp_path / "quickstart" / "engine").glob("*.log") for line in f.read_text().splitlines()]
    pools = [int(line.split("KV cache: ")[1].split()[0]) for line in lines if "KV cache: " in line]
    assert pools and max(pools) <= rollout_tokens(cfg, 1, 1), pools


def test_the_tool_quickstart_on_a_gpu_runs_its_engine_split_in_two_and_verifies_every_sync(tmp_path):
    """Multi-turn on a GPU: the embedded engine starts with its HTTP in a process of its own
    (engine.embedded.separate_http_process=auto), the trajectories' turns go through it, and the
    weight sync (CUDA IPC, through the HTTP process to the engine's) is verified every step: the
    engine's probe agrees with the trainer's, no generation fails, the turns are counted."""
    _, _, rows = _loop_on_one_gpu(tmp_path, "quickstart-tools", "loop.steps=3", "metrics.plot=false")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["generation_failed"] == 0 and row["multiturn"]["turns_trajectories"] == row["samples"], row
        assert 0 <= row["sync_probe_diff"] <= row["sync_probe_worst"], row
    log = next((tmp_path / "quickstart-tools" / "engine").glob("*.log")).read_text()
    assert "--separate-http-process" in log


def test_an_offload_within_a_budget_returns_what_moved_and_its_overlapped_copies_train_as_without(
    tmp_path, monkeypatch
):
    """loop.offload_trainer=fit's trainer side: the optimizer state leaves (its copy out begun on a
    side stream right after the step), the weights stay; what moved goes back to the driver (the
    allocator keeps no more than the budget); the state comes back with the optimizer state behind
    the weights, the onload (re-bind included) waiting for its own stream only, never for the
    whole device (which would wait for those copies too: the e2e run of 2026-12-05 measured its
    onload at the optimizer state's copy time), settled before the step; three steps bitwise
    those of a trainer never offloaded."""
    from models import make_model, random_batch
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.world import World
    from rltrain.trainer.fsdp import FSDPTrainer

    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    path = make_model(tmp_path / "m", seed=3, vocab=8192, hidden=512, layers=2)
    batch = random_batch()
    world = World(backend="nccl", timeout=60)
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        cfg = TrainerConfig(lr=1e-3, micro_batch_size=4, dtype="float32")
        # The trainer never offloaded runs first, alone: the allocator's segments then hold the
        # parked trainer's tensors only (the stranded-memory guard reads the whole process's).
        steady = FSDPTrainer(cfg, AlgoConfig(), str(path), torch.device("cuda"))
        steady.create()
        for _ in range(3):
            batch.old_logp, _ = steady.logprobs(batch)
            steady.train_step(batch)
        want = {k: v.detach().cpu().clone() for k, v in steady.export_weights()}
        steady.release()
        del steady
        parked = FSDPTrainer(cfg, AlgoConfig(), str(path), torch.device("cuda"))
        parked.create()
        for _ in range(3):
            batch.old_logp, _ = parked.logprobs(batch)
            parked.train_step(batch)
            weights = sum(p.to_local().numel() * p.element_size() for p in parked.model.parameters())
            keep = weights + (4 << 20)  # (the buffers, rounded)
            parked.trim()
            parked.stage_offload(keep)
            world.destroy()
            world.wait_destroyed()
            reserved = torch.cuda.memory_reserved()
            parked.offload(keep)
            assert parked.offloaded and not parked._keep_refused
            assert 0 < parked._park.kept <= keep
            # What moved went back to the driver: the allocator's reserve fell by about the optimizer state.
            assert reserved - torch.cuda.memory_reserved() >= 2 * weights - (8 << 20)
            world.rebuild()
            waits: list[object] = []  # device-wide waits in the onload: they would wait for the late copies too
            device_wide = torch.cuda.synchronize
            monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (waits.append(a), device_wide(*a))[1])
            parked.onload()
            monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
            assert parked._park.unsettled  # the optimizer state still on its way (settled at the step)
            assert not waits, "the onload waited for the whole device: the optimizer state's copies did not overlap"
        got = {k: v.detach().cpu() for k, v in parked.export_weights()}
        assert set(got) == set(want)
        for k in got:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    finally:
        torch.use_deterministic_algorithms(False)
        world.close()


def _ledger_rank(rank: int, world_size: int, model: str, log_dir: str) -> list[dict]:
    """A fresh process (its CUDA context measured at first touch): a trainer, an embedded engine
    on the same GPU, a one-rank NCCL world; the ledger after each transition."""
    from pathlib import Path

    from rltrain.batch import TrainBatch
    from rltrain.config import AlgoConfig, EngineConfig, TrainerConfig
    from rltrain.engine.client import EngineClient
    from rltrain.engine.command import server_command
    from rltrain.engine.launcher import NodeEngine
    from rltrain.engine.process import EngineProcess
    from rltrain.generation import SamplingParams
    from rltrain.runtime.ledger import MemoryLedger
    from rltrain.runtime.net import free_port
    from rltrain.runtime.world import World
    from rltrain.trainer.fsdp import FSDPTrainer

    world = World(backend="nccl", timeout=60)
    device = world.device
    port = free_port()
    engine = EngineProcess.start(
        server_command(EngineConfig(backend="embedded", device="cuda", dtype="bfloat16"), model, port),
        f"http://127.0.0.1:{port}",
        Path(log_dir) / "engine.log",
    )
    client = EngineClient(engine.url, retries=0)
    client.wait_healthy(300, alive=lambda: engine.alive)
    node = NodeEngine(client, engine.url, engine, world)
    trainer = FSDPTrainer(TrainerConfig(lr=1e-3, micro_batch_size=4, dtype="bfloat16"), AlgoConfig(), model, device)
    trainer.create()
    ledger = MemoryLedger(
        device, trainer.held_tensors, node.memory_report, world.communicator_bytes, world.cuda_context
    )
    B, L = 8, 64
    batch = TrainBatch(
        torch.randint(1, 8192, (B, L)),
        torch.ones(B, L, dtype=torch.long),
        torch.ones(B, L),
        advantages=torch.randn(B, L),
    )
    out = []
    try:
        batch.old_logp, _ = trainer.logprobs(batch)
        trainer.train_step(batch)
        torch.cuda.synchronize()
        params = sum(p.to_local().untyped_storage().nbytes() for p in trainer.model.parameters())
        out.append({"when": "trained", "params": params, **ledger.read()})
        trainer.offload()
        world.destroy()
        world.wait_destroyed()
        client.generate([[1, 2, 3]] * 8, SamplingParams(max_new_tokens=16))
        out.append({"when": "generating", **ledger.read()})
        client.release(["kv_cache", "weights"])
        world.rebuild()
        trainer.onload()
        out.append({"when": "engine released", **ledger.read()})
    finally:
        client.close()
        engine.stop()
        world.close()
    return out


def test_memory_ledger_accounts_for_the_gpu(tmp_path):
    """Every part of the ledger is measured; what they do not explain stays small (and shown)."""
    from models import make_model
    from multiproc import run_ranks, values

    model = make_model(tmp_path / "m", seed=3, vocab=8192, hidden=512, layers=2)
    trained, generating, released = values(run_ranks(_ledger_rank, 1, str(model), str(tmp_path), deadline_s=300))[0]
    gib = 2**30
    assert abs(trained["trainer_weights"] * gib - trained["params"]) < 2**20  # + buffers (rotary)
    assert trained["trainer_optimizer"] * gib >= 2 * trained["params"] * 0.99  # Adam moments
    assert trained["nccl"] > 0 and trained["cuda_context"] > 0.1 and trained["engine_context"] > 0.1
    assert trained["engine_weights"] > 0
    # Offloaded, world down: the trainer holds nothing on the device, its state is on the host.
    assert generating["trainer_weights"] == generating["trainer_optimizer"] == generating["nccl"] == 0
    assert generating["trainer_host"] * gib >= 3 * trained["params"] * 0.99
    assert released["engine_weights"] == 0 and released["engine_kv_cache"] < 0.01
    for row in (trained, generating, released):
        print(" ".join(f"{k}={v:.3f}" for k, v in row.items() if k != "when"))
        if "other_processes" in row:  # NVML per process: the engine's graphs and kernels are measured
            assert row["engine_outside"] >= 0
        # GiB. The device's baseline (the other tests' engine) is measured and shown apart; what
        # remains is mostly kernel code CUDA loads lazily after the contexts were measured (seen:
        # up to 0.29 GiB once the engine has generated).
        assert abs(row["unexplained"]) < 0.5, " ".join(f"{k}={v:.3f}" for k, v in row.items() if k != "when")


@pytest.mark.parametrize(
    "attention,compiled", [("auto", False), ("sdpa", False), ("auto", True)]
)  # auto: flex attention when packed on a GPU
def test_padding_free_packed_micro_batches_match_the_padded_path_on_the_gpu(tmp_path, attention, compiled):
    """bf16 on the H200: packed micro-batches (one row per micro-batch, per-sequence position ids)
    score and step as the padded path does, within bf16 noise, at other micro-batch boundaries;
    also with the packed trainer's blocks compiled (trainer.compile), whose fused kernels round
    differently from eager bf16: both are held to an fp32 reference, the compiled one no further
    from it than eager bf16 is."""
    from models import make_model
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.trainer.fsdp import FSDPTrainer
    from test_trainer import _varied_batch

    path = make_model(tmp_path / "m", seed=3, arch="qwen3", vocab=256, hidden=256, layers=2)
    batch = _varied_batch()
    out = {}
    for name, budget, dtype in (("fp32", 0, "float32"), ("padded", 0, "bfloat16"), ("packed", 40, "bfloat16")):
        cfg = TrainerConfig(
            dtype=dtype,  # type: ignore[arg-type]
            lr=1e-4,
            micro_batch_size=3,
            max_tokens_per_micro_batch=budget,
            attention=attention,
            compile=compiled and bool(budget),
        )
        t = FSDPTrainer(cfg, AlgoConfig(), str(path), torch.device("cuda", 0), total_steps=10)
        t.create()
        if budget:
            assert t.attention == ("flex_attention" if attention == "auto" else attention)
        lp, ent = t.logprobs(batch)
        batch.old_logp = lp
        stats = t.train_step(batch)
        out[name] = (lp, ent, stats)
        t.release()
    mask = batch.loss_mask.bool()
    lp_r = out["fp32"][0]
    (lp_a, ent_a, sa), (lp_b, ent_b, sb) = out["padded"], out["packed"]
    err = {k: float((lp[mask] - lp_r[mask]).abs().mean()) for k, (lp, _, _) in out.items()}
    assert err["padded"] < 0.03 and err["packed"] < max(0.03, 1.25 * err["padded"]), err
    assert (lp_a[mask] - lp_b[mask]).abs().mean() < 0.03
    assert (ent_a[mask] - ent_b[mask]).abs().mean() < 0.03
    assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=0.05)
    assert sa["entropy"] == pytest.approx(sb["entropy"], rel=0.02)


# ---------------------------------------------------------------------- the paged engine (#30)


@pytest.mark.parametrize("new", [False, True], ids=["cached", "new-kv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_kernel_matches_the_reference(dtype, new):
    """The kernel against the float64 reference; with `new`, both store the new keys and values
    in each row's last slot (the same pools after) and attend over them."""
    from rltrain.kernels.decode_attention import paged_decode_attention, reference_paged_decode_attention

    torch.manual_seed(0)
    B, kvh, groups, D, P, pool = 37, 8, 2, 128, 64, 300
    k = torch.randn(pool, kvh, P, D, device="cuda", dtype=dtype)
    v = torch.randn(pool, kvh, P, D, device="cuda", dtype=dtype)
    lens = torch.randint(1, 6 * P, (B,), device="cuda", dtype=torch.int32)
    table = torch.randperm(pool - 1, device="cuda")[: B * 8].reshape(B, 8).int() + 1  # (no page shared)
    q = torch.randn(B, kvh * groups, D, device="cuda", dtype=dtype)
    kn, vn = (torch.randn(B, kvh, D, device="cuda", dtype=dtype) for _ in range(2))
    kd, vd = k.double(), v.double()
    new_kv = (kn, vn) if new else ()
    out = paged_decode_attention(q, k, v, table, lens, D**-0.5, *new_kv)
    ref = reference_paged_decode_attention(q.double(), kd, vd, table, lens, D**-0.5, *(x.double() for x in new_kv))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max() < tol
    assert torch.equal(k.double(), kd) and torch.equal(v.double(), vd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_extend_kernel_compiled_reads_the_pages_like_the_reference(dtype):
    """The paged extend kernel compiled for the GPU against its torch reference: rows of new
    queries after 0 to 70 cached keys, GQA groups of 2 (Qwen3-1.7B's) and 8, bf16 and fp32; page
    tables of three widths served by one compiled kernel (a width used to compile its own)."""
    from rltrain.kernels import triton_extend
    from rltrain.kernels.extend_attention import paged_extend_attention, reference_paged_extend_attention

    def compiled() -> int:
        return sum(len(cache[0]) for cache in triton_extend._paged_extend_kernel.device_caches.values())

    for groups in (2, 8):
        g = torch.Generator(device="cuda").manual_seed(groups)
        kvh, D, P, pool = 4, 128, 16, 64
        k, v = (torch.randn(pool, kvh, P, D, generator=g, device="cuda").to(dtype) for _ in range(2))
        rows = [(0, 33), (70, 33), (15, 1), (16, 40), (33, 0)]
        pages = torch.randperm(pool - 1, generator=g, device="cuda") + 1
        starts = [sum(n for _, n in rows[:r]) for r in range(len(rows))]
        T = sum(n for _, n in rows)
        q = torch.randn(kvh * groups, T, D, generator=g, device="cuda").to(dtype).transpose(0, 1)
        for width in (8, 11, 9):
            table = pages[: len(rows) * width].view(len(rows), width).int()
            args = [
                table,
                *(
                    torch.tensor(x, dtype=torch.int32, device="cuda")
                    for x in (starts, [n for _, n in rows], [c for c, _ in rows])
                ),
            ]
            out = paged_extend_attention(q, k, v, *args, D**-0.5, max(n for _, n in rows), impl="triton")
            ref = reference_paged_extend_attention(q.float(), k.float(), v.float(), *args, D**-0.5)
            torch.testing.assert_close(out.float(), ref, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=0)
            if width == 8:
                kernels = compiled()
        assert compiled() == kernels


def test_compiled_blocks_in_decode_and_extend_prefills_generate_what_eager_blocks_do(model_a):
    """--enable-torch-compile: the blocks compiled for decode steps (inside CUDA graphs) and for
    prefills, whole and extending a prompt the prefix cache holds (a later turn's, its attention
    the extend kernel reading the pages in place): greedy tokens equal the eager engine's, which
    prefills the later turn whole, in fp32; log-probs to float rounding."""
    from rltrain.engine.embedded.engine import EmbeddedEngine

    eager = EmbeddedEngine(str(model_a), device="cuda", dtype="float32", decode="paged")
    compiled = EmbeddedEngine(str(model_a), device="cuda", dtype="float32", decode="paged", compile=True)
    try:
        assert compiled.decoder is not None and compiled.decoder.compiled
        greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        prompts = [[1, 2, 3], [5, 6, 7, 8] * 20, [9] * 64]
        assert eager.decoder.extend_impl == compiled.decoder.extend_impl == "triton"  # (it built and agreed)
        for turn in range(2):  # the second turn extends each first turn's cached prompt and answer
            eager.flush_cache()  # (prefilled whole: the extend kernel's reading of the pages against none)
            a = eager.submit(prompts, greedy, True).result(timeout=300)
            b = compiled.submit(prompts, greedy, True).result(timeout=300)
            assert [y["meta_info"]["cached_tokens"] > 0 for y in b] == [turn > 0] * len(prompts)
            assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b], turn
            for x, y in zip(a, b):
                la = [t[0] for t in x["meta_info"]["output_token_logprobs"]]
                lb = [t[0] for t in y["meta_info"]["output_token_logprobs"]]
                assert lb == pytest.approx(la, abs=1e-4)
            prompts = [p + x["output_ids"] + [11, 12, 13] for p, x in zip(prompts, a)]
        assert compiled.decoder.stats["prefills"] >= 2
    finally:
        eager.shutdown()
        compiled.shutdown()


def test_prefills_replayed_from_cuda_graphs_generate_what_queued_ones_do_at_a_fraction_of_the_host_time(model_a):
    """--enable-prefill-cuda-graph with compiled blocks: prefills, whole and extending the last
    turn's cached keys, replayed from graphs captured by token bucket (the start-up probe's among
    them, dropped with its pool), sample the greedy tokens the queued prefills do, in fp32; a
    release drops the graphs and the next rollout captures again; replayed, the model's forward
    costs the host less than half as much (the point of it: ~1 ms per layer queued)."""
    from rltrain.engine.embedded.engine import EmbeddedEngine

    kw = dict(device="cuda", dtype="float32", decode="paged", compile=True)
    queued = EmbeddedEngine(str(model_a), **kw)
    graphed = EmbeddedEngine(str(model_a), **kw, prefill_cuda_graph=True)
    try:
        greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        first = [[1, 2, 3], [5, 6, 7, 8] * 20, [9] * 64] * 8
        for cycle in range(3):  # 0; 1 after a release (captured again); 2 the same, replayed
            if cycle == 1:
                for e in (queued, graphed):
                    e.release(None)
                    e.resume(None)
            for e in (queued, graphed):
                e.flush_cache()  # (each cycle the same prefills)
            prompts = first
            before = {e: dict(e.decoder.stats) for e in (queued, graphed)}
            for turn in range(3):
                a = queued.submit(prompts, greedy, True).result(timeout=300)
                b = graphed.submit(prompts, greedy, True).result(timeout=300)
                assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b], (cycle, turn)
                for x, y in zip(a, b):
                    la = [t[0] for t in x["meta_info"]["output_token_logprobs"]]
                    lb = [t[0] for t in y["meta_info"]["output_token_logprobs"]]
                    assert lb == pytest.approx(la, abs=1e-4)
                prompts = [p + x["output_ids"] + [11, 12, 13] for p, x in zip(prompts, a)]
            spent = {
                e: (e.decoder.stats["prefill_model_s"] - before[e]["prefill_model_s"])
                / max(e.decoder.stats["prefills"] - before[e]["prefills"], 1)
                for e in (queued, graphed)
            }
            captures = graphed.decoder.stats["prefill_graph_captures"] - before[graphed]["prefill_graph_captures"]
            print(
                f"cycle {cycle}: a prefill's forward queued {spent[queued] * 1e3:.2f} ms, "
                f"replayed {spent[graphed] * 1e3:.2f} ms; {captures} captures"
            )
            assert (captures >= 1) if cycle < 2 else (captures == 0 and spent[graphed] < spent[queued] / 2)
    finally:
        queued.shutdown()
        graphed.shutdown()


def test_a_prefill_in_pieces_on_its_stream_beside_graphed_decode_steps_samples_what_one_at_once_does(model_a):
    """On CUDA a prefill admitted while rows decode is queued in pieces, on a stream of its own,
    between the running rows' graphed decode steps (batching.py, --enable-prefill-pieces): requests joining
    a running one, whole and extending cached keys, sample (greedy, fp32) what an engine that
    prefills at once samples for them, and the running row what it samples alone."""
    import time

    from rltrain.engine.embedded.engine import EmbeddedEngine

    once = EmbeddedEngine(str(model_a), device="cuda", dtype="float32", decode="paged", prefill_pieces=False)
    pieces = EmbeddedEngine(
        str(model_a), device="cuda", dtype="float32", decode="paged", compile=True, prefill_pieces=True
    )
    try:
        assert pieces.scheduler.paged is not None and pieces.scheduler.paged.prefill_pieces
        greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
        alone = once.submit([[4, 4, 4]], long, True).result(timeout=300)
        prompts = [[1, 2, 3], [5, 6, 7, 8] * 20, [9] * 64]
        for turn in range(2):  # the second turn extends each first turn's cached prompt and answer
            a = once.submit(prompts, greedy, True).result(timeout=300)
            steps = pieces.decoder.stats["decode_steps"]
            running = pieces.submit([[4, 4, 4]], long, True)
            while pieces.decoder.stats["decode_steps"] == steps:
                time.sleep(0.001)
            b = pieces.submit(prompts, greedy, True).result(timeout=300)
            assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b], turn
            assert [y["meta_info"]["cached_tokens"] > 0 for y in b] == [turn > 0] * len(prompts)
            assert running.result(timeout=300)[0]["output_ids"] == alone[0]["output_ids"]
            prompts = [p + x["output_ids"] + [11, 12, 13] for p, x in zip(prompts, a)]
        assert pieces.decoder.stats["prefills_in_pieces"] == 2
    finally:
        once.shutdown()
        pieces.shutdown()


def test_cuda_rows_joining_graphed_steps_with_their_first_tokens_unread_sample_what_they_do_alone(model_a):
    """On CUDA, requests admitted while a row decodes in graphed steps join with their first
    tokens still on the device (the next step queued behind their prefill before those are
    read: batching.py): with penalties, a logit bias, a stopping first token and a second turn
    extending cached keys, each samples (seeded, fp32) what it samples alone, the running row
    too; every page comes back."""
    import time

    from rltrain.engine.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(str(model_a), device="cuda", dtype="float32", decode="paged", compile=True)
    try:
        assert engine.decoder is not None and engine.decoder.cuda_graphs
        stats = engine.decoder.stats
        P = SamplingParams
        long = P(max_new_tokens=300, temperature=1.0, sampling_seed=3, ignore_eos=True, frequency_penalty=0.3)
        joiners = [
            ([[9, 9, 8], [5, 6, 7, 8] * 20], P(max_new_tokens=12, temperature=1.0, sampling_seed=4, n=2)),
            ([[4, 4, 4, 4]], P(max_new_tokens=8, temperature=1.0, sampling_seed=5, repetition_penalty=1.3)),
            ([[6, 5]], P(max_new_tokens=9, temperature=0.0, logit_bias={11: 2.0}, presence_penalty=0.5)),
            ([[2, 7, 2]], P(max_new_tokens=7, temperature=1.0, stop_token_ids=[17], logit_bias={17: 100.0})),
        ]
        ids = lambda out: [x["output_ids"] for x in out]  # noqa: E731
        for turn in range(2):  # the second: every prompt's keys cached by the first (extend prefills)
            if turn == 0:
                engine.flush_cache()
            alone = [ids(engine.submit(p, q, True).result(timeout=300)) for p, q in [([[1, 2, 3]], long), *joiners]]
            assert alone[4] == [[17]]
            if turn == 0:
                engine.flush_cache()
            unread = stats["admits_unread"]
            running = engine.submit([[1, 2, 3]], long, True)
            got = []
            for prompts, params in joiners:
                steps = stats["decode_steps"]
                while stats["decode_steps"] < steps + 3:
                    time.sleep(0.001)
                got.append(ids(engine.submit(prompts, params, True).result(timeout=300)))
            assert not running.done(), "the joiners waited for the running row"
            assert got == alone[1:], turn
            assert ids(running.result(timeout=300)) == alone[0], turn
            assert stats["admits_unread"] - unread == 5, turn
        engine.flush_cache()
        assert engine.decoder.pool is not None and engine.decoder.pool.free == engine.decoder.pool.pages - 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_paged_graphs_generate_what_the_plain_path_does(model_a, dtype):
    """The paged path on the GPU (CUDA graphs replayed, Triton decode attention, continuous
    batching) against transformers' own cache in the same engine class: greedy tokens equal
    (fp32: and transformers' greedy), log-probs equal to float rounding; seeded samples too."""
    from rltrain.engine.embedded.engine import EmbeddedEngine

    hf = EmbeddedEngine(str(model_a), device="cuda", dtype=dtype, decode="hf")
    paged = EmbeddedEngine(str(model_a), device="cuda", dtype=dtype, decode="paged")
    try:
        assert paged.decoder is not None and paged.decoder.cuda_graphs
        prompts = [[1, 2, 3], [5, 6, 7, 8] * 20, [9] * 64, [4, 4]]
        tol = 1e-4 if dtype == "float32" else 0.05
        for params in (
            SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
            SamplingParams(max_new_tokens=24, temperature=1.0, n=3, sampling_seed=7, ignore_eos=True),
        ):
            a = hf.submit(prompts, params, True).result(timeout=300)
            b = paged.submit(prompts, params, True).result(timeout=300)
            if dtype == "float32":
                assert [x["output_ids"] for x in a] == [y["output_ids"] for y in b]
            for x, y in zip(a, b):
                la = [t[0] for t in x["meta_info"]["output_token_logprobs"]]
                lb = [t[0] for t in y["meta_info"]["output_token_logprobs"]]
                same = next((i for i, (s, t) in enumerate(zip(x["output_ids"], y["output_ids"])) if s != t), len(la))
                assert same > 0 and lb[:same] == pytest.approx(la[:same], abs=tol)
        if dtype == "float32":
            greedy = paged.submit(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), False)
            assert [x["output_ids"] for x in greedy.result(timeout=300)] == hf_greedy(model_a, prompts, 8)
        assert paged.decoder.stats["graph_captures"] > 0
        plain = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        # Prefilled whole before and after (a resume empties the prefix cache): in bf16 a
        # prompt served from the cache may flip a near tie (the prefix-cache test's tolerance).
        paged.flush_cache()
        before = [x["output_ids"] for x in paged.submit(prompts, plain, False).result(timeout=300)]
        m0 = paged.memory_report()
        paged.release(["kv_cache", "cuda_graph"])
        m1 = paged.memory_report()
        assert m0["kv_cache_bytes"] > 0 and m1["kv_cache_bytes"] == 0
        assert m0["cuda_reserved"] - m1["cuda_reserved"] >= m0["kv_cache_bytes"]
        paged.resume(["kv_cache", "cuda_graph"])
        assert [x["output_ids"] for x in paged.submit(prompts, plain, False).result(timeout=300)] == before
    finally:
        hf.shutdown()
        paged.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_prefix_cache_serves_a_turns_prefix_and_samples_what_a_fresh_prefill_does(model_a, dtype):
    """The paged path's prefix cache on the GPU (its extend prefill over cached keys, CUDA graphs
    replayed for the decode): 64 trajectories' next turns extend their finished rows; only the
    new tokens are prefilled, and greedy tokens equal a fresh prefill's (fp32; bf16: log-probs
    to bf16's noise over the tokens both share). A release empties the cache."""
    from rltrain.engine.embedded.engine import EmbeddedEngine

    paged = EmbeddedEngine(str(model_a), device="cuda", dtype=dtype, decode="paged")
    try:
        greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        firsts = [[(7 * i + 3 * j) % 250 + 4 for j in range(50 + i)] for i in range(64)]
        outs = [x["output_ids"] for x in paged.submit(firsts, greedy, False).result(timeout=300)]
        turns = [f + o + [5, 6, 7] for f, o in zip(firsts, outs)]
        cached = paged.submit(turns, greedy, True).result(timeout=300)
        assert [x["meta_info"]["cached_tokens"] for x in cached] == [len(f) + 39 for f in firsts]
        paged.flush_cache()
        fresh = paged.submit(turns, greedy, True).result(timeout=300)
        assert all(x["meta_info"]["cached_tokens"] == 0 for x in fresh)
        tol = 1e-4 if dtype == "float32" else 0.05
        agree = 0
        for x, y in zip(cached, fresh):
            if dtype == "float32":
                assert x["output_ids"] == y["output_ids"]
            la = [t[0] for t in x["meta_info"]["output_token_logprobs"]]
            lb = [t[0] for t in y["meta_info"]["output_token_logprobs"]]
            same = next((i for i, (s, t) in enumerate(zip(x["output_ids"], y["output_ids"])) if s != t), len(la))
            assert la[:same] == pytest.approx(lb[:same], abs=tol)
            agree += same > 0
        # (bf16: a random model's greedy picks are near ties, which the two prefills' rounding may
        # split; most first tokens agree)
        assert agree == len(turns) if dtype == "float32" else agree >= 0.9 * len(turns)
        paged.release(["kv_cache", "cuda_graph"])
        paged.resume(["kv_cache", "cuda_graph"])
        again = paged.submit(turns[:4], greedy, False).result(timeout=300)
        assert all(x["meta_info"]["cached_tokens"] == 0 for x in again)
    finally:
        paged.shutdown()


def test_cuda_seeded_draw_kernel_picks_what_the_torch_ops_pick():
    """The fused seeded draw (kernels/triton_sampling.py) against sampling.py's torch ops on the
    same device: the same token for every row, -inf columns and all-(-inf) rows included."""
    from rltrain.engine.embedded.sampling import _row_hash, seeded_uniform
    from rltrain.kernels.triton_sampling import seeded_argmax

    torch.manual_seed(0)
    x = torch.randn(64, 151936, device="cuda")
    x[1, :1000] = float("-inf")
    x[2] = float("-inf")
    seeds = torch.randint(-(2**62), 2**62, (64,), device="cuda")
    steps = torch.randint(0, 4096, (64,), device="cuda")
    u = seeded_uniform(seeds, steps, x.shape[1])
    ref = torch.argmax(x - torch.log(-torch.log(u)).float(), dim=-1)
    assert torch.equal(seeded_argmax(x, _row_hash(seeds, steps)), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cuda_one_pass_sampling_matches_the_torch_ops(dtype, temperature):
    """The one-pass sampling kernel (what decode steps sample with on CUDA) against sampling.py's
    unfused ops on the same device, at the RL rollout's size: the same token for seeded and
    greedy rows, log-probs to float32 rounding; bf16 logits are read as they are."""
    from rltrain.engine.embedded.sampling import SamplingPlan, sample
    from rltrain.generation import SamplingParams

    torch.manual_seed(0)
    rows, vocab = 512, 151936
    x = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
    x[1, :100000] = float("-inf")
    params = [SamplingParams(temperature=0.0 if b % 7 == 3 else temperature) for b in range(rows)]
    seeds = [None if b % 7 == 3 else b * 7919 - 2**40 for b in range(rows)]
    steps = torch.randint(0, 4096, (rows,), device="cuda")
    plan = SamplingPlan(params, seeds, vocab, torch.device("cuda"))
    assert plan.fused
    got, got_lp = sample(x, plan, steps, torch.Generator(device="cuda"))
    plan.fused = False  # the torch ops (and the tested one-program-per-row draw)
    want, want_lp = sample(x, plan, steps, torch.Generator(device="cuda"))
    assert torch.equal(got, want)
    assert torch.allclose(got_lp, want_lp, atol=1e-4)


def test_cuda_unseeded_rows_draw_from_their_distribution_in_the_one_pass_kernel():
    """Rows with no seed sample in the fused pass too, keyed by a seed the engine's generator
    gives per row and step: their tokens follow softmax(logits / T) (counts within 5 sigma over
    8192 rows), their log-probs are the distribution's, a second step draws afresh, the same
    generator seed repeats the draws, and seeded rows beside them draw what they draw alone."""
    from rltrain.engine.embedded.sampling import SamplingPlan, sample
    from rltrain.generation import SamplingParams

    rows, vocab, dev = 8192, 151936, torch.device("cuda")
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], device=dev)
    x = torch.full((rows, vocab), float("-inf"), device=dev, dtype=torch.bfloat16)
    x[:, 1000:1004] = (probs.log() * 0.7).to(torch.bfloat16)  # temperature 0.7 undoes the 0.7
    params = [SamplingParams(temperature=0.7)] * rows
    plan = SamplingPlan(params, [None] * rows, vocab, dev)
    assert plan.fused
    gen = lambda: torch.Generator(device=dev).manual_seed(5)  # noqa: E731
    g = gen()
    first, lp = sample(x, plan, 0, g)
    second, _ = sample(x, plan, 1, g)
    counts = torch.bincount(first - 1000, minlength=4).float()
    expect = probs * rows
    assert ((counts - expect).abs() <= 5 * (expect * (1 - probs)).sqrt()).all(), counts.tolist()
    want_lp = x[0, 1000:1004].float().div(0.7).log_softmax(-1)[first - 1000]
    assert torch.allclose(lp, want_lp, atol=1e-5)
    assert not torch.equal(first, second)
    assert torch.equal(sample(x, plan, 0, gen())[0], first)
    seeds = [b * 31 if b % 2 else None for b in range(rows)]
    mixed, _ = sample(x, SamplingPlan(params, seeds, vocab, dev), 3, gen())
    alone, _ = sample(x[1::2], SamplingPlan(params[1::2], seeds[1::2], vocab, dev), 3, gen())
    assert torch.equal(mixed[1::2], alone)


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch_memory_saver") is None, reason="needs torch_memory_saver"
)
def test_cuda_memory_saver_keeps_the_graphs_through_release_and_resume(model_a, tmp_path):
    """The embedded engine with its memory saver (a real server process, preloaded): release
    gives the weights', the KV pool's and the graphs' device memory back (NVML, whole device);
    resume maps them at the same addresses, so the next generation replays the graphs captured
    before it (no capture) and gives the same tokens; ten cycles grow nothing; released weights
    without a backup come back as NaN until an update writes them."""
    from rltrain.runtime.ledger import device_used

    dev = torch.device("cuda", 0)
    srv = start_engine("embedded", model_a, tmp_path, device="cuda", memory_saver=True, weights_backup=True)
    try:
        info = srv.client.server_info()
        assert info["enable_memory_saver"] is True
        before = greedy(srv.client)
        assert before == hf_greedy(model_a, PROMPTS, 6)
        captures = srv.client.server_info()["decode_stats"]["graph_captures"]
        m0, used0 = srv.client.memory_report(), device_used(dev)
        released = []
        for cycle in range(10):
            srv.client.release()
            m1 = srv.client.memory_report()
            released.append(device_used(dev))
            assert m1["weight_bytes"] == 0 and m1["kv_cache_bytes"] == 0
            assert m1["cuda_reserved"] <= m0["cuda_reserved"] - m0["kv_cache_bytes"] - m0["weight_bytes"]
            assert used0 - released[-1] >= 0.95 * (m0["kv_cache_bytes"] + m0["weight_bytes"]), (used0, released)
            srv.client.resume()
            assert greedy(srv.client) == before, cycle
        assert srv.client.server_info()["decode_stats"]["graph_captures"] == captures  # replayed, not captured
        assert max(released) - min(released) <= 64 * 2**20, released
    finally:
        srv.client.close()
        srv.process.stop()
    srv = start_engine("embedded", model_a, tmp_path / "discard", device="cuda", memory_saver=True)
    try:
        before = greedy(srv.client)
        srv.client.release(["weights"])
        srv.client.resume(["weights"])
        with pytest.raises(AssertionError, match="update the weights before generating"):
            greedy(srv.client)
        srv.client.update_weights_from_disk(str(model_a), weight_version="again")
        assert greedy(srv.client) == before
    finally:
        srv.client.close()
        srv.process.stop()


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch_memory_saver") is None, reason="needs torch_memory_saver"
)
def test_with_the_memory_saver_every_prefill_bucket_is_captured_at_the_first_prefill_and_kept(model_a, tmp_path):
    """Prefill graphs with the memory saver (their default; a real server process, preloaded): the
    first prefill captures every bucket's graph (from padding only: no row's keys written), the
    first decode step every power of two of rows up to the engine's batch, and none is captured
    again, through releases, in later turns and rollouts; whole and extending prefills replayed
    from them sample the greedy tokens an engine without prefill graphs does."""
    from rltrain.config import EmbeddedEngineConfig
    from rltrain.engine.embedded.graphs import BUCKETS, PREFILL_BUCKETS

    rows = EmbeddedEngineConfig().max_batch_size
    sizes = len([s for s in BUCKETS if s < rows and not s & (s - 1)]) + 1

    kw = dict(device="cuda", memory_saver=True, weights_backup=True)
    graphed = start_engine("embedded", model_a, tmp_path, **kw)
    plain = start_engine("embedded", model_a, tmp_path / "plain", **kw, extra_args=["--disable-prefill-cuda-graph"])
    try:
        stats = graphed.client.server_info()["decode_stats"]  # (the start-up probe's captures)
        before = stats["prefill_graph_captures"], stats["graph_captures"]
        first = [[1, 2, 3], [5, 6, 7, 8] * 20, [9] * 64] * 4
        for cycle in range(3):
            prompts = first
            for turn in range(3):  # (later turns extend the last one's cached keys)
                a, b = (engine_greedy(srv.client, prompts, 12) for srv in (plain, graphed))
                assert a == b, (cycle, turn)
                stats = graphed.client.server_info()["decode_stats"]
                captures = stats["prefill_graph_captures"] - before[0], stats["graph_captures"] - before[1]
                assert captures == (len(PREFILL_BUCKETS), sizes), (cycle, turn, captures)
                prompts = [p + x + [11, 12, 13] for p, x in zip(prompts, a)]
            for srv in (plain, graphed):
                srv.client.release()
                srv.client.resume()
    finally:
        for srv in (graphed, plain):
            srv.client.close()
            srv.process.stop()


def test_cuda_checksums_by_the_kernel_equal_the_torch_ops_sums():
    """weights/checksum.py on a GPU sums through kernels/triton_checksum.py: every tensor's sums
    equal the torch path's (the definition, tested on the CPU) on the same device, for bf16
    weights of odd sizes and one of more than 2**31 words (8 GiB: int64 offsets inside the kernel)."""
    from rltrain.weights import checksum as integrity

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [
        torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        for n in (1, 2, 3, 4095 * 2, 4096 * 2 + 1, 151936 * 257)
    ]
    tensors.append(torch.randint(-(2**31), 2**31 - 1, ((1 << 31) + 7,), dtype=torch.int32, device="cuda", generator=g))
    rows = [integrity._device_sums(t) for t in tensors]
    assert all(r.shape[0] > 1 for r in rows[-2:])  # the kernel's rows, not one torch-path row
    got = [tuple(p) for p in integrity.fold(rows).tolist()]
    want = []
    for t in tensors:
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % 4)]).view(torch.int32)
        want.append(tuple(integrity._torch_sums(flat).tolist()))
    assert got == want


def test_cuda_checksums_in_one_launch_equal_one_launch_per_tensor():
    """`checksum.entries` sums the weights that are whole words in place in one kernel launch
    (kernels/triton_checksum.py: multi_block_sums); a tensor that is not (a view at an odd
    address, an odd number of bytes) goes one by one. Every tensor's sums equal `entry`'s."""
    from rltrain.weights import checksum as integrity

    g = torch.Generator(device="cuda").manual_seed(1)
    base = torch.randn(4096 * 3 + 3, device="cuda", generator=g).to(torch.bfloat16)
    named = [
        (f"w{i}", torch.randn(n, device="cuda", generator=g).to(torch.bfloat16))
        for i, n in enumerate((2, 8190, 8194, 151936 * 64))
    ]
    named += [
        ("empty", torch.empty(0, device="cuda")),
        ("odd", base[1:]),
        ("odd_bytes", base[:3]),
        ("int", base.view(torch.int16)[:4096].contiguous()),
    ]
    got = integrity.fetched(integrity.entries(named))  # batched, folded on the device (`Row`s)
    want = integrity.fetched({n: integrity.entry(t) for n, t in named})  # a launch each
    assert got == want and any(isinstance(e[2], integrity.Row) for e in integrity.entries(named).values())
    assert integrity.checksum(named) == integrity.combine({n: integrity.entry(t) for n, t in named})


def test_cuda_probe_scores_replayed_from_a_graph_follow_the_weights():
    """engine/embedded/scoring.py: a sequence scored a second time is captured in a CUDA graph;
    replays give what the eager forward gives, see weights updated in place (a sync), and weights
    moved to new addresses are captured again; after a release without the memory saver it stays
    eager (a capture per resume would cost more than it saves)."""
    import transformers

    from rltrain.engine.embedded.scoring import SequenceScorer

    cfg = transformers.Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    eager = SequenceScorer(model, torch.device("cuda"), None, graphs=False)
    scorer = SequenceScorer(model, torch.device("cuda"), None)
    ids = [int(t) for t in torch.randint(0, 512, (33,))]
    first = scorer.score(ids)
    assert scorer.captures == 0 and first == eager.score(ids)  # once: eager, no capture
    assert scorer.score(ids) == first and scorer.captures == 1
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # in place, as a sync writes
    replayed = scorer.score(ids)
    assert scorer.captures == 1 and replayed == eager.score(ids) and replayed != first
    for p in model.parameters():
        p.data = p.data.clone()  # new addresses
    assert scorer.score(ids) == eager.score(ids) and scorer.captures == 2
    scorer.drop(for_good=True)  # a release without the memory saver: eager from then on
    assert scorer.score(ids) == scorer.score(ids) == eager.score(ids) and scorer.captures == 2


def test_cuda_side_stream_checksums_equal_the_direct_ones_though_their_tensors_are_freed_and_reused():
    """weights/checksum.py's SideSums (the sync's sender and the embedded engine's landed sums):
    sums queued on a side stream after the copies that wrote their tensors equal those taken on
    the current stream, though each bucket's tensors are freed at once and their memory written
    over by the next (the side stream's reads keep it from reuse until they are done)."""
    from rltrain.weights.checksum import SideSums, entries, fetched

    side = SideSums(transient=True)
    g = torch.Generator(device="cuda").manual_seed(3)
    want: dict = {}
    got: dict = {}
    for i in range(6):
        named = [(f"b{i}.w{j}", torch.randn(1 << 22, device="cuda", generator=g).to(torch.bfloat16)) for j in range(4)]
        want.update(fetched(entries(named)))
        got.update(side.entries(named))
        del named
        for _ in range(4):  # the next bucket's allocations, written at once
            torch.full((1 << 21,), 7, dtype=torch.float32, device="cuda").mul_(3)
    side.join()
    assert fetched(got) == want
