"""The driver loop: every rank runs this, one step per iteration, phases in order.

ROLLOUT        engines awake; each rank samples its prompts' groups and scores them
ENGINE ->      pause the engines, release their memory (weights, KV cache, CUDA graphs) [colocate]
TRAIN          world rebuild, trainer back on the device (re-created if released), old/ref
               log-probs, advantages, optimizer steps, checkpoint
SYNC           engine resumes weights; the trainer gathers its shards and sends the new
               version (sync.transport), every engine loads it; version and checksum verified
RELEASE WORLD  world destroy (NCCL freed in the background; the Gloo bridge stays)
PUT AWAY       trainer offloaded or released (between_steps.py)
ENGINE <-      engines resume the KV cache and CUDA graphs                [colocate]
PROBE          every engine scores a fixed sequence as the trainer did (sync.verify)

A stop request (SIGTERM, SIGUSR1: runtime/stop.py) is agreed on by all ranks before a step's
rollout (the last finished step is saved, nothing else runs) and before its save (the step is
saved and recorded, its weights not synced); then the loop ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from rltrain.algo.advantages import compute_advantages, overlong_penalty, return_moments
from rltrain.algo.losses import kl_penalty
from rltrain.batch import TrainBatch
from rltrain.config import Config
from rltrain.generation import SamplingParams
from rltrain.interfaces import Trainer, World
from rltrain.metrics import MetricsWriter, PhaseClock
from rltrain.rollout.collect import (
    Rollout,
    build_batch,
    collect,
    extend,
    informative,
    keep_informative,
    quotas,
    retry_failed,
)
from rltrain.runtime.ledger import MemoryLedger
from rltrain.runtime.stop import StopRequest, write_marker
from rltrain.setup import RunParts, setup_run
from rltrain.weights.versions import StaleWeightsError

log = logging.getLogger("rltrain.loop")

Phase = Callable[[str], AbstractContextManager[None]]


def run(cfg: Config, world: World, stop: StopRequest) -> dict[str, float]:
    parts: RunParts = setup_run(cfg, world)
    engine, trainer, cycle, sampler = parts.engine, parts.trainer, parts.cycle, parts.sampler
    clock = PhaseClock(
        world.device,
        world.rank,
        MemoryLedger(
            world.device, trainer.held_tensors, engine.memory_report, world.communicator_bytes, world.cuda_context
        ),
    )
    writer = MetricsWriter(cfg, world, parts.start_step)
    params = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        n=cfg.rollout.n,
        stop_token_ids=list(cfg.rollout.stop_token_ids) or None,
    )
    version = parts.initial_version
    last: dict[str, float] = {}
    world.destroy()  # rollout runs with the NCCL world down
    if cfg.loop.colocate:
        world.wait_destroyed()
    cycle.make_room()
    engine.resume_kv()  # released during setup, for the trainer
    parts.sync.probe_engines()  # of the weights the setup sent, if it did
    try:
        end = min(cfg.loop.steps, cfg.loop.stop_after) if cfg.loop.stop_after else cfg.loop.steps
        if parts.start_step >= end:
            log.info("nothing to run: step %d of %d is done (run.start_over=true runs again)", parts.start_step, end)
        for step in range(parts.start_step, end):
            clock.start_step(step + 1)
            if reason := stop.agreed(world, "before the rollout"):
                _stop_at_step_boundary(cfg, parts, world, step, reason)
                break
            with clock.phase("rollout"):
                step_params = params
                if cfg.rollout.seeded:
                    step_params = dataclasses.replace(
                        params, sampling_seed=rollout_seed(cfg.run.seed, step, world.rank)
                    )
                prompts = sampler.next_batch(world.rank, world.world_size)
                rollout = collect(engine.client, prompts, step_params, parts.tokenizer, parts.rewards)
                batches = 1
                # DAPO's dynamic sampling: more prompts while too few groups are informative.
                while cfg.algo.dynamic_sampling and batches < cfg.algo.dynamic_sampling_max_batches:
                    if sum(_informative_counts(world, rollout)) >= cfg.data.prompts_per_step:
                        break
                    more = sampler.next_batch(world.rank, world.world_size)
                    fresh = collect(engine.client, more, step_params, parts.tokenizer, parts.rewards, len(prompts))
                    rollout, prompts, batches = extend(rollout, fresh), prompts + more, batches + 1
            if engine.recover():  # an engine died: restarted (or the job stops, with its log tail)
                with clock.phase("engine_restart"):
                    parts.sync.engine_restarted()
                    _send_weights_again(parts, world, version)
                    rollout = retry_failed(rollout, engine.client, prompts, step_params, parts.tokenizer, parts.rewards)
                    rollout.stats["engine_restarts"] = 1.0
            with clock.phase("rollout"):
                _check_versions(rollout, version, world.rank)
                if cfg.algo.dynamic_sampling:
                    rollout = _keep_informative(cfg, world, rollout, batches)
            _to_training(clock.phase, parts, world)
            with clock.phase("logprobs"):
                batch, rewards, adv_stats = _prepare(cfg, trainer, rollout)
            with clock.phase("train"):
                train_stats = trainer.train_step(batch)
                cycle.after_train()
            with clock.phase("save"):
                reason = stop.agreed(world, "after the train step")
                cycle.keep_state(step, {"sampler": sampler.state_dict()}, force=reason is not None)
            version = str(step + 1)
            if reason is None:
                train_stats.update(_to_rollout(clock.phase, parts, world, version))
            last = writer.step(step, rollout, rewards, adv_stats, train_stats, clock)
            if step == parts.start_step:
                # What the first step built (compiled code, the trainer's state, the libraries'
                # caches) lives to the end: frozen, Python's full collections, triggered by each
                # rollout's many small objects, no longer walk it.
                gc.freeze()
            if reason is not None:
                _stopped(cfg, world, step + 1, cycle.saved, reason)
                break
    finally:
        writer.close()
        parts.close()
    return last


def _informative_counts(world: World, rollout: Rollout) -> list[int]:
    """Each rank's number of kept groups whose rewards differ (over the bridge: the world is down)."""
    return world.bridge.all_gather_object(sum(map(informative, rollout.groups)), phase="dynamic sampling")


