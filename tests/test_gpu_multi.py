"""Runs that need two GPUs of one host (issue #12; the lent `nvidia-h200-x2`), skipped elsewhere.

The CPU tests' own rank functions (test_megatron.py) run here on NCCL, one GPU per rank, with
megatron-core unpatched: TP=2, DP=2 and EP=2 against the HF model, a GRPO step, a world rebuild,
weight sync to embedded engines on the second GPU (expert routing over NCCL, checked by each
engine's checksum), and release-train; then the whole loop under torchrun on both GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices of one host"),
]
pytest.importorskip("megatron.core")

from conftest import start_engine  # noqa: E402
from models import make_model, make_moe_model  # noqa: E402
from multiproc import run_ranks, values  # noqa: E402
from test_checkpoint import assert_bitwise_equal, final_weights, rows  # noqa: E402
from test_loop import run_quickstart  # noqa: E402
from test_megatron import (
    _batch,
    _hf_logprobs,
    _hf_state,
    _megatron_rank,
    _moe_rank,
    _resume_rank,  # noqa: E402
    assert_rows_match,
)
from test_trainer import _gather_rank  # noqa: E402

# cuBLAS repeats bitwise only with a fixed workspace (read when a process makes its first handle).
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# The engines run on the second GPU: NCCL refuses a group with two members on one device, and
# the weight-update group joins the trainer's rank 0 (GPU 0) with the engine.
ON_GPU1 = {"CUDA_VISIBLE_DEVICES": "1"}
LOGP_ATOL = 5e-5  # fp32 on the GPU (TF32 off) against the HF model in fp32 on the CPU


def _engine(path: Path, log_dir: Path, *extra: str):
    return start_engine("embedded", path, log_dir, env=ON_GPU1, device="cuda", extra_args=list(extra))


def test_full_tensors_gathers_row_shards_over_nccl():
    """The FSDP2 trainer's export gathers a chunk of parameters with one NCCL all-gather."""
    for rank, r in enumerate(values(run_ranks(_gather_rank, 2, "cuda", deadline_s=120))):
        assert all(r["equal"]) and all(r["dtypes"]), r
        assert r["shards"] == [x[rank] for x in [[3, 3], [3, 2], [1, 0], [4, 3], [1, 1]]]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    path = make_model(root / "m", seed=11, arch="qwen3")
    engine = _engine(path, root)
    try:
        tp2 = values(
            run_ranks(
                _megatron_rank,
                2,
                str(path),
                2,
                engine.process.url,
                str(root / "w"),
                False,
                1,
                "cuda",
                deadline_s=400,
                env=ENV,
            )
        )
        dp2 = values(
            run_ranks(
                _megatron_rank, 2, str(path), 1, None, str(root / "w2"), False, 1, "cuda", deadline_s=400, env=ENV
            )
        )
    finally:
        engine.client.close()
        engine.process.stop()
    return path, tp2, dp2


