"""Weight versions on disk: atomic publication, a checksummed manifest, pruning.

A version is a directory `<weights_dir>/weight_v{N:06d}`, written into a temporary directory
(every file fsynced) and renamed into place, so no reader ever sees half of one. Its manifest
`rltrain_version.json` names the version, its kind (`full`: an HF checkpoint loadable by
`from_pretrained`; `delta`: see delta.py) and the xxh3 of every file, which the receiving side
checks before an engine loads anything (the embedded engine as it reads the files, `read_weights`;
for SGLang the node's leader first, `verify`): a corrupt or truncated shard is refused and the
engine keeps serving the version it has. Versions beyond `sync.keep_weight_versions` are pruned, and
so are versions numbered above the new one (left by an earlier run that went further).
With several nodes, `sync.weights_dir` must be on a filesystem all nodes see.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rltrain.runtime.files import file_digest, fsync_file, make_readable, replace_dir
from rltrain.weights.hf_files import CorruptWeightsError, map_safetensors

MANIFEST = "rltrain_version.json"


class StaleWeightsError(RuntimeError):
    """An engine serves a weight version other than the one just published."""


def version_dir(root: Path, version: str) -> Path:
    return root / f"weight_v{int(version):06d}"


def publish(target: Path, keep: int | None, write: Callable[[Path], dict[str, Any]]) -> Path:
    """Run `write(tmp_dir) -> manifest fields` (a "digests" field: xxh3 of files it wrote, known
    without reading them back), add file digests, fsync, rename to `target`, prune
    (unless `keep` is None: then the caller prunes, e.g. off the critical path)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp"))
    try:
        fields = write(tmp)
        known = fields.pop("digests", {})  # computed while writing: not read back
        files = {f.name: known.get(f.name) or file_digest(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({**fields, "files": files}, indent=1))
        fsync_file(manifest)
        make_readable(tmp)
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        prune(target, keep)
    return target


def prune(newest: Path, keep: int | None, newer: bool = True) -> None:
    """Delete versions numbered above `newest` (left by an earlier run that went further;
    unless `newer` is False) and all but the `keep` newest up to it (none if `keep` is None).
    A prune that runs while the next version is published must pass newer=False."""
    number = lambda p: int(p.name.removeprefix("weight_v"))  # noqa: E731
    versions = sorted((p for p in newest.parent.glob("weight_v*") if p.is_dir()), key=number)
    stale = [p for p in versions if number(p) > number(newest)] if newer else []
    older = [p for p in versions if number(p) <= number(newest)]
    for old in stale + (older[:-keep] if keep else []):
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CorruptWeightsError(f"weight version {path}: unreadable manifest {MANIFEST} ({e})") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `path`, memory-mapped, the files read in
    parallel. A published version (it has a manifest) is checked against it as it is read, so
    a corrupt or partly written file raises CorruptWeightsError before any tensor is used; a
    plain HF directory is read as it is. Other unreadable files raise ValueError."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(path)!r}")
    digests: dict[str, str | None] = dict.fromkeys((f.name for f in files), None)
    if (path / MANIFEST).exists():
        listed = {n: d for n, d in read_manifest(path).get("files", {}).items() if n.endswith(".safetensors")}
        if set(listed) != set(digests):
            raise CorruptWeightsError(
                f"weight version {path}: its files {sorted(digests)} are not the manifest's "
                f"{sorted(listed)}; the engine keeps its current weights"
            )
        digests = listed

    def one(f: Path) -> dict[str, torch.Tensor]:
        try:
            return map_safetensors(f, digests[f.name])
        except CorruptWeightsError:
            raise
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read weight file {f}: {e}") from e

    state: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(min(8, len(files)), thread_name_prefix="rltrain-read") as pool:
        for tensors in pool.map(one, files):
            state.update(tensors)
    return state


def verify(path: Path) -> dict[str, Any]:
    """Check every file of a published version against its manifest; returns the manifest.
    Files are hashed in parallel (xxhash releases the GIL)."""
    manifest = read_manifest(path)
    files = manifest.get("files", {})
    for name in files:
        if not (path / name).is_file():
            raise CorruptWeightsError(f"weight version {path}: {name} is missing")
    with ThreadPoolExecutor(min(8, max(1, len(files))), thread_name_prefix="rltrain-verify") as pool:
        digests = dict(zip(files, pool.map(lambda n: file_digest(path / n), files)))
    for name, digest in files.items():
        if digests[name] != digest:
            raise CorruptWeightsError(
                f"weight version {path}: {name} does not match its checksum (corrupt or "
                f"partly written); the engine keeps its current weights"
            )
    return manifest
