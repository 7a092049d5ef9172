"""An HF checkpoint read into a sharded model: each rank reads only the rows it holds.

`load_hf_checkpoint(model, path)` fills a model that was built on the meta device, sharded (FSDP2
splits dim 0 of every parameter over its group: a rank's DTensor holds rows [start, stop)) or not,
and allocated with `to_empty`, from the `*.safetensors` files of an HF checkpoint directory (one
`model.safetensors`, or the files `model.safetensors.index.json` names). The model then holds what
`from_pretrained` + sharding would give it, bit for bit:

- every parameter and persistent buffer: its local rows, read with safetensors' `get_slice` (a view
  of the file's memory map: only those rows' pages are touched) and cast to the tensor's dtype on
  the copy, as `from_pretrained(dtype=...)` casts;
- tied weights (the LM head tied to the embedding) once: the checkpoint names the head or not;
- weights transformers keeps converted (MoE experts fused into one 3-D tensor, checkpoints naming
  them per expert: weights/names.py): the checkpoint tensors of this rank's experts only;
- non-persistent buffers (rotary `inv_freq`), which no checkpoint holds: `compute_buffers`
  recomputes them as `from_pretrained` does, through the model's own `_init_weights`, on the host.

Module names are matched to checkpoint names without the wrappers' segments (`_orig_mod.` of a
compiled module, activation checkpointing's); the FSDP trainer's LogprobHead keeps the head's
name. Everything is checked before anything is copied: a checkpoint name the model lacks, a model
weight the checkpoint lacks (a tied head excepted), or a shape that differs is refused with every
such name (`CheckpointMismatch`).

Host memory: a rank's reads touch only its rows' pages of the files, and a file is re-opened after
`REMAP_BYTES` read through one mapping (`SafetensorsSource`, megatron's reader too), which drops
the pages read so far from the process (they stay in the page cache). A converted weight's reads
share one row's index pattern per weight kind. A rank never holds more than its shards plus that
much. No collectives.

Time: a thread asks the kernel to read the rank's byte ranges up to `READ_AHEAD_BYTES` ahead of
the reads (`_ReadAhead`), so the disk reads the next tensors while the last ones are copied to the
device (page cache, not the process's memory).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Replicate, Shard

from rltrain.runtime.internals import local_shard
from rltrain.weights.hf_files import INDEX
from rltrain.weights.names import EXPERT, module_weights, to_checkpoint

# Bytes read through one memory map of a file before it is re-opened (the pages read through a
# map stay in the process's resident set until it is closed).
REMAP_BYTES = 64 << 20
# Checkpoint bytes the kernel is asked to read ahead of a rank's reads (`_ReadAhead`).
READ_AHEAD_BYTES = 1 << 30
# The largest index a converted weight that keeps no expert per row may need (8 bytes per element).
GENERAL_INDEX_BYTES = 1 << 30
# A layer's number inside a module name: weights of every layer share one index pattern.
_LAYER = re.compile(r"\.\d+\.")
# Segments wrappers put into module names that checkpoints do not have (torch.compile's, the
# activation-checkpoint wrapper's, FSDP1's).
_WRAPPERS = re.compile(r"(^|\.)(?:_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")
# Old checkpoints kept each layer's rotary inv_freq, which transformers ignores.
_IGNORED = (re.compile(r"rotary_emb\.inv_freq$"),)


class CheckpointMismatch(ValueError):
    """A checkpoint whose names or shapes do not fit the model it is loaded into."""


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a checkpoint: the file it is in, its shape and safetensors dtype code, and
    where its bytes start in the file (-1: not known)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str
    offset: int = -1


@dataclass(frozen=True)
class Read:
    """One checkpoint tensor (or its rows [start, stop)) copied into a rank's local tensor: whole
    (`index` None) or, for a converted weight, element by element at `index` + `offset` of the
    local tensor (`mask`: which of the checkpoint tensor's elements are this rank's; None: all)."""

    name: str
    stored: StoredTensor
    target: torch.Tensor
    rows: tuple[int, int] | None = None
    index: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    offset: int = 0  # added to `index` (reads of one expert row each share one pattern)

    @property
    def nbytes(self) -> int:
        if self.rows is None:
            return math.prod(self.stored.shape) * _ITEMSIZE.get(self.stored.dtype, 1)
        start, stop = self.rows
        return (stop - start) * math.prod(self.stored.shape[1:]) * _ITEMSIZE.get(self.stored.dtype, 1)


# Bytes per element of each safetensors dtype code (for the bytes read; FP8 and smaller: 1).
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


def stored_tensors(path: str | Path) -> dict[str, StoredTensor]:
    """name -> where and what, for every tensor of the HF checkpoint at `path` (headers only): the
    files `model.safetensors.index.json` names, else `model.safetensors`, else every
    `*.safetensors` there."""
    root = Path(path)
    index = root / INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({root / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names files that are not there: {absent[:5]}")
    elif (root / "model.safetensors").is_file():
        weight_map, files = {}, [root / "model.safetensors"]
    else:
        weight_map, files = {}, sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no {INDEX}, model.safetensors or *.safetensors in {root}: the trainer reads HF safetensors "
            "checkpoints (re-save the model with save_pretrained, which writes safetensors)"
        )
    out: dict[str, StoredTensor] = {}
    for f in files:
        starts = _data_offsets(f)
        with safe_open(str(f), "pt") as h:
            for name in h.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if name in out:
                    raise CheckpointMismatch(f"{root}: {name} is in both {out[name].file.name} and {f.name}")
                s = h.get_slice(name)
                out[name] = StoredTensor(f, tuple(s.get_shape()), s.get_dtype(), starts.get(name, -1))
    wrong = sorted(n for n, f in weight_map.items() if n not in out or out[n].file.name != Path(f).name)
    if wrong:
        raise CheckpointMismatch(f"{index}: {len(wrong)} names are not in the file it names, e.g. {wrong[:5]}")
    return out


def _data_offsets(f: Path) -> dict[str, int]:
    """Where each tensor's bytes start in safetensors file `f` (its header's data_offsets, after
    the 8-byte length and the header); {} where the header does not say (safe_open, which read it
    already, decides what is valid)."""
    try:
        with open(f, "rb") as h:
            n = int.from_bytes(h.read(8), "little")
            header = json.loads(h.read(n))
        return {k: 8 + n + int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


class _ReadAhead:
    """Asks the kernel to read the checkpoint bytes a rank's reads will touch, in their order,
    up to `ahead` bytes before the reader (posix_fadvise WILLNEED, from a thread of its own): the
    disk reads the next tensors while the reader copies the last ones to the device. Advice only:
    any failure leaves the reads as they were."""

    def __init__(self, reads: list[Read], ahead: int = READ_AHEAD_BYTES):
        self.ranges = []  # (file, start, length), in the reader's order
        for r in reads:
            if r.stored.offset < 0:
                continue
            row = r.nbytes // max(1, (r.rows[1] - r.rows[0])) if r.rows is not None else 0
            start = r.stored.offset + (r.rows[0] * row if r.rows is not None else 0)
            self.ranges.append((r.stored.file, start, r.nbytes))
        self.ahead = ahead
        self.done = 0  # bytes the reader has read
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rltrain-read-ahead", daemon=True)

    def __enter__(self) -> _ReadAhead:
        if self.ranges and hasattr(os, "posix_fadvise"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def read(self, nbytes: int) -> None:
        """The reader has read `nbytes` more."""
        with self._cond:
            self.done += nbytes
            self._cond.notify()

    def _run(self) -> None:
        fds: dict[Path, int] = {}
        advised = 0
        try:
            for f, start, length in self.ranges:
                with self._cond:
                    while not self._stop and advised - self.done > self.ahead:
                        self._cond.wait(timeout=1.0)
                    if self._stop:
                        return
                if f not in fds:
                    fds[f] = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fds[f], start, length, os.POSIX_FADV_WILLNEED)
                advised += length
        except OSError:
            return  # advice only
        finally:
            for fd in fds.values():
                os.close(fd)


def checkpoint_name(module_name: str) -> str:
    """A module tensor's name as checkpoints spell it: without the wrappers' segments."""
    return _WRAPPERS.sub(r"\1", module_name)


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of `t`'s global dim 0 that this rank holds: all of them for a plain
    tensor or a replicated DTensor; for FSDP2's `Shard(0)` over a 1-D mesh, rank r's chunk of
    ceil(rows / ranks) rows (the last ones short or empty), as FSDP2 and DTensor split. Checked
    against the local tensor's shape."""
    if not isinstance(t, DTensor):
        return 0, t.shape[0] if t.dim() else 0
    placements = tuple(t.placements)
    rows = t.shape[0] if t.dim() else 0
    if placements == (Replicate(),):
        start, stop = 0, rows
    elif placements == (Shard(0),) and t.device_mesh.ndim == 1:
        ranks, rank = t.device_mesh.size(), t.device_mesh.get_local_rank()
        chunk = -(-rows // ranks)
        start = min(rank * chunk, rows)
        stop = min(start + chunk, rows)
    else:
        raise NotImplementedError(
            f"a DTensor placed {placements} over a {t.device_mesh.ndim}-D mesh: the sharded reader knows "
            "FSDP2's Shard(0) over one mesh dimension and Replicate"
        )
    local = local_shard(t)
    if tuple(local.shape) != (stop - start, *t.shape[1:]):
        raise RuntimeError(
            f"a local shard of {tuple(local.shape)} of a {tuple(t.shape)} tensor is not rows {start}..{stop}, "
            "the dim-0 split the sharded reader assumes"
        )
    return start, stop


def _renumber(name: str, offset: int) -> str:
    """`name` with its expert index moved up by `offset`."""
    return EXPERT.sub(lambda m: m.group(0).replace(m.group(1), str(int(m.group(1)) + offset)), name, count=1)


def _expert_rows(model: Any, name: str, shape: torch.Size) -> bool:
    """Whether converted weight `name` stores expert e as row e of its dim 0: its checkpoint
    tensors are those of one row, numbered e (what transformers' fused experts are). Then a rank
    reads only its experts' tensors. Checked on meta tensors."""
    one = to_checkpoint(model, name, torch.empty((1, *shape[1:]), device="meta"))
    if not one or any(not EXPERT.search(n) for n, _ in one):
        return False
    full = {n: tuple(t.shape) for n, t in to_checkpoint(model, name, torch.empty(shape, device="meta"))}
    rows = {_renumber(n, r): tuple(t.shape) for r in range(shape[0]) for n, t in one}
    return full == rows


def _converted_reads(
    model: Any,
    name: str,
    target: torch.Tensor,
    stored: dict[str, StoredTensor],
    patterns: dict[tuple[str, tuple[int, ...]], list[torch.Tensor]],
    general: bool = False,
) -> list[Read]:
    """The reads that fill this rank's rows of converted weight `name` (several checkpoint
    tensors, not a reshaped one): where the conversion keeps an expert per row, the tensors of this
    rank's experts, each with the element indices of one row (`patterns`: one per weight kind and
    shape, shared by every layer's) offset to its row; otherwise (or with `general`) every
    checkpoint tensor with an element in those rows, with the indices of the whole tensor (8 bytes
    per element of it, refused above GENERAL_INDEX_BYTES)."""
    start, stop = local_rows(target)
    if stop <= start:
        return []
    local = local_shard(target)
    shape = target.shape
    row = math.prod(shape[1:])
    if not general and _expert_rows(model, name, shape):
        # One expert's element positions in its row, shared by every expert's reads (8 bytes per
        # element of one row, not of the rank's block), each read offset to its row.
        key = (_LAYER.sub(".#.", name), tuple(shape))
        if key not in patterns:
            one = torch.arange(row).reshape(1, *shape[1:])
            patterns[key] = [idx.reshape(-1) for _, idx in to_checkpoint(model, name, one)]
        names = [ck for ck, _ in to_checkpoint(model, name, torch.empty((1, *shape[1:]), device="meta"))]
        return [
            Read(_renumber(ck, r), stored[_renumber(ck, r)], local, index=idx, offset=(r - start) * row)
            for r in range(start, stop)
            for ck, idx in zip(names, patterns[key], strict=True)
        ]
    if math.prod(shape) * 8 > GENERAL_INDEX_BYTES:
        raise NotImplementedError(
            f"{name} {list(shape)}: its conversion from the checkpoint's tensors keeps no expert per row, and "
            f"mapping its elements takes {math.prod(shape) * 8 / 2**30:.1f} GiB of indices on every rank "
            f"(more than {GENERAL_INDEX_BYTES >> 30} GiB): load this architecture with from_pretrained "
            "(a smaller model) or add its conversion to weights/names.py as rows"
        )
    whole = torch.arange(math.prod(shape)).reshape(shape) - start * row  # positions in the local rows
    reads = []
    for ck, idx in to_checkpoint(model, name, whole):
        flat = idx.reshape(-1)
        mine = (flat >= 0) & (flat < local.numel())
        if bool(mine.all()):
            reads.append(Read(ck, stored[ck], local, index=flat.clone()))
        elif bool(mine.any()):
            reads.append(Read(ck, stored[ck], local, index=flat[mine], mask=mine))
    return reads


def plan_reads(model: torch.nn.Module, stored: dict[str, StoredTensor], path: str | Path = "") -> list[Read]:
    """Every read that fills this rank's part of `model` from checkpoint tensors `stored`, after
    checking that the names and shapes fit (CheckpointMismatch names every misfit; nothing is read)."""
    weights = module_weights(model)
    kept = {n for n, _ in weights}
    tied = {checkpoint_name(n) for n, _ in model.named_parameters(remove_duplicate=False)} - {
        checkpoint_name(n) for n in kept
    }
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    ignored += _IGNORED
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}  # checkpoint name -> (module name, shape)
    for module_name, t in weights:
        if t.device.type == "meta":
            raise ValueError(f"{module_name} is on the meta device: allocate the model (to_empty) before loading")
        name = checkpoint_name(module_name)
        for ck, ct in to_checkpoint(model, name, torch.empty(t.shape, dtype=t.dtype, device="meta")):
            expected[ck] = (module_name, tuple(ct.shape))
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(n for n in set(stored) - set(expected) - tied if not any(p.search(n) for p in ignored))
    shapes = [
        f"{ck}: checkpoint {list(stored[ck].shape)}, model {list(shape)}"
        for ck, (_, shape) in expected.items()
        if ck in stored and stored[ck].shape != shape
    ]
    if missing or unexpected or shapes:
        parts = [f"{len(missing)} model weights missing from it, e.g. {missing[:5]}"] if missing else []
        parts += [f"{len(unexpected)} names the model lacks, e.g. {unexpected[:5]}"] if unexpected else []
        parts += [f"{len(shapes)} shapes differ, e.g. {shapes[:5]}"] if shapes else []
        raise CheckpointMismatch(
            f"the checkpoint at {path} does not fit {type(model).__name__} as its config.json builds it: "
            f"{'; '.join(parts)}. Point model.path at a checkpoint of this architecture and size (its "
            "config.json and *.safetensors written together, e.g. by save_pretrained)"
        )
    reads: list[Read] = []
    patterns: dict[tuple[str, tuple[int, ...]], list[torch.Tensor]] = {}
    for module_name, t in weights:
        name = checkpoint_name(module_name)
        out = to_checkpoint(model, name, torch.empty(t.shape, dtype=t.dtype, device="meta"))
        if len(out) == 1 and tuple(out[0][1].shape) == tuple(t.shape):  # the same tensor (or renamed)
            ck = out[0][0]
            if t.dim() == 0:
                reads.append(Read(ck, stored[ck], local_shard(t)))
                continue
            start, stop = local_rows(t)
            if stop > start:
                reads.append(Read(ck, stored[ck], local_shard(t), rows=(start, stop)))
        else:
            reads += _converted_reads(model, name, t, stored, patterns)
    return reads


