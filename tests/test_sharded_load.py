"""The FSDP trainer loads HF checkpoints sharded (weights/hf_sharded.py): on real gloo ranks every
rank's shards and buffers equal, bit for bit, what `from_pretrained` + sharding gives — the policy,
the reference model, and the release-train re-creations — and no rank's host memory grows by the
whole model while it loads. A checkpoint that does not fit the model is refused before anything is
copied."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

from models import ARCHS, make_moe_model, tiny
from multiproc import run_ranks, values

# (directory name, trainer dtype, trainer.compile) of the checkpoints `checkpoints` writes.
CASES = [
    ("qwen3-tied-bf16-one-file", "float32", False),
    ("qwen2-untied-fp32-index", "float32", True),
    ("qwen3-moe-3-experts-fp32", "bfloat16", False),
]


def _save(path: Path, arch: str, dtype: torch.dtype, tied: bool, vocab: int, seed: int, **save: object) -> Path:
    cfg_cls, model_cls = ARCHS[arch]
    cfg = cfg_cls(**{**tiny(vocab=vocab).config_kwargs(), "tie_word_embeddings": tied}, pad_token_id=0)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype)
    model.save_pretrained(path, **save)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpts")
    # 250 rows of embedding: uneven shards over 4 ranks (63, 63, 63, 61).
    _save(root / CASES[0][0], "qwen3", torch.bfloat16, tied=True, vocab=250, seed=1)
    _save(root / CASES[1][0], "qwen2", torch.float32, tied=False, vocab=256, seed=2, max_shard_size="100KB")
    assert (root / CASES[1][0] / "model.safetensors.index.json").is_file()
    assert len(list((root / CASES[1][0]).glob("*.safetensors"))) > 1
    # 3 experts: uneven over 2 ranks, one rank without any over 4.
    make_moe_model(root / CASES[2][0], seed=3, experts=3)
    return root


def _todays_model(path: str, dtype: str, compile: bool) -> torch.nn.Module:
    """The model as the trainer built it before sharded loading: from_pretrained, then sharded."""
    from rltrain.trainer.causal_lm import LogprobHead, compile_blocks
    from rltrain.trainer.sharding import shard

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    head = model.get_output_embeddings()
    if LogprobHead.fits(head, model.config):
        model.set_output_embeddings(LogprobHead(head))
    if compile:
        compile_blocks(model)
    shard(model, torch.device("cpu"))
    return model


def _bits(t: torch.Tensor) -> torch.Tensor:
    from rltrain.runtime.internals import local_shard as local

    return local(t).detach().contiguous().reshape(-1).view(torch.uint8)


def _differences(new: torch.nn.Module, old: torch.nn.Module, buffers_only: bool = False) -> list[str]:
    """Where `new` differs from `old` on this rank: names, tying, and every local shard and buffer
    (dtype, shape, bits)."""
    out = []
    for kind, a, b in (
        (
            "parameter",
            dict(new.named_parameters(remove_duplicate=False)),
            dict(old.named_parameters(remove_duplicate=False)),
        ),
        ("buffer", dict(new.named_buffers()), dict(old.named_buffers())),
    ):
        if set(a) != set(b):
            out.append(f"{kind} names differ: {sorted(set(a) ^ set(b))[:5]}")
            continue
        if kind == "parameter" and buffers_only:
            continue
        for n in b:
            x, y = _bits(a[n]), _bits(b[n])
            if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or not torch.equal(x, y):
                out.append(f"{kind} {n}: {a[n].dtype} {tuple(a[n].shape)} vs {b[n].dtype} {tuple(b[n].shape)}")
    tied = lambda m: m.get_output_embeddings().weight is m.get_input_embeddings().weight  # noqa: E731
    if tied(new) != tied(old):
        out.append(f"tied: {tied(new)}, from_pretrained's: {tied(old)}")
    return out


def _equal_rank(rank: int, world_size: int, root: str) -> dict[str, list[str]]:
    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.world import World
    from rltrain.trainer.fsdp import FSDPTrainer
    from rltrain.weights import hf_sharded

    world = World(backend="gloo", timeout=60)
    found: dict[str, list[str]] = {}
    try:
        for name, dtype, compile in CASES:
            path = str(Path(root) / name)
            t = FSDPTrainer(
                TrainerConfig(dtype=dtype, compile=compile), AlgoConfig(kl_coef=0.1), path, torch.device("cpu")
            )
            t.create()
            old = _todays_model(path, dtype, compile)
            found[f"{name} policy"] = _differences(t.model, old)
            found[f"{name} reference"] = _differences(t.ref_model, old)
            if name.startswith("qwen3-tied"):
                # Release-train: a re-creation from the host snapshot (the reference re-read)...
                snap = t.snapshot()
                t.release()
                t.restore_snapshot(snap)
                found[f"{name} restored policy"] = _differences(t.model, old)
                found[f"{name} restored reference"] = _differences(t.ref_model, old)
                # ... and the architecture for a DCP checkpoint: tied, buffers computed.
                t.release()
                t.create(load_weights=False)
                found[f"{name} re-created for a checkpoint"] = _differences(t.model, old, buffers_only=True)
            if "moe" in name:
                # The general path for converted weights (indices of the whole tensor), forced.
                hf_sharded._expert_rows = lambda *a: False
                t = FSDPTrainer(TrainerConfig(dtype=dtype), AlgoConfig(), path, torch.device("cpu"))
                t.create()
                found[f"{name} policy, general conversion"] = _differences(t.model, old)
        return found
    finally:
        world.close()


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_rank_loads_its_shards_as_from_pretrained_and_sharding_give_them(checkpoints, ranks):
    """Tied (single file, bf16 read as fp32, uneven rows), untied (index of several files,
    compiled blocks), MoE (converted experts, fp32 read as bf16, a rank with no expert): policy,
    reference, and the release-train re-creations, bitwise on every rank."""
    for rank, found in enumerate(values(run_ranks(_equal_rank, ranks, str(checkpoints), deadline_s=120))):
        assert all(not v for v in found.values()), (rank, {k: v for k, v in found.items() if v})
        assert len(found) == 2 * len(CASES) + 4


def test_a_compiled_module_and_no_process_group_load_whole_tensors(checkpoints):
    """Without torch.distributed every tensor is read whole; a module compiled as a module (names
    with `_orig_mod.`) reads the checkpoint's names."""
    from rltrain.runtime import internals
    from rltrain.weights.hf_sharded import load_hf_checkpoint

    path = checkpoints / CASES[1][0]
    cfg = transformers.AutoConfig.from_pretrained(path)
    with internals.no_init_weights(), torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.model.layers[0] = torch.compile(model.model.layers[0])  # compiled on first call only
    model.to_empty(device="cpu")
    assert any("._orig_mod." in n for n, _ in model.named_parameters())
    read = load_hf_checkpoint(model, path)
    old = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    new = {n.replace("._orig_mod", ""): t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    want = dict([*old.named_parameters(), *old.named_buffers()])
    assert set(new) == set(want)
    assert all(torch.equal(_bits(new[n]), _bits(want[n])) for n in want)
    assert read == sum(t.numel() * t.element_size() for t in old.state_dict().values())


def _meta_model(path: Path) -> torch.nn.Module:
    from rltrain.runtime import internals

    cfg = transformers.AutoConfig.from_pretrained(path)
    with internals.no_init_weights(), torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in model.parameters():
            t.fill_(float("nan"))
    return model


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_copied(tmp_path):
    """Missing weights, names the model lacks and shapes that differ are all named in one error;
    no model tensor was written. The trainer's create() says the same."""
    from safetensors.torch import load_file, save_file

    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.trainer.fsdp import FSDPTrainer
    from rltrain.weights.hf_sharded import CheckpointMismatch, load_hf_checkpoint

    path = _save(tmp_path / "m", "qwen2", torch.float32, tied=False, vocab=256, seed=4)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(128, 64)
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = _meta_model(path)
    with pytest.raises(CheckpointMismatch) as e:
        load_hf_checkpoint(model, path)
    msg = str(e.value)
    assert "1 model weights missing from it, e.g. ['model.layers.1.mlp.up_proj.weight']" in msg, msg
    assert "1 names the model lacks, e.g. ['model.layers.9.mlp.up_proj.weight']" in msg, msg
    assert "model.norm.weight: checkpoint [65], model [64]" in msg, msg
    assert all(bool(t.isnan().all()) for t in model.parameters())  # nothing copied
    t = FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), str(path), torch.device("cpu"))
    with pytest.raises(CheckpointMismatch, match=re.escape("does not fit Qwen2ForCausalLM")):
        t.create()


