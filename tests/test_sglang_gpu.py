"""Real SGLang on a GPU (run on the lent H200): its memory release, CUDA-IPC weight updates, the loop.

What CI cannot run (SGLang's memory release and CUDA IPC exist on CUDA only). On the lent H200
SGLang runs from the carried wheel set with the test-only stand-in for sglang-kernel
(tests/sglang_gpu_shim/README.md); with SGLang's own kernels installed the same tests run with
its default backends. Skipped where SGLang or a GPU is absent.

Device memory is read the way the loop's ledger reads it: NVML, the whole device and per process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch

from conftest import sglang_gpu_args, start_server
from models import QWEN2_160M
from rltrain.bench.models import save_random_qwen2
from rltrain.config import EngineConfig
from rltrain.engine.client import EngineClient
from rltrain.engine.launcher import NodeEngine
from rltrain.engine.process import EngineProcess
from rltrain.generation import SamplingParams
from rltrain.runtime.ledger import device_used, process_device_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang"),
]

MIB, GIB = 2**20, 2**30
DEVICE = torch.device("cuda", 0)
REPORT = Path(os.environ.get("RLTRAIN_GPU_REPORT", "")) if os.environ.get("RLTRAIN_GPU_REPORT") else None


def _report(name: str, data: dict) -> None:
    """What a test measured, kept as JSON where RLTRAIN_GPU_REPORT names a directory."""
    if REPORT is not None:
        REPORT.mkdir(parents=True, exist_ok=True)
        (REPORT / f"{name}.json").write_text(json.dumps(data, indent=1))


def _model(path: Path, seed: int) -> Path:
    """A Qwen2-shaped model (`QWEN2_160M`, bf16) with the synthetic task's tokenizer."""
    from rltrain.rollout import synthetic

    save_random_qwen2(path, QWEN2_160M, torch.bfloat16, seed, eos_token_id=QWEN2_160M.vocab - 1)
    synthetic.build_tokenizer(synthetic.addition_words()).save_pretrained(path)
    return path


