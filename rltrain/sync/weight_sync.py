"""Weight sync after each step: plan → stream → verify.

Every rank calls `push(version)` with the world up: a sharded trainer all-gathers each weight
(`trainer.export_weights(names)`, the same names in the same order on every rank), and each
engine's leader rank hands the full tensors to its engine by the configured transport (one file
each; the engine's other ranks build their TP ranks' payloads where the transport needs them):

    tensor       per bucket, a buffer passed by handle (CUDA IPC / shared memory)   sync/tensor.py
    distributed  per bucket, a broadcast over a weight-update group                 sync/distributed.py
    disk, delta  a published HF version (or a delta against the last one)           sync/disk.py

What every transport shares lives here: the plan (plan.py: coverage, routing, buckets), the
stream of the trainer's tensors, the agreement of every rank on a failure (no rank waits on a
failed one), and the verification around it (`sync.verify`: what is checked, each rank's report
and the verdict are in verify.py; SGLang's engines are reset before the send, so that what it
misses is garbage the checks see). The probe (probe.py) is made and measured at start-up, while
the engines serve model.path as each loaded it (`calibration.probe_at_start`), and its bounds calibrated
against the trainer as it is built, which holds those weights still. It runs at one moment per run
(`verify.ProbeMoment`, logged by the setup): the trainer's log-probs are taken in `push` (it is on
the device; by rank 0 for every rank where its forward is no collective, `trainer.gathered()`);
the engines score it once awake again (`probe_engines`: a forward needs the KV cache they get
back last), or, where they keep their memory through the sync (`awake`: on the CPU, or not
colocated), in `push` too, while the trainer scores it. A failed check fails the step on every
rank (`WeightMismatchError`, `StaleWeightsError`) naming the engine.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
from transformers import AutoConfig

from rltrain.batch import TrainBatch, with_probe_row
from rltrain.config import Config
from rltrain.engine.client import EngineCapabilities, EngineClient, EngineError
from rltrain.engine.layout import EngineLayout
from rltrain.interfaces import Needs, ProbeRide, Trainer, World
from rltrain.sync import calibration, probe, verify
from rltrain.sync.disk import DiskTransport
from rltrain.sync.distributed import DistributedTransport
from rltrain.sync.plan import EngineParallelism, EngineTopology, SyncPlan, WeightSpec, build_plan
from rltrain.sync.probe import ProbeBounds, StartProbe
from rltrain.sync.tensor import TensorTransport
from rltrain.sync.transport import SyncContext, Transport, WeightStream
from rltrain.sync.verify import ProbeMoment, Sums
from rltrain.weights.checksum import SideSums, fetched
from rltrain.weights.names import checkpoint_names, num_experts

Scores = list[verify.ProbeScore] | Future[list[verify.ProbeScore]]
PROBE_ANSWER_S = 300.0  # the longest a ridden judge waits for its engines still answering the probe

log = logging.getLogger("rltrain.sync")


def make_transport(name: str, ctx: SyncContext) -> Transport:
    if name == "tensor":
        return TensorTransport(ctx)
    if name == "distributed":
        return DistributedTransport(ctx)
    if name in ("disk", "delta"):
        return DiskTransport(ctx, delta=name == "delta")
    raise ValueError(f"sync.transport={name!r}: expected tensor, distributed, disk or delta")


def plan_sync(
    cfg: Config, trainer: Trainer, receivers: list[EngineClient], engine_model_path: str, experts: int, tp_size: int
) -> SyncPlan:
    """The plan of every push: the trainer's weights against the engine's checkpoint names, routed
    by the layouts the engines report where the model has experts."""
    weights = [WeightSpec(n, tuple(s), d) for n, _, s, d in trainer.weight_specs()]
    engine_names, aliases = checkpoint_names(engine_model_path)
    layouts = engine_layouts(receivers) if experts else ()
    per_rank = cfg.sync_transport == "tensor" and tp_size > 1
    topology = EngineTopology((len(receivers),), experts, layouts, per_rank_payloads=per_rank)
    return build_plan(weights, topology, cfg.sync.bucket_mb << 20, engine_names, aliases)


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
    through the sync (`NodeEngine.releases` false), so the probe is scored in `push`. `start`:
    the engines' scores of the probe at start-up (`calibration.probe_at_start`): the trainer scores it here,
    as it holds model.path's weights still, and the probe's bounds are calibrated from the
    difference (a collective); None: random tokens, the precision's ceilings. `alive`: whether
    this rank's engine process still runs (asked by its leader when an engine does not answer)."""

    def __init__(
        self,
        cfg: Config,
        world: World,
        trainer: Trainer,
        receivers: list[EngineClient],
        engine_model_path: str,
        engine: EngineLayout | None = None,
        awake: bool = False,
        start: StartProbe | None = None,
        alive: Callable[[], bool] | None = None,
    ):
        self.cfg, self.world, self.trainer, self.receivers = cfg, world, trainer, list(receivers)
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="rltrain-probe")
        self._side_sums = SideSums(transient=True)  # the sent tensors' checksums, beside their copies (GPU)
        env = world.env
        self.engine_name, self.leader = verify.engine_place(world, engine)
        self.tp_rank, tp_size = (engine.tp_rank, engine.gpus_per_engine) if engine is not None else (0, 1)
        self.tp_group = None
        if engine is not None and engine.trainer_tp_ranks:  # (each TP rank's payload built on its GPU)
            self.tp_group = world.bridge.subgroup(engine.ranks(world.rank - env.local_rank), f"sync/{engine.name}")
        model_cfg = AutoConfig.from_pretrained(engine_model_path)
        self.plan = plan_sync(cfg, trainer, self.receivers, engine_model_path, num_experts(model_cfg), tp_size)
        if self.plan.engine_ep_ranks is not None and len(self.plan.engine_ep_ranks) != tp_size:
            raise ValueError(
                f"{self.engine_name} reports {len(self.plan.engine_ep_ranks)} TP ranks, but it was laid out over "
                f"{tp_size} GPUs (engine.gpus_per_engine): set its --tp-size through the layout, not extra_args"
            )
        # Routed inside the engine: each trainer rank is handed only its TP rank's payload.
        self.needs: Needs | None = None
        if self.plan.engine_ep_ranks is not None and not (engine is not None and engine.apart):
            local = env.local_world_size  # (apart, an engine's leader sends every TP rank's share)
            self.needs = lambda rank, name: self.plan.needed_by((rank % local) % tp_size, name)
        # Asked of the engines once, by the leader; its TP ranks checksum their payloads by its answer.
        asked = [c.capabilities() for c in self.receivers] if self.leader else []
        caps = EngineCapabilities.shared(asked)  # (none asked: defaults)
        if self.tp_group is not None:
            caps = self.tp_group.all_gather_object(caps, phase="sync caps")[0]
        sessions = cfg.sync_transport in ("tensor", "distributed")
        checks = verify.Checks.decide(cfg.sync.verify, cfg.sync.probe_tokens, caps, awake, sessions)
        if cfg.sync.verify and self.leader and not (checks.checksums or checks.weights_checker):
            log.warning(
                "sync.verify: %s neither checksums the weights it holds nor answers /weights_checker: a weight "
                "the sync misses is seen only by the probe, and there as last version's copy",
                self.engine_name,
            )
        riding = self._trainer_probe_riding if trainer.rides_probe else None  # (as `can_ride` below)
        tokens, bounds = (
            ([], ProbeBounds.fixed(0.0))
            if checks.probe is ProbeMoment.OFF
            else calibration.tokens_and_bounds(
                cfg.sync,
                world,
                caps,
                self.plan,
                model_cfg.vocab_size,
                start,
                self._trainer_probe,
                trainer.sharded,
                riding,
            )
        )
        self.verifier = verify.EngineVerifier(
            self.receivers, self.engine_name, self.leader, self.plan, caps, checks, tokens, bounds, alive
        )
        self.checks, self.probe = checks, tokens
        # The probe's statistics of the weights the engines serve, last judged (at start-up: the
        # difference the bounds were calibrated from, model.path on both sides).
        measured = bounds.measured
        self.served_probe = (
            {} if measured is None else {"sync_probe_diff": measured.mean, "sync_probe_worst": measured.worst}
        )
        # Whether any rank resets its engines before each sync, and whether the trainer's side of
        # the probe can ride the next training step (`push`): where the engines' checksums are
        # compared with the trainer's in the sync itself (a miss or a half-written fused weight
        # fails the sync there; against SGLang, whose digests are not the trainer's, only the
        # probe sees a half-written fused weight: it stays in the sync), and the trainer can
        # (`Trainer.rides_probe`). The leaders know their engines' checks: every rank agrees.
        can_ride = checks.probe is not ProbeMoment.OFF and trainer.rides_probe
        leaders = world.bridge.all_gather_object(
            (checks.weights_checker and self.leader, can_ride, checks.checksums if self.leader else None),
            phase="sync resets",
        )
        self.resets = cfg.sync.verify and any(r for r, _, _ in leaders)
        self.rides = all(c for _, c, _ in leaders) and all(k for _, _, k in leaders if k is not None)
        context = SyncContext(
            cfg=cfg.sync,
            world=world,
            receivers=self.receivers,
            plan=self.plan,
            caps=caps,
            device=trainer.device,
            model_path=trainer.model_path,
            weights_dir=cfg.weights_dir,
            request_timeout_s=cfg.engine.request_timeout_s,
            sender=self.leader,
            tp_rank=self.tp_rank,
            tp_size=tp_size,
            tp_group=self.tp_group,
            engine_name=self.engine_name,
            checksums=self.checks.checksums,
            probe=tuple(self.probe) if self.checks.probe is ProbeMoment.SESSION_END else (),
        )
        self.transport: Transport = make_transport(cfg.sync_transport, context)
        # (version, the trainer's probe log-probs; None: they ride the next training step)
        self._probe_due: tuple[str, torch.Tensor | None] | None = None
        self._rides = False  # the last push's probe rides the next training step
        # (version, this rank's engines' scores, or their answers still coming: `ride`)
        self._ride: tuple[str, Scores] | None = None
        self._early: Future[torch.Tensor] | None = None  # the trainer's probe, scored during a push
        self._start_early = False
        self.verify_seconds = self.reset_seconds = 0.0  # of the last push
        self.verify_parts: dict[str, float] = {}  # the last push's verification, part by part

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per part of the last push (benchmarks), the verification's included."""
        return {
            **self.transport.timings,
            "verify": self.reset_seconds + self.verify_seconds,
            **{f"verify: {k}": v for k, v in self.verify_parts.items()},
        }

    def push(self, version: str, ride: bool = False) -> dict[str, float]:
        """Send the trainer's weights as `version`; verified on return (collective). `ride`: a
        training step follows these weights, and the trainer's side of the probe rides its first
        micro-batch (`ride()`; where `self.rides`) instead of a forward of its own here; the
        engines' side is asked as before, and the probe judged there."""
        t0 = time.perf_counter()
        sums: Sums = {}
        self._rides = ride and self.rides
        self._ride = None  # an unjudged probe of an earlier version: these weights replace it
        with self.trainer.gathered():  # one gathering for the export and the probe
            # The trainer's probe forward, where it is no collective with a peer (not sharded, or
            # a world of one rank: its export then runs no collective at all), runs on a thread
            # while the weights go out: started once the first bucket is exported (the export's
            # first walk of the modules is done by then; a forward swaps their parameters).
            alone = (
                not self._rides
                and self._scores_for_trainer()
                and (not self.trainer.sharded or self.world.world_size == 1)
            )
            self._early = None
            self._start_early = alone
            try:
                sent = self._stream(version, sums)
                stats = self._verify(version, sums, self._early)
            finally:
                if self._early is not None:
                    wait([self._early])  # the weights are let go of only after that forward
                self._early, self._start_early = None, False
        seconds = time.perf_counter() - t0
        log.debug("synced version %s by %s: %d bytes in %.3fs", version, self.cfg.sync_transport, sent, seconds)
        # sync_routed: the experts went only to the engine ranks that hold them (plan.py).
        return {"sync_bytes": float(sent), "sync_routed": float(self.plan.routed), **stats}  # time: the "sync" phase

    def _stream(self, version: str, sums: Sums) -> int:
        """The transport's send of every planned tensor; a rank that failed fails it on every rank."""
        error, sent = None, 0
        self._reset(version)
        try:
            sent = self.transport.send(version, WeightStream(self.plan, lambda names: self._tensors(names, sums)))
        except (OSError, ValueError, RuntimeError) as e:  # this rank failed; the others must hear of it
            error = f"rank {self.world.rank}: sync of version {version} by {self.cfg.sync_transport} failed: {e}"
        errors = self.world.bridge.all_gather_object(error, phase="sync")
        if any(errors):
            raise SyncError(next(e for e in errors if e))
        return sent

    def _reset(self, version: str) -> None:
        """Before the send, where any engine answers /weights_checker: the leaders reset their
        engines' weights (`EngineVerifier.before_sync`: what the send misses is then garbage the
        checks see), and every rank learns that it worked before any starts the send's
        collectives (a rank that skipped them would leave the others waiting)."""
        if not self.resets:
            return
        t0, error = time.perf_counter(), None
        try:
            self.verifier.before_sync()
        except EngineError as e:
            error = (
                f"rank {self.world.rank}: {self.engine_name} could not reset its weights before version {version}: {e}"
            )
        errors = self.world.bridge.all_gather_object(error, phase="sync reset")
        self.reset_seconds = time.perf_counter() - t0
        if any(errors):
            raise SyncError(next(e for e in errors if e))

    def _tensors(self, names: list[str] | None, sums: Sums) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's tensors this rank sends (a collective): all of them, or, routed inside
        the engine, its TP rank's. Checksummed in the engine's dtype where the engines report
        checksums: by the leader, and by every rank of an engine over several (each TP rank's)."""
        dtype = self.verifier.engine_dtype
        check = self.checks.checksums and (self.leader or self.tp_group is not None)
        exported = self.trainer.export_weights(names, needs=self.needs)
        mine = [(n, t) for n, t in exported if self.plan.needed_by(self.tp_rank, n)]
        if check:  # the bucket's checksums in one launch on a GPU, beside its copy (a side stream)
            sums.update(self._side_sums.entries((n, t if dtype is None else t.to(dtype)) for n, t in mine))
        if self._start_early:  # (push)
            self._start_early = False
            self._early = self._pool.submit(self._trainer_probe)
        yield from mine

    def _scores_for_trainer(self) -> bool:
        """Whether this rank takes the trainer's probe log-probs: every rank where the forward is a
        collective (sharded) or each rank judges its own engines later (once awake); else rank 0
        for all (the ranks hold the same weights)."""
        moment, sharded = self.checks.probe, self.trainer.sharded
        return moment is not ProbeMoment.OFF and (sharded or moment is ProbeMoment.AWAKE or self.world.rank == 0)

    def _trainer_probe(self, tokens: list[int] | None = None) -> torch.Tensor:
        """The trainer's log-probs of the probe's tokens 1.. (or `tokens`') at temperature 1."""
        batch = probe.probe_batch(self.probe if tokens is None else tokens)
        return self.trainer.logprobs(batch, temperature=1.0)[0][0, 1:]

    def _trainer_probe_riding(self, tokens: list[int]) -> torch.Tensor:
        """The trainer's log-probs of `tokens` 1.. as the probe rides a training step: one more
        row of a micro-batch of the training's shape (trainer.micro_batch_size rows, or
        padding-free as many as trainer.max_tokens_per_micro_batch holds, each a prompt of the
        probe's length with a whole response; their tokens the probe's, repeated)."""
        t, length = self.cfg.trainer, len(tokens) + self.cfg.rollout.max_new_tokens
        rows = max(1, t.max_tokens_per_micro_batch // length) if t.max_tokens_per_micro_batch else t.micro_batch_size
        filler = torch.tensor((tokens * -(-length // len(tokens)))[:length]).repeat(rows, 1)
        batch = with_probe_row(
            TrainBatch(filler, torch.ones_like(filler), torch.zeros_like(filler)), tokens, self.trainer.pad_id
        )
        return self.trainer.logprobs(batch, temperature=1.0)[0][rows, 1 : len(tokens)]

    def _verify(self, version: str, sums: Sums, early: Future[torch.Tensor] | None = None) -> dict[str, float]:
        """This rank's report on its engines, judged with every rank's (a collective). Returns what
        was compared (`sync_digests_compared`: checksums with the trainer's and SGLang digests with
        another engine's; `sync_rewrites_checked`: SGLang TP ranks whose every parameter was found
        rewritten after its reset) and the probe's largest differences where it ran in the push
        (its seconds go to `self.timings["verify"]`: metrics rows hold no timings outside their
        "time")."""
        t0 = time.perf_counter()
        self._side_sums.join()
        per_rank = {self.tp_rank: sums}  # TP rank -> what its trainer rank sent and checksummed
        if self.checks.checksums and self.tp_group is not None:
            per_rank = dict(enumerate(self.tp_group.all_gather_object(fetched(sums), phase="sync checksums")))
        report = self.verifier.report(version, self.transport.ends, sums, per_rank)
        t1 = time.perf_counter()
        self._probe_in_push(version, report, early)
        t2 = time.perf_counter()
        verdict = verify.judge(version, self.world.bridge.all_gather_object(report, phase="sync verify"))
        self.verify_seconds = time.perf_counter() - t0
        self.verify_parts = {"reports": t1 - t0, "probe": t2 - t1, "verdict": t0 + self.verify_seconds - t2}
        stats = {
            "sync_digests_compared": float(verdict.digests_compared),
            "sync_rewrites_checked": float(verdict.rewrites_checked),
        }
        return {**stats, **self._probe_stats(version, verdict)}

    def _probe_stats(self, version: str, verdict: verify.Verdict) -> dict[str, float]:
        """The probe's largest differences, mean and worst position, of a verdict that judged it
        (and, once, the engines it left to the restart path)."""
        if verdict.dead and self.world.rank == 0:
            log.warning("sync of version %s: %s exited; left to the restart", version, ", ".join(verdict.dead))
        if verdict.probe is None:
            return {}
        self.served_probe = {"sync_probe_diff": verdict.probe.mean, "sync_probe_worst": verdict.probe.worst}
        return dict(self.served_probe)

    def _probe_in_push(self, version: str, report: verify.RankReport, early: Future[torch.Tensor] | None) -> None:
        """The probe's part of the push: where the engines score it in the push, theirs (the
        leader's engines) and the trainer's (rank 0's) go into `report`; where they score it once
        awake, the trainer's log-probs are kept for `probe_engines`."""
        moment = self.checks.probe
        if moment is ProbeMoment.OFF:
            return
        in_push = moment is not ProbeMoment.AWAKE and self.leader
        engines = self.verifier.scores_in_push(version, self.transport.ends, self._pool) if in_push else None
        if self._rides:  # judged when the next training step has the trainer's side (`ride`)
            if moment is ProbeMoment.AWAKE:
                self._probe_due = (version, None)
            else:
                self._ride = (version, engines or [])
            return
        here = self._scores_for_trainer()
        trainer_logp = early.result() if early is not None else self._trainer_probe() if here else None
        if moment is ProbeMoment.AWAKE:
            assert trainer_logp is not None
            self._probe_due = (version, trainer_logp)
            return
        report.scores = engines.result() if isinstance(engines, Future) else engines or []
        report.trainer_logp = trainer_logp if self.world.rank == 0 else None

    def probe_engines(self) -> dict[str, float]:
        """The probe of the last push, on the engines (awake: weights and KV cache back), against
        the trainer's log-probs taken then. Collective over the bridge; a mismatch anywhere raises
        WeightMismatchError on every rank, naming the engine. Returns the largest differences seen,
        mean and worst position ({} when no probe is due: none pushed, or probed in the push itself;
        0 where no engine answered: they exited, left to the restart path). Where the trainer's side
        rides the next training step, the engines are asked on a thread and nothing waits here:
        they answer beside the rollout (an engine scores under its lock, in turn with its
        decoding), `probe_answered` has their answers before they release, and the step's judge
        takes them (`ride`)."""
        due, self._probe_due = self._probe_due, None
        if due is None:
            return {}
        version, trainer_logp = due
        if trainer_logp is None:  # the trainer's side rides the next training step
            self._ride = (version, self._pool.submit(self.verifier.scores, version) if self.leader else [])
            return {}
        scores = self.verifier.scores(version) if self.leader else []
        return self._judge_probe(version, scores, trainer_logp)

    def probe_answered(self) -> None:
        """Wait until this rank's engines have answered the ridden probe (asked on a thread by
        `probe_engines`): before they release their memory, which their answers need. Their
        scoring runs under each engine's lock, so it takes its turn with the rollout's decoding;
        what failed or did not come within PROBE_ANSWER_S is a refused answer (the judge fails
        the step on every rank, naming the engine)."""
        if self._ride is not None and isinstance(self._ride[1], Future):
            self._ride = (self._ride[0], self._answers(self._ride[1]))

    def _answers(self, asked: Future[list[verify.ProbeScore]]) -> list[verify.ProbeScore]:
        try:
            return asked.result(timeout=PROBE_ANSWER_S)
        except Exception as e:  # (every rank must reach the judge: this one's engines failed it)
            why = f"no answer to the probe within {PROBE_ANSWER_S:.0f} s" if isinstance(e, TimeoutError) else e
            return [verify.ProbeScore(name, refused=str(why)) for name in self.verifier.names]

    def ride(self) -> ProbeRide | None:
        """The probe of the last push for the next training step to score and judge (None: none
        is due). Its judge is a collective over the bridge before that step's first optimizer
        step: a mismatch raises WeightMismatchError on every rank, naming the engine, before
        anything is trained on the rollout those weights made."""
        if self._ride is None:
            return None
        version, scores = self._ride
        self._ride = None
        return ProbeRide(list(self.probe), functools.partial(self._judge_ride, version, scores))

    def _judge_ride(self, version: str, scores: Scores, trainer_logp: torch.Tensor | None) -> dict[str, float]:
        if isinstance(scores, Future):  # the engines' answers, asked beside the rollout
            scores = self._answers(scores)
        # No micro-batch ran on this rank: a forward of its own (sharded, none ran on any rank).
        logp = trainer_logp if trainer_logp is not None else self._trainer_probe()
        return self._judge_probe(version, scores, logp.detach().cpu())

    def _judge_probe(
        self, version: str, scores: list[verify.ProbeScore], trainer_logp: torch.Tensor
    ) -> dict[str, float]:
        """The engines' `scores` of `version`'s probe against the trainer's log-probs (collective)."""
        report = verify.RankReport(scores=scores, trainer_logp=trainer_logp, bounds=self.verifier.bounds)
        verdict = verify.judge(version, self.world.bridge.all_gather_object(report, phase="sync probe"))
        return self._probe_stats(version, verdict) or {"sync_probe_diff": 0.0, "sync_probe_worst": 0.0}

    def engine_restarted(self) -> None:
        """This node's engine was started again (its weight-update groups died with it)."""
        self.transport.engine_restarted()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.transport.close()
        if self.tp_group is not None:
            self.tp_group.close()


class SyncError(RuntimeError):
    """A rank could not send or load a weight version. What the engine holds then depends on the
    transport: disk and delta refuse a bad version before the engine loads anything (it keeps
    the previous one); tensor and distributed may leave a partial update; and an SGLang engine
    whose weights were reset before the sync (`sync.verify`) holds garbage for whatever was not
    sent. In every case it is not to be sampled from until a sync succeeds (the loop stops on this
    error; a restart starts the engines afresh)."""