def _keep_informative(cfg: Config, world: World, rollout: Rollout, batches: int) -> Rollout:
    """data.prompts_per_step informative groups over all ranks (fewer, said, if the budget ran out)."""
    counts = _informative_counts(world, rollout)
    share = quotas(counts, cfg.data.prompts_per_step)
    if world.rank == 0 and sum(share) < cfg.data.prompts_per_step:
        log.warning(
            "dynamic sampling: %d of %d groups informative after %d batches of prompts "
            "(algo.dynamic_sampling_max_batches=%d); training on those",
            sum(share),
            cfg.data.prompts_per_step,
            batches,
            cfg.algo.dynamic_sampling_max_batches,
        )
    return keep_informative(rollout, share[world.rank], batches)


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


def _to_training(phase: Phase, parts: RunParts, world: World) -> None:
    """From rollout to training: the engine lets go of its memory, the world comes up, the
    trainer comes back onto the device."""
    with phase("engine_release"):
        parts.engine.release_memory()
    with phase("world_rebuild"):
        world.rebuild()
    with phase("trainer_onload"):
        parts.cycle.bring_back()


def _to_rollout(phase: Phase, parts: RunParts, world: World, version: str) -> dict[str, float]:
    """From training to rollout: the engines take their weights' memory back and receive
    `version` (verified), the world goes down, the trainer is put away, the engines take their
    KV cache back once the world's NCCL memory is free."""
    with phase("engine_resume_weights"):
        parts.engine.resume_weights()
    with phase("sync"):
        stats = parts.sync.push(version)  # gathers shards: world up
    with phase("world_destroy"):
        world.destroy()  # NCCL teardown runs in the background during the trainer's put-away
    with phase("trainer_offload"):
        parts.cycle.put_away()
    with phase("engine_resume_kv"):
        world.wait_destroyed()  # NCCL memory is back before the KV cache takes it
        parts.engine.resume_kv()
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
    _to_training(untimed, parts, world)
    _to_rollout(untimed, parts, world, version)
    log.info("engine restarted: weight version %s sent again", version)


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of a rank's requests at a step: spaced so no two samples share a stream."""
    return (seed * 1_000_003 + step * 1_009 + rank) * 1_000_000


