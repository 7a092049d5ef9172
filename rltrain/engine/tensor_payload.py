"""Tensors handed to an engine by handle: SGLang's `flattened_bucket` payload, serialised.

A bucket is one contiguous uint8 buffer plus per-tensor metadata (name, shape, dtype, byte
range) — the layout SGLang's `FlattenedTensorBucket` reconstructs. The metadata are
`types.SimpleNamespace` objects, which SGLang's restricted unpickler accepts, so neither side
needs the other's classes. The payload is pickled with torch's `ForkingPickler`: CUDA tensors
travel as CUDA IPC handles, CPU tensors as shared-memory file names (the `file_system` sharing
strategy; the default fd-passing strategy cannot cross an HTTP request). Only the handle
crosses the wire; the receiver maps the sender's memory and copies from it.

Buffer lifetime: the sender must keep each bucket's buffer alive until the engine has answered
the update request, and must not reuse it for the next bucket while an engine may still read
it — allocate a fresh buffer per bucket.
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


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]], device: torch.device | None = None) -> dict[str, Any]:
    """Copy tensors into one fresh uint8 buffer; returns {"flattened_tensor", "metadata"}."""
    if not named_tensors:
        raise ValueError("cannot build an empty bucket")
    metadata, offset = [], 0
    for name, t in named_tensors:
        offset = -(-offset // ALIGN) * ALIGN
        nbytes = t.numel() * t.element_size()
        metadata.append(types.SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=t.dtype,
                                              start_idx=offset, end_idx=offset + nbytes, numel=nbytes))
        offset += nbytes
    dev = device or named_tensors[0][1].device
    flat = torch.empty(offset, dtype=torch.uint8, device=dev)
    if flat.device.type == "cpu":
        # Filled in shared memory directly: pickling a private buffer would copy it there again
        # (that copy was 3/4 of a CPU sync, measured).
        flat.share_memory_()
    for meta, (_, t) in zip(metadata, named_tensors):
        flat[meta.start_idx : meta.end_idx].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten_bucket(bucket: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Views (no copies) of every tensor in a bucket."""
    flat = bucket["flattened_tensor"]
    out = []
    for m in bucket["metadata"]:
        if m.end_idx > flat.numel() or m.end_idx - m.start_idx != torch.Size(m.shape).numel() * m.dtype.itemsize:
            raise ValueError(f"bucket metadata for {m.name!r} does not fit the buffer ({m.start_idx}:{m.end_idx} of {flat.numel()})")
        out.append((m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)))
    return out


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
