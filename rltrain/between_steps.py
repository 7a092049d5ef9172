"""What happens to the trainer between steps: one value, decided once from the config.

    KEEP          it stays on the device                       loop.offload_trainer=false (auto: when
                                                               not colocated)
    OFFLOAD       weights and optimizer state to host memory,  loop.offload_trainer=true (auto: when
                  modules kept, onloaded next step             colocated, and on GPUs (fsdp) only where
                                                               the last rollout left no room for the
                                                               whole state); =fit: only what the
                                                               engines' rollout needs (`Residency`)
    RELEASE_DISK  dropped whole after the step's verified      release.train=true, release.source=disk
                  checkpoint, re-created from it next step
    RELEASE_HOST  dropped whole after a host-memory snapshot,  release.train=true, release.source=host
                  re-created from the snapshot next step

`TrainerCycle` carries the trainer through those states for the loop: `bring_back` before the
step's log-probs, `keep_state` after the train step (the checkpoint when due, the snapshot),
`put_away` once the weights are synced (with fit, `after_train` begins it), `recorded` once the
step's metrics row is written (the checkpoints a restart no longer needs are pruned then).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rltrain.checkpoint import Checkpointer
from rltrain.config import Config
from rltrain.interfaces import Snapshot, Trainer
from rltrain.runtime.ledger import GIB, storage_bytes

log = logging.getLogger("rltrain.between_steps")


class BetweenSteps(enum.Enum):
    KEEP = "keep"
    OFFLOAD = "offload"
    RELEASE_DISK = "release, re-created from the checkpoint"
    RELEASE_HOST = "release, re-created from a host snapshot"

    @classmethod
    def of(cls, cfg: Config) -> BetweenSteps:
        if cfg.release.train:
            return cls.RELEASE_HOST if cfg.release.source == "host" else cls.RELEASE_DISK
        offload = cfg.loop.colocate if cfg.loop.offload_trainer == "auto" else cfg.loop.offload_trainer
        return cls.OFFLOAD if offload else cls.KEEP

    @property
    def releases(self) -> bool:
        return self in (BetweenSteps.RELEASE_DISK, BetweenSteps.RELEASE_HOST)

    @property
    def leaves_device(self) -> bool:
        """Whether the trainer gives the device up between steps (so the engine can have it)."""
        return self is not BetweenSteps.KEEP


@dataclass
class Residency:
    """How many bytes of its state the trainer keeps on the device while the engines roll out
    (loop.offload_trainer=fit, and auto with the fsdp backend). Measured, not assumed: a rollout
    ends with `free` bytes of the device unused while `kept` bytes of the trainer's state sit
    beside the engine (its KV pool, its CUDA graphs and the peak its allocator still caches all
    taken). The next put-away may keep `budget` = `kept + free - headroom` (never below 0), so the
    next rollout ends `headroom` short of the device's end; a rollout that took more shrinks it.
    What it keeps is decided against the state as it is at the put-away (`keep`): the optimizer's
    state appears at the first step, after the first rollout was measured. `whole` (auto): the
    whole state stays where the budget holds it, else all of it moves (no part kept, no copy beside
    training: measured slower than one bulk copy each way when part must move, docs/loop.md).
    Until a rollout is measured, nothing stays."""

    headroom: int
    whole: bool = False
    budget: int = 0

    def observe(self, free: int, kept: int) -> int:
        """The next put-away's budget after a rollout that ended with `free` bytes unused and
        `kept` of the trainer's state on the device; returns it."""
        self.budget = max(kept + free - self.headroom, 0)
        return self.budget

    def keep(self, total: int) -> int:
        """Bytes of a state of `total` bytes that stay on the device: whole (auto) all of them
        where the budget holds them, else none; fit as many as the budget holds."""
        if self.whole:
            return total if self.budget >= total else 0
        return min(self.budget, total)


# Device bytes the engines' KV cache must leave free where it maps beside NCCL memory a teardown
# still holds (`TrainerCycle.room_for`).
KV_ROOM_MARGIN = 1 << 30


def kv_room(free: int, kept: int, now: int, communicators: int) -> int:
    """Bytes the device has free once the engines' KV cache is back while `communicators` bytes of
    NCCL are still held: the last rollout ended with `free` bytes unused while the trainer held
    `kept` on the device, and the trainer holds `now` (the engines take back what they held then)."""
    return free - (now - kept) - communicators


