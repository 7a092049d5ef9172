"""Checkpoints: sharded, atomic, checksummed, and verified before anything relies on them.

Layout under `<checkpoint dir>`:

    step_000012/
        trainer/          torch.distributed.checkpoint of {"model", "optim"} (FQN-keyed, sharded per rank)
        rank0.pt ...      per rank: RNG states, scheduler, trainer step count, data iterator, step, weight version
        manifest.json     every file with its size and xxh3-128 checksum; step, version, world size
    latest                "step_000012" (written last, atomically)

A save writes everything into `.step_000012.tmp/`, fsyncs the files, writes the manifest, renames
the directory into place and only then moves `latest`; a crash at any point leaves the previous
checkpoint and `latest` untouched. Loading verifies the manifest's checksums first; `resume: auto`
walks from `latest` to older checkpoints and skips, with a warning, any that is partial or corrupt.

Pruning keeps the newest `keep_last` checkpoints and, whatever `keep_last` says, the newest one
whose step the metrics recorded. A step is saved before its metrics row is written, and a restart
resumes only from a recorded step (rltrain/history.py): a job that dies between the save and the
row resumes from that one, and its unrecorded step runs again. With `keep_last=1` the previous
checkpoint therefore stays until the new step's row is written (`Checkpointer.recorded`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from rltrain.interfaces import Trainer, World
from rltrain.runtime.files import atomic_write_text, file_digest, fsync_tree, replace_dir

log = logging.getLogger("rltrain.checkpoint")

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not usable; the message says which and why."""


