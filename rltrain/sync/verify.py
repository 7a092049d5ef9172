"""Everything that judges a sync: what an engine is checked for after it, beyond the version it
reports, and the one verdict over every rank's findings.

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

What is checked is decided once per run (`Checks.decide`: `sync.verify`, the engines'
capabilities, and when the probe runs, `ProbeMoment`). After each sync every rank asks its own
engines (`EngineVerifier`) and contributes a `RankReport` (facts, no verdict); the reports are gathered over the
bridge and `judge` decides on every rank alike, naming every miss: an engine at another version,
a checksum per engine (and TP rank), an engine that disagrees with its peers, a probe off the
trainer's. Only the probe's log-probs are tensors here.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrain.batch import TrainBatch
from rltrain.config import SyncConfig
from rltrain.engine.client import EngineCapabilities, EngineClient, EngineError
from rltrain.sync.plan import SyncPlan
from rltrain.sync.transport import SessionEnds
from rltrain.weights.checksum import Entry, WeightMismatchError, combine
from rltrain.weights.versions import StaleWeightsError

log = logging.getLogger("rltrain.sync")

Sums = dict[str, Entry]  # checkpoint name -> `checksum.entry` of what was sent

# Mean absolute log-prob difference allowed between an engine and the trainer on the probe.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
PROBE_TOLERANCE_HALF = 0.1  # bf16 / fp16 engines


class ProbeMoment(enum.Enum):
    """When the engines score the probe, decided once per run (`Checks.decide`); the value is
    the phrase the setup logs."""

    OFF = "off"  # sync.verify false, or sync.probe_tokens 0
    # The engines keep their memory through the sync and score it as their weight-update session
    # ends (the embedded engine's inline sessions): in the push, no request of its own.
    SESSION_END = "in the push, as the engines end their weight-update session"
    PUSH = "in the push, asked while the trainer scores it"  # they keep their memory, without that extension
    AWAKE = "once the engines are awake again"  # they release it: `WeightSync.probe_engines`, after resume


@dataclass(frozen=True)
class Checks:
    """What every sync is checked for beyond the version each engine serves (on an engine's
    leader, which asks its engines; the other ranks check the version only)."""

    checksums: bool  # the engines report checksums: each compared with the trainer's
    digests: bool  # the engines answer /weights_checker: their digests must agree
    probe: ProbeMoment

    @staticmethod
    def decide(verify: bool, probe_tokens: int, caps: EngineCapabilities, awake: bool, sessions: bool) -> Checks:
        """From `sync.verify`, `sync.probe_tokens`, the engines' capabilities, whether they keep
        their memory through the sync (`awake`) and whether the transport has weight-update
        sessions (`sessions`: tensor, distributed)."""
        if not (verify and probe_tokens):
            moment = ProbeMoment.OFF
        elif not awake:
            moment = ProbeMoment.AWAKE
        elif caps.inline_sessions and sessions:
            moment = ProbeMoment.SESSION_END
        else:
            moment = ProbeMoment.PUSH
        return Checks(verify and caps.checksums, verify and caps.weights_checker, moment)


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


@dataclass(frozen=True)
class ChecksumCheck:
    """One engine's checksum over what it owns (one TP rank's, where it reports per TP rank),
    beside the trainer's over what was sent there."""

    engine: str  # "node0-engine0", or "node0-engine0 TP rank 1"
    served: str  # the version the engine's report was taken at
    checksum: str
    count: int  # tensors the engine's checksum covers
    trainer: str
    trainer_count: int


@dataclass(frozen=True)
class ProbeScore:
    """One engine's answer to the probe: its log-probs of tokens 1.., or its refusal (the
    engine's error text); neither where it did not answer (gone: the next rollout's recover()
    restarts it and syncs again)."""

    engine: str
    logprobs: list[float] | None = None
    refused: str | None = None