class TrainerCycle:
    """The trainer through the loop's steps, as `BetweenSteps` says."""

    def __init__(
        self,
        trainer: Trainer,
        checkpointer: Checkpointer,
        between: BetweenSteps,
        colocate: bool,
        checkpoint_interval: int,
        last_steps: tuple[int, ...],
        residency: Residency | None = None,
    ):
        self.trainer, self.checkpointer, self.between = trainer, checkpointer, between
        self.colocate = colocate
        self.residency = residency if between is BetweenSteps.OFFLOAD else None
        self._said: int | None = None  # fit: the budget last logged
        # (free bytes, the trainer's bytes on the device) at the last rollout's end, until `room_for` reads it
        self._rollout_end: tuple[int, int] | None = None
        self._total = 0  # fit: bytes of the state at the last offload
        # For the step's row: the parts of the last onload and offload, seconds (the trainer's
        # timings), and with fit the state they kept and moved, GiB.
        self.figures: dict[str, float] = {}
        # Saved every `interval` steps and at the run's end: loop.steps, or loop.stop_after.
        self.interval, self.last_steps = checkpoint_interval, last_steps
        self.saved: Path | None = None  # the newest checkpoint this run wrote or resumed from
        self.saved_step = 0  # the step `saved` holds (0: none)
        self.snapshot: Snapshot | None = None  # RELEASE_HOST: the released trainer's state

    def make_room(self) -> None:
        """Before the first rollout: out of the engine's way (colocated), as after every step.
        Offloaded, not released: there is no checkpoint or snapshot to re-create it from yet."""
        if self.colocate and self.between.leaves_device:
            self._offload()

    def bring_back(self) -> None:
        """On the device, over the world's current groups (re-created first if released)."""
        if self.trainer.released:
            if self.between is BetweenSteps.RELEASE_HOST:
                assert self.snapshot is not None
                self.trainer.restore_snapshot(self.snapshot)
            else:
                assert self.saved is not None
                self.trainer.create(load_weights=False)
                self.checkpointer.load(self.saved, self.trainer, restore_rank_state=False)
        self.trainer.timings.clear()  # (the parts of this onload only)
        self.trainer.onload()
        self.figures = _parts(self.trainer.timings, "onload")

    def after_train(self) -> None:
        """The train step's activation cache back to the device before the engine's weights,
        when the trainer leaves the device after the step anyway; with fit, the offload begun
        (the optimizer state's copy out, beside the checkpoint and the sync; auto's all-or-none
        offload is one bulk copy at the put-away)."""
        if self.colocate and self.between.leaves_device:
            self.trainer.trim()
        if self.residency is not None and not self.residency.whole:
            self.trainer.stage_offload(self.residency.keep(self._on_device()))

    def rollout_done(self) -> None:
        """What the rollout left free on the device, before the engines let go of anything (fit:
        it sizes what the next put-away keeps; `room_for` reads it)."""
        if self.trainer.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(self.trainer.device)
        self._rollout_end = (free, self._on_device())
        if self.residency is None:
            return
        budget = self.residency.observe(*self._rollout_end)
        if self._said is None or abs(budget - self._said) >= GIB:  # the first budget, and each that changes
            log.info(
                "trainer: may keep %.2f GiB of its state (%.2f GiB at the last offload) on the device while the "
                "engines roll out (loop.offload_trainer=%s: the last rollout ended with %.2f GiB free, headroom "
                "%.2f GiB)",
                budget / GIB,
                self._total / GIB,
                "auto, all of it or none" if self.residency.whole else "fit",
                free / GIB,
                self.residency.headroom / GIB,
            )
            self._said = budget

    def room_for(self, communicators: int) -> bool:
        """Whether the engines' KV cache fits on this rank's device beside `communicators` bytes
        of NCCL that a teardown still holds, with `KV_ROOM_MARGIN` to spare: measured against the
        last rollout's end, once (an engine restart's resend, with no rollout before it, and the
        first step find no measure: False)."""
        end, self._rollout_end = self._rollout_end, None
        return end is not None and kv_room(*end, self._on_device(), communicators) >= KV_ROOM_MARGIN

    def _on_device(self) -> int:
        """Bytes of the trainer's state (weights, gradients, optimizer state) on the device now."""
        held = self.trainer.held_tensors()
        return storage_bytes([*held["weights"], *held["grads"], *held["optimizer"]], set())["device"]

    def _offload(self) -> None:
        """Offload (with a `Residency`: within its budget), and what stayed and what moved."""
        for name in [n for n in self.trainer.timings if n.startswith("offload: ")]:
            del self.trainer.timings[name]  # (the parts of this offload only)
        if self.residency is None or self.trainer.device.type != "cuda":
            self.trainer.offload()
        else:
            self._total = max(self._on_device(), self._total)  # (an offloaded trainer: the last size)
            self.trainer.offload(self.residency.keep(self._total) or None)  # (0: nothing stays)
            kept = self._on_device()
            self.figures.update(offload_kept_gib=kept / GIB, offload_moved_gib=(self._total - kept) / GIB)
        self.figures.update(_parts(self.trainer.timings, "offload"))

    def save_due(self, step: int) -> bool:
        if self.between is BetweenSteps.RELEASE_DISK:
            return True  # re-creation reads this step's checkpoint
        last = step + 1 in self.last_steps
        return self.interval > 0 and ((step + 1) % self.interval == 0 or last)

    def keep_state(self, step: int, extra: dict[str, Any], force: bool = False) -> None:
        """This step's checkpoint (verified) when due or forced, and the snapshot a host release
        needs — before the trainer may be released: a failed save raises with the trainer still
        alive and the previous checkpoint untouched."""
        if force or self.save_due(step):
            self.save(step + 1, extra)
        if self.between is BetweenSteps.RELEASE_HOST:
            self.snapshot = self.trainer.snapshot()

    def save(self, done: int, extra: dict[str, Any]) -> None:
        """A verified checkpoint of the trainer after `done` steps (its weights are version `done`)."""
        self.saved = self.checkpointer.save(done, self.trainer, str(done), extra)
        self.saved_step = done

    def recorded(self, done: int) -> None:
        """Step `done`'s metrics row is written: a restart may resume from its checkpoint."""
        self.checkpointer.recorded(done)

    def put_away(self) -> None:
        if self.between.releases:
            self.trainer.release()
        elif self.between is BetweenSteps.OFFLOAD:
            self._offload()


def _parts(timings: dict[str, float], what: str) -> dict[str, float]:
    """A trainer's timings of `what` ("onload: copy to device": 0.4) as row figures
    ("onload_copy_to_device_s": 0.4)."""
    return {
        f"{what}_{part.replace(' ', '_')}_s": s
        for name, s in timings.items()
        for kind, _, part in [name.partition(": ")]
        if kind == what
    }
