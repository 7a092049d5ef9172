"""The probe at start-up: its tokens, and its bounds calibrated against the trainer.

While every engine serves model.path as it loaded it (before its first release or sync) and the
trainer holds the same weights (before a checkpoint is loaded), the difference between their
log-probs of the probe is what the two sides' arithmetic gives, and nothing else: the bounds every
later sync is judged by are a multiple of it (probe.py says which, with its floors and ceilings).

    probe_at_start      (setup) the tokens — a data prompt's first ones and rank 0's engine's
                        greedy continuation — and every engine's log-probs of them
    tokens_and_bounds   (WeightSync) the trainer's log-probs of the same tokens, the difference,
                        the bounds; random tokens within the precision's ceilings without a start

Where the trainer's side of the probe will ride a training step (one more row of a micro-batch),
the trainer scores it at start-up that way too, in a micro-batch of the training's shape: in half
precision a row's log-probs move with the shape of the batch around it (other kernels, sums in
another order; ~0.02 mean, ~0.06 at the worst position for the 1.7B shape in bf16 on an H200),
which the row scored alone, as the engine scores it, does not show. The bounds are calibrated
from the larger of the two differences.
Both are collectives over the bridge; an engine that cannot answer, or computes another model,
stops the run on every rank, named.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from rltrain.config import Config, SyncConfig
from rltrain.engine.client import EngineCapabilities, EngineClient, EngineError
from rltrain.engine.layout import EngineLayout
from rltrain.interfaces import World
from rltrain.sync import probe, verify
from rltrain.sync.plan import SyncPlan
from rltrain.sync.probe import ProbeBounds, ProbeDiff, StartProbe
from rltrain.weights.checksum import WeightMismatchError

log = logging.getLogger("rltrain.sync")


def probe_at_start(
    cfg: Config, world: World, receivers: list[EngineClient], engine: EngineLayout | None, prompt: Sequence[int]
) -> StartProbe | None:
    """Collective over the bridge, while the engines serve model.path as each loaded it (before
    their first release or sync): the probe's tokens — `prompt`'s first tokens and rank 0's
    engine's greedy continuation of them, `sync.probe_tokens` in all — and every engine's
    log-probs of them, for `WeightSync` to calibrate its bounds against the trainer. None where
    the probe is off. An engine that gives none fails the start on every rank, naming it."""
    length = cfg.sync.probe_tokens
    if not (cfg.sync.verify and length):
        return None
    name, leader = verify.engine_place(world, engine)
    prefix = probe.natural_prefix(prompt, length)
    tokens, error = None, None
    if world.rank == 0:
        try:
            tokens = prefix + receivers[0].greedy(prefix, length - len(prefix))
        except EngineError as e:
            error = f"{name} gave no greedy continuation of the probe's prompt at start-up: {e}"
    tokens, error = world.bridge.broadcast_object((tokens, error), src=0, phase="sync probe tokens")
    scores: dict[str, list[float]] = {}
    if error is None and leader:
        for engine_name, client in zip(verify.receiver_names(name, len(receivers)), receivers):
            try:
                scores[engine_name] = client.score(tokens)
            except EngineError as e:
                error = f"{engine_name} could not score the probe at start-up: {e}"
                break
    errors = world.bridge.all_gather_object(error, phase="sync probe at start")
    if any(errors):
        raise RuntimeError(next(e for e in errors if e))
    return StartProbe(tokens, len(prefix), scores)


def tokens_and_bounds(
    cfg: SyncConfig,
    world: World,
    caps: EngineCapabilities,
    plan: SyncPlan,
    vocab: int,
    start: StartProbe | None,
    trainer_logprobs: Callable[[list[int]], torch.Tensor],
    sharded: bool,
    riding: Callable[[list[int]], torch.Tensor] | None = None,
) -> tuple[list[int], ProbeBounds]:
    """The probe's tokens and bounds: calibrated from `start` against `trainer_logprobs` of its
    tokens now (a collective; taken by rank 0, and by every rank where the trainer's forward is a
    collective: `sharded`), and against `riding`'s (the trainer's log-probs of them as they ride
    a training step) where given, the larger difference; else random tokens within the
    precision's ceilings. An engine that computed otherwise at start-up stops the run here."""
    engine_dtype = getattr(torch, caps.dtype) if caps.dtype else None
    precision = probe.precision(engine_dtype, plan.weights[0].dtype)
    if start is None:
        return probe.random_tokens(vocab, cfg.probe_tokens), probe.uncalibrated(cfg, precision)
    rank0 = world.rank == 0
    ours = [f(start.tokens) for f in (trainer_logprobs, riding) if f is not None] if rank0 or sharded else None
    gathered = world.bridge.all_gather_object((start.scores, ours if rank0 else None), phase="sync probe")
    references = gathered[0][1]
    measured = {
        name: ProbeDiff.largest([ProbeDiff.of(lp, ref) for ref in references])
        for scores, _ in gathered
        for name, lp in scores.items()
    }
    errors = [e for name, d in sorted(measured.items()) if (e := probe.start_error(name, d, cfg, precision))]
    if errors:
        raise WeightMismatchError("; ".join(errors))
    bounds = probe.calibrated(cfg, precision, ProbeDiff.largest(list(measured.values())))
    if rank0:
        log.info(
            "sync probe: %d tokens, %d of the first prompt and the engine's greedy continuation; bounds: mean "
            "%.3g, worst position %.3g (%s; the trainer's side scored alone%s)",
            len(start.tokens),
            start.prompt_tokens,
            bounds.mean,
            bounds.worst,
            bounds.how,
            " and in a micro-batch of the training's shape, as it rides" if riding is not None else "",
        )
    return start.tokens, bounds
