"""Everything that judges a sync: what an engine is checked for after it, beyond the version it
reports, and the one verdict over every rank's findings.

    checksums   the embedded engine's checksum over what it owns against the one the trainer's
                tensors gave as they were sent (`weights/checksum.py`)
    rewrites    SGLang's /weights_checker: before the sync every parameter of the engine is
                overwritten with random values (`reset_tensors`) and hashed; after it, a
                parameter whose hash did not change was not written by the sync. Its own, fused
                layout is not comparable with the trainer's, but this needs no comparison: with
                one engine or many, whatever the sync missed is named, and is garbage the probe
                sees, never a stale copy that passes for the new weights.
    agreement   the same digests after the sync: engines of the same TP size hold the same
                shard at the same TP rank, so they must all report the same digest there; an
                engine that disagrees with the others missed or mangled an update.
    probe       a natural token sequence scored by every engine (log-probs at temperature 1)
                against the trainer's log-probs of it, judged on the mean and the worst
                position within bounds calibrated at start-up (`probe.py`): catches what the
                digests cannot — an engine that computes otherwise, a half-written fused weight.

What is checked is decided once per run (`Checks.decide`: `sync.verify`, the engines'
capabilities, and when the probe runs, `ProbeMoment`). Before each sync an engine's leader
resets its engines (`EngineVerifier.before_sync`); after it every rank asks its own engines
(`EngineVerifier`) and contributes a `RankReport` (facts, no verdict); the reports are gathered
over the bridge and `judge` decides on every rank alike, naming every miss: an engine at another
version, a checksum per engine (and TP rank), a parameter left unwritten, an engine that
disagrees with its peers, a probe off the trainer's, an engine that did not answer. An engine
whose process has exited (`alive`) is left to the loop's restart path (`engine.recover()`,
which sends and verifies the weights again); one that runs and does not answer fails the sync.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rltrain.engine.client import EngineCapabilities, EngineClient, EngineError
from rltrain.engine.layout import EngineLayout
from rltrain.interfaces import World
from rltrain.sync.plan import SyncPlan
from rltrain.sync.probe import ProbeBounds, ProbeDiff, probe_error
from rltrain.sync.transport import SessionEnds
from rltrain.weights.checksum import Entry, WeightMismatchError, combine
from rltrain.weights.versions import StaleWeightsError

log = logging.getLogger("rltrain.sync")

Sums = dict[str, Entry]  # checkpoint name -> `checksum.entry` of what was sent
Digests = list[dict[str, Any]]  # an engine's /weights_checker answer, per TP rank (`EngineClient.weights_checker`)

NAMED = 8  # unwritten parameters named per engine TP rank in an error (the count says the rest)


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
    # The engines answer /weights_checker: reset before each sync, every parameter found
    # rewritten after it, the digests of engines that hold the same shard agree.
    weights_checker: bool
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


def shard_groups(digests: Sequence[EngineDigest]) -> dict[tuple[int, str], list[EngineDigest]]:
    """The digests by the shard their engines hold (TP size and `shard`)."""
    groups: dict[tuple[int, str], list[EngineDigest]] = defaultdict(list)
    for d in digests:
        groups[d.tp_size, d.shard].append(d)
    return groups


def compared(digests: Sequence[EngineDigest]) -> int:
    """How many TP-rank digests had another engine's to be compared with (a group of one has none)."""
    return sum(len(g) * size for (size, _), g in shard_groups(digests).items() if len(g) > 1)


def disagreements(digests: Sequence[EngineDigest]) -> list[str]:
    """Engines whose digest at some TP rank differs from the most common one of the engines that
    hold the same shard (TP size and `shard`); with two engines that disagree, both are named."""
    errors = []
    for (size, _), group in sorted(shard_groups(digests).items()):
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


def unwritten(before: Digests, after: Digests) -> dict[int, list[str]]:
    """Per TP rank, the parameters whose hash after the sync is the one they had after the reset
    (a rewritten parameter cannot hash the same: it held random values)."""
    out = {}
    for b, a in zip(before, after):
        same = sorted(n for n, h in a["tensors"].items() if b["tensors"].get(n) == h)
        if same:
            out[a["tp_rank"]] = same
    return out


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
    """One engine's answer to the probe: its log-probs of tokens 1.., or why it has none (its
    error, or that it did not answer); neither where its process has exited (the next rollout's
    recover() restarts it and syncs again)."""

    engine: str
    logprobs: list[float] | None = None
    refused: str | None = None


