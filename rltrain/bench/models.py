"""The benchmarks' models: named shapes, and random weights built locally (no downloads).

A `ModelShape` states the sizes of a decoder-only model once; `config_kwargs()` is the
transformers config keys they set (any architecture's config takes them). The shapes named here:
`QWEN3_SHAPES` (what `build` writes: engine, trainer, load and end-to-end benchmarks; from 4b up
the dims of the released Qwen3 models, 30b-a3b being `QWEN3_30B_A3B`, the MoE whose expert routing
bench.sync and bench.routing measure), `SYNC_SHAPES` (bench.sync's `--shape`), `SOAK` (bench.soak),
and `scaled_qwen2(hidden, layers, vocab)`, a small Qwen2 of any width (`build_model`). `cut(shape,
layers)` keeps a shape's widths with fewer layers, for machines that cannot hold the whole model
(`build(..., layers=)`, the benchmarks' `--layers`). The tests name theirs with the same
`ModelShape`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import transformers


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a decoder-only transformer. A size left None is the config's own default."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int | None = None  # (the config's default: hidden // heads)
    max_positions: int | None = None
    tied: bool = False  # the LM head is the embedding

    def config_kwargs(self) -> dict[str, Any]:
        """The transformers config keys of this shape."""
        kwargs: dict[str, Any] = dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            tie_word_embeddings=self.tied,
        )
        if self.head_dim is not None:
            kwargs["head_dim"] = self.head_dim
        if self.max_positions is not None:
            kwargs["max_position_embeddings"] = self.max_positions
        return kwargs


@dataclass(frozen=True, kw_only=True)
class MoeShape(ModelShape):
    """A mixture of experts: every layer's MLP is `experts` experts of `expert_intermediate`, of
    which each token is routed to `experts_per_token` (`intermediate`: a dense MLP's width)."""

    experts: int
    expert_intermediate: int
    experts_per_token: int

    def config_kwargs(self) -> dict[str, Any]:
        return {
            **super().config_kwargs(),
            "moe_intermediate_size": self.expert_intermediate,
            "num_experts": self.experts,
            "num_experts_per_tok": self.experts_per_token,
        }


def _qwen3(
    vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool = False
) -> ModelShape:
    """A Qwen3 shape as the benchmarks build them: head dim 128 from width 1024 up, else 64;
    positions 4096 (the released models allow more; no weight depends on it)."""
    return ModelShape(
        vocab=vocab,
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=128 if hidden >= 1024 else 64,
        max_positions=4096,
        tied=tied,
    )


# Qwen3-30B-A3B: every layer a MoE (`intermediate` is its config's dense width, used by no layer).
QWEN3_30B_A3B = MoeShape(
    vocab=151936,
    hidden=2048,
    intermediate=6144,
    layers=48,
    heads=32,
    kv_heads=4,
    head_dim=128,
    experts=128,
    expert_intermediate=768,
    experts_per_token=8,
)

QWEN3_SHAPES: dict[str, ModelShape] = {
    "tiny": _qwen3(vocab=1024, hidden=256, intermediate=768, layers=2, heads=4, kv_heads=2),
    "0.6b": _qwen3(vocab=151936, hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8),
    "1.7b": _qwen3(vocab=151936, hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8),
    # The released models' dims (their config.json): Qwen3-4B ties its LM head to the embedding,
    # the larger ones do not.
    "4b": _qwen3(vocab=151936, hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, tied=True),
    "8b": _qwen3(vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8),
    "14b": _qwen3(vocab=151936, hidden=5120, intermediate=17408, layers=40, heads=40, kv_heads=8),
    "30b-a3b": QWEN3_30B_A3B,
}

SYNC_SHAPES = {
    "tiny": _qwen3(vocab=32000, hidden=256, intermediate=768, layers=4, heads=4, kv_heads=2),
    "small": _qwen3(vocab=32000, hidden=1024, intermediate=3072, layers=8, heads=16, kv_heads=4),
    # Qwen3-4B's dims with its LM head untied: the bytes bench.sync's recorded runs moved.
    "4b": replace(QWEN3_SHAPES["4b"], tied=False),
}

SOAK = ModelShape(vocab=2048, hidden=256, intermediate=768, layers=2, heads=4, kv_heads=2, max_positions=512)


def cut(shape: ModelShape, layers: int | None) -> ModelShape:
    """`shape` with its first `layers` layers only (None: all of them): the same widths, for a
    machine that cannot hold the whole model."""
    if layers is None:
        return shape
    if not 1 <= layers <= shape.layers:
        raise ValueError(f"layers={layers}: a cut keeps 1 to {shape.layers} of this shape's {shape.layers} layers")
    return replace(shape, layers=layers)


def scaled_qwen2(hidden: int, layers: int, vocab: int) -> ModelShape:
    """A small Qwen2 of any width: MLP 3x the width, a head per 64 and a KV head per 256 of it."""
    return ModelShape(
        vocab=vocab,
        hidden=hidden,
        intermediate=hidden * 3,
        layers=layers,
        heads=max(1, hidden // 64),
        kv_heads=max(1, hidden // 256),
        max_positions=4096,
    )


def qwen3_config(shape: ModelShape) -> transformers.Qwen3Config | transformers.Qwen3MoeConfig:
    """A Qwen3 config of this shape (Qwen3-MoE for a `MoeShape`) whose last token is the end of sequence."""
    import transformers

    kind = transformers.Qwen3MoeConfig if isinstance(shape, MoeShape) else transformers.Qwen3Config
    return kind(**shape.config_kwargs(), eos_token_id=shape.vocab - 1)


def build(
    path: Path, shape: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, layers: int | None = None
) -> Path:
    """A random Qwen3 of `QWEN3_SHAPES[shape]` (its first `layers` layers: `cut`) saved to `path`."""
    import transformers

    if shape not in QWEN3_SHAPES:
        raise ValueError(f"shape {shape!r}: expected one of {', '.join(QWEN3_SHAPES)}")
    with device:  # random init on the GPU: seconds instead of a minute on the host
        model = transformers.AutoModelForCausalLM.from_config(qwen3_config(cut(QWEN3_SHAPES[shape], layers)))
        model = model.to(dtype)
    model.save_pretrained(path)
    return path


def save_random_qwen2(
    path: Path, shape: ModelShape, dtype: torch.dtype, seed: int = 0, eos_token_id: int | None = None
) -> Path:
    """A Qwen2 of `shape`, random weights from `seed`, saved to `path`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape.config_kwargs(), eos_token_id=eos_token_id))
    # transformers declares PreTrainedModel.to through functools.wraps, whose stub loses the bound
    # self: mypy reads the dtype as the model argument.
    model = model.to(dtype)  # type: ignore[arg-type]
    model.save_pretrained(path)
    return path


def build_model(path: Path, hidden: int, layers: int, vocab: int, dtype: torch.dtype) -> Path:
    """A random Qwen2 of `scaled_qwen2(hidden, layers, vocab)` saved to `path`."""
    return save_random_qwen2(path, scaled_qwen2(hidden, layers, vocab), dtype, eos_token_id=vocab - 1)