def test_a_directory_without_safetensors_is_refused_saying_what_the_trainer_reads(tmp_path):
    from rltrain.trainer.fsdp import FSDPTrainer  # noqa: F401 - (the trainer's import of the reader)
    from rltrain.weights.hf_sharded import load_hf_checkpoint

    path = _save(tmp_path / "m", "qwen2", torch.float32, tied=False, vocab=256, seed=5)
    model = _meta_model(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="reads HF safetensors checkpoints"):
        load_hf_checkpoint(model, path)


# ---------------------------------------------------------------- host memory while loading

# Wide and shallow: ~420 MB in fp32, its largest tensor 64 MiB (the embedding and each MLP matrix).
WIDE = dict(vocab_size=8192, hidden_size=2048, intermediate_size=4096, num_hidden_layers=2,
            num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024)  # fmt: skip
# The bound: 1.5 x its share of the model covers the shards and the pages of the file the reader
# maps (at most REMAP_BYTES plus the read that crosses it, <= 32 MiB here); MARGIN covers the
# interpreter's own allocations while it builds the modules and their FSDP2 state. Loading with
# from_pretrained first exceeds it (and exceeds the whole model's bytes): the test fails on that.
MARGIN = 64 << 20


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) << 10  # type: ignore[union-attr]


def _memory_rank(rank: int, world_size: int, path: str) -> dict[str, int]:
    import gc

    from rltrain.config import AlgoConfig, TrainerConfig
    from rltrain.runtime.world import World
    from rltrain.trainer.fsdp import FSDPTrainer

    world = World(backend="gloo", timeout=60)
    try:
        t = FSDPTrainer(TrainerConfig(dtype="float32"), AlgoConfig(), path, torch.device("cpu"))
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
        before = _status("VmRSS")
        t.create()
        peak = _status("VmHWM")
        shard = sum(p.to_local().numel() * p.element_size() for p in t.model.parameters())
        return {"grown": peak - before, "shard": shard}
    finally:
        world.close()