@dataclass
class RankReport:
    """What one rank found on its engines after a sync (facts; `judge` decides). `scores` is
    None where the probe is not judged at this moment; `trainer_logp`, the trainer's log-probs
    of the probe where this rank took them (else rank 0's stand for it); `bounds`, the probe's."""

    stale: dict[str, str | None] = field(default_factory=dict)  # engine -> the other version it serves
    checksums: list[ChecksumCheck] = field(default_factory=list)
    digests: list[EngineDigest] = field(default_factory=list)
    # engine (TP rank) -> the parameters, in the engine's names, the sync did not write
    unwritten: dict[str, list[str]] = field(default_factory=dict)
    rewrites: int = 0  # engine TP ranks whose every parameter was checked for a rewrite
    unverified: dict[str, str] = field(default_factory=dict)  # engine -> why it could not be asked
    dead: list[str] = field(default_factory=list)  # engines whose process has exited (their leader says)
    scores: list[ProbeScore] | None = None
    trainer_logp: torch.Tensor | None = None
    bounds: ProbeBounds = ProbeBounds.fixed(0.0)


@dataclass(frozen=True)
class Verdict:
    """A sync that passed: how many digests were compared with a reference (a checksum with the
    trainer's, an SGLang TP rank's digest with another engine's), how many engine TP ranks were
    found with every parameter rewritten, the probe's largest differences (None: not judged),
    and the engines left to the restart path (their process has exited)."""

    digests_compared: int
    rewrites_checked: int = 0
    probe: ProbeDiff | None = None
    dead: tuple[str, ...] = ()


class EngineVerifier:
    """This rank's side of the verification, set up once per run: what every sync is checked for
    (`checks`), the probe (`tokens`, judged within `bounds`), and the asking of this rank's
    engines (`receivers`, by EP rank) before and after each sync, written into a `RankReport`.
    Every rank asks for the version; the engine's leader (`leader`) for the rest. `alive`:
    whether this rank's engine process still runs (its leader's; None: taken as running)."""

    def __init__(
        self,
        receivers: Sequence[EngineClient],
        engine_name: str,
        leader: bool,
        plan: SyncPlan,
        caps: EngineCapabilities,
        checks: Checks,
        tokens: list[int],
        bounds: ProbeBounds,
        alive: Callable[[], bool] | None = None,
    ):
        self.receivers, self.engine_name, self.leader, self.targets = list(receivers), engine_name, leader, plan.targets
        self.names = receiver_names(engine_name, len(self.receivers))
        self.engine_dtype: torch.dtype | None = getattr(torch, caps.dtype) if caps.dtype else None
        self.checks, self.probe, self.bounds, self.alive = checks, tokens, bounds, alive
        self._reset: dict[int, Digests] = {}  # receiver -> its digests after the reset, this sync

    def before_sync(self) -> None:
        """On the leader, where the engines answer /weights_checker: every parameter of each
        engine overwritten with random values and hashed, so that `report` finds what the sync
        does not write. Raises EngineError (the sync fails on every rank)."""
        self._reset = {}
        if not (self.leader and self.checks.weights_checker):
            return
        for r, client in enumerate(self.receivers):
            client.reset_weights()
            self._reset[r] = client.weights_checker()

    def report(self, version: str, ends: SessionEnds, sums: Sums, per_rank: dict[int, Sums]) -> RankReport:
        """What the engines serve after the sync to `version` and, asked by the leader, their
        checksums beside the trainer's over what was sent (`sums`: this rank's; `per_rank`: each
        TP rank's, where the engine's ranks sent theirs) and their /weights_checker digests. A
        checksum report that came with the end of the weight-update session (`ends`) is used,
        not asked again."""
        report = RankReport(bounds=self.bounds)
        for r, client in enumerate(self.receivers):
            name = self.names[r]
            try:
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
                if self.leader and self.checks.weights_checker:
                    self._digests(r, client.weights_checker(), report)
            except EngineError as e:
                if self._gone(e):
                    report.dead.append(name)
                else:
                    report.unverified[name] = str(e)
        self._reset = {}
        return report

    def _digests(self, r: int, after: Digests, report: RankReport) -> None:
        """Receiver `r`'s digests after the sync into `report`: for the agreement, and beside
        those after its reset (`before_sync`), for what the sync left unwritten."""
        name = self.names[r]
        shard = f"ep{r}/{len(self.receivers)}" if len(self.receivers) > 1 else ""
        report.digests.append(EngineDigest(name, len(after), tuple(e["checksum"] for e in after), shard))
        before = self._reset.get(r)
        if before is None:
            return
        if [e["tp_rank"] for e in before] != [e["tp_rank"] for e in after]:
            report.unverified[name] = f"answered /weights_checker for TP ranks {len(before)} then {len(after)}"
            return
        report.rewrites += len(after)
        for k, names in unwritten(before, after).items():
            report.unwritten[f"{name} TP rank {k}" if len(after) > 1 else name] = names

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

    def _gone(self, e: EngineError) -> bool:
        """Whether an engine that failed a request has died (no answer, and its process has
        exited): left to the restart path. Only the leader, which owns the process, can tell."""
        return e.status is None and self.leader and self.alive is not None and not self.alive()

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
                if self._gone(e):
                    log.warning("%s has exited; its probe of version %s is left to its restart", name, version)
                    out.append(ProbeScore(name))
                elif e.status is None:
                    out.append(ProbeScore(name, refused=f"it did not answer ({e})"))
                else:
                    out.append(ProbeScore(name, refused=str(e)))
        return out


