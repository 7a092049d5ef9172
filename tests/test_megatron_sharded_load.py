"""Megatron's sharded load: each rank reads only its share of the HF checkpoint, slice by slice.

The per-slice reads (`mcore_state` over the safetensors files) give the same shards, bit for bit,
as the full read they replace (kept below as `_full_read`: every file loaded whole, converted, cut
to the rank's part), at TP=2, PP=2, TP=2 x PP=2 and, for an MoE model, EP=2 (and EP=2 x PP=2);
each rank reads the bytes of what it holds and no more; a checkpoint that does not fit is refused
before any tensor is read. Real processes: a TP=2 x PP=2 world of 4 gloo ranks loads through the
trainer's `hf_state`, each rank's peak host memory grows by its share, not by the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.models import make_model, make_moe_model
from tests.multiproc import run_ranks, values

pytest.importorskip("megatron.core")

DENSE_LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (tp, pp)


def _full_read(path: Path, d, part) -> dict[str, torch.Tensor]:
    """The load as it was before the sharded one (the reference): every file read whole, each
    megatron weight converted in full, cut to the TP shard, then the rank's stage and experts kept."""
    from rltrain.trainer.megatron.convert import (
        expert_of,
        hf_names_of,
        local_expert_name,
        mcore_names,
        stage_name,
        stage_of,
    )

    hf: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    per = d.heads // d.groups * d.head_dim
    state = {}
    for name in mcore_names(d):
        parts = [hf[s] for s in hf_names_of(name, d)]
        rest = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
        if rest.startswith("self_attention.linear_qkv"):
            q, k, v = parts
            tail = q.shape[1:]
            full = torch.cat(
                [
                    q.reshape(d.groups, per, *tail),
                    k.reshape(d.groups, d.head_dim, *tail),
                    v.reshape(d.groups, d.head_dim, *tail),
                ],
                dim=1,
            ).reshape(-1, *tail)
        elif rest.endswith("linear_fc1.weight"):
            full = torch.cat(parts)
        else:
            (full,) = parts
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                full = torch.cat([full, full.new_zeros(d.padded_vocab - d.vocab, *full.shape[1:])])
        e = expert_of(name)
        if e is not None:
            if e // (d.experts // part.ep) == part.ep_rank:
                state[local_expert_name(name, e % (d.experts // part.ep))] = full
            continue
        r, tp = part.tp_rank, part.tp
        if rest == "mlp.linear_fc1.weight":
            gate, up = full.chunk(2)
            full = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        elif rest in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
            full = full.chunk(tp, dim=1)[r]
        elif rest.startswith("self_attention.linear_qkv") or "embedding" in name or "output_layer" in name:
            full = full.chunk(tp)[r]
        state[name] = full
    out = {stage_name(n, d, part.pp): t for n, t in state.items() if stage_of(n, d, part.pp) == part.pp_rank}
    if d.tied and part.pp > 1 and part.pp_rank == part.pp - 1:
        out["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    return out


def _split_checkpoint(path: Path, shard_bytes: int) -> Path:
    """Re-save the checkpoint in `path` as several files with a `model.safetensors.index.json`."""
    single = path / "model.safetensors"
    tensors = load_file(str(single))
    single.unlink()
    files: list[dict[str, torch.Tensor]] = [{}]
    for name, t in tensors.items():
        if files[-1] and sum(x.nbytes for x in files[-1].values()) + t.nbytes > shard_bytes:
            files.append({})
        files[-1][name] = t
    weight_map = {}
    for i, part in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _parts(tp: int = 1, pp: int = 1, ep: int = 1) -> list:
    from rltrain.trainer.megatron.convert import RankPart

    return [RankPart(t, tp, e, ep, p, pp) for p in range(pp) for e in range(ep) for t in range(tp)]


def _hf(path: Path) -> dict[str, torch.Tensor]:
    return {n: t for f in sorted(path.glob("*.safetensors")) for n, t in load_file(str(f)).items()}


def _bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _padding_bytes(state: dict[str, torch.Tensor], d, part) -> int:
    """Bytes of the vocabulary padding rows a state holds (zeros that no rank reads)."""
    rows = d.padded_vocab // part.tp
    start, stop = part.tp_rank * rows, (part.tp_rank + 1) * rows
    pad = stop - max(start, min(stop, d.vocab))
    heads = [t for n, t in state.items() if n in ("embedding.word_embeddings.weight", "output_layer.weight")]
    return sum(pad * t.shape[1] * t.element_size() for t in heads)


def _sliced(path: Path, d, part) -> tuple[dict[str, torch.Tensor], int]:
    from rltrain.trainer.megatron.convert import mcore_state
    from rltrain.weights.hf_sharded import SafetensorsSource

    with SafetensorsSource(path) as src:
        state = mcore_state(src, d, part)
        return state, src.bytes_read


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:5])
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(got[n], t), (what, n)


@pytest.mark.parametrize(
    "arch,vocab,tied",
    [("qwen2", 256, False), ("qwen3", 255, False), ("llama", 255, True)],
    ids=["qwen2-qkv-bias", "qwen3-qk-norm-odd-vocab", "llama-tied-odd-vocab"],
)
def test_sliced_reads_give_the_full_reads_shards_bit_for_bit_at_tp2_pp2(tmp_path, arch, vocab, tied):
    from rltrain.trainer.megatron.convert import dims

    path = make_model(tmp_path / "m", seed=5, arch=arch, vocab=vocab)
    if tied:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        model.config.tie_word_embeddings = True
        model.tie_weights()
        model.save_pretrained(path)
    _split_checkpoint(path, shard_bytes=120_000)
    assert len(list(path.glob("*.safetensors"))) > 2
    cfg = transformers.AutoConfig.from_pretrained(path)
    hf = _hf(path)
    total = sum(t.nbytes for t in hf.values())
    replicated = sum(t.nbytes for n, t in hf.items() if n.endswith("norm.weight"))
    for tp, pp in DENSE_LAYOUTS:
        d = dims(cfg, tp, pp)
        reads = []
        for part in _parts(tp, pp):
            state, read = _sliced(path, d, part)
            _assert_same(state, _full_read(path, d, part), f"{part}")
            # A rank reads what it holds, nothing else (the padding rows are zeros, not read).
            assert read == _bytes(state) - _padding_bytes(state, d, part), part
            reads.append(read)
        # Together the ranks read the checkpoint once per copy held: the sharded weights once, a
        # replicated one (norms) on each TP rank, a tied head also on the last stage.
        tied_copy = hf["model.embed_tokens.weight"].nbytes if tied and pp > 1 else 0
        assert sum(reads) == total + (tp - 1) * replicated + tied_copy, (tp, pp)
        if tp == 2 and pp == 1:  # each TP rank reads about half of the checkpoint
            assert all(r <= total / 2 + replicated for r in reads), (reads, total)


def test_sliced_reads_give_the_full_reads_experts_at_ep2(tmp_path):
    """Qwen3-MoE, 4 experts: at EP=2 each rank reads the dense weights and its 2 experts only;
    with PP=2 too (a layout the trainer does not run yet), its stage's layers of them."""
    from rltrain.trainer.megatron.convert import dims

    path = _split_checkpoint(make_moe_model(tmp_path / "moe", seed=2), shard_bytes=200_000)
    d = dims(transformers.AutoConfig.from_pretrained(path), 1)
    hf = _hf(path)
    experts = sum(t.nbytes for n, t in hf.items() if ".experts." in n)
    dense = sum(t.nbytes for t in hf.values()) - experts
    for ep, pp in ((2, 1), (2, 2)):
        reads = []
        for part in _parts(pp=pp, ep=ep):
            state, read = _sliced(path, d, part)
            _assert_same(state, _full_read(path, d, part), f"{part}")
            assert read == _bytes(state), part
            held = sorted({n.split("local_experts.")[1].split(".")[0] for n in state if "local_experts" in n})
            assert held == ["0", "1"], held  # local indices of its block of experts
            reads.append(read)
        assert sum(reads) == ep * dense + experts, (ep, pp)  # each expert read by one rank only


def test_the_in_memory_conversion_is_the_same_code(tmp_path):
    """`hf_to_mcore_shards` (a state dict in memory, the round-trip tests' path) goes
    through the same per-slice conversion and gives the same shards."""
    from rltrain.trainer.megatron.convert import RankPart, dims, hf_to_mcore_shards

    path = make_model(tmp_path / "m", seed=5, arch="qwen3", vocab=255)
    d = dims(transformers.AutoConfig.from_pretrained(path), 2)
    for r in range(2):
        _assert_same(hf_to_mcore_shards(_hf(path), d, r, 2), _sliced(path, d, RankPart(r, 2))[0], f"tp rank {r}")


def test_a_checkpoint_that_does_not_fit_is_refused_before_any_read(tmp_path):
    from rltrain.trainer.megatron.convert import ConversionError, RankPart, dims, mcore_state
    from rltrain.weights.hf_sharded import SafetensorsSource

    path = make_model(tmp_path / "m", seed=5, arch="qwen3")
    d = dims(transformers.AutoConfig.from_pretrained(path), 2)
    hf = _hf(path)
    bad = dict(hf)
    bad.pop("model.layers.1.mlp.up_proj.weight")
    bad.pop("model.layers.0.self_attn.k_norm.weight")
    bad["model.layers.0.mlp.down_proj.weight"] = bad["model.layers.0.mlp.down_proj.weight"][:, :-2].contiguous()
    bad["model.layers.0.self_attn.rope.weight"] = torch.zeros(3)
    save_file(bad, str(path / "model.safetensors"))
    with SafetensorsSource(path) as src:
        with pytest.raises(ConversionError) as e:
            mcore_state(src, d, RankPart(0, 2))
        assert src.bytes_read == 0
    msg = str(e.value)
    for expected in (
        "2 weights missing",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.self_attn.rope.weight",
        "model.layers.0.mlp.down_proj.weight [64, 126], expected [64, 128]",
        "config.json",
    ):
        assert expected in msg, msg
    # An index naming a file that is not there.
    _split_checkpoint(path, shard_bytes=120_000)
    next(path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-"):
        SafetensorsSource(path)


# ---------------------------------------------------------------------- real processes


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _load_rank(rank: int, world_size: int, path: str, tp: int, pp: int) -> dict:
    """This rank's `hf_state` through real megatron groups, and the peak host memory it added
    (VmHWM, reset to the current RSS just before: file pages it touched count too)."""
    from rltrain.runtime.world import World
    from rltrain.trainer.megatron.convert import dims
    from rltrain.trainer.megatron.load import hf_state
    from rltrain.trainer.megatron.model import MegatronGroups
    from rltrain.weights.hf_sharded import SafetensorsSource

    # Unmap a file after fewer touched bytes than by default, which exceeds this whole checkpoint.
    SafetensorsSource.unmap_after_bytes = 8 << 20
    world = World(backend="gloo", timeout=120)
    try:
        groups = MegatronGroups(world, tp, 1, pp)
        d = dims(transformers.AutoConfig.from_pretrained(path), tp, pp)
        Path("/proc/self/clear_refs").write_text("5")
        base = _status_kb("VmHWM")
        state = hf_state(path, d, groups)
        added = (_status_kb("VmHWM") - base) * 1024
        return {"tp_rank": groups.tp_rank, "pp_rank": groups.pp_rank, "added": added, "state": state}
    finally:
        world.close()


def _make_wide_model(path: Path) -> Path:
    """A Qwen3 checkpoint of some hundreds of MB (random bf16 weights written directly), big enough
    for a rank's memory to tell its share from the whole model."""
    cfg = transformers.Qwen3Config(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in transformers.Qwen3ForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    save_file(
        {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}, str(path / "model.safetensors")
    )
    cfg.save_pretrained(path)
    return path


def test_each_rank_of_a_tp2_pp2_world_loads_its_share_only(tmp_path):
    """4 gloo ranks, TP=2 x PP=2, load a checkpoint through the trainer's `hf_state`: each holds the
    full read's shards bit for bit, and its peak host memory grows by about its quarter of the model
    (its slices, and the file pages it read them from), not by the model."""
    from rltrain.trainer.megatron.convert import RankPart, dims

    tmp_path.mkdir(exist_ok=True)
    path = _make_wide_model(tmp_path)
    model_bytes = (path / "model.safetensors").stat().st_size
    ranks = values(run_ranks(_load_rank, 4, str(path), 2, 2, deadline_s=150))
    d = dims(transformers.AutoConfig.from_pretrained(path), 2, 2)
    for r in ranks:
        _assert_same(r["state"], _full_read(path, d, RankPart(r["tp_rank"], 2, 0, 1, r["pp_rank"], 2)), str(r))
        # Its quarter of the model, one fused weight being assembled and the file pages mapped at a
        # time: well under 3/5 of the model. The full read held the fused QKV and gate/up of every
        # layer (and the pages they came from), more than the model.
        assert r["added"] < 0.6 * model_bytes, (r["added"], model_bytes)