def test_no_rank_holds_the_whole_model_in_host_memory_while_loading(tmp_path):
    """2 ranks load a ~420 MB model: each one's resident memory grows by its half (and the
    reader's bounded mapping), never by the whole model, as it did when every rank ran
    from_pretrained before sharding."""
    cfg = transformers.Qwen2Config(**WIDE, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(tmp_path / "wide")
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    del model
    assert 300e6 < total < 600e6
    ranks = values(run_ranks(_memory_rank, 2, str(tmp_path / "wide"), deadline_s=150, fresh=True))
    for r in ranks:
        assert r["shard"] == total // 2
        assert r["grown"] <= 1.5 * total / 2 + MARGIN, (r, total)
        assert r["grown"] < total, (r, total)


def test_converted_expert_reads_share_one_row_of_indices_per_weight_kind(tmp_path, monkeypatch):
    """The reads of transformers' fused experts share one expert row's element indices per
    weight kind (every layer's and every expert's, each offset to its row): the plan holds 8 bytes
    per element of one row per kind, not of every expert of every layer, and the model loads the
    same. A conversion that keeps no expert per row needs indices over its whole tensor: above
    GENERAL_INDEX_BYTES it is refused, naming the weight, before anything is read."""
    from rltrain.weights import hf_sharded

    path = make_moe_model(tmp_path / "moe", seed=5, experts=4, layers=3)
    model = _meta_model(path)
    reads = hf_sharded.plan_reads(model, hf_sharded.stored_tensors(path), path)
    indices = {id(r.index): r.index for r in reads if r.index is not None}
    kinds = {re.sub(r"\.\d+\.", ".#.", n): p for n, p in model.named_parameters() if "experts" in n}
    row_bytes = sum(p[0].numel() * 8 for p in kinds.values())
    assert len(reads) > len(indices) and sum(i.nbytes for i in indices.values()) <= row_bytes, (len(indices), kinds)
    hf_sharded.load_hf_checkpoint(model, path)
    want = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert all(torch.equal(t, want[n]) for n, t in model.state_dict().items())

    monkeypatch.setattr(hf_sharded, "_expert_rows", lambda *a: False)
    monkeypatch.setattr(hf_sharded, "GENERAL_INDEX_BYTES", 1024)
    with pytest.raises(NotImplementedError, match=r"mlp\.experts\.gate_up_proj.*keeps no expert per row"):
        hf_sharded.plan_reads(_meta_model(path), hf_sharded.stored_tensors(path), path)