@dataclass
class RankReport:
    """What one rank found on its engines after a sync (facts; `judge` decides). `scores` is
    None where the probe is not judged at this moment; `trainer_logp`, the trainer's log-probs
    of the probe where this rank took them (else rank 0's stand for it); `tolerance`, the
    probe's for this rank's engines' precision."""

    stale: dict[str, str | None] = field(default_factory=dict)  # engine -> the other version it serves
    checksums: list[ChecksumCheck] = field(default_factory=list)
    digests: list[EngineDigest] = field(default_factory=list)
    unverified: dict[str, str] = field(default_factory=dict)  # engine -> why it could not be asked
    scores: list[ProbeScore] | None = None
    trainer_logp: torch.Tensor | None = None
    tolerance: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """A sync that passed: how many /weights_checker digests were compared, and the largest mean
    absolute probe difference (None: no probe judged)."""

    digests: int
    probe_diff: float | None


class EngineVerifier:
    """This rank's side of the verification, set up once per run: what every sync is checked for
    (`checks`, from `sync.*` and the engines' capabilities `caps`), the probe and its tolerance,
    and the asking of this rank's engines (`receivers`, by EP rank) after each sync, written into
    a `RankReport`. Every rank asks for the version; the engine's leader (`leader`) for the rest.
    `awake`, `sessions`: as `Checks.decide`."""

    def __init__(
        self,
        cfg: SyncConfig,
        receivers: Sequence[EngineClient],
        engine_name: str,
        leader: bool,
        plan: SyncPlan,
        caps: EngineCapabilities,
        awake: bool,
        sessions: bool,
        vocab_size: int,
    ):
        self.receivers, self.engine_name, self.leader, self.targets = list(receivers), engine_name, leader, plan.targets
        n = len(self.receivers)
        self.names = [engine_name] if n == 1 else [f"{engine_name} (EP rank {r})" for r in range(n)]
        self.engine_dtype: torch.dtype | None = getattr(torch, caps.dtype) if caps.dtype else None
        self.checks = Checks.decide(cfg.verify, cfg.probe_tokens, caps, awake, sessions)
        probing = self.checks.probe is not ProbeMoment.OFF
        self.probe = probe_tokens(vocab_size, cfg.probe_tokens) if probing else []
        trainer_dtype = plan.weights[0].dtype
        self.tolerance = probe_tolerance(cfg.probe_tolerance, self.engine_dtype, trainer_dtype) if probing else 0.0

    def report(self, version: str, ends: SessionEnds, sums: Sums, per_rank: dict[int, Sums]) -> RankReport:
        """What the engines serve after the sync to `version` and, asked by the leader, their
        checksums beside the trainer's over what was sent (`sums`: this rank's; `per_rank`: each
        TP rank's, where the engine's ranks sent theirs) and their /weights_checker digests. A
        checksum report that came with the end of the weight-update session (`ends`) is used,
        not asked again."""
        report = RankReport(tolerance=self.tolerance)
        try:
            for r, client in enumerate(self.receivers):
                name = self.names[r]
                # The checksum report carries the version it was taken at: one request, not two.
                rep = None
                if self.leader and self.checks.checksums:
                    rep = ends.reports.pop(r, None) or client.weights_checksum()
                served = rep["weight_version"] if rep is not None else client.weight_version()
                if served != version:
                    report.stale[name] = served
                    continue
                if rep is not None:
                    report.checksums += self._checksums(r, rep, sums, per_rank)
                if self.leader and self.checks.digests:
                    ranks = client.weights_checker()
                    shard = f"ep{r}/{len(self.receivers)}" if len(self.receivers) > 1 else ""
                    report.digests.append(EngineDigest(name, len(ranks), tuple(e["checksum"] for e in ranks), shard))
        except EngineError as e:
            report.unverified[self.engine_name] = str(e)
        return report

    def _checksums(self, r: int, rep: dict[str, Any], sums: Sums, per_rank: dict[int, Sums]) -> list[ChecksumCheck]:
        """Receiver `r`'s checksums beside the trainer's over what it owns: one per TP rank (what
        that rank holds) for an engine over several, else one over all it owns."""
        out = []
        for e in rep.get("ranks") or [{"tp_rank": 0, **rep}]:
            k = e["tp_rank"]
            owned = {n: v for n, v in per_rank.get(k, sums).items() if r in self.targets[n]}
            engine = f"{self.names[r]} TP rank {k}" if "ranks" in rep else self.names[r]
            out.append(
                ChecksumCheck(engine, rep["weight_version"], e["checksum"], e["count"], combine(owned), len(owned))
            )
        return out

    def scores_in_push(
        self, version: str, ends: SessionEnds, pool: ThreadPoolExecutor
    ) -> list[ProbeScore] | Future[list[ProbeScore]]:
        """The probe's scores of engines that stay awake: as every engine reported them when its
        session ended (`ProbeMoment.SESSION_END`; consumed, as the checksum reports are), else
        asked now on a thread of `pool`, while the trainer scores it."""
        probes, ends.probes = ends.probes, {}
        if self.checks.probe is ProbeMoment.SESSION_END and len(probes) == len(self.receivers):
            return [
                ProbeScore(self.names[r], p) if isinstance(p, list) else ProbeScore(self.names[r], refused=p)
                for r, p in sorted(probes.items())
            ]
        return pool.submit(self.scores, version)

    def scores(self, version: str) -> list[ProbeScore]:
        """Each engine's answer to the probe, asked now."""
        out = []
        for name, client in zip(self.names, self.receivers):
            try:
                out.append(ProbeScore(name, client.score(self.probe)))
            except EngineError as e:
                if e.status is not None:
                    out.append(ProbeScore(name, refused=str(e)))
                    continue
                log.warning("%s did not answer the probe of version %s: %s", name, version, e)
                out.append(ProbeScore(name))
        return out


