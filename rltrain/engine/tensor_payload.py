"""Tensors handed to an engine by handle: SGLang's `flattened_bucket` payload, serialised.

A bucket is one contiguous uint8 buffer plus per-tensor metadata (name, shape, dtype, byte
range) — the layout SGLang's `FlattenedTensorBucket` reconstructs. The metadata are
`types.SimpleNamespace` objects, which SGLang's restricted unpickler accepts, so neither side
needs the other's classes. The payload is pickled with torch's `ForkingPickler`: CUDA tensors
travel as CUDA IPC handles, CPU tensors as shared-memory file names (the `file_system` sharing
strategy; the default fd-passing strategy cannot cross an HTTP request). Only the handle
crosses the wire; the receiver maps the sender's memory and copies from it.

Buffer lifetime: the sender must keep each bucket's buffer alive until the engine has answered
the update request. SGLang answers before its copies out of the buffer have run, so against it
every bucket needs a fresh buffer. The embedded engine answers after its copies are done
(`"weight_updates": "synchronous"` in /get_server_info), so a sender may refill a buffer once
the request that used it has returned.
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

ALIGN = 16  # bytes; every tensor starts aligned so `.view(dtype)` works for any dtype


def bucket_layout(named_tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[types.SimpleNamespace], int]:
    """Per-tensor metadata (byte ranges, each start aligned) and the bucket's size in bytes."""
    if not named_tensors:
        raise ValueError("cannot build an empty bucket")
    metadata, offset = [], 0
    for name, t in named_tensors:
        offset = -(-offset // ALIGN) * ALIGN
        nbytes = t.numel() * t.element_size()
        metadata.append(types.SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=t.dtype,
                                              start_idx=offset, end_idx=offset + nbytes, numel=nbytes))
        offset += nbytes
    return metadata, offset


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None,
                   layout: tuple[list[types.SimpleNamespace], int] | None = None) -> dict[str, Any]:
    """Copy tensors into one uint8 buffer; returns {"flattened_tensor", "metadata"}.

    The buffer is fresh (on the tensors' device), or the front of `out` (uint8, on the tensors' device, large enough;
    on CPU in shared memory) for a sender that reuses buffers: only against an engine that
    answers after its copies are done (the embedded engine; SGLang does not). `layout`: the
    tensors' `bucket_layout`, when the caller has it already."""
    metadata, size = layout or bucket_layout(named_tensors)
    if out is None:
        flat = torch.empty(size, dtype=torch.uint8, device=named_tensors[0][1].device)
        if flat.device.type == "cpu":
            # Filled in shared memory directly: pickling a private buffer would copy it there again
            # (that copy was 3/4 of a CPU sync, measured).
            flat.share_memory_()
    else:
        if out.dtype != torch.uint8 or out.numel() < size:
            raise ValueError(f"buffer of {out.numel()} {out.dtype} elements cannot hold a bucket of {size} bytes")
        flat = out[:size]
    views = _views(flat, metadata)
    # One fused copy per dtype on CUDA (multi-tensor apply) rather than one launch per tensor.
    for dtype in {m.dtype for m in metadata}:
        pairs = [(v, t.detach()) for v, m, (_, t) in zip(views, metadata, named_tensors) if m.dtype == dtype]
        torch._foreach_copy_([v for v, _ in pairs], [t for _, t in pairs])
    return {"flattened_tensor": flat, "metadata": metadata}


def _views(flat: torch.Tensor, metadata: list[Any]) -> list[torch.Tensor]:
    """A contiguous view of the buffer per tensor: one `as_strided` each on a per-dtype view
    (a quarter of the cost of slice + view + reshape, measured)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for m in metadata:
        size = m.dtype.itemsize
        if m.start_idx % size or m.end_idx > flat.numel() or m.start_idx < 0 \
                or m.end_idx - m.start_idx != torch.Size(m.shape).numel() * size:
            raise ValueError(f"bucket metadata for {m.name!r} does not fit the buffer ({m.start_idx}:{m.end_idx} of "
                             f"{flat.numel()} bytes, {m.dtype} {tuple(m.shape)})")
        base = typed.get(m.dtype)
        if base is None:
            base = typed[m.dtype] = flat[: flat.numel() - flat.numel() % size].view(m.dtype)
        stride, step = [], 1
        for dim in reversed(m.shape):
            stride.append(step)
            step *= dim
        out.append(base.as_strided(m.shape, stride[::-1], m.start_idx // size))
    return out


def unflatten_bucket(bucket: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Views (no copies) of every tensor in a bucket; metadata that do not fit the buffer are refused."""
    metadata = bucket["metadata"]
    return [(m.name, v) for m, v in zip(metadata, _views(bucket["flattened_tensor"], metadata))]


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
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "str"),
    ("builtins", "int"), ("builtins", "float"), ("builtins", "bool"), ("builtins", "bytes"),
    ("types", "SimpleNamespace"), ("collections", "OrderedDict"), ("copyreg", "__newobj__"),
    ("torch", "Size"), ("torch", "dtype"), ("torch", "device"), ("torch", "Tensor"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
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
