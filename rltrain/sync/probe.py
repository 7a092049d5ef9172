"""The probe: a natural token sequence every engine scores after each sync, against the trainer's
log-probs of it, and the bounds its differences are judged by. Pure: no request, no collective
(`calibration.py` takes the measurements).

The sequence (`StartProbe.tokens`) is the first data prompt's first tokens (`natural_prefix`)
and the greedy continuation of them by rank 0's engine, made once at start-up: text the model
itself finds likely, where a log-prob difference is the two sides' arithmetic, not the far tail
of a softmax that random tokens would probe.

Judged twice (`ProbeDiff`): the mean |Δ log p| over its positions and the worst position — what
a miss does to a few positions only is diluted in the mean.

The bounds (`calibrated`) come from start-up, where the engine and the trainer each hold
model.path's weights as each loaded them, known equal with no sync involved:
`CALIBRATION_FACTOR` × the difference measured there (the largest over every engine), each at
least its precision's floor. The measurement itself must lie under the precision's ceiling
(`CEILING`), else the engine does not compute the model the trainer does and the run stops
before its first step. `sync.probe_tolerance` (mean) and `sync.probe_worst_tolerance` (worst
position), where > 0, replace the calibrated bound. A sync built without a start-up measurement
(benchmarks, tests) scores `random_tokens` against the ceilings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rltrain.batch import TrainBatch
from rltrain.config import SyncConfig

CALIBRATION_FACTOR = 4.0  # the bounds: this many times the difference measured at start-up


@dataclass(frozen=True)
class ProbeDiff:
    """How far an engine's log-probs of the probe are from the trainer's: the mean absolute
    difference over the positions, and the largest at any one."""

    mean: float
    worst: float

    @staticmethod
    def of(engine_logp: Sequence[float], trainer_logp: torch.Tensor) -> ProbeDiff:
        diff = (torch.tensor(list(engine_logp), dtype=torch.float64) - trainer_logp.to(torch.float64)).abs()
        return ProbeDiff(float(diff.mean()), float(diff.max()))

    @staticmethod
    def largest(diffs: Sequence[ProbeDiff]) -> ProbeDiff:
        return ProbeDiff(max(d.mean for d in diffs), max(d.worst for d in diffs))


@dataclass(frozen=True)
class ProbeBounds:
    """The largest mean and worst-position differences a sync passes with, and how they were
    set (for the log and the errors); `measured`: the start-up difference they were calibrated
    from, where they were."""

    mean: float
    worst: float
    how: str = "fixed"
    measured: ProbeDiff | None = None

    @staticmethod
    def fixed(mean: float, worst: float = math.inf) -> ProbeBounds:
        return ProbeBounds(mean, worst)


# What a precision allows at most (a calibration above it stops the run), and the least a
# calibrated bound is (fp32 arithmetic on two sides agrees to far less than weights that
# moved would change). Half precision's worst position: 0.1, not 0.05 — bf16 keeps 8 bits of a
# logit, and as training sharpens the model its logits grow and so does one position's rounding:
# the SGLang GPU loop test's 14th sync on an H100 (2026-12-07) measured 0.051 at the worst of
# 32 positions (mean 0.0041) where start-up had measured 0.0052, and stopped a healthy run.
CEILING = {"double": ProbeBounds(1e-6, 1e-5), "single": ProbeBounds(1e-3, 1e-2), "half": ProbeBounds(0.1, 1.0)}
FLOOR = {"double": ProbeBounds(1e-8, 1e-7), "single": ProbeBounds(1e-4, 1e-3), "half": ProbeBounds(0.01, 0.1)}


def precision(engine_dtype: torch.dtype | None, trainer_dtype: torch.dtype) -> str:
    """The coarser of the two sides' precisions (the engine's, where it says it; else the trainer's)."""
    bits = {torch.float64: "double", torch.float32: "single"}
    sides = {bits.get(d, "half") for d in (engine_dtype or trainer_dtype, trainer_dtype)}
    return "half" if "half" in sides else "single" if "single" in sides else "double"


def uncalibrated(cfg: SyncConfig, prec: str) -> ProbeBounds:
    """Bounds without a start-up measurement: the configured ones, else the precision's ceiling."""
    ceiling = CEILING[prec]
    return ProbeBounds(
        cfg.probe_tolerance or ceiling.mean,
        cfg.probe_worst_tolerance or ceiling.worst,
        f"{prec} precision's ceilings (no start-up measurement)",
    )


