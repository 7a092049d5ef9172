"""The driver loop: every rank runs this, one step per iteration, phases in order.

EVAL           every eval.every steps (and before step 1 with eval.before_train): held-out
               prompts sampled and scored on the engines, nothing trained (rollout/evaluation.py)
ROLLOUT        engines awake; each rank samples its prompts' groups and scores them, more prompts
               while DAPO's dynamic sampling wants them (rollout/step.py). loop.max_staleness=1:
               step t+1's rollout then starts in a thread, from the same weights, and runs
               while step t trains; step t+1 takes it (the sync waits for it first)
ENGINE ->      pause the engines, release their memory (weights, KV cache, CUDA graphs) [colocate]
TRAIN          world rebuild, trainer back on the device (re-created if released), old/ref
               log-probs and advantages (rollout/prepare.py), optimizer steps, checkpoint
SYNC           engine resumes weights; the trainer gathers its shards and sends the new
               version (sync.transport), every engine loads it; version and checksum verified
RELEASE WORLD  world destroy (NCCL freed in the background; the Gloo bridge stays)
PUT AWAY       trainer offloaded or released (between_steps.py)
ENGINE <-      engines resume the KV cache and CUDA graphs                [colocate]
PROBE          every engine scores a fixed sequence as the trainer did (sync.verify)

A stop request (SIGTERM, SIGUSR1: runtime/stop.py) is agreed on by all ranks before a step's
rollout (the last finished step is saved, nothing else runs) and before its save (the step is
saved and recorded, its weights not synced); then the loop ends.

A failure names where it happened (a phase of a step, the setup, or a part closed at the end of
the run: runtime/failure.py) on the rank that saw it; at the end, every part is closed even if
one fails. A job whose every step is recorded has nothing to run (history.py).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from rltrain.config import Config
from rltrain.history import Finished, PreviousAttemptFailed, last_step, nothing_to_run
from rltrain.interfaces import PROBE_STATS, World
from rltrain.metrics import MetricsWriter, PhaseClock
from rltrain.rollout.prepare import LogpGapAlarm, prepare_batch
from rltrain.rollout.step import RolloutAhead, StepRollout
from rltrain.runtime.failure import clear_failures, failing_in, name_failure
from rltrain.runtime.ledger import MemoryLedger
from rltrain.runtime.stop import StopRequest, write_marker
from rltrain.setup import RunParts, setup_run, where_the_run_begins

log = logging.getLogger("rltrain.loop")

Phase = Callable[[str], AbstractContextManager[None]]


def run(cfg: Config, world: World, stop: StopRequest) -> dict[str, float]:
    begins = where_the_run_begins(cfg, world)  # or a refusal that would lose history: before anything starts
    if isinstance(begins, Finished):  # every step recorded: no setup, no checkpoint needed
        nothing_to_run(cfg, begins.step, world.world_size)  # a restart ends with the failure of the attempt before it
        return {}
    with failing_in(world.rank, "the setup"):
        parts: RunParts = setup_run(cfg, world, begins)
    engine, trainer, cycle, sampler = parts.engine, parts.trainer, parts.cycle, parts.sampler
    clock = PhaseClock(
        world.device,
        world.rank,
        MemoryLedger(
            world.device, trainer.held_tensors, engine.memory_report, world.communicator_bytes, world.cuda_context
        ),
    )
    writer = MetricsWriter(cfg, world, parts.start_step)
    rollouts = StepRollout(cfg, world, sampler, parts.tokenizer, parts.rewards)
    # loop.max_staleness=k: the rollouts of steps t+1..t+k while step t trains
    ahead = RolloutAhead(rollouts, cfg.loop.in_flight_update, cfg.world.timeout_s)
    gap = LogpGapAlarm(cfg.sync.logp_gap_alarm, world.rank)
    version = parts.initial_version
    recent = [version]  # the versions a step may train on, newest first (loop.max_staleness + 1 of them)
    # The steps whose rollouts an engine restart cut (this step's, and every rollout ahead in
    # flight when it died): their lost generations are sampled again when each is taken.
    retry: set[int] = set()
    last: dict[str, float] = {}
    done = parts.start_step  # the last recorded step
    closing = [("the metrics writer's close", writer.close), *parts.closing()]
    try:
        with failing_in(world.rank, "the setup"):
            world.destroy()  # rollout runs with the NCCL world down
            if cfg.loop.colocate:
                world.wait_destroyed()
            cycle.make_room()
            engine.resume_kv()  # released during setup, for the trainer
            parts.sync.probe_engines()  # of the weights the setup sent, if it did
        if parts.start_step >= last_step(cfg):
            nothing_to_run(cfg, parts.start_step, world.world_size)
        for step in range(parts.start_step, last_step(cfg)):
            clock.start_step(step + 1)
            if reason := stop.agreed(world, "before the rollout"):
                ahead.discard()  # (its prompts go back to the sampler: the checkpoint draws them again)
                _stop_at_step_boundary(cfg, parts, world, step, reason)
                break
            if parts.evaluator is not None and parts.evaluator.due(step):  # the weights of `step` steps
                with clock.phase("eval"):
                    writer.evaluation(parts.evaluator.run(engine.client, step, version))
            with clock.phase("rollout"):  # (a rollout ahead: the wait for what is left of it)
                rollout = ahead.take(step)
                if rollout is None:
                    rollout = rollouts.collect(engine.client, step)
                else:
                    rollout.stats["rollout_ahead_s"] = ahead.seconds
            if engine.recover():  # an engine died: restarted (or the job stops, with its log tail)
                with clock.phase("engine_restart"):
                    parts.sync.engine_restarted()
                    _send_weights_again(parts, world, version)
                retry |= {step, *ahead.steps}
            if step in retry:  # (or under a rollout ahead: restarted before a sync)
                with clock.phase("engine_restart"):
                    rollout = rollouts.retry_failed(engine.client, rollout, recent)
                retry.discard(step)
            with clock.phase("rollout"):
                rollout = rollouts.for_training(rollout, recent)
            for later in range(step + 1, min(step + 1 + cfg.loop.max_staleness, last_step(cfg))):
                if later not in ahead.steps:  # (from the weights before this step's training)
                    ahead.start(engine.client, later)
            _to_training(clock.phase, parts, world)
            with clock.phase("logprobs"):
                batch, rewards, adv_stats = prepare_batch(cfg, trainer, rollout)
            with clock.phase("train"):
                # The last sync's probe rides the step's first micro-batch, judged before its
                # optimizer step (WeightSync.ride): the row's probe statistics are those of the
                # weights its rollout came from.
                probe = parts.sync.ride()
                train_stats = trainer.train_step(batch, probe)
                if probe is None and parts.sync.rides:  # (step 1: judged at the setup, or at start-up)
                    train_stats.update(parts.sync.served_probe)
                cycle.after_train()
            gap.observe(step + 1, {**adv_stats, **train_stats})  # a warning where the gap jumps
            with clock.phase("save"):
                reason = stop.agreed(world, "after the train step")
                cycle.keep_state(step, {"sampler": ahead.sampler_state()}, force=reason is not None)
            version = str(step + 1)
            recent = [version, *recent][: cfg.loop.max_staleness + 1]
            if reason is not None:  # no sync this step: its row has no sync_* figures (the ridden probe: logged)
                judged = {k: train_stats.pop(k) for k in PROBE_STATS if k in train_stats}
                if judged and world.rank == 0:
                    log.info("step %d: the probe of the weights it trained from: %s", step + 1, judged)
            if reason is not None:
                ahead.discard()
            else:
                in_flight = bool(ahead.steps) and cfg.loop.in_flight_update != "wait"
                if cfg.loop.max_staleness:
                    if not in_flight:
                        with clock.phase("rollout_ahead_wait"):
                            ahead.wait()  # the engines idle before their weights change
                    if engine.recover():  # one died under the rollout ahead: back before the sync reaches it
                        with clock.phase("engine_restart"):
                            parts.sync.engine_restarted()
                        retry |= set(ahead.steps)  # (the sync sends it this step's weights; each take retries)
                    if in_flight:  # the rows in flight cut, to go on from the new weights
                        with clock.phase("rollout_ahead_pause"):
                            ahead.pause(engine)
                paused = ahead if in_flight else None
                sent = _to_rollout(clock.phase, parts, world, version, ride=step + 1 < last_step(cfg), resume=paused)
                for k in PROBE_STATS:  # the ridden probe's and the last push's
                    if k in train_stats and k in sent:
                        sent[k] = max(sent[k], train_stats[k])
                train_stats.update(sent)
            last = writer.step(step, rollout, rewards, adv_stats, train_stats, clock)
            done = step + 1
            cycle.recorded(done)  # after the row: pruning keeps the newest recorded checkpoint
            if parts.evaluator is not None and reason is None and done == last_step(cfg) and parts.evaluator.due(done):
                writer.evaluation(parts.evaluator.run(engine.client, done, version))  # the run's last weights
            if step == parts.start_step:
                # What the first step built (compiled code, the trainer's state, the libraries'
                # caches) lives to the end: frozen, Python's full collections, triggered by each
                # rollout's many small objects, no longer walk it.
                gc.freeze()
                if world.rank == 0:  # the failure this attempt was restarted after is behind it
                    clear_failures(cfg.run_dir)
            if reason is not None:
                _stopped(cfg, world, step + 1, cycle.saved, reason)
                break
    except BaseException as e:
        if not isinstance(e, PreviousAttemptFailed):  # (a phase's own name stays)
            name_failure(e, world.rank, f"step {done + 1}, between its phases")
        _end_of_run(closing, world.rank, done, failing=True)
        raise
    _end_of_run(closing, world.rank, done, failing=False)
    return last


def _end_of_run(closing: list[tuple[str, Callable[[], None]]], rank: int, done: int, failing: bool) -> None:
    """Close every part, each named if it fails, none left open by another's failure (the
    engine's process above all). The first failure is raised, unless the run failed before:
    then that error goes on, and these are only logged."""
    first: Exception | None = None
    for name, close in closing:
        try:
            with failing_in(rank, f"{name} at the end of the run" + (f", after step {done}" if done else "")):
                close()
        except Exception as e:  # noqa: BLE001 - named and logged; the first is raised below
            first = first or e
    if first is not None and not failing:
        raise first


def _stop_at_step_boundary(cfg: Config, parts: RunParts, world: World, done: int, reason: str) -> None:
    """Stop before step `done + 1`: `done` finished steps, saved first unless a checkpoint has them.
    The engines are stopped, not released (the job's signal may have stopped SGLang already)."""
    if done > parts.cycle.saved_step:
        parts.engine.shutdown()
        world.rebuild()
        parts.cycle.bring_back()
        parts.cycle.save(done, {"sampler": parts.sampler.state_dict()})
    _stopped(cfg, world, done, parts.cycle.saved, reason)


def _stopped(cfg: Config, world: World, step: int, checkpoint: Path | None, reason: str) -> None:
    if world.rank == 0:
        marker = write_marker(cfg.run_dir, step, checkpoint, reason)
        log.warning(
            "stopped on %s after step %d, checkpoint %s (%s); start the job again to continue from it",
            reason,
            step,
            checkpoint if checkpoint is not None else "none (nothing trained yet)",
            marker,
        )


def _to_training(phase: Phase, parts: RunParts, world: World, after_rollout: bool = True) -> None:
    """From rollout to training: the engine lets go of its memory, the world comes up, the
    trainer comes back onto the device. `after_rollout`: a rollout just ended (not an engine
    restart's resend, whose fresh engine has not generated: its free memory sizes nothing)."""
    with phase("engine_release"):
        parts.sync.probe_answered()  # the engines' answers to a ridden probe are in before they let go
        if after_rollout:
            parts.cycle.rollout_done()  # (what the rollout left free sizes what the trainer keeps: auto, fit)
        parts.engine.release_memory()
    with phase("world_rebuild"):
        world.rebuild()
    with phase("trainer_onload"):
        parts.cycle.bring_back()


def _to_rollout(
    phase: Phase, parts: RunParts, world: World, version: str, ride: bool, resume: RolloutAhead | None = None
) -> dict[str, float]:
    """From training to rollout: the engines take their weights' memory back and receive
    `version` (verified; the trainer's side of the probe rides the next training step where
    `ride`: one follows), the world goes down, the trainer is put away, the engines take their
    KV cache back once the world's NCCL memory is free. `resume`: rollouts ahead paused for the
    update, which go on once it is made (before the engines' probe, which they would hold)."""
    with phase("engine_resume_weights"):
        parts.engine.resume_weights()
    with phase("sync"):
        stats = parts.sync.push(version, ride=ride)  # gathers shards: world up
    if resume is not None:
        with phase("rollout_ahead_resume"):
            resume.resume(parts.engine)
    with phase("world_destroy"):
        world.destroy()  # NCCL teardown runs in the background during the trainer's put-away
    with phase("trainer_offload"):
        parts.cycle.put_away()
    stats.update(parts.cycle.figures)
    with phase("engine_resume_kv"):
        # NCCL memory is back before the KV cache takes it: the part of the background teardown
        # the put-away did not cover (with offload_trainer=fit, most of it) is waited for here —
        # unless the last rollout ended with room for that memory too (then the next rebuild joins it).
        room = parts.cycle.room_for(world.communicator_bytes())
        waited = 0.0 if room else world.wait_destroyed()
        if world.backend == "nccl":  # (a figure of the GPU's switches, as the trainer's onload/offload parts)
            stats["world_destroy_wait_s"] = waited
        parts.engine.resume_kv(room)  # (with room, the engines do not wait for the teardown either)
    with phase("sync_probe"):
        stats.update(parts.sync.probe_engines())  # the engines awake: do they score as the trainer does?
    return stats


def _send_weights_again(parts: RunParts, world: World, version: str | None) -> None:
    """A restarted engine serves model.path's weights. If any engine is not at `version`, the
    step's own phase switches, without the training, send `version` to every engine again."""
    stale = version is not None and parts.engine.weight_version() != version
    if not any(world.bridge.all_gather_object(stale, phase="engine restart version")):
        return
    assert version is not None
    untimed: Phase = lambda name: contextlib.nullcontext()  # noqa: E731 (timed as "engine_restart")
    _to_training(untimed, parts, world, after_rollout=False)
    _to_rollout(untimed, parts, world, version, ride=True)  # the step's training follows
    log.info("engine restarted: weight version %s sent again", version)
