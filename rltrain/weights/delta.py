"""Delta weight versions: byte-level XOR against the last published version, zstd-compressed.

Between RL steps most bytes of most tensors change a little, but with a small learning rate, a
frozen part, or LoRA-like updates many bytes do not change at all; XOR turns unchanged bytes into
zeros, which zstd removes. Meant for engines that read weights from slow shared storage
(`loop.colocate=false`); colocated engines read trainer memory directly (`sync.transport=tensor`).

Publisher (rank 0): keeps the last published state in host memory (one copy of the model) and
writes either a full version (an HF checkpoint, every `sync.delta_full_every`-th version and
whenever there is no base) or `delta.bin` + a manifest with, per tensor, dtype, shape, byte range
and the xxh3 of the *new* bytes. Receiver (each node's leader): checks the base version named in
the manifest is the one it holds (strict ordering: a skipped or reordered delta is refused),
applies the XOR, checks every tensor's xxh3, and writes the result as a full local version that
the engine loads from disk as usual. Any mismatch raises and the engine keeps its weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard
from safetensors import safe_open

from rltrain.runtime.memory import host_bytes
from rltrain.weights.hf_files import INDEX, CorruptWeightsError, write_checkpoint
from rltrain.weights.versions import read_manifest

DELTA_FILE = "delta.bin"


class DeltaOrderError(RuntimeError):
    """A delta's base is not the version the receiver holds."""


def _raw(t: torch.Tensor) -> np.ndarray:
    return host_bytes(t.detach().to("cpu"))


class DeltaPublisher:
    def __init__(self, full_every: int, level: int = 3):
        self.full_every = full_every
        self.level = level
        self.base: dict[str, np.ndarray] | None = None
        self.base_version: str | None = None
        self.published = 0
        self._pending: tuple[dict[str, np.ndarray], str] | None = None

    def write(
        self, tmp: Path, version: str, tensors: Iterable[tuple[str, torch.Tensor]], config_from: str
    ) -> dict[str, Any]:
        """Write version `version` into `tmp`; returns the manifest fields. Call `commit()` once
        the version is published (a failed publish leaves the base unchanged)."""

        new_base: dict[str, np.ndarray] = {}
        base_state = self.base
        if base_state is None or self.published % self.full_every == 0:

            def recorded() -> Iterator[tuple[str, torch.Tensor]]:
                for name, t in tensors:
                    new_base[name] = _raw(t).copy()
                    yield name, t

            write_checkpoint(tmp, config_from, recorded())
            fields: dict[str, Any] = {"version": version, "kind": "full"}
        else:
            entries: dict[str, Any] = {}
            compressor = zstandard.ZstdCompressor(level=self.level)
            offset = 0
            with open(tmp / DELTA_FILE, "wb") as out:
                for name, t in tensors:
                    raw = _raw(t)
                    base = base_state.get(name)
                    if base is None or base.size != raw.size:
                        raise ValueError(
                            f"delta of {name!r}: the base version has no tensor of {raw.size} bytes by "
                            f"that name; the model changed between versions"
                        )
                    blob = compressor.compress(np.bitwise_xor(raw, base).tobytes())
                    out.write(blob)
                    entries[name] = {
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                        "offset": offset,
                        "length": len(blob),
                        "xxh3": xxhash.xxh3_64_hexdigest(raw),
                    }
                    offset += len(blob)
                    new_base[name] = raw.copy()
            fields = {"version": version, "kind": "delta", "base_version": self.base_version, "tensors": entries}
        self._pending = (new_base, version)
        return fields

    def commit(self) -> None:
        assert self._pending is not None
        self.base, self.base_version = self._pending
        self._pending = None
        self.published += 1


def reconstruct(delta_dir: Path, base_dir: Path, out: Path) -> None:
    """Write the full version of `delta_dir` (applied to the full version `base_dir`) into `out`."""

    manifest = read_manifest(delta_dir)
    base_version = read_manifest(base_dir)["version"]
    if manifest["base_version"] != base_version:
        raise DeltaOrderError(
            f"delta {delta_dir.name} applies to version {manifest['base_version']} but this node "
            f"holds version {base_version}; a version was skipped or reordered"
        )
    files = _tensor_files(base_dir)
    decompressor = zstandard.ZstdDecompressor()
    handles: dict[str, Any] = {}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with open(delta_dir / DELTA_FILE, "rb") as fh:
            for name, e in manifest["tensors"].items():
                if name not in files:
                    raise CorruptWeightsError(f"delta {delta_dir.name}: {name} is not in base version {base_version}")
                f = files[name]
                if f not in handles:
                    handles[f] = safe_open(str(base_dir / f), "pt")
                base = _raw(handles[f].get_tensor(name))
                fh.seek(e["offset"])
                try:
                    xor = np.frombuffer(decompressor.decompress(fh.read(e["length"])), dtype=np.uint8)
                except zstandard.ZstdError as err:
                    raise CorruptWeightsError(f"delta {delta_dir.name}: {name} does not decompress ({err})") from None
                if xor.size != base.size:
                    raise CorruptWeightsError(f"delta {delta_dir.name}: {name} has {xor.size} bytes, base {base.size}")
                new = np.bitwise_xor(base, xor)
                if xxhash.xxh3_64_hexdigest(new) != e["xxh3"]:
                    raise CorruptWeightsError(
                        f"delta {delta_dir.name}: {name} does not match its checksum after "
                        f"applying; the engine keeps its current weights"
                    )
                dtype = getattr(torch, e["dtype"])
                yield name, torch.from_numpy(new.copy()).view(dtype).reshape(e["shape"])

    write_checkpoint(out, base_dir, tensors())


def _tensor_files(path: Path) -> dict[str, str]:

    index = path / INDEX
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: f.name for k in h.keys()})
    return out
