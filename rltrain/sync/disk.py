"""Disk weight sync: publish an HF checkpoint per version, every engine loads it, versions verified.

Rank 0 writes `<weights_dir>/weight_v{N:06d}` through a temporary directory (files fsynced, then
renamed into place), so an engine can never load a half-written version; older versions beyond
`loop.keep_weight_versions` are pruned. Each node's engine then loads it with the version number
and every rank checks that its engine reports that version. With several nodes, `weights_dir`
must be on a filesystem all nodes see.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


class StaleWeightsError(RuntimeError):
    """An engine serves a weight version other than the one just published."""


def weights_dir(cfg: Any) -> Path:
    return Path(cfg.loop.weights_dir) if cfg.loop.weights_dir else cfg.run_dir / "weights"


def version_dir(cfg: Any, version: str) -> Path:
    return weights_dir(cfg) / f"weight_v{int(version):06d}"


def publish(trainer: Any, target: Path, keep: int) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp"))
    try:
        trainer.save_pretrained(str(tmp))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        dirfd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Versions above this one were written by an earlier run that went further (a fresh start
    # or a resume from an older checkpoint in the same directory): they are stale, remove them.
    # Of the rest keep the newest `keep`, this one included.
    number = lambda p: int(p.name.removeprefix("weight_v"))  # noqa: E731
    versions = sorted((p for p in target.parent.glob("weight_v*") if p.is_dir()), key=number)
    stale = [p for p in versions if number(p) > number(target)]
    older = [p for p in versions if number(p) <= number(target)]
    for old in stale + (older[:-keep] if keep > 0 else []):
        shutil.rmtree(old, ignore_errors=True)
    return target


def publish_and_load(cfg: Any, world: Any, trainer: Any, client: Any, version: str) -> None:
    target = version_dir(cfg, version)
    error = None
    if world.rank == 0:
        try:
            publish(trainer, target, cfg.loop.keep_weight_versions)
        except OSError as e:
            error = f"publishing weight version {version} to {target} failed: {e}"
    errors = world.bridge.all_gather_object(error, phase="sync publish")
    if any(errors):
        raise OSError(next(e for e in errors if e))
    if world.env.is_node_leader:
        client.update_weights_from_disk(str(target), weight_version=version)
    world.bridge.barrier(phase="sync load")
    served = client.weight_version()
    if served != version:
        raise StaleWeightsError(f"rank {world.rank}: engine serves weight version {served!r} after loading {version!r}")
