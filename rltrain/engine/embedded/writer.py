"""The one place that writes into the embedded engine's weights: names resolved to parameters,
every name and shape checked before anything is copied, the copies queued and awaited.

    writer = WeightWriter(model, device, layout)
    writer.copy(named)                          # [(name, tensor)]: checked, then copied
    key = writer.bucket_key(metadata)           # a flattened bucket's layout (outside the lock)
    writer.copy_bucket(key, flat, metadata)     # then its tensors, one fused copy where it can
    writer.wait()                               # this thread's copies are done

Names may be a parameter's or buffer's (module names) or a checkpoint's (per-expert MoE names;
weights/names.py). A weight this engine does not own (experts.py) or of another shape is refused
with nothing copied. Copies from pageable host memory (a disk load) go through page-locked
buffers; the rest run as fused copies per group of tensors. Each request thread waits for its
own copies only (`wait`): the sender may reuse its buffers after.

State kept, each looked up or checked once: the parameter objects by name (they outlive release
and resume: only their .data changes), each name's target, and per bucket layout its views and
the parameters they copy into. The layouts hold views of the weights: `forget_views` drops them
when the weights are released.

While `summing` (a weight-update session whose end reports the checksum: receiver.py), each
bucket's weights are checksummed as they land, queued behind their copy on a side stream beside
the next bucket's copies (`landed`: name -> checksum entry, on the device until the report
fetches them): the report then reads only what no bucket wrote. Any other write of a weight
drops its entry; `forget_landed` drops them all (a new session, a release).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from rltrain.engine.embedded.experts import ExpertLayout
from rltrain.runtime import internals
from rltrain.runtime.pinned import PinnedUpload
from rltrain.weights.bucket import BucketViews
from rltrain.weights.checksum import Entry, SideSums
from rltrain.weights.names import checkpoint_index, write

KEPT_LAYOUTS = 4096  # bucket layouts (and keys) kept; a sync sends the same layouts every time


class WeightWriter:
    """Checked copies into one model's weights (module doc)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, layout: ExpertLayout):
        self.model = model
        self.device = device
        self.layout = layout
        # Updates may name weights as checkpoints do (per-expert MoE names; see weights/names.py).
        self.checkpoint_names = checkpoint_index(model)
        # Parameter and buffer objects outlive release/resume (only their .data changes): looked
        # up once, not per update (walking the module tree is dear per bucket).
        self.tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
        self._targets: dict[str, tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]] = {}
        # Flattened buckets by layout: the bucket's views and the parameters they go to, checked
        # once. A sync sends the same layouts every time. Holds views of the weights, so it is
        # emptied when they are released.
        self._bucket_plans: dict[tuple, tuple[Any, list[torch.Tensor] | None]] = {}
        self._bucket_keys: dict[int, tuple[list[Any], tuple]] = {}  # id(metadata) -> (metadata, its key)
        self._local = threading.local()  # per request thread: its last update's copies and times
        self._upload: PinnedUpload | None = None  # disk loads: host-to-device through page-locked buffers
        self.bytes_loaded = 0  # bytes of weights copied in (updates and restored backups), for sync accounting
        self.summing = False  # checksum each bucket's weights as they land (module doc)
        self.landed: dict[str, Entry] = {}
        self.side = SideSums(transient=False)  # the landed sums' stream, beside the next copies (a GPU)

    def target(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
        """(parameter or buffer, index into it or None, checkpoint shape) for a weight name."""
        hit = self._targets.get(name)
        if hit is not None:
            return hit
        target, index, shape = self.tensors.get(name), None, None
        if target is None and name in self.checkpoint_names:
            module_name, index, shape = self.checkpoint_names[name]
            target = self.tensors.get(module_name)
            index = None if index is None else index.to(self.device)
        if target is None:
            raise KeyError(f"unknown parameter {name!r} for {type(self.model).__name__}")
        hit = self._targets[name] = (target, index, tuple(shape if shape is not None else target.shape))
        return hit

    def checked_target(self, name: str, shape: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`target` of a weight an update sends, refused unless this engine owns it in that shape."""
        target, index, expected = self.target(name)
        if not self.layout.owns(name):
            raise ValueError(
                f"parameter {name!r} belongs to another EP rank (this engine is EP rank "
                f"{self.layout.ep_rank} of {self.layout.ep_size})"
            )
        if tuple(shape) != expected:
            raise ValueError(f"parameter {name!r}: shape {tuple(shape)} does not match the model's {expected}")
        return target, index

    def copy(self, named: Iterable[tuple[str, torch.Tensor]], wait: bool = True) -> int:
        """Check every name and shape first, then copy: a bad update changes nothing. Returns
        once the copies are done, or with `wait=False` once queued (`wait`)."""
        t0 = time.perf_counter()
        plan, nbytes = [], 0
        for name, t in named:
            target, index = self.checked_target(name, t.shape)
            plan.append((target, index, t, index is None and (t.dtype, t.device) == (target.dtype, target.device)))
            nbytes += t.numel() * t.element_size()
            self.landed.pop(name, None)
        t1 = time.perf_counter()
        # staged: from pageable host memory (a disk load), through page-locked buffers
        direct: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for target, _, t, plain in plan:
            if plain:
                (staged if PinnedUpload.suits(target.data, t) else direct).append((target.data, t))
        if staged:
            if self._upload is None:
                self._upload = PinnedUpload()
            self._upload.copy(staged)
        if direct:  # one fused launch per group of tensors on CUDA instead of one copy each
            internals.foreach_copy_([d for d, _ in direct], [t for _, t in direct], non_blocking=True)
        for target, index, t, plain in plan:
            if not plain:
                write(target.data, index, t.to(device=target.device, dtype=target.dtype, non_blocking=True))
        self._queued(nbytes, t0, t1)
        if wait:
            self.wait()
        return len(plan)

    def bucket_key(self, metadata: list[Any]) -> tuple:
        """The layout of a flattened bucket's `metadata` (the server passes a kept payload's same
        list: its key is then looked up, not built)."""
        hit = self._bucket_keys.get(id(metadata))
        if hit is not None and hit[0] is metadata:
            return hit[1]
        key = tuple((m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx) for m in metadata)
        if len(self._bucket_keys) >= KEPT_LAYOUTS:
            self._bucket_keys.clear()
        self._bucket_keys[id(metadata)] = (metadata, key)  # (held: its id stays its own)
        return key

    def copy_bucket(self, key: tuple, flat: torch.Tensor, metadata: list[Any]) -> int:
        """Queue the copies of a flattened bucket (SGLang's `flattened_bucket`: a uint8 buffer and
        per-tensor metadata) of layout `key`. The layout is checked against the model once and
        kept: a bucket whose every tensor has its parameter's dtype and needs no index is then
        one split and one fused copy. Returns the tensors queued (`wait` waits for them)."""
        plan = self._bucket_plans.get(key)
        if plan is None:
            plan = self._bucket_plan(metadata)
            if len(self._bucket_plans) >= KEPT_LAYOUTS:  # layouts change only with the sender's plan
                self._bucket_plans.clear()
            self._bucket_plans[key] = plan
        layout, dsts = plan
        views = layout.views(flat)
        if dsts is None:
            return self.copy([(m.name, v.view(m.shape)) for m, v in zip(metadata, views)], wait=False)
        t0 = time.perf_counter()
        internals.foreach_copy_(dsts, views, non_blocking=True)
        self._queued(layout.tensor_bytes, t0, t0)
        if self.summing:  # queued behind the copies; read by the session's checksum report
            self.landed.update(self.side.entries((m.name, d.view(m.shape)) for m, d in zip(metadata, dsts)))
        else:
            for m in metadata:
                self.landed.pop(m.name, None)
        return len(views)

    def _bucket_plan(self, metadata: list[Any]) -> tuple[Any, list[torch.Tensor] | None]:
        """(the bucket's `BucketViews`, each tensor's destination as a 1-D view of its parameter, or
        None when some tensor needs a cast or an index: those go through `copy`)."""
        layout = BucketViews(metadata)
        dsts: list[torch.Tensor] | None = []
        for m in metadata:
            target, index = self.checked_target(m.name, m.shape)
            data = target.data
            if dsts is not None and index is None and m.dtype == data.dtype and data.is_contiguous():
                dsts.append(data.view(-1))
            else:
                dsts = None
        return layout, dsts

    def forget_views(self) -> None:
        """Drop the kept bucket layouts' views of the weights (the weights are being freed)."""
        self._bucket_plans.clear()

    def forget_landed(self) -> None:
        """Drop the checksums taken as buckets landed (a new session; the weights released)."""
        self.landed.clear()

    def _queued(self, nbytes: int, t0: float, t1: float) -> None:
        """Copies of `nbytes` are queued (checked from t0, copying from t1): count them, and mark
        where this thread's `wait` waits to."""
        self.bytes_loaded += nbytes
        self._local.copied = None
        if self.device.type == "cuda":
            self._local.copied = torch.cuda.Event()
            self._local.copied.record()
        self._local.update_ms = {"check": (t1 - t0) * 1e3, "copy": (time.perf_counter() - t1) * 1e3}

    def wait(self) -> None:
        """Wait for this thread's last `copy` (the sender may reuse its buffers after)."""
        t0 = time.perf_counter()
        if self._local.copied is not None:
            self._local.copied.synchronize()
        self._local.update_ms["wait"] = (time.perf_counter() - t0) * 1e3

    @property
    def last_update_ms(self) -> dict[str, float]:
        """This thread's last weight update: check, copy (launch) and wait, ms."""
        return getattr(self._local, "update_ms", {})