def engine_place(world: World, engine: EngineLayout | None) -> tuple[str, bool]:
    """This rank's engine's name and whether this rank is its leader (which talks to it): by the
    layout, else the node's one engine, led by the node's leader."""
    if engine is not None:
        return engine.name, engine.is_engine_leader
    return f"node{world.env.node_rank}-engine0", world.env.is_node_leader


def receiver_names(engine_name: str, n: int) -> list[str]:
    """The names of a rank's `n` receivers in errors: its engine's, with their EP ranks where several."""
    return [engine_name] if n == 1 else [f"{engine_name} (EP rank {r})" for r in range(n)]


def judge(version: str, reports: Sequence[RankReport]) -> Verdict:
    """The verdict on a sync to `version` from every rank's report, in rank order (the same on
    every rank). Raises StaleWeightsError where engines serve another version and nothing else is
    wrong, else WeightMismatchError naming every miss; the probe is judged only where every engine
    holds the version's weights (a stale engine's probe says nothing new). An engine whose process
    has exited is left to the restart path, on every rank."""
    dead = sorted({e for rep in reports for e in rep.dead})
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
            f"rank {r}: {engine}: {len(names)} parameter(s) not written by the sync of version {version} (their "
            f"hash is still the one /weights_checker reset_tensors left before it): {', '.join(names[:NAMED])}"
            + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
            for engine, names in rep.unwritten.items()
        ]
        wrong += [
            f"rank {r}: cannot verify weight version {version} on {e}: {why}"
            for e, why in rep.unverified.items()
            if e not in dead
        ]
    digests = [d for rep in reports for d in rep.digests]
    wrong += disagreements(digests)
    missed, diffs = [], []
    for r, rep in enumerate(reports):
        if rep.scores is None:
            continue
        reference = rep.trainer_logp if rep.trainer_logp is not None else reports[0].trainer_logp
        assert reference is not None, "rank 0 scores the probe for the trainer"
        scores = [s for s in rep.scores if s.engine not in dead]
        errors, diff = probe_verdict(version, scores, reference, rep.bounds)
        missed += [f"rank {r}: {e}" for e in errors]
        diffs += [diff] if diff is not None else []
    if not (wrong or stale):
        wrong = missed
    if wrong:
        raise WeightMismatchError("; ".join(stale + wrong))
    if stale:
        raise StaleWeightsError("; ".join(stale))
    checked = sum(len(rep.checksums) for rep in reports) + compared(digests)
    probe = ProbeDiff.largest(diffs) if diffs else None
    return Verdict(checked, sum(rep.rewrites for rep in reports), probe, tuple(dead))


def probe_verdict(
    version: str, scores: Sequence[ProbeScore], trainer_logp: torch.Tensor, bounds: ProbeBounds
) -> tuple[list[str], ProbeDiff | None]:
    """(errors, largest differences) of the engines' probe log-probs against the trainer's."""
    errors: list[str] = []
    diffs = []
    for s in scores:
        if s.refused is not None:
            errors.append(f"{s.engine} could not score the probe of version {version}: {s.refused}")
        elif s.logprobs is not None:
            error = probe_error(s.engine, s.logprobs, trainer_logp, bounds)
            if error is not None:
                errors.append(f"version {version}: {error}")
            elif len(s.logprobs) == trainer_logp.numel():
                diffs.append(ProbeDiff.of(s.logprobs, trainer_logp))
    return errors, ProbeDiff.largest(diffs) if diffs else None