def calibrated(cfg: SyncConfig, prec: str, measured: ProbeDiff) -> ProbeBounds:
    """The bounds from the difference `measured` at start-up (engine and trainer known equal)."""
    floor = FLOOR[prec]
    mean = cfg.probe_tolerance or max(CALIBRATION_FACTOR * measured.mean, floor.mean)
    worst = cfg.probe_worst_tolerance or max(CALIBRATION_FACTOR * measured.worst, floor.worst)
    how = (
        f"calibrated at start-up: {CALIBRATION_FACTOR:g} x the measured mean {measured.mean:.3g} and worst "
        f"{measured.worst:.3g}, at least {floor.mean:g} and {floor.worst:g} ({prec} precision)"
    )
    if cfg.probe_tolerance or cfg.probe_worst_tolerance:
        how += "; sync.probe_tolerance / sync.probe_worst_tolerance where set"
    return ProbeBounds(mean, worst, how, measured)


def start_error(engine: str, measured: ProbeDiff, cfg: SyncConfig, prec: str) -> str | None:
    """None if `engine`'s difference from the trainer at start-up, both holding model.path's
    weights, lies within what the precision allows (or the configured bounds), else why not."""
    limit = ProbeBounds(cfg.probe_tolerance or CEILING[prec].mean, cfg.probe_worst_tolerance or CEILING[prec].worst)
    if measured.mean <= limit.mean and measured.worst <= limit.worst:
        return None
    return (
        f"{engine}'s log-probs of the probe sequence differ from the trainer's by {measured.mean:.4g} on average "
        f"(worst position {measured.worst:.4g}) at start-up, where both hold model.path's weights as each "
        f"loaded them; {prec} precision allows {limit.mean:g} and {limit.worst:g}: the engine does not compute "
        f"the model the trainer does (another checkpoint in engine.model_path, another config?). Set "
        f"sync.probe_tolerance and sync.probe_worst_tolerance to accept the difference"
    )


def probe_error(
    engine: str, engine_logp: Sequence[float], trainer_logp: torch.Tensor, bounds: ProbeBounds | float
) -> str | None:
    """None if the engine's probe log-probs match the trainer's within `bounds` (a float: a
    bound on the mean alone), else the error naming the engine."""
    if not isinstance(bounds, ProbeBounds):
        bounds = ProbeBounds.fixed(bounds)
    theirs = list(engine_logp)
    if len(theirs) != trainer_logp.numel():
        return f"{engine} scored {len(theirs)} probe tokens, the trainer {trainer_logp.numel()}"
    if not all(math.isfinite(x) for x in theirs):
        return f"{engine} gives non-finite log-probs on the probe sequence (weights it never received?)"
    d = ProbeDiff.of(theirs, trainer_logp)
    if d.mean > bounds.mean or d.worst > bounds.worst:
        return (
            f"{engine}'s log-probs of the probe sequence differ from the trainer's by {d.mean:.4g} on average, "
            f"{d.worst:.4g} at the worst position (bounds {bounds.mean:.3g} and {bounds.worst:.3g}, {bounds.how})"
        )
    return None


@dataclass(frozen=True)
class StartProbe:
    """What the engines said at start-up, before any sync touched them: the probe's tokens, and
    this rank's engines' log-probs of tokens 1.. as each serves model.path, by engine name."""

    tokens: list[int]
    prompt_tokens: int  # how many of them are the prompt's (the rest: the engine's continuation)
    scores: dict[str, list[float]]


def natural_prefix(prompt: Sequence[int], length: int) -> list[int]:
    """The probe's first tokens: the prompt's first half of `length` (all of a shorter prompt)."""
    return list(prompt[: max(1, length // 2)])


def random_tokens(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """`length` token ids drawn from the vocabulary by `seed`: the probe where no prompt is given."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def probe_batch(tokens: list[int]) -> TrainBatch:
    """The probe as a one-row batch whose "response" is every token after the first."""
    t = torch.tensor([tokens])
    mask = torch.ones_like(t, dtype=torch.float32)
    mask[0, 0] = 0.0
    return TrainBatch(t, torch.ones_like(t), mask)