@dataclass
class Restored:
    path: Path
    step: int
    version: str | None
    extra: dict[str, Any]


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every step_* directory, oldest first (the step read from its name)."""
    found = []
    for p in root.glob("step_*"):
        if p.is_dir() and p.name[len("step_") :].isdigit():
            found.append((int(p.name[len("step_") :]), p))
    return sorted(found)


# ---------------------------------------------------------------------------- files


def verify(path: Path) -> dict[str, Any]:
    """The manifest, after checking that every file it lists exists with its size and checksum."""
    mf = path / MANIFEST
    if not mf.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (partial or interrupted save)")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mf}: not valid JSON ({e})") from None
    for rel, meta in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: file {rel} listed in the manifest is missing")
        if f.stat().st_size != meta["size"]:
            raise CheckpointError(f"{path}: {rel} has {f.stat().st_size} bytes, the manifest says {meta['size']}")
        if file_digest(f, bits=128) != meta["xxh3_128"]:
            raise CheckpointError(f"{path}: {rel} does not match its checksum (corrupt)")
    return manifest


def candidates(root: Path) -> list[Path]:
    """Checkpoints newest first: `latest` first, then every step_* directory by step."""
    found = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    latest = root / "latest"
    if latest.is_file():
        named = root / latest.read_text().strip()
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def find_resumable(root: Path, max_step: int | None = None) -> Path | None:
    """The newest checkpoint that verifies (corrupt or partial ones are skipped with a warning),
    of a step <= `max_step` if given."""
    for path in candidates(root):
        try:
            step = verify(path)["step"]
        except CheckpointError as e:
            log.warning("skipping checkpoint: %s", e)
            continue
        if max_step is not None and step > max_step:
            log.warning(
                "skipping checkpoint %s: the job ended before step %d was recorded in the metrics "
                "(after the save); that step runs again",
                path,
                step,
            )
            continue
        return path
    return None


# ---------------------------------------------------------------------------- rank state


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------- save / load


class Checkpointer:
    """Collective save/load over the world (up) and the bridge. `world` is a `World`."""

    def __init__(self, root: Path, world: World, keep_last: int = 3):
        self.root = Path(root)
        self.world = world
        self.keep_last = keep_last
        # The last step whose metrics row is written (0: none yet): its checkpoint is where a
        # restart resumes, never pruned. Set by a resume (`load`) and by `recorded`.
        self.recorded_step = 0
        if world.rank == 0:  # saves cut short by a job that died (never loaded: they have no manifest)
            for stale in self.root.glob(".step_*.tmp"):
                log.warning("removing %s, left by an interrupted save", stale)
                shutil.rmtree(stale, ignore_errors=True)

    def save(self, step: int, trainer: Trainer, version: str | None, extra: dict[str, Any]) -> Path:
        """Write, verify and publish checkpoint `step`; raise CheckpointError (on every rank) if any part failed."""

        world = self.world
        final = self.root / step_dir_name(step)
        tmp = self.root / f".{step_dir_name(step)}.tmp"
        t0 = time.perf_counter()
        error = None
        if world.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir()
            except OSError as e:
                error = f"cannot create {tmp}: {e}"
        self._agree(error, "checkpoint prepare")
        error = None
        try:
            model_sd, optim_sd = trainer.distributed_state_dict()
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "trainer"))
        # DCP's CheckpointException derives from BaseException, not Exception.
        except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - every rank learns it below
            error = f"writing the trainer state failed: {type(e).__name__}: {e}"
        if error is None:
            try:
                buf = io.BytesIO()
                torch.save(
                    {
                        "rng": rng_state(),
                        "trainer": trainer.host_state(),
                        "step": step,
                        "version": version,
                        "extra": extra,
                    },
                    buf,
                )
                rank_file = tmp / f"rank{world.rank}.pt"
                with open(rank_file, "wb") as f:
                    f.write(buf.getvalue())
                    f.flush()
                    os.fsync(f.fileno())
            except Exception as e:  # noqa: BLE001
                error = f"writing rank {world.rank}'s state failed: {type(e).__name__}: {e}"
        self._agree(error, "checkpoint write", cleanup=tmp)
        error = None
        if world.rank == 0:
            try:
                fsync_tree(tmp)
                files = {
                    str(p.relative_to(tmp)): {"size": p.stat().st_size, "xxh3_128": file_digest(p, bits=128)}
                    for p in sorted(tmp.rglob("*"))
                    if p.is_file()
                }
                manifest = {
                    "step": step,
                    "version": version,
                    "world_size": world.world_size,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "files": files,
                }
                # The checksums were computed by reading the files back after fsync: that read is
                # the verification; the manifest then certifies them for every later load.
                atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
                replace_dir(tmp, final)
                atomic_write_text(self.root / "latest", final.name)
                self._prune()
            except (OSError, CheckpointError) as e:
                error = f"finishing checkpoint {final} failed: {type(e).__name__}: {e}"
        self._agree(error, "checkpoint publish", cleanup=tmp)
        log.info("checkpoint %s saved and verified in %.2fs", final, time.perf_counter() - t0)
        return final

    def _agree(self, error: str | None, phase: str, cleanup: Path | None = None) -> None:
        errors = self.world.bridge.all_gather_object(error, phase=phase)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            if cleanup is not None and self.world.rank == 0:
                shutil.rmtree(cleanup, ignore_errors=True)
            raise CheckpointError(
                "; ".join(f"rank {r}: {e}" for r, e in failed)
                + " — the trainer is kept and the previous checkpoint is untouched"
            )

    def recorded(self, step: int) -> None:
        """Step `step`'s metrics row is written: a restart resumes from its checkpoint now (if it
        has one), and the older ones beyond `keep_last` go. Every rank calls it; rank 0 prunes."""
        self.recorded_step = step
        if self.world.rank == 0:
            self._prune()

    def _prune(self) -> None:
        """Remove all but the newest `keep_last` checkpoints, the newest recorded one (where a
        restart resumes: see the module docstring) and the one `latest` names."""
        if self.keep_last <= 0:
            return
        done = step_dirs(self.root)
        keep = {path for _, path in done[-self.keep_last :]}
        resumable = [path for step, path in done if step <= self.recorded_step]
        if resumable:
            keep.add(resumable[-1])
        latest = self.root / "latest"
        if latest.is_file():
            keep.add(self.root / latest.read_text().strip())
        for _, old in done:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, trainer: Trainer, restore_rank_state: bool = True) -> Restored:
        """Verify (rank 0, shared with all), then restore trainer state and — unless
        `restore_rank_state` is False (re-creation within a run) — RNG and the saved extras."""

        error = None
        manifest = None
        if self.world.rank == 0:
            try:
                manifest = verify(path)
                if manifest["world_size"] != self.world.world_size:
                    error = (
                        f"{path} was saved by {manifest['world_size']} ranks, this job has {self.world.world_size}; "
                        "per-rank RNG and data state cannot be mapped"
                    )
            except CheckpointError as e:
                error = str(e)
        errors = self.world.bridge.all_gather_object(error, phase="checkpoint verify")
        if errors[0]:
            raise CheckpointError(errors[0])
        model_sd, optim_sd = trainer.distributed_state_dict()
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "trainer"))
        trainer.load_distributed_state_dict(state["model"], state["optim"])
        rank_state = torch.load(path / f"rank{self.world.rank}.pt", weights_only=False)
        trainer.load_host_state(rank_state["trainer"])
        step = int(rank_state["step"])
        if restore_rank_state:
            set_rng_state(rank_state["rng"])
            # A resume continues after a recorded step (history.py resumes from no other; the
            # rows after a named checkpoint are moved aside): it stays until a newer one is recorded.
            self.recorded_step = step
        return Restored(path, step, rank_state["version"], rank_state["extra"])