def test_the_colocated_loop_on_sglang_for_twenty_steps(tmp_path):
    """The quickstart on one GPU with SGLang as the engine and CUDA-IPC sync: every step has a
    reward, no failed generation, a verified sync (version, SGLang's checksum read, the probe
    within bf16 tolerance), and a memory ledger per phase that accounts for the whole GPU, in
    which SGLang has let go of its weights and KV cache while the trainer trains. First in the
    file: no other test's engine is on the GPU yet; what the tests before it in this pytest
    process left on the GPU (their caches: run after test_gpu.py, 7.4 GiB of it counted as
    SGLang's while training, on an H100 on 2026-12-06) is measured first and set aside."""
    from multiproc import run_torchrun

    # (the ledger counts this pytest process among the "other processes", as it counts SGLang)
    held = 0.0
    if torch.cuda.is_initialized():
        mine = process_device_bytes(torch.device("cuda"))
        held = (mine.get(os.getpid(), 0) if mine is not None else device_used(torch.device("cuda"))) / 2**30

    args = ",".join(sglang_gpu_args())
    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    overrides = [
        "--config",
        str(config),
        f"run.dir={tmp_path}",
        f"model.path={tmp_path / 'base_model'}",
        "metrics.progress_bar=false",
        "engine.backend=sglang",
        "engine.device=cuda",
        "engine.dtype=bfloat16",
        "engine.mem_fraction_static=0.3",
        "engine.max_total_tokens=0",  # (the pool of the memory fraction: its release shows below)
        "engine.startup_timeout_s=600",
        f"engine.extra_args=[{args}]",
        "world.backend=nccl",
        "trainer.dtype=bfloat16",
        "model.build_hidden=256",
        "sync.transport=tensor",
        "loop.steps=20",
        "checkpoint.interval=0",
    ]
    r = run_torchrun(tmp_path, ["-m", "rltrain"], overrides, nproc=1, timeout_s=900)
    assert r.returncode == 0, r.stderr[-6000:]
    rows = [json.loads(x) for x in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    _report("sglang_loop", {"rows": rows})
    assert [row["step"] for row in rows] == list(range(1, 21))
    for row in rows:
        assert row["generation_failed"] == 0 and isinstance(row["reward_mean"], float)
        # SGLang's /weights_checker after every sync: reset before it, every parameter rewritten
        # (one engine: no other engine's digests to compare with)
        assert row["sync_rewrites_checked"] == 1 and row["sync_digests_compared"] == 0, row
        assert 0 <= row["sync_probe_diff"] < 0.1, row
        memory = row["memory"]["rank0"]
        assert {"rollout", "train"} <= set(memory), memory.keys()
        for phase, parts in memory.items():
            # The world's teardown runs in the background (world.async_destroy): until it ends its
            # communicators count, freed or not, so a phase that ends while it runs may show up to
            # their bytes below zero.
            low = -0.5 - (parts.get("nccl", 0.0) if phase in ("world_destroy", "trainer_offload") else 0.0)
            assert low < parts["unexplained"] < 0.5, (phase, parts)
        # SGLang is every other process on the GPU: its weights and KV cache (mem_fraction_static
        # 0.3 of the GPU) while generating, gone while the trainer trains.
        generating, training = memory["rollout"]["other_processes"], memory["train"]["other_processes"]
        generating, training = generating - held, training - held
        assert generating > 20.0 and training < 0.15 * generating, (generating, training, held)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sglang_gpu_models")
    return _model(root / "a", 1), _model(root / "b", 2)


@pytest.fixture(scope="module")
def sglang(models, tmp_path_factory):
    """SGLang serving model A on the GPU, with its memory saver (the launcher's, on CUDA)."""
    torch.zeros(1, device=DEVICE)  # this process's context first: the baseline includes it
    torch.cuda.synchronize()
    baseline = device_used(DEVICE)
    cfg = EngineConfig(
        backend="sglang",
        device="cuda",
        dtype="bfloat16",
        mem_fraction_static=0.3,
        startup_timeout_s=600,
        extra_args=sglang_gpu_args(),
    )
    log = tmp_path_factory.mktemp("sglang_gpu_logs") / "sglang.log"
    srv = start_server(cfg, models[0], log, request_timeout_s=300, retries=0)
    yield srv.client, srv.process, baseline
    srv.client.close()
    srv.process.stop()


def _engine_bytes(proc: EngineProcess) -> dict[int, int]:
    """NVML's device memory of each of the engine's processes that holds any (pid -> bytes)."""
    import psutil

    per_process = process_device_bytes(DEVICE)
    assert per_process is not None, "NVML cannot read device memory per process here"
    root = psutil.Process(proc.proc.pid)
    tree = {root.pid, *(c.pid for c in root.children(recursive=True))}
    return {pid: b for pid, b in per_process.items() if pid in tree}


def _generate_ok(client: EngineClient, n: int = 16) -> None:
    out = client.generate([[1, 2, 3, 4, 5]] * n, SamplingParams(max_new_tokens=32, temperature=1.0, ignore_eos=True))
    assert all(c.ok and len(c.output_ids) == 32 for c in out), [c.error for c in out if not c.ok]


def test_release_frees_what_sglang_held_and_resume_brings_it_back_over_ten_cycles(sglang):
    client, proc, baseline = sglang
    _generate_ok(client, 64)
    usage = client.server_info().get("internal_states", [{}])[0].get("memory_usage", {})
    held_weights_kv = (usage.get("weight", 0) + usage.get("kvcache", 0)) * GIB
    assert held_weights_kv > 10 * GIB, usage  # 0.3 of the H200's memory: weights and KV cache
    up = device_used(DEVICE)
    rows = []
    for cycle in range(10):
        t0 = time.perf_counter()
        client.pause("abort")
        client.release(NodeEngine.REGIONS)
        released_s = time.perf_counter() - t0
        released, by_process = device_used(DEVICE), _engine_bytes(proc)
        t0 = time.perf_counter()
        client.resume(["weights"])
        client.resume(["kv_cache", "cuda_graph"])
        client.continue_generation()
        resumed_s = time.perf_counter() - t0
        resumed = device_used(DEVICE)
        _generate_ok(client)  # the weights are back as they were (no sync here): it still generates
        rows.append(
            {
                "cycle": cycle,
                "release_s": released_s,
                "resume_s": resumed_s,
                "released": released,
                "resumed": resumed,
                "engine_released_by_pid": by_process,
            }
        )
    _report(
        "sglang_release_cycles",
        {"baseline": baseline, "up": up, "memory_usage_gb": usage, "cycles": rows},
    )
    for r in rows:
        # What the release freed covers the weights and KV cache SGLang reports it holds.
        assert up - r["released"] >= held_weights_kv * 0.98, (up, r, usage)
        # Resume brings back what it held (the allocator may settle a little after the first batch).
        assert abs(r["resumed"] - up) <= 256 * MIB, (up, r)
    # No growth over the cycles, released or resumed (NVML: whole device).
    assert max(r["released"] for r in rows) - min(r["released"] for r in rows) <= 64 * MIB, rows
    assert max(r["resumed"] for r in rows[1:]) - rows[1]["resumed"] <= 64 * MIB, rows


def _hf_logprobs(path: Path, tokens: list[int]) -> torch.Tensor:
    """The trainer's side: the log-probs of tokens[1:] under the HF model in bf16 on the GPU."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device=DEVICE)).logits[0, :-1].float()
    del model
    ids = torch.tensor(tokens[1:], device=DEVICE)
    return torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0].cpu()


def test_cuda_ipc_update_from_a_trainer_process_on_the_same_gpu(sglang, models):
    """rltrain's flattened buckets of model B, handed to SGLang by CUDA IPC inside one weight-update
    session: the version is set by the last bucket, SGLang's own checksum of what it loaded equals
    its checksum after loading model B from disk, the engine's log-probs match the trainer's
    (bf16), and neither side keeps bucket memory afterwards."""
    from safetensors.torch import load_file

    from rltrain.runtime.memory import free_cuda_caches
    from rltrain.sync.probe import CEILING, probe_error, random_tokens
    from rltrain.weights import bucket as payload

    client, proc, _ = sglang
    model_a, model_b = models
    tokens = random_tokens(32000, 64)
    trainer_lp = _hf_logprobs(model_b, tokens)
    free_cuda_caches()  # as the trainer does before the engine's phase (cuBLAS workspaces too)
    allocated0 = torch.cuda.memory_allocated(DEVICE)
    engine0 = sum(_engine_bytes(proc).values())
    state = sorted(load_file(str(model_b / "model.safetensors"), device="cuda").items())
    parts = [state[i::3] for i in range(3)]  # three buckets, the last one carries the version
    t0 = time.perf_counter()
    with client.weight_update_session():
        for k in range(len(parts)):
            bucket = payload.flatten_bucket(parts[k])
            torch.cuda.current_stream().synchronize()
            last = k == len(parts) - 1
            client.update_weights_from_tensor(
                [payload.serialize(bucket)],
                load_format="flattened_bucket",
                weight_version="ipc-b" if last else None,
                flush_cache=last,
            )
            del bucket
    update_s = time.perf_counter() - t0
    del state, parts
    torch.cuda.synchronize()
    parked = torch.cuda.memory_allocated(DEVICE)  # the last bucket, in torch's IPC limbo
    assert client.weight_version() == "ipc-b"
    by_ipc = client.weights_checker()
    engine_lp = client.score(tokens)
    error = probe_error("sglang", engine_lp, trainer_lp, CEILING["half"].mean)
    diff = float((torch.tensor(engine_lp) - trainer_lp).abs().mean())
    # No bucket memory left once the consumer has let go (rltrain's sync collects after its
    # session): the trainer's allocator is back where it was, the engine holds what it did.
    free_cuda_caches()
    allocated1 = torch.cuda.memory_allocated(DEVICE)
    engine1 = sum(_engine_bytes(proc).values())
    client.update_weights_from_disk(str(model_b), weight_version="disk-b")
    by_disk = client.weights_checker()
    client.update_weights_from_disk(str(model_a), weight_version="default")
    by_a = client.weights_checker()
    _report(
        "sglang_ipc_update",
        {
            "update_s": update_s,
            "probe_diff": diff,
            "trainer_allocated": [allocated0, parked, allocated1],
            "engine_bytes": [engine0, engine1],
            "checksums": [by_ipc, by_disk, by_a],
        },
    )
    assert error is None, error
    assert by_ipc == by_disk != by_a  # SGLang's own sha256 of its parameters: the IPC bytes are model B's
    assert allocated1 == allocated0, (allocated0, allocated1)
    assert abs(engine1 - engine0) <= 64 * MIB, (engine0, engine1)