def judge(version: str, reports: Sequence[RankReport]) -> Verdict:
    """The verdict on a sync to `version` from every rank's report, in rank order (the same on
    every rank). Raises StaleWeightsError where engines serve another version and nothing else is
    wrong, else WeightMismatchError naming every miss; the probe is judged only where every engine
    holds the version's weights (a stale engine's probe says nothing new)."""
    stale = [
        f"rank {r}: {engine} serves weight version {served!r} after loading {version!r}"
        for r, rep in enumerate(reports)
        for engine, served in rep.stale.items()
    ]
    wrong = []
    for r, rep in enumerate(reports):
        wrong += [
            f"rank {r}: after syncing version {version}, {c.engine} serves version {c.served!r} with weight "
            f"checksum {c.checksum} over {c.count} tensors; the trainer's is {c.trainer} over {c.trainer_count}"
            for c in rep.checksums
            if c.served != version or c.checksum != c.trainer
        ]
        wrong += [
            f"rank {r}: cannot verify weight version {version} on {e}: {why}" for e, why in rep.unverified.items()
        ]
    wrong += disagreements([d for rep in reports for d in rep.digests])
    missed, diffs = [], []
    for r, rep in enumerate(reports):
        if rep.scores is None:
            continue
        reference = rep.trainer_logp if rep.trainer_logp is not None else reports[0].trainer_logp
        assert reference is not None, "rank 0 scores the probe for the trainer"
        errors, diff = probe_verdict(version, rep.scores, reference, rep.tolerance)
        missed += [f"rank {r}: {e}" for e in errors]
        diffs.append(diff)
    if not (wrong or stale):
        wrong = missed
    if wrong:
        raise WeightMismatchError("; ".join(stale + wrong))
    if stale:
        raise StaleWeightsError("; ".join(stale))
    return Verdict(sum(len(rep.digests) for rep in reports), max(diffs) if diffs else None)


def probe_verdict(
    version: str, scores: Sequence[ProbeScore], trainer_logp: torch.Tensor, tolerance: float
) -> tuple[list[str], float]:
    """(errors, largest mean absolute difference) of the engines' probe log-probs against the trainer's."""
    errors: list[str] = []
    diff = 0.0
    for s in scores:
        if s.refused is not None:
            errors.append(f"{s.engine} could not score the probe of version {version}: {s.refused}")
        elif s.logprobs is not None:
            error = probe_error(s.engine, s.logprobs, trainer_logp, tolerance)
            if error is not None:
                errors.append(f"version {version}: {error}")
            diff = max(diff, probe_diff(s.logprobs, trainer_logp))
    return errors, diff
