"""The driver loop: every rank runs this, one step per iteration, phases in order.

    ROLLOUT        engine awake; each rank samples its prompts' groups and scores them
    ENGINE ->      release engine memory (weights, KV cache)               [colocate]
    TRAIN          world rebuild, trainer onload (re-sharded onto the new group), old/ref
                   log-probs, advantages, optimizer steps, checkpoint
    SYNC           engine resumes weights; the trainer gathers its shards and sends the new
                   version (sync.transport), every engine loads it; version and checksum verified
    RELEASE WORLD  world destroy (NCCL freed in the background; the Gloo bridge stays)
    OFFLOAD        trainer params and optimizer state to host memory (or released)
    ENGINE <-      engine resumes the KV cache                               [colocate]
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from rltrain.algo.advantages import compute_advantages
from rltrain.algo.losses import kl_penalty
from rltrain.engine.protocol import SamplingParams
from rltrain.metrics import MetricsWriter, PhaseClock
from rltrain.runtime.ledger import MemoryLedger
from rltrain.rollout.collect import build_batch, collect, retry_failed
from rltrain.setup import RunParts, setup_run
from rltrain.weights.versions import StaleWeightsError

log = logging.getLogger("rltrain.loop")


def run(cfg: Any, world: Any) -> dict[str, float]:
    parts: RunParts = setup_run(cfg, world)
    engine, trainer, sampler = parts.engine, parts.trainer, parts.sampler
    clock = PhaseClock(world.device, world.rank,
                       MemoryLedger(world.device, trainer, engine, world, world.cuda_context))
    writer = MetricsWriter(cfg, world, parts.start_step)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, n=cfg.rollout.n)
    version = parts.initial_version
    last: dict[str, float] = {}
    saved, snapshot = None, None
    world.destroy()  # rollout runs with the NCCL world down
    if cfg.loop.colocate:
        # The trainer was just created (or resumed) on the device: out of the engine's way before
        # the first rollout too (the memory ledger showed it holding its weights there).
        # (Offloaded, not released: there is no checkpoint or snapshot to re-create it from yet.)
        world.wait_destroyed()
        if cfg.loop.offload_trainer or cfg.release.train:
            trainer.offload()
    try:
        end = min(cfg.loop.steps, cfg.loop.stop_after) if cfg.loop.stop_after else cfg.loop.steps
        for step in range(parts.start_step, end):
            clock.start_step(step + 1)
            with clock.phase("rollout"):
                step_params = params
                if cfg.rollout.seeded:
                    step_params = dataclasses.replace(params, sampling_seed=rollout_seed(cfg.run.seed, step, world.rank))
                prompts = sampler.next_batch(world.rank, world.world_size)
                rollout = collect(engine.client, prompts, step_params, parts.tokenizer, parts.rewards)
            if engine.recover(world):  # an engine died: restarted (or the job stops, with its log tail)
                with clock.phase("engine_restart"):
                    parts.sync.engine_restarted()
                    _send_weights_again(cfg, parts, world, version, saved, snapshot)
                    rollout = retry_failed(rollout, engine.client, prompts, step_params, parts.tokenizer,
                                           parts.rewards)
                    rollout.stats["engine_restarts"] = 1.0
            with clock.phase("rollout"):
                _check_versions(rollout, version, world.rank)
            with clock.phase("engine_release"):
                _release_engine(cfg, world, engine.client)
            with clock.phase("world_rebuild"):
                world.rebuild()
            with clock.phase("trainer_onload"):
                _onload(cfg, trainer, parts.checkpointer, saved, snapshot)
            with clock.phase("logprobs"):
                batch, rewards, adv_stats = _prepare(cfg, trainer, rollout)
            with clock.phase("train"):
                train_stats = trainer.train_step(batch)
                if cfg.loop.colocate and (cfg.loop.offload_trainer or cfg.release.train):
                    trainer.trim()  # the activations' cache back to the device before the engine's weights
            with clock.phase("save"):
                # Saved (and verified) before the trainer may be released; a failed save raises
                # with the trainer still alive and the previous checkpoint untouched.
                if save_due(cfg, step):
                    saved = parts.checkpointer.save(step + 1, trainer, str(step + 1),
                                                    {"sampler": sampler.state_dict()})
                if cfg.release.train and cfg.release.source == "host":
                    snapshot = trainer.snapshot()
            with clock.phase("engine_resume_weights"):
                _resume_engine_weights(cfg, world, engine.client)
            with clock.phase("sync"):
                version = str(step + 1)
                train_stats.update(parts.sync.push(version))  # gathers shards: world up
            with clock.phase("world_destroy"):
                world.destroy()  # NCCL teardown (~0.5 s inside NCCL) runs in the background during offload
            with clock.phase("trainer_offload"):
                _put_trainer_away(cfg, trainer)
            with clock.phase("engine_resume_kv"):
                _resume_engine_kv(cfg, world, engine.client)
            last = writer.step(step, rollout, rewards, adv_stats, train_stats, clock)
    finally:
        writer.close()
        parts.close()
    return last


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of a rank's requests at a step: spaced so no two samples share a stream."""
    return (seed * 1_000_003 + step * 1_009 + rank) * 1_000_000


