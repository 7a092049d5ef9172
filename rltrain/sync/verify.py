"""What an engine is checked for after each sync, beyond the version it reports (pure checks).

    checksums   the embedded engine's checksum over what it owns against the one the trainer's
                tensors gave as they were sent (`weights/checksum.py`)
    agreement   SGLang's /weights_checker: every engine reports a sha256 per TP rank over its own
                parameters (in its own, fused layout: not comparable with the trainer's). Engines
                of the same TP size hold the same shard at the same TP rank, so after a sync they
                must all report the same digest there; an engine that disagrees with the others
                missed or mangled an update.
    probe       a fixed token sequence scored by every engine (log-probs at temperature 1) against
                the trainer's log-probs of it: catches what agreement cannot — all engines wrong
                the same way, or a single engine — within a tolerance for the engine's precision.

Each check returns the errors it found (one line each, naming the engine) and touches no tensor
but the probe's log-probs; `WeightSync` gathers them over the bridge and fails the step on every
rank with all of them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rltrain.batch import TrainBatch

# Mean absolute log-prob difference allowed between an engine and the trainer on the probe.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
PROBE_TOLERANCE_HALF = 0.1  # bf16 / fp16 engines


@dataclass(frozen=True)
class EngineDigest:
    """One engine's /weights_checker answer: its sha256 per TP rank. `shard`: which weights it
    holds beyond its TP size — its EP rank where the sync routes experts ("" for a replica)."""

    engine: str
    tp_size: int
    by_tp_rank: tuple[str, ...]
    shard: str = ""


def disagreements(digests: Sequence[EngineDigest]) -> list[str]:
    """Engines whose digest at some TP rank differs from the most common one of the engines that
    hold the same shard (TP size and `shard`); with two engines that disagree, both are named."""
    errors = []
    by_size: dict[tuple[int, str], list[EngineDigest]] = defaultdict(list)
    for d in digests:
        by_size[d.tp_size, d.shard].append(d)
    for (size, _), group in sorted(by_size.items()):
        if len(group) < 2:
            continue
        for k in range(size):
            seen = Counter(d.by_tp_rank[k] for d in group)
            if len(seen) == 1:
                continue
            (top, count), *rest = seen.most_common()
            tie = rest and rest[0][1] == count
            for d in group:
                if tie or d.by_tp_rank[k] != top:
                    errors.append(
                        f"{d.engine} holds a different TP-rank-{k} shard (sha256 {d.by_tp_rank[k][:16]}…) "
                        f"than {count} of the {len(group)} engines of TP size {size} ({top[:16]}…)"
                    )
    return errors


def probe_tokens(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """The fixed probe sequence: `length` token ids drawn from the vocabulary by `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def probe_batch(tokens: list[int]) -> TrainBatch:
    """The probe as a one-row batch whose "response" is every token after the first."""
    t = torch.tensor([tokens])
    mask = torch.ones_like(t, dtype=torch.float32)
    mask[0, 0] = 0.0
    return TrainBatch(t, torch.ones_like(t), mask)


def probe_tolerance(configured: float, engine_dtype: torch.dtype | None, trainer_dtype: torch.dtype) -> float:
    """`sync.probe_tolerance`, or the default for the coarser of the two precisions."""
    if configured > 0:
        return configured
    dtypes = {engine_dtype or trainer_dtype, trainer_dtype}
    if dtypes <= set(PROBE_TOLERANCE):
        return max(PROBE_TOLERANCE[d] for d in dtypes)
    return PROBE_TOLERANCE_HALF


def probe_diff(engine_logp: Sequence[float], trainer_logp: torch.Tensor) -> float:
    """Mean absolute difference of the engine's probe log-probs from the trainer's."""
    return float((torch.tensor(list(engine_logp), dtype=torch.float64) - trainer_logp.double()).abs().mean())


def probe_error(engine: str, engine_logp: Sequence[float], trainer_logp: torch.Tensor, tolerance: float) -> str | None:
    """None if the engine's probe log-probs match the trainer's [L-1] within `tolerance` (mean
    absolute difference), else the error naming the engine."""
    theirs = torch.tensor(list(engine_logp), dtype=torch.float64)
    ours = trainer_logp.to(torch.float64)
    if theirs.shape != ours.shape:
        return f"{engine} scored {theirs.numel()} probe tokens, the trainer {ours.numel()}"
    diff = (theirs - ours).abs()
    if not torch.isfinite(theirs).all():
        return f"{engine} gives non-finite log-probs on the probe sequence (weights it never received?)"
    mean = float(diff.mean())
    if mean > tolerance:
        return (
            f"{engine}'s log-probs of the probe sequence differ from the trainer's by {mean:.4g} on average "
            f"(max {float(diff.max()):.4g}; tolerance {tolerance:g}, sync.probe_tolerance)"
        )
    return None
