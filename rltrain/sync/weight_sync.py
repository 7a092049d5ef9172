"""Weight sync after each step: one plan, one transport, every sync verified.

Every rank calls `push(version)` with the world up: a sharded trainer all-gathers each weight
(`trainer.export_weights(names)`, the same names in the same order on every rank), and each
engine's leader rank hands the full tensors to its engine by the configured transport (one file
each; the engine's other ranks build their TP ranks' payloads where the transport needs them):

    tensor       per bucket, a buffer passed by handle (CUDA IPC / shared memory)   sync/tensor.py
    distributed  per bucket, a broadcast over a weight-update group                 sync/distributed.py
    disk, delta  a published HF version (or a delta against the last one)           sync/disk.py

What every transport shares lives here: the plan (plan.py: coverage, routing, buckets), the
stream of the trainer's tensors, the agreement of every rank on a failure (no rank waits on a
failed one), and the verification afterwards (`sync.verify`; the checks are in verify.py):

    every engine     reports the version it was sent
    embedded engine  its checksum over what it owns = the one the sender computed, in the
                     engine's dtype, over the tensors as they passed
    SGLang           every engine's /weights_checker digest per TP rank agrees with the other
                     engines' of its TP size
    every engine     a fixed probe sequence's log-probs (the engine's at temperature 1) match
                     the trainer's within `sync.probe_tolerance`: the trainer's are taken in
                     `push` (it is on the device; by rank 0 for every rank where its forward
                     is no collective, `trainer.gathered()`), the engines' by `probe_engines` once they
                     are awake again (a forward needs the KV cache the engines get back last),
                     or, where the engines keep their memory through the sync (`awake`: on the
                     CPU, or not colocated), in `push` too, while the trainer scores it

An engine that reports checksums sends its report with the end of the weight-update session
(`end_weight_update(checksum=True)`) where the transport has sessions, instead of a request of
its own after.

A failed check fails the step on every rank (`WeightMismatchError`, `StaleWeightsError`) naming
the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from transformers import AutoConfig

from rltrain.config import Config
from rltrain.engine.client import EngineClient, EngineError
from rltrain.engine.layout import EngineLayout
from rltrain.interfaces import Needs, Trainer, World
from rltrain.sync import verify
from rltrain.sync.disk import DiskTransport
from rltrain.sync.distributed import DistributedTransport
from rltrain.sync.plan import EngineParallelism, EngineTopology, SyncPlan, WeightSpec, build_plan
from rltrain.sync.tensor import TensorTransport
from rltrain.sync.transport import EngineCaps, SyncContext, Transport, WeightStream, probe
from rltrain.weights.checksum import WeightMismatchError, combine, entry, fetched
from rltrain.weights.names import checkpoint_names, num_experts
from rltrain.weights.versions import StaleWeightsError

log = logging.getLogger("rltrain.sync")

# Engines' probe log-probs by engine name: an error text where one refused, None where it did not answer.
Scores = list[tuple[str, list[float] | str | None]]

Sums = dict[str, Any]  # checkpoint name -> `checksum.entry` of what was sent


def make_transport(name: str, ctx: SyncContext) -> Transport:
    if name == "tensor":
        return TensorTransport(ctx)
    if name == "distributed":
        return DistributedTransport(ctx)
    if name in ("disk", "delta"):
        return DiskTransport(ctx, delta=name == "delta")
    raise ValueError(f"sync.transport={name!r}: expected tensor, distributed, disk or delta")


def engine_layouts(receivers: list[EngineClient]) -> tuple[EngineParallelism, ...]:
    """Each receiver's layout as it reports it (asked of the engine, never derived from how many
    receivers there are). An engine that cannot say is taken as EPLB-free TP 1, EP 1: routing off."""
    out = []
    for client in receivers:
        try:
            out.append(EngineParallelism.from_server_info(client.server_info()))
        except (EngineError, ValueError, TypeError) as e:
            log.warning("sync: %s did not report its layout (%s); experts go to every rank", client.url, e)
            out.append(EngineParallelism())
    return tuple(out)


class WeightSync:
    """`receivers`: this rank's engine clients, indexed by EP rank (the loop: its one engine;
    with several and a MoE model, experts are routed, plan.py). `engine`: this rank's place in
    its engine (`engine/layout.py`): its leader sends, its TP ranks build their payloads (None:
    one engine of TP size 1 per node, sent to by the node's leader). Every rank of an engine
    holds the same list (each checks the served version). `awake`: the engines keep their memory
    through the sync (`NodeEngine.releases` false), so the probe is scored in `push`."""

    def __init__(
        self,
        cfg: Config,
        world: World,
        trainer: Trainer,
        receivers: list[EngineClient],
        engine_model_path: str,
        engine: EngineLayout | None = None,
        awake: bool = False,
    ):
        self.cfg, self.world, self.trainer, self.receivers = cfg, world, trainer, list(receivers)
        # The engines keep their memory through the sync (they release none): they score the
        # probe in `push`, while the trainer does; otherwise in `probe_engines`, once awake.
        self.awake = awake
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="rltrain-probe")
        env = world.env
        self.engine_name = engine.name if engine is not None else f"node{env.node_rank}-engine0"
        self.leader = engine.is_engine_leader if engine is not None else env.is_node_leader
        tp_rank, tp_size = (engine.tp_rank, engine.gpus_per_engine) if engine is not None else (0, 1)
        tp_group = None
        if engine is not None and tp_size > 1:
            tp_group = world.bridge.subgroup(engine.ranks(world.rank - env.local_rank), f"sync/{engine.name}")
        weights = [WeightSpec(n, tuple(s), d) for n, _, s, d in trainer.weight_specs()]
        engine_names, aliases = checkpoint_names(engine_model_path)
        model_cfg = AutoConfig.from_pretrained(engine_model_path)
        experts = num_experts(model_cfg)
        topology = EngineTopology(
            (len(self.receivers),),
            experts,
            engine_layouts(self.receivers) if experts else (),
            per_rank_payloads=cfg.sync_transport == "tensor" and tp_size > 1,
        )
        self.plan: SyncPlan = build_plan(weights, topology, cfg.sync.bucket_mb << 20, engine_names, aliases)
        if self.plan.engine_ep_ranks is not None and len(self.plan.engine_ep_ranks) != tp_size:
            raise ValueError(
                f"{self.engine_name} reports {len(self.plan.engine_ep_ranks)} TP ranks, but it was laid out over "
                f"{tp_size} GPUs (engine.gpus_per_engine): set its --tp-size through the layout, not extra_args"
            )
        self.caps = probe(self.receivers) if self.leader else EngineCaps()
        if tp_group is not None:  # every rank of the engine checksums its own payload (`_tensors`)
            self.caps = tp_group.all_gather_object(self.caps, phase="sync caps")[0]
        self.tp_rank = tp_rank
        # Routed inside the engine: each trainer rank is handed only its TP rank's payload.
        self.needs: Needs | None = None
        if self.plan.engine_ep_ranks is not None:
            local, per = env.local_world_size, tp_size
            self.needs = lambda rank, name: self.plan.needed_by((rank % local) % per, name)
        self.probe = verify.probe_tokens(model_cfg.vocab_size, cfg.sync.probe_tokens) if cfg.sync.probe_tokens else []
        self.tp_group = tp_group
        self.transport: Transport = make_transport(
            cfg.sync_transport,
            SyncContext(
                cfg=cfg.sync,
                world=world,
                receivers=self.receivers,
                plan=self.plan,
                caps=self.caps,
                device=trainer.device,
                model_path=trainer.model_path,
                weights_dir=cfg.weights_dir,
                request_timeout_s=cfg.engine.request_timeout_s,
                sender=self.leader,
                tp_rank=tp_rank,
                tp_size=tp_size,
                tp_group=tp_group,
                engine_name=self.engine_name,
                # engines that stay awake score the probe as their session ends, where they can
                probe=tuple(self.probe) if awake and cfg.sync.verify else (),
            ),
        )
        self._probe_due: tuple[str, torch.Tensor] | None = None  # (version, the trainer's probe log-probs)
        self.verify_seconds = 0.0  # of the last push

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per part of the last push (benchmarks), the verification's included."""
        return {**self.transport.timings, "verify": self.verify_seconds}

    def push(self, version: str) -> dict[str, float]:
        """Send the trainer's weights as `version`; verified on return (collective)."""
        t0 = time.perf_counter()
        sums: Sums = {}
        error = None
        with self.trainer.gathered():  # one gathering for the export and the probe
            # The trainer's probe forward, where it is no collective, runs while the weights go out.
            early = self._pool.submit(self._trainer_probe) if self._probe_alone() else None
            try:
                try:
                    sent = self.transport.send(
                        version, WeightStream(self.plan, lambda names: self._tensors(names, sums))
                    )
                except (OSError, ValueError, RuntimeError) as e:  # this rank failed; the others must hear of it
                    error, sent = (
                        f"rank {self.world.rank}: sync of version {version} by {self.cfg.sync_transport} failed: {e}",
                        0,
                    )
                errors = self.world.bridge.all_gather_object(error, phase="sync")
                if any(errors):
                    raise SyncError(next(e for e in errors if e))
                stats = self._verify(version, sums, early)
            finally:
                if early is not None:
                    wait([early])  # the weights are let go of only after that forward
        log.debug(
            "synced version %s by %s: %d bytes in %.3fs",
            version,
            self.cfg.sync_transport,
            sent,
            time.perf_counter() - t0,
        )
        # sync_routed: the experts went only to the engine ranks that hold them (plan.py).
        return {"sync_bytes": float(sent), "sync_routed": float(self.plan.routed), **stats}  # time: the "sync" phase

    def _tensors(self, names: list[str] | None, sums: Sums) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's tensors this rank sends (a collective): all of them, or, routed inside
        the engine, its TP rank's. Checksummed in the engine's dtype by the leader, and by every
        rank of an engine that checksums each TP rank's weights."""
        dtype = self.caps.dtype
        check = self.cfg.sync.verify and (self.leader or (self.caps.checksums and self.tp_group is not None))
        for name, t in self.trainer.export_weights(names, needs=self.needs):
            if not self.plan.needed_by(self.tp_rank, name):
                continue
            if check:
                sums[name] = entry(t if dtype is None else t.to(dtype))
            yield name, t

    def _probe_alone(self) -> bool:
        """Whether this rank scores the probe for the trainer and its forward is no collective
        (the weights gathered on every rank, or one rank): it may run beside the send."""
        return bool(self.cfg.sync.verify and self.probe and not self.trainer.sharded) and (
            not self.awake or self.world.rank == 0
        )

    def _trainer_probe(self) -> torch.Tensor:
        """The trainer's log-probs of the probe's tokens 1.. at temperature 1."""
        return self.trainer.logprobs(verify.probe_batch(self.probe), temperature=1.0)[0][0, 1:]

    def _verify(self, version: str, sums: Sums, early: Future[torch.Tensor] | None = None) -> dict[str, float]:
        """Every check of the module docstring; all ranks agree on the outcome (a collective).
        Returns how many engines' /weights_checker digests were compared (its seconds go to
        `self.timings["verify"]`: metrics rows hold no timings outside their "time")."""
        t0 = time.perf_counter()
        stale: list[str] = []  # engines at another version
        wrong: list[str] = []  # engines at the version with other weights
        check = self.cfg.sync.verify
        digests: list[verify.EngineDigest] = []
        per_rank = {self.tp_rank: sums}  # TP rank -> what its trainer rank sent and checksummed
        if check and self.caps.checksums and self.tp_group is not None:
            per_rank = dict(enumerate(self.tp_group.all_gather_object(fetched(sums), phase="sync checksums")))
        try:
            for r, client in enumerate(self.receivers):
                name = self._name(r)
                # The checksum report carries the version it was taken at: one request, not two
                # (none where it came with the end of the weight-update session).
                rep = None
                if check and self.leader and self.caps.checksums:
                    rep = self.transport.ends.reports.pop(r, None) or client.weights_checksum()
                served = rep["weight_version"] if rep is not None else client.weight_version()
                if served != version:
                    stale.append(f"{name} serves weight version {served!r} after loading {version!r}")
                    continue
                if not (check and self.leader):
                    continue
                if rep is not None:
                    # An engine over several TP ranks checksums each (what that rank holds); one
                    # of one rank, all it owns.
                    for e in rep.get("ranks") or [{"tp_rank": 0, **rep}]:
                        k = e["tp_rank"]
                        owned = {n: v for n, v in per_rank.get(k, sums).items() if r in self.plan.targets[n]}
                        mine = combine(owned)
                        if rep["weight_version"] != version or e["checksum"] != mine:
                            rank = f" TP rank {k}" if "ranks" in rep else ""
                            wrong.append(
                                f"after syncing version {version}, {name}{rank} serves version "
                                f"{rep['weight_version']!r} with weight checksum {e['checksum']} over {e['count']} "
                                f"tensors; the trainer's is {mine} over {len(owned)}"
                            )
                if self.caps.weights_checker:
                    ranks = client.weights_checker()
                    shard = f"ep{r}/{len(self.receivers)}" if len(self.receivers) > 1 else ""
                    digests.append(verify.EngineDigest(name, len(ranks), tuple(e["checksum"] for e in ranks), shard))
        except EngineError as e:
            wrong.append(f"cannot verify weight version {version} on {self.engine_name}: {e}")
        # Engines that stay awake score the probe now, while the trainer does; the others once
        # awake (`probe_engines`). Where the trainer's forward is no collective (its weights
        # gathered on every rank, or one rank), rank 0 scores it for all: the ranks hold the same
        # weights. Every rank then judges every rank's engines against it, after the gather.
        probed: tuple[Scores, torch.Tensor | None] | None = None  # (this rank's engines', the trainer's)
        if check and self.probe:
            scores = self._awake_scores(version) if self.awake and self.leader else None
            trainer_logp = None
            if early is not None:  # (taken beside the send)
                trainer_logp = early.result()
            elif self.trainer.sharded or not self.awake or self.world.rank == 0:
                trainer_logp = self._trainer_probe()
            if self.awake:
                got = scores.result() if isinstance(scores, Future) else scores or []
                probed = (got, trainer_logp if self.world.rank == 0 else None)
            else:
                assert trainer_logp is not None
                self._probe_due = (version, trainer_logp)
        gathered = self.world.bridge.all_gather_object((stale, wrong, digests, probed), phase="sync verify")
        wrong = [f"rank {r}: {e}" for r, (_, w, _, _) in enumerate(gathered) for e in w]
        wrong += verify.disagreements([d for _, _, ds, _ in gathered for d in ds])
        stale = [f"rank {r}: {e}" for r, (st, _, _, _) in enumerate(gathered) for e in st]
        judged: list[tuple[list[str], float]] = []  # (errors, largest difference) of each rank's engines
        if probed is not None:
            reference = gathered[0][3][1]
            assert reference is not None, "rank 0 scores the probe for the trainer"
            judged = [self._compare(version, p[0], reference) for *_, p in gathered if p is not None]
        if not (wrong or stale):  # the probe judges engines that hold the version's weights, as once awake
            wrong = [f"rank {r}: {e}" for r, (errors, _) in enumerate(judged) for e in errors]
        if wrong:
            raise WeightMismatchError("; ".join(stale + wrong))
        if stale:
            raise StaleWeightsError("; ".join(stale))
        self.verify_seconds = time.perf_counter() - t0
        stats = {"sync_digests": float(sum(len(ds) for _, _, ds, _ in gathered))}
        if judged:
            stats["sync_probe_diff"] = max(diff for _, diff in judged)
        return stats

    def probe_engines(self) -> dict[str, float]:
        """The probe of the last push, on the engines (awake: weights and KV cache back), against
        the trainer's log-probs taken then. Collective over the bridge; a mismatch anywhere raises
        WeightMismatchError on every rank, naming the engine. Returns the largest mean absolute
        difference seen ({} when no probe is due: none pushed, or probed in the push itself)."""
        due, self._probe_due = self._probe_due, None
        if due is None:
            return {}
        version, trainer_logp = due
        errors, diff = self._compare(version, self._engine_scores(version) if self.leader else [], trainer_logp)
        gathered = self.world.bridge.all_gather_object((errors, diff), phase="sync probe")
        found = [f"rank {r}: {e}" for r, (errs, _) in enumerate(gathered) for e in errs]
        if found:
            raise WeightMismatchError("; ".join(found))
        return {"sync_probe_diff": max(d for _, d in gathered)}

    def _awake_scores(self, version: str) -> Scores | Future[Scores]:
        """The probe's scores of engines that stay awake: as they reported them when their
        session ended (`SyncContext.probe`), else asked now on a thread, while the trainer scores."""
        ends, self.transport.ends.probes = self.transport.ends.probes, {}  # (consumed, as the reports are)
        if len(ends) == len(self.receivers):
            return [
                (self._name(r), p if isinstance(p, list) else self._refused(r, version, p))
                for r, p in sorted(ends.items())
            ]
        return self._pool.submit(self._engine_scores, version)

    def _refused(self, receiver: int, version: str, why: Any) -> str:
        return f"{self._name(receiver)} could not score the probe of version {version}: {why}"

    def _engine_scores(self, version: str) -> Scores:
        """Each receiver's name and log-probs of the probe (the engine's leader asks): an error
        text where it refused, None where it did not answer (gone: the next rollout's recover()
        restarts it and syncs again)."""
        out: Scores = []
        for r, client in enumerate(self.receivers):
            name = self._name(r)
            try:
                out.append((name, client.score(self.probe)))
            except EngineError as e:
                if e.status is None:
                    log.warning("%s did not answer the probe of version %s: %s", name, version, e)
                    out.append((name, None))
                else:
                    out.append((name, self._refused(r, version, e)))
        return out

    def _compare(self, version: str, scores: Scores, trainer_logp: torch.Tensor) -> tuple[list[str], float]:
        """(errors, largest mean absolute difference) of the engines' probe log-probs against the trainer's."""
        errors: list[str] = []
        diff = 0.0
        if not scores:
            return errors, diff
        tol = verify.probe_tolerance(self.cfg.sync.probe_tolerance, self.caps.dtype, self.plan.weights[0].dtype)
        for name, logp in scores:
            if isinstance(logp, str):
                errors.append(logp)
            elif logp is not None:
                error = verify.probe_error(name, logp, trainer_logp, tol)
                if error is not None:
                    errors.append(f"version {version}: {error}")
                diff = max(diff, verify.probe_diff(logp, trainer_logp))
        return errors, diff

    def _name(self, receiver: int) -> str:
        return self.engine_name if len(self.receivers) == 1 else f"{self.engine_name} (EP rank {receiver})"

    def engine_restarted(self) -> None:
        """This node's engine was started again (its weight-update groups died with it)."""
        self.transport.engine_restarted()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.transport.close()
        if self.tp_group is not None:
            self.tp_group.close()


class SyncError(RuntimeError):
    """A rank could not send or load a weight version; the engine keeps its previous weights."""