def test_megatron_tp2_and_dp2_across_two_gpus_match_hf_and_take_the_same_step(dense):
    path, tp2, dp2 = dense
    full = _batch(0, n=8)
    ref = _hf_logprobs(path, full)
    hf = _hf_state(path)
    for runs in (tp2, dp2):
        for rank, r in enumerate(runs):
            assert_rows_match(r, "lp_before", rank, full, ref, atol=LOGP_ATOL)
            assert r["stats"]["grad_norm"] > 0 and not torch.equal(r["lp_after"], r["lp_before"])
            # After destroy/rebuild of the NCCL world the re-made modules give the same log-probs.
            assert torch.allclose(r["lp_cycled"], r["lp_after"], atol=1e-6, rtol=0)
            assert torch.isfinite(torch.tensor(r["stats2"]["grad_norm"]))
            assert len([n for n, t in hf.items() if not torch.equal(r["weights"][n], t)]) == len(hf)
        for n in hf:
            assert torch.equal(runs[0]["weights"][n], runs[1]["weights"][n]), n
    assert tp2[0]["stats"]["grad_norm"] == pytest.approx(dp2[0]["stats"]["grad_norm"], rel=1e-4)
    for n in hf:
        assert (tp2[0]["weights"][n] - dp2[0]["weights"][n]).abs().max() < 1e-4, n
    # A disk sync from TP=2 to the engine on GPU 1 passed the engine's checksum.
    assert [r["synced"] for r in tp2] == ["7", "7"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    path = make_moe_model(root / "moe", seed=2)
    engines = [_engine(path, root / f"ep{r}", "--ep-size", "2", "--ep-rank", str(r)) for r in range(2)]
    try:
        ep1 = values(
            run_ranks(_moe_rank, 2, str(path), 1, str(root), None, "distributed", "cuda", deadline_s=400, env=ENV)
        )
        ep2 = values(
            run_ranks(
                _moe_rank,
                2,
                str(path),
                2,
                str(root),
                [e.process.url for e in engines],
                "distributed",
                "cuda",
                deadline_s=400,
                env=ENV,
            )
        )
        loaded = [e.client.weights_checksum() for e in engines]
    finally:
        for e in engines:
            e.client.close()
            e.process.stop()
    return path, ep1, ep2, loaded


def test_megatron_ep2_across_two_gpus_matches_hf_and_routes_experts_over_nccl(moe):
    """Qwen3-MoE with its experts split over the two GPUs (EP=2): log-probs match the HF model, the
    step equals the replicated-expert run's, a checkpoint resumes exactly, and the `distributed`
    sync (NCCL from GPU 0 to two engines that are EP ranks 0 and 1) sends each only its experts."""
    path, ep1, ep2, loaded = moe
    full = _batch(2, n=4)
    ref = _hf_logprobs(path, full)
    hf = _hf_state(path)
    for runs in (ep1, ep2):
        for rank, r in enumerate(runs):
            assert_rows_match(r, "lp", rank, full, ref, atol=LOGP_ATOL)
            for n, w in r["weights"].items():
                assert torch.equal(r["resumed"][n], w), n
    assert len(ep1[0]["held"]) == 2 * 2 * 4 and len(ep2[0]["held"]) == 2 * 2 * 2
    assert ep2[0]["stats"]["grad_norm"] == pytest.approx(ep1[0]["stats"]["grad_norm"], rel=1e-5)
    for n in hf:
        assert (ep2[0]["weights"][n] - ep1[0]["weights"][n]).abs().max() < 1e-4, n
    total = sum(t.numel() * t.element_size() for t in hf.values())
    experts = sum(t.numel() * t.element_size() for n, t in hf.items() if ".experts." in n)
    s = ep2[0]["synced"]
    assert s["routed"] and s["versions"] == ["5", "5"]
    assert s["bytes_to"] == [total - experts // 2] * 2
    assert [x["bytes_loaded"] for x in loaded] == s["bytes_to"] and [x["weight_version"] for x in loaded] == ["5", "5"]
    print(
        f"\nexpert routing over NCCL, EP=2: bytes to each engine EP rank routed {s['bytes_to']}, "
        f"unrouted {[total, total]} (experts {experts} of {total} bytes)"
    )


@pytest.mark.parametrize("tp,dist_opt", [(2, False), (1, True)], ids=["tp2", "dp2-distributed-optimizer"])
def test_megatron_release_and_resume_across_two_gpus_are_exact(tmp_path, tp, dist_opt):
    """Release the trainer (every GPU byte), re-create it from the checkpoint and from a host
    snapshot: the next steps equal the run that never released, bitwise."""
    path = make_model(tmp_path / "m", seed=11, arch="qwen3")
    for r in values(
        run_ranks(_resume_rank, 2, str(path), str(tmp_path), tp, dist_opt, 1, "cuda", deadline_s=400, env=ENV)
    ):
        assert r["steps"] == 3
        for n, w in r["straight"].items():
            assert torch.equal(r["resumed"][n], w), n


DET = (
    "engine.deterministic=true",
    "trainer.deterministic=true",
    "rollout.max_new_tokens=2",
    "loop.steps=4",
    "checkpoint.interval=2",
)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_release_train_across_two_gpus_equals_a_run_without_release(tmp_path, backend):
    """The quickstart loop under torchrun on both GPUs (FSDP2 sharded over them, or megatron at
    TP=2), colocated with the embedded engine on GPU, NCCL world destroyed and rebuilt every step:
    releasing the trainer after every step and re-creating it from its checkpoint changes nothing,
    bitwise. Every step's disk sync passed the engine's checksum (a mismatch fails the step)."""
    extra = ("trainer.backend=megatron", "trainer.tensor_parallel_size=2") if backend == "megatron" else ()
    straight = tmp_path / "straight"
    released = tmp_path / "released"
    for d, more in ((straight, ()), (released, ("release.train=true", "release.source=disk"))):
        d.mkdir()
        r = run_quickstart(d, *DET, *extra, *more, env=ENV)
        assert r.returncode == 0, r.stderr[-4000:]
    a, b = rows(straight / "quickstart"), rows(released / "quickstart")
    assert [x["step"] for x in a] == [1, 2, 3, 4] and a == b
    # The engine sampled with the weights the trainer holds (gathered from both GPUs and synced).
    assert all(x["logp_diff_engine_trainer"] < 1e-2 for x in a), [x["logp_diff_engine_trainer"] for x in a]
    assert_bitwise_equal(final_weights(straight / "quickstart", 4), final_weights(released / "quickstart", 4))
    ledger = json.loads((released / "quickstart" / "metrics.jsonl").read_text().splitlines()[-1])["memory"]
    assert set(ledger) == {"rank0", "rank1"}  # the ledger holds per rank
    for rank in ledger.values():
        assert rank["rollout"].get("trainer_weights", 0.0) == 0.0  # released: nothing of the trainer while generating
