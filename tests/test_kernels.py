"""rltrain.kernels: the Triton kernels against float64 torch references, forward and backward.

On CPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py
before triton is first imported), so sizes stay tiny; on the H200 the same tests compile them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from multiproc import run_ranks, values  # noqa: E402
from rltrain.kernels import (  # noqa: E402
    linear_logprobs_entropy,
    logprobs_entropy,
    reference_linear_logprobs_entropy,
    reference_logprobs_entropy,
)

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _grads(fn, inputs, glogp, gent):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    logp, ent = fn(*inputs)
    ((logp * glogp).sum() + (ent * gent).sum()).backward()
    return logp.detach(), ent.detach(), [x.grad for x in inputs]


def _close(a, b, tol):
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.allclose(a, b, atol=tol, rtol=tol), f"max |diff| {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize(
    "rows,vocab,temperature,dtype",
    [
        (5, 37, 1.0, torch.float32),  # odd sizes, one block
        (3, 257, 0.7, torch.float32),  # temperature
        (4, 300, 1.0, torch.bfloat16),  # bf16 logits, float32 statistics
    ],
)
def test_logprob_entropy_kernel_matches_float64_reference(rows, vocab, temperature, dtype, monkeypatch):
    from rltrain.kernels import triton_logprob

    monkeypatch.setattr(triton_logprob, "BLOCK", 64)  # several vocabulary blocks per row even here
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype).to(DEV)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(DEV)
    glogp, gent = torch.randn(rows, generator=g).to(DEV), torch.randn(rows, generator=g).to(DEV)
    lp, ent, (gl,) = _grads(lambda x: logprobs_entropy(x, targets, temperature, impl="triton"), [logits], glogp, gent)
    rlp, rent, (rgl,) = _grads(
        lambda x: reference_logprobs_entropy(x.double(), targets, temperature), [logits], glogp.double(), gent.double()
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _close(lp, rlp, tol)
    _close(ent, rent, tol)
    assert gl.dtype == dtype
    _close(gl, rgl, tol)


def test_fused_linear_kernel_matches_float64_reference_in_chunks(monkeypatch):
    from rltrain.kernels import triton_logprob

    monkeypatch.setattr(triton_logprob, "BLOCK", 64)
    g = torch.Generator().manual_seed(1)
    n, h, v = 7, 24, 101
    hidden = torch.randn(n, h, generator=g).to(DEV)
    weight = (torch.randn(v, h, generator=g) / 4).to(DEV)
    targets = torch.randint(0, v, (n,), generator=g).to(DEV)
    glogp, gent = torch.randn(n, generator=g).to(DEV), torch.randn(n, generator=g).to(DEV)
    out = _grads(
        lambda a, b: linear_logprobs_entropy(a, b, targets, 0.9, chunk_tokens=3, impl="triton"),
        [hidden, weight],
        glogp,
        gent,
    )
    ref = _grads(
        lambda a, b: reference_linear_logprobs_entropy(a.double(), b.double(), targets, 0.9),
        [hidden, weight],
        glogp.double(),
        gent.double(),
    )
    for a, b in zip(out[:2] + tuple(out[2]), ref[:2] + tuple(ref[2])):
        _close(a, b, 1e-4)


def test_torch_statistics_path_equals_the_reference_and_masks_padding():
    """The torch twin of the kernels (used on CPU with a TP group) on a shard with padding
    columns: the padding neither counts in the softmax nor gets a gradient."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 40, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 33, (6,), generator=g)
    glogp, gent = torch.randn(6, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    for impl in ("torch", "triton"):
        x, tg, gl, ge = logits.float().to(DEV), targets.to(DEV), glogp.float().to(DEV), gent.float().to(DEV)
        lp, ent, (gx,) = _grads(lambda t: logprobs_entropy(t, tg, 1.3, valid=33, impl=impl), [x], gl, ge)
        rlp, rent, (rg,) = _grads(lambda t: reference_logprobs_entropy(t[:, :33], targets, 1.3), [logits], glogp, gent)
        _close(lp, rlp, 1e-5)
        _close(ent, rent, 1e-5)
        _close(gx[:, :33], rg[:, :33], 1e-5)
        assert (gx[:, 33:] == 0).all().item()


def _vocab_parallel_rank(rank: int, world_size: int, impl: str) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dev = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"  # else Triton's interpreter
    g = torch.Generator().manual_seed(3)
    vocab, padded, n, h = 29, 32, 5, 12  # 29 real tokens padded to 2 shards of 16
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(padded, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=g)
    glogp, gent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    shard = padded // world_size
    start = rank * shard
    valid = max(0, min(shard, vocab - start))
    group = dist.group.WORLD
    local_w = weight[start : start + shard].float().to(dev)
    lp, ent, (gh, gw) = _grads(
        lambda a, b: linear_logprobs_entropy(
            a, b, targets.to(dev), 0.8, group=group, vocab_start=start, valid=valid, chunk_tokens=2, impl=impl
        ),
        [hidden.float().to(dev), local_w],
        glogp.float().to(dev),
        gent.float().to(dev),
    )
    lp, ent, gh, gw = lp.cpu(), ent.cpu(), gh.cpu(), gw.cpu()
    dist.all_reduce(gh, group=group)  # the output layer's input gradient is summed over TP
    rlp, rent, (rgh, rgw) = _grads(
        lambda a, b: reference_linear_logprobs_entropy(a, b[:vocab], targets, 0.8), [hidden, weight], glogp, gent
    )
    dist.destroy_process_group()
    diff = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    return {
        "logp": diff(lp, rlp),
        "ent": diff(ent, rent),
        "gh": diff(gh, rgh),
        "gw": diff(gw[:valid], rgw[start : start + valid]),
        "pad_grad": gw[valid:].abs().max().item() if valid < shard else 0.0,
    }


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_vocab_parallel_over_two_real_ranks_matches_the_unsharded_reference(impl):
    """Two processes on gloo, each holding half of a padded vocabulary (the second half ends in
    padding), match the float64 reference of the whole model: values and both gradients."""
    # gloo between the ranks; on a GPU machine the Triton case runs compiled on CUDA tensors
    env = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
    for r in values(run_ranks(_vocab_parallel_rank, 2, impl, deadline_s=240, env=env)):
        assert max(r["logp"], r["ent"], r["gh"], r["gw"]) < 1e-4, r
        assert r["pad_grad"] == 0.0


def test_dispatch_uses_the_reference_on_cpu_and_refuses_unknown_impls():
    x, t = torch.randn(2, 5), torch.tensor([1, 4])
    assert all(torch.equal(a, b) for a, b in zip(logprobs_entropy(x, t), reference_logprobs_entropy(x, t)))
    with pytest.raises(ValueError, match="expected triton or torch"):
        logprobs_entropy(x, t, impl="cuda")


def test_pyproject_lists_every_package():
    """kernels/ is mapped to rltrain.kernels, so pyproject lists packages by hand: none missing."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(root).parts)
        for p in (root / "rltrain").rglob("__init__.py")
        if not p.parent.is_symlink()
    }
    assert found | {"rltrain.kernels"} == listed
    assert Path(sys.modules["rltrain.kernels"].__file__).resolve().parent == root / "kernels"


def test_trainer_with_the_fused_head_matches_the_unfused_loss_path(tmp_path, monkeypatch):
    """The FSDP2 trainer computes log-probs through the fused LM head; the same trainer with the
    head left alone (logits, then the log-softmax path on CPU, the logits kernel on CUDA) gives
    the same log-probs, entropies and GRPO step within float32 rounding."""
    from models import make_model
    from rltrain.batch import TrainBatch
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.trainer.causal_lm import LogprobHead
    from rltrain.trainer.fsdp import FSDPTrainer

    path = make_model(tmp_path / "m", seed=5, vocab=300, hidden=32, layers=2)
    g = torch.Generator().manual_seed(0)
    B, L = 4, 12
    batch = TrainBatch(
        torch.randint(1, 300, (B, L), generator=g),
        torch.ones(B, L, dtype=torch.long),
        torch.ones(B, L),
        advantages=torch.randn(B, L, generator=g),
    )
    results = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(LogprobHead, "fits", classmethod(lambda cls, head, config: False))
        t = FSDPTrainer(
            TrainerConfig(lr=1e-3, micro_batch_size=2, dtype="float32"),
            AlgoConfig(entropy_coef=0.01),
            str(path),
            torch.device(DEV),
            temperature=0.8,
        )
        t.create()
        assert isinstance(t.model.get_output_embeddings(), LogprobHead) == fused
        lp, ent = t.logprobs(batch)
        batch.old_logp = lp
        stats = t.train_step(batch)
        results[fused] = (lp, ent, stats, [p.detach().clone() for p in t.model.parameters()])
        t.release()
    (lp1, ent1, s1, w1), (lp0, ent0, s0, w0) = results[True], results[False]
    tol = 1e-5 if DEV == "cpu" else 1e-4  # on CUDA: the Triton kernels, float32 in another order
    _close(lp1, lp0, tol)
    _close(ent1, ent0, tol)
    for k in ("loss", "entropy", "grad_norm"):
        assert abs(s1[k] - s0[k]) <= tol * max(1.0, abs(s0[k])), (k, s1[k], s0[k])
    for a, b in zip(w1, w0):
        _close(a, b, tol)


def test_checksum_sums_of_many_tensors_in_one_launch_equal_the_definition():
    """kernels/triton_checksum.py's multi_block_sums (under the interpreter on the CPU): each
    tensor's rows, folded, are the torch path's sums of its words (weights/checksum.py's
    definition), for sizes around a block's edge, an empty tensor and int32 extremes; a view at
    an odd address is refused (`checksum.entries` sums those one by one)."""
    from rltrain.kernels.triton_checksum import multi_block_rows, multi_block_sums
    from rltrain.weights import checksum as integrity

    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(n, generator=g).to(torch.bfloat16) for n in (2, 2 * 65535, 2 * 65536, 2 * 65537, 65536 * 2 * 3 + 6)
    ]
    tensors += [torch.empty(0), torch.tensor([-(2**31), 2**31 - 1, -1, 7], dtype=torch.int32)]
    got = integrity.fold(multi_block_sums(tensors, integrity.BLOCK)).tolist()
    want = [integrity._torch_sums(t.reshape(-1).view(torch.int32)).tolist() for t in tensors]
    assert got == want
    # Folded where they were summed (`checksum.entries`' batches on a GPU), and fetched as `Row`s
    # beside rows of partial sums and sums already ints: the same sums, each under its name.
    batch = integrity.fold_rows(*multi_block_rows(tensors, integrity.BLOCK))
    assert batch.tolist() == want
    sums = {f"r{i}": ("int32", (1,), integrity.Row(batch, i)) for i in range(len(tensors))}
    sums |= {"loose": ("int32", (1,), integrity._device_sums(tensors[3])), "ints": ("int32", (1,), (5, 7))}
    assert integrity.fetched(sums) == {
        **{f"r{i}": ("int32", (1,), tuple(w)) for i, w in enumerate(want)},
        "loose": ("int32", (1,), tuple(want[3])),
        "ints": ("int32", (1,), (5, 7)),
    }
    with pytest.raises(ValueError, match="4-byte aligned"):
        multi_block_sums([torch.zeros(9, dtype=torch.bfloat16)[1:]], integrity.BLOCK)


@pytest.mark.parametrize("nbytes", [3, 4 * 4096 + 8, 3 * 4 * 4096 - 2])
def test_a_kernels_copy_writes_every_byte_of_the_source_and_nothing_past_it(nbytes):
    """kernels/triton_copy.py: the SMs' copy (on a GPU from page-locked host memory, read over the
    bus), words where the size allows, bytes where it does not; a size mismatch is refused."""
    from rltrain.kernels.triton_copy import sm_copy

    g = torch.Generator().manual_seed(nbytes)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if DEV == "cuda":
        src = src.pin_memory()
    dst = torch.zeros(nbytes + 8, dtype=torch.uint8, device=DEV)
    sm_copy(dst[:nbytes], src, block=1024)
    assert torch.equal(dst[:nbytes].cpu(), src.cpu())
    assert not dst[nbytes:].any(), "the copy wrote past its end"
    with pytest.raises(ValueError, match="bytes into"):
        sm_copy(dst, src)
