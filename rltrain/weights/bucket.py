"""The flattened-bucket wire format: tensors handed to an engine by handle, as SGLang reads them.

A bucket is one contiguous uint8 buffer plus per-tensor metadata (name, shape, dtype, byte
range) — the layout SGLang's `FlattenedTensorBucket` reconstructs. The metadata are
`types.SimpleNamespace` objects, which SGLang's restricted unpickler accepts, so neither side
needs the other's classes. The payload is pickled with torch's `ForkingPickler`: CUDA tensors
travel as CUDA IPC handles, CPU tensors as shared-memory file names (the `file_system` sharing
strategy; the default fd-passing strategy cannot cross an HTTP request). Only the handle
crosses the wire; the receiver maps the sender's memory and copies from it.

Buffer lifetime. The sender keeps each bucket's buffer alive until the engine has answered the
update request. SGLang answers before its copies out of the buffer have run, so against it every
bucket needs a fresh buffer. The embedded engine answers after its copies are done
(`"weight_updates": "synchronous"` in /get_server_info), so a sender may refill a buffer once
the request that used it has returned.

Buffer slots and kept mappings (the embedded engine's extension; `"weight_buffer_slots": K` in
/get_server_info; SGLang's path never uses it). Inside one weight-update session
(/begin_weight_update ... /end_weight_update) a sender that refills a ring of at most K buffers
sends each buffer's handle once, as `{"flattened_tensor": buf, "metadata": [...], "buffer": k}`,
and afterwards `{"flattened_tensor": None, "metadata": [...], "buffer": k}`: the same string every
sync for a given plan bucket, since the plan never changes. A slot never sent, a slot out of
range, or a slot outside a session is a 400. Ending the session forgets every slot and unmaps
the buffers. Who keeps what, and why (each cache is bounded and dropped with what it refers to):

    sender (sync/tensor.py)
      ring           the refilled buffers, by slot          freed at the session's end (on
                                                            the CPU kept for the next session,
                                                            whose handles are sent again)
      layouts        per plan bucket: its metadata, its     the plan is fixed: a bucket's layout
                     BucketViews and its handle-less        is computed and checked once
                     payload strings, by slot
      sent           (receiver, slot) pairs that hold       a handle goes once per session
                     the slot's current buffer
    engine server (engine/embedded/receiver.py)
      slots          slot -> the sender's mapped buffer     the handle is opened once per session
      mapped         the last few buffers sent with a       torch's IPC cache then serves a
                     handle, kept mapped                    refilled buffer without a re-map
      decoded        handle-less payload string -> its      the same string every sync
                     decoded metadata
    engine model (engine/embedded/writer.py)
      bucket plans   layout key -> BucketViews and the      checked against the model once;
                     1-D parameter views it copies into     dropped when the weights are released
      bucket keys    id(metadata list) -> layout key        a decoded payload's list is reused
      targets        weight name -> parameter (+ index)     the module tree is walked once
"""

from __future__ import annotations

import base64
import io
import pickle
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from rltrain.runtime import internals

ALIGN = 16  # bytes; every tensor starts aligned so `.view(dtype)` works for any dtype


def bucket_layout(named_tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[types.SimpleNamespace], int]:
    """Per-tensor metadata (byte ranges, each start aligned) and the bucket's size in bytes."""
    if not named_tensors:
        raise ValueError("cannot build an empty bucket")
    metadata, offset = [], 0
    for name, t in named_tensors:
        offset = -(-offset // ALIGN) * ALIGN
        nbytes = t.numel() * t.element_size()
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=torch.Size(t.shape),
                dtype=t.dtype,
                start_idx=offset,
                end_idx=offset + nbytes,
                numel=nbytes,
            )
        )
        offset += nbytes
    return metadata, offset


