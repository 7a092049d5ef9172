"""What happens to the trainer between steps: one value, decided once from the config.

    KEEP          it stays on the device                       loop.offload_trainer=false (auto: when
                                                               not colocated)
    OFFLOAD       weights and optimizer state to host memory,  loop.offload_trainer=true (auto: when
                  modules kept, onloaded next step             colocated)
    RELEASE_DISK  dropped whole after the step's verified      release.train=true, release.source=disk
                  checkpoint, re-created from it next step
    RELEASE_HOST  dropped whole after a host-memory snapshot,  release.train=true, release.source=host
                  re-created from the snapshot next step

`TrainerCycle` carries the trainer through those states for the loop: `bring_back` before the
step's log-probs, `keep_state` after the train step (the checkpoint when due, the snapshot),
`put_away` once the weights are synced, `recorded` once the step's metrics row is written (the
checkpoints a restart no longer needs are pruned then).
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

from rltrain.checkpoint import Checkpointer
from rltrain.config import Config
from rltrain.interfaces import Snapshot, Trainer


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
    ):
        self.trainer, self.checkpointer, self.between = trainer, checkpointer, between
        self.colocate = colocate
        # Saved every `interval` steps and at the run's end: loop.steps, or loop.stop_after.
        self.interval, self.last_steps = checkpoint_interval, last_steps
        self.saved: Path | None = None  # the newest checkpoint this run wrote or resumed from
        self.saved_step = 0  # the step `saved` holds (0: none)
        self.snapshot: Snapshot | None = None  # RELEASE_HOST: the released trainer's state

    def make_room(self) -> None:
        """Before the first rollout: out of the engine's way (colocated), as after every step.
        Offloaded, not released: there is no checkpoint or snapshot to re-create it from yet."""
        if self.colocate and self.between.leaves_device:
            self.trainer.offload()

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
        self.trainer.onload()

    def after_train(self) -> None:
        """The train step's activation cache back to the device before the engine's weights,
        when the trainer leaves the device after the step anyway."""
        if self.colocate and self.between.leaves_device:
            self.trainer.trim()

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
            self.trainer.offload()