class SafetensorsSource:
    """The tensors of an HF checkpoint directory, read slice by slice: both trainers' reader
    (this module's `read`; megatron's `mcore_state`, as its `WeightSource`).

    Names map to files as `stored_tensors` finds them (through `model.safetensors.index.json` when
    there is one), shapes from the files' headers. `safe_open` maps a file without reading it; a
    read copies the rows/columns asked for out of the mapping, so the rank's own memory holds its
    slices, not the files. The file pages a read touches count in the process's resident memory
    while the file is mapped, and a column slice touches nearly every page of its tensor: a file is
    unmapped (and mapped again on its next read, which parses its header again) once reads touched
    `unmap_after_bytes` of it. `bytes_read` counts the tensor bytes handed out. Use as a context
    manager: leaving it unmaps every file."""

    unmap_after_bytes = REMAP_BYTES

    def __init__(self, model_path: str | Path, stored: dict[str, StoredTensor] | None = None):
        self.root = Path(model_path)
        self.bytes_read = 0
        self._open_files: dict[Path, Any] = {}  # mapped on first use
        self._touched: dict[Path, int] = {}  # bytes of each mapped file that reads touched
        self._stored = stored if stored is not None else stored_tensors(self.root)

    def _mapped(self, f: Path) -> Any:
        if f not in self._open_files:
            self._open_files[f] = safe_open(str(f), framework="pt")
            self._touched[f] = 0
        return self._open_files[f]

    def _unmap(self, f: Path) -> None:
        self._open_files.pop(f).__exit__(None, None, None)

    def names(self) -> Collection[str]:
        return self._stored.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._stored[name].shape

    def take(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Rows (and columns) of tensor `name` as safetensors gives them: possibly a view of the
        file's mapping, valid until the next call (which unmaps a file past its budget): copy it
        out before. `read` gives a copy."""
        for full in [g for g, n in self._touched.items() if n >= self.unmap_after_bytes and g in self._open_files]:
            self._unmap(full)
        f = self._stored[name].file
        whole = self._mapped(f).get_slice(name)
        if not whole.get_shape():  # a scalar: no rows to slice
            t = self._open_files[f].get_tensor(name)
        else:
            rows = slice(None) if rows is None else rows
            t = whole[rows] if cols is None else whole[rows, cols]
        self.bytes_read += t.nbytes
        # A column slice spans the pages of its rows whole.
        self._touched[f] += t.nbytes if cols is None else len(t) * math.prod(whole.get_shape()[1:]) * t.element_size()
        return t

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """`take`, copied into storage of its own."""
        return self.take(name, rows, cols).clone()

    def close(self) -> None:
        for f in list(self._open_files):
            self._unmap(f)

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@torch.no_grad()
def read(reads: list[Read], src: SafetensorsSource) -> int:
    """Copy every read's rows into its target through `src` (file by file: a file's mapping is
    dropped after `src.unmap_after_bytes` read through it). A converted weight's index pattern
    goes to the target's device once per pattern, not once per read. Returns the bytes read."""
    by_file: dict[Path, list[Read]] = defaultdict(list)
    for r in reads:
        by_file[r.stored.file].append(r)
    total = 0
    on_device: dict[tuple[int, torch.device], torch.Tensor] = {}  # id(index pattern), device -> it there
    ahead = _ReadAhead([r for todo in by_file.values() for r in todo])
    with ahead:
        for r in (r for todo in by_file.values() for r in todo):
            value = src.take(r.name, None if r.rows is None else slice(*r.rows))
            if r.index is None:
                r.target.copy_(value)
            else:
                flat = value.reshape(-1)
                if r.mask is not None:
                    flat = flat[r.mask]
                key = (id(r.index), r.target.device)
                if key not in on_device:
                    on_device[key] = r.index.to(r.target.device)
                index = on_device[key] if not r.offset else on_device[key] + r.offset
                r.target.view(-1)[index] = flat.to(r.target.device, r.target.dtype)
            total += r.nbytes
            ahead.read(r.nbytes)
    return total