class BucketViews:
    """Where a bucket's tensors lie in its buffer, checked once, and every tensor's 1-D view of
    a buffer taken in one `split` per run of one dtype. A view per tensor (`as_strided`, its
    checks and its stride) costs on both sides of every tensor of every bucket of every sync."""

    def __init__(self, metadata: list[Any]):
        self.metadata = metadata
        order = sorted(range(len(metadata)), key=lambda i: metadata[i].start_idx)
        self.tensor_bytes = sum(m.end_idx - m.start_idx for m in metadata)  # without the gaps
        # (dtype, byte start, byte stop, split sizes: a gap then a tensor, each, metadata indices)
        self.runs: list[tuple[torch.dtype, int, int, list[int], list[int]]] = []
        end = 0
        for i in order:
            m = metadata[i]
            size = m.dtype.itemsize
            numel = torch.Size(m.shape).numel()
            if m.start_idx < 0 or m.start_idx % size or m.end_idx - m.start_idx != numel * size:
                raise ValueError(
                    f"bucket metadata for {m.name!r} is inconsistent ({m.start_idx}:{m.end_idx}, "
                    f"{m.dtype} {tuple(m.shape)})"
                )
            if m.start_idx < end:
                raise ValueError(
                    f"bucket metadata for {m.name!r} overlaps the tensor before it ({m.start_idx} < {end})"
                )
            run = self.runs[-1] if self.runs else None
            if run is None or run[0] != m.dtype:
                run = (m.dtype, m.start_idx, m.start_idx, [], [])
                self.runs.append(run)
            dtype, start, stop, sizes, index = run
            sizes += [(m.start_idx - stop) // size, numel]
            index.append(i)
            self.runs[-1] = (dtype, start, m.end_idx, sizes, index)
            end = m.end_idx
        self.nbytes = end  # the end of the last tensor

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """1-D views of `flat` (uint8), one per tensor, in metadata order."""
        if flat.dtype != torch.uint8 or flat.dim() != 1:
            raise ValueError(f"a flattened bucket is a 1-D uint8 tensor, not {flat.dtype} of shape {tuple(flat.shape)}")
        if flat.numel() < self.nbytes:
            raise ValueError(f"a bucket of {flat.numel()} bytes cannot hold the {self.nbytes} its metadata describe")
        out: list[Any] = [None] * len(self.metadata)
        for dtype, start, stop, sizes, index in self.runs:
            pieces = flat[start:stop].view(dtype).split(sizes)
            for i, piece in zip(index, pieces[1::2]):
                out[i] = piece
        return out


def flatten_bucket(
    named_tensors: list[tuple[str, torch.Tensor]],
    out: torch.Tensor | None = None,
    layout: tuple[list[types.SimpleNamespace], int] | None = None,
    views: BucketViews | None = None,
) -> dict[str, Any]:
    """Copy tensors into one uint8 buffer; returns {"flattened_tensor", "metadata"}.

    The buffer is fresh (on the tensors' device), or the front of `out` (uint8, on the tensors' device, large enough;
    on CPU in shared memory) for a sender that reuses buffers: only against an engine that
    answers after its copies are done (the embedded engine; SGLang does not). `layout`: the
    tensors' `bucket_layout`, and `views` its `BucketViews`, when the caller kept them."""
    metadata, size = layout or bucket_layout(named_tensors)
    if out is None:
        flat = torch.empty(size, dtype=torch.uint8, device=named_tensors[0][1].device)
        if flat.device.type == "cpu":
            # Filled in shared memory directly: pickling a private buffer would copy it there again.
            flat.share_memory_()
    else:
        if out.dtype != torch.uint8 or out.numel() < size:
            raise ValueError(f"buffer of {out.numel()} {out.dtype} elements cannot hold a bucket of {size} bytes")
        flat = out[:size]
    dsts = (views or BucketViews(metadata)).views(flat)
    # One fused copy per dtype on CUDA (multi-tensor apply) rather than one launch per tensor.
    with torch.no_grad():
        for dtype in {m.dtype for m in metadata}:
            pairs = [(v, t.reshape(-1)) for v, m, (_, t) in zip(dsts, metadata, named_tensors) if m.dtype == dtype]
            internals.foreach_copy_([v for v, _ in pairs], [t for _, t in pairs])
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten_bucket(bucket: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Views (no copies) of every tensor in a bucket; metadata that do not fit the buffer are refused."""
    metadata = bucket["metadata"]
    views = BucketViews(metadata).views(bucket["flattened_tensor"])
    return [(m.name, v.view(m.shape)) for m, v in zip(metadata, views)]


def serialize(obj: Any) -> str:
    """ForkingPickler + base64, as SGLang's MultiprocessingSerializer(output_str=True)."""
    # CPU tensors must be shared by file name, not by fd: the receiver is an unrelated process.
    if torch_mp.get_sharing_strategy() != "file_system":
        torch_mp.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# What a weight payload may contain. Anything else (code objects, arbitrary callables) is refused.
_ALLOWED = {
    ("builtins", "dict"),
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("builtins", "str"),
    ("builtins", "int"),
    ("builtins", "float"),
    ("builtins", "bool"),
    ("builtins", "bytes"),
    ("types", "SimpleNamespace"),
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    ("torch", "Size"),
    ("torch", "dtype"),
    ("torch", "device"),
    ("torch", "Tensor"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
}


class _PayloadUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"weight payload refers to {module}.{name}, which is not allowed")


def deserialize(data: str | bytes) -> Any:
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    return _PayloadUnpickler(io.BytesIO(raw)).load()