def _check_versions(rollout: Rollout, expected: str | None, rank: int) -> None:
    """Never train on samples from stale weights: every completion must carry the current version."""
    if expected is None:
        return
    seen = {s.completion.weight_version for g in rollout.groups for s in g}
    if seen - {expected}:
        raise StaleWeightsError(
            f"rank {rank}: rollout produced by weight version(s) {sorted(map(str, seen))}, "
            f"expected {expected}; the engine did not load the published weights"
        )


def _prepare(
    cfg: Config, trainer: Trainer, rollout: Rollout
) -> tuple[TrainBatch, torch.Tensor | None, dict[str, float]]:
    """Old/ref log-probs and advantages for this rank's kept groups (an empty batch if none:
    the rank still joins every collective of the train step)."""
    batch, rewards = build_batch(rollout.groups, trainer.pad_id)
    fused = cfg.algo.old_logp_from_training  # then the training forward's, detached (rl_update.micro_loss)
    if not fused:
        batch.old_logp, _ = trainer.logprobs(batch)  # collectives: also on a rank without samples
    if cfg.algo.kl_coef > 0:
        batch.ref_logp, _ = trainer.logprobs(batch, reference=True)
    algo = cfg.algo
    # REINFORCE++ normalises over the whole batch: its moments are summed over the data ranks.
    global_sum = _data_sum(trainer) if algo.advantage.startswith("reinforce_plus_plus") else None
    if len(batch) == 0 or rewards is None:
        if global_sum is not None:
            return_moments(torch.zeros(0), global_sum)  # the collective the other ranks run
        return batch, rewards, {}
    stats: dict[str, float] = {}
    samples = [s for g in rollout.groups for s in g]
    if algo.overlong_buffer:
        lengths = torch.tensor([len(s.completion.output_ids) for s in samples])
        penalty = overlong_penalty(lengths, cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
        rewards = rewards + penalty.reshape(rewards.shape)
        stats["overlong_penalty"] = float(penalty.mean())
    token_kl = None
    if algo.kl_coef > 0:
        assert batch.ref_logp is not None and batch.old_logp is not None
        token_kl = kl_penalty(batch.old_logp, batch.ref_logp, algo.kl_estimator) * batch.loss_mask
    in_reward = algo.kl_in == "reward" and algo.kl_coef > 0
    batch.advantages = compute_advantages(
        algo.advantage,
        rewards,
        batch.loss_mask,
        norm_std=algo.norm_std,
        token_kl=token_kl if in_reward else None,
        kl_coef=algo.kl_coef if in_reward else 0.0,
        gamma=algo.gamma,
        global_sum=global_sum,
    )
    if algo.overlong_filter:  # DAPO: a response cut at the limit is kept out of the loss
        cut = torch.tensor([s.completion.finish_reason == "length" for s in samples])
        batch.loss_mask[cut] = 0.0
        batch.advantages = batch.advantages * batch.loss_mask
        stats["overlong_filtered"] = float(cut.sum())
    if fused:  # the distance to the engine's log-probs is measured in the training forward
        return batch, rewards, stats
    # How far the engine's log-probs are from the trainer's for the same tokens and weights.
    mask = batch.loss_mask.bool()
    assert batch.rollout_logp is not None and batch.old_logp is not None
    diff = float((batch.old_logp - batch.rollout_logp)[mask].abs().mean())
    if cfg.algo.tis_cap is None:
        batch.rollout_logp = None
    return batch, rewards, {"logp_diff_engine_trainer": diff, **stats}


def _data_sum(trainer: Trainer) -> Callable[[torch.Tensor], torch.Tensor]:
    """A sum over the trainer's data-parallel ranks (the ranks that hold different samples)."""

    def total(t: torch.Tensor) -> torch.Tensor:
        if not torch.distributed.is_initialized():
            return t
        on = t.to(trainer.device)
        torch.distributed.all_reduce(on, group=trainer.data_group())
        return on.cpu()

    return total