@torch.no_grad()
def compute_buffers(model: Any) -> None:
    """Recompute every non-persistent buffer (rotary `inv_freq`: in no checkpoint, garbage after
    `to_empty`) as `from_pretrained` does: the model's own `_init_weights` on the module holding it,
    computed on the host and copied into the buffer. A module holding parameters beside such a
    buffer, or a buffer `_init_weights` leaves unwritten, is refused: nothing here could rebuild it."""
    for prefix, module in model.named_modules():
        names = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        if not names:
            continue
        if any(p is not None for p in module._parameters.values()):
            raise NotImplementedError(
                f"{prefix} ({type(module).__name__}) holds parameters beside non-persistent buffers {names}: "
                "recomputing the buffers through _init_weights would re-initialise the parameters"
            )
        versions = {n: module._buffers[n]._version for n in names}
        with torch.random.fork_rng(devices=[]):
            model._init_weights(module)
        stale = [n for n in names if module._buffers[n]._version == versions[n]]
        if stale:
            raise NotImplementedError(
                f"{prefix} ({type(module).__name__}): {type(model).__name__}._init_weights does not compute "
                f"its non-persistent buffers {stale}, which no checkpoint holds"
            )


def load_hf_checkpoint(model: torch.nn.Module, path: str | Path) -> int:
    """Fill `model` (built on meta, sharded or not, allocated with `to_empty`) from the HF
    checkpoint at `path`, each rank its own rows, as `from_pretrained` + sharding would: weights
    cast to each tensor's dtype, non-persistent buffers recomputed. Refuses a checkpoint that does
    not fit before copying anything (CheckpointMismatch). Returns the bytes this rank read."""
    stored = stored_tensors(path)
    reads = plan_reads(model, stored, path)
    compute_buffers(model)
    with SafetensorsSource(path, stored) as src:
        return read(reads, src)