def save_due(cfg: Any, step: int) -> bool:
    if cfg.release.train and cfg.release.source == "disk":
        return True  # re-creation reads this step's checkpoint
    last = step + 1 in (cfg.loop.steps, cfg.loop.stop_after)
    return cfg.checkpoint.interval > 0 and ((step + 1) % cfg.checkpoint.interval == 0 or last)


def recreate(cfg: Any, trainer: Any, checkpointer: Any, saved: Any, snapshot: Any) -> None:
    """Build the released trainer again and restore it, from the host snapshot or the checkpoint."""
    if cfg.release.source == "host":
        trainer.restore_snapshot(snapshot)
    else:
        trainer.create(load_weights=False)
        checkpointer.load(saved, trainer, restore_rank_state=False)


def _send_weights_again(cfg: Any, parts: RunParts, world: Any, version: str | None, saved: Any, snapshot: Any) -> None:
    """A restarted engine serves model.path's weights. If any engine is not at `version`, the
    step's own phase sequence without the training sends `version` to every engine again."""
    stale = version is not None and parts.engine.client.weight_version() != version
    if not any(world.bridge.all_gather_object(stale, phase="engine restart version")):
        return
    client = parts.engine.client
    _release_engine(cfg, world, client)
    world.rebuild()
    _onload(cfg, parts.trainer, parts.checkpointer, saved, snapshot)
    _resume_engine_weights(cfg, world, client)
    parts.sync.push(version)
    world.destroy()
    _put_trainer_away(cfg, parts.trainer)
    _resume_engine_kv(cfg, world, client)
    log.info("engine restarted: weight version %s sent again", version)


# The step's phase switches (the loop's, and an engine restart's re-send of the weights).

def _release_engine(cfg: Any, world: Any, client: Any) -> None:
    # Every rank of the node must be done generating before its engine lets go of its memory:
    # a release under a slower rank's requests fails them all.
    world.bridge.barrier(phase="rollout done")
    if cfg.loop.colocate and world.env.is_node_leader:
        client.release(["kv_cache", "weights"])


def _onload(cfg: Any, trainer: Any, checkpointer: Any, saved: Any, snapshot: Any) -> None:
    if trainer.released:
        recreate(cfg, trainer, checkpointer, saved, snapshot)
    trainer.onload()


def _resume_engine_weights(cfg: Any, world: Any, client: Any) -> None:
    if cfg.loop.colocate and world.env.is_node_leader:
        client.resume(["weights"])
    world.bridge.barrier(phase="engine resume weights")


def _put_trainer_away(cfg: Any, trainer: Any) -> None:
    if cfg.release.train:
        trainer.release()
    elif cfg.loop.offload_trainer:
        trainer.offload()


def _resume_engine_kv(cfg: Any, world: Any, client: Any) -> None:
    world.wait_destroyed()  # NCCL memory is back before the KV cache takes it
    if cfg.loop.colocate and world.env.is_node_leader:
        client.resume(["kv_cache"])
    world.bridge.barrier(phase="engine resume kv")


def _check_versions(rollout: Any, expected: str | None, rank: int) -> None:
    """Never train on samples from stale weights: every completion must carry the current version."""
    if expected is None:
        return
    seen = {s.completion.weight_version for g in rollout.groups for s in g}
    if seen - {expected}:
        raise StaleWeightsError(f"rank {rank}: rollout produced by weight version(s) {sorted(map(str, seen))}, "
                                f"expected {expected}; the engine did not load the published weights")


def _prepare(cfg: Any, trainer: Any, rollout: Any) -> tuple[Any, torch.Tensor | None, dict[str, float]]:
    """Old/ref log-probs and advantages for this rank's kept groups (an empty batch if none:
    the rank still joins every collective of the train step)."""
    batch, rewards = build_batch(rollout.groups, trainer.pad_id)
    batch.old_logp, _ = trainer.logprobs(batch)  # collectives: also on a rank without samples
    if cfg.algo.kl_coef > 0:
        batch.ref_logp, _ = trainer.logprobs(batch, reference=True)
    if len(batch) == 0:
        return batch, rewards, {}
    token_kl = None
    if cfg.algo.kl_coef > 0:
        token_kl = kl_penalty(batch.old_logp, batch.ref_logp, cfg.algo.kl_estimator) * batch.loss_mask
    in_reward = cfg.algo.kl_in == "reward" and cfg.algo.kl_coef > 0
    batch.advantages = compute_advantages(cfg.algo.advantage, rewards, batch.loss_mask, norm_std=cfg.algo.norm_std,
                                          token_kl=token_kl if in_reward else None,
                                          kl_coef=cfg.algo.kl_coef if in_reward else 0.0, gamma=cfg.algo.gamma)
    # How far the engine's log-probs are from the trainer's for the same tokens and weights.
    mask = batch.loss_mask.bool()
    diff = float((batch.old_logp - batch.rollout_logp)[mask].abs().mean())
    if cfg.algo.tis_cap is None:
        batch.rollout_logp = None
    return batch, rewards, {"logp_diff_engine_trainer": diff}
