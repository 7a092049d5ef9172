"""Weight checksums both sides compute on the device, so a sync can be verified every step.

Per tensor: two integer sums over the tensor's bytes read as int32 words, plain and weighted by
position (1-based), in int64 with wrap-around. Integer addition is associative, so the result
does not depend on the reduction order (GPU or CPU, trainer or engine). The position weight
catches swapped elements. The model checksum hashes (name, dtype, shape, sums) of every tensor
in name order with xxh3. It is a check against lost, stale or mangled updates, not a
cryptographic hash.

Cost: the words are viewed as a (rows, COLS) matrix; each block of rows is widened to int64
once (a bounded temporary, 128 MiB) and reduced along both axes: with i = r * COLS + c,

    sum_i (i + 1) w_i = COLS * sum_r r * rowsum_r + sum_c (c + 1) colsum_c     (mod 2**64)

(torch widens a whole input to the sum's dtype before reducing it unless it is half to float on
a GPU, so reducing the int32 matrix with dtype=int64 directly would copy a 0.6 GB embedding to
1.2 GB.) On a GPU one Triton kernel per tensor reads the words once instead
(kernels/triton_checksum.py): a row of partial sums per block of BLOCK words. Either way a
tensor's sums are rows (plain, weighted) where row b covers the words from b * BLOCK on, its
weighted sum by position inside the row's block (one row of whole-tensor sums is the block at
0). They stay on the device until `combine` needs them: `fold` adds every tensor's rows up in a
few torch ops for all of them together, fetched in one transfer instead of waiting for the
device once per tensor. The tensors `entries` sums in one launch are folded on the device at
once (a `Row` each of the batch's [n, 2] sums): fetching many batches is then one transfer of
their whole-tensor sums, nothing per tensor (a sync's checksums are a batch per bucket).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from rltrain.runtime.memory import host_bytes

COLS = 4096  # int32 words per row of the reduction
ROWS = 4096  # rows widened to int64 at a time: 128 MiB
HOST_WORDS = 1 << 16  # a host tensor up to this many words is summed by numpy (`_host_sums`)
HOST_BLOCK = HOST_WORDS
BLOCK = 65536  # words per row of the GPU kernel's partial sums (bench.checksum: block x chunk x warps)
_POSITIONS = np.arange(1, HOST_BLOCK + 1, dtype=np.int64)


@torch.no_grad()
def _device_sums(t: torch.Tensor) -> torch.Tensor:
    """[rows, 2] int64 partial sums (module doc) of `t`'s bytes as int32 words, on `t`'s device."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    elif flat.storage_offset() % 4:  # a view that starts inside a word: its bytes, copied to read as words
        flat = flat.clone()
    words = flat.view(torch.int32)
    if words.device.type == "cuda":
        from rltrain.kernels.triton_checksum import block_sums  # noqa: PLC0415 - needs Triton: CUDA only

        return block_sums(words, BLOCK)
    if words.numel() <= HOST_WORDS:
        return torch.tensor([_host_sums(host_bytes(words).view(np.int32))], dtype=torch.int64)
    return _torch_sums(words).view(1, 2)


def fold(parts: list[torch.Tensor]) -> torch.Tensor:
    """[len(parts), 2] int64 (plain, weighted) sums of each tensor from its rows of partial sums
    (`_device_sums`, all on one device): weighted = sum_b (b * BLOCK * plain_b + weighted_b),
    with torch's int64 wrap-around."""
    device = parts[0].device
    counts = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)
    first = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)]).to(device)
    return fold_rows(torch.cat(parts), first)


def fold_rows(rows: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """`fold` of tensors whose partial sums are consecutive in `rows` ([R, 2]), tensor i's from
    row first[i] to first[i + 1] (`first` on the rows' device, its last entry R): all on the
    device, nothing waits for it."""
    n = first.numel() - 1
    index = torch.arange(rows.shape[0], dtype=torch.int64, device=rows.device)
    owner = torch.searchsorted(first[1:], index, right=True)
    block = index - first[owner]
    out = torch.zeros(n, 2, dtype=torch.int64, device=rows.device)
    out[:, 0].index_add_(0, owner, rows[:, 0])
    out[:, 1].index_add_(0, owner, block * BLOCK * rows[:, 0] + rows[:, 1])
    return out


@dataclass(frozen=True)
class Row:
    """One tensor's whole-tensor (plain, weighted) sums: row `index` of `batch`, the [n, 2] int64
    sums of the tensors `entries` summed in one launch, on their device until fetched."""

    batch: torch.Tensor
    index: int


def _torch_sums(words: torch.Tensor) -> torch.Tensor:
    """`_device_sums` of int32 `words` by torch ops on their device."""
    rows = words.numel() // COLS
    dev = words.device
    body = words[: rows * COLS].view(rows, COLS)
    row = torch.empty(rows, dtype=torch.int64, device=dev)
    col = torch.zeros(COLS, dtype=torch.int64, device=dev)
    for start in range(0, rows, ROWS):
        block = body[start : start + ROWS].to(torch.int64)
        torch.sum(block, dim=1, out=row[start : start + ROWS])
        col += block.sum(dim=0)
    tail = words[rows * COLS :].to(torch.int64)
    r = torch.arange(rows, dtype=torch.int64, device=dev)
    c = torch.arange(1, COLS + 1, dtype=torch.int64, device=dev)
    p = torch.arange(rows * COLS + 1, rows * COLS + 1 + tail.numel(), dtype=torch.int64, device=dev)
    plain = row.sum() + tail.sum()
    weighted = (r * row).sum() * COLS + (c * col).sum() + (p * tail).sum()
    return torch.stack([plain, weighted])


def _host_sums(words: np.ndarray) -> tuple[int, int]:
    """The same two sums of host memory by numpy, for a small tensor (the ~20 torch calls of the
    device path cost more than its work there). Array sums and dot products wrap in int64 as
    torch's do; the per-block parts are added as Python ints and wrapped once. Blocks of
    HOST_BLOCK words: sum_j (start + j + 1) w_j = start * sum_j w_j + sum_j (j + 1) w_j."""
    plain = weighted = 0
    for start in range(0, words.size, HOST_BLOCK):
        block = words[start : start + HOST_BLOCK].astype(np.int64)
        s = int(block.sum(dtype=np.int64))
        plain += s
        weighted += start * s + int(np.dot(block, _POSITIONS[: block.size]))
    return _wrap(plain), _wrap(weighted)


def _wrap(x: int) -> int:
    """`x` modulo 2**64 as a signed int64."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


Entry = tuple[str, tuple[int, ...], "torch.Tensor | Row | tuple[int, int]"]


def tensor_sums(t: torch.Tensor) -> tuple[int, int]:
    s1, s2 = fold([_device_sums(t)])[0].tolist()
    return s1, s2


def entry(t: torch.Tensor) -> tuple[str, tuple[int, ...], torch.Tensor]:
    """(dtype name, shape, sums): the sums are still on the device (`combine` fetches them)."""
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), _device_sums(t)


def entries(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Entry]:
    """`entry` of every (name, tensor), the same sums: on a GPU, the tensors that are whole
    int32 words in place (contiguous, aligned: every weight of a model, in practice) in one
    kernel launch for all of them (`multi_block_sums`), folded there at once (a `Row` each), the
    rest one by one. What a sync's checksums cost at either end is then the reading of the
    bytes, not a launch per tensor."""
    named = list(named)
    out: dict[str, Entry] = {}
    batched: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        t = t.detach()
        if t.device.type == "cuda" and t.is_contiguous() and t.data_ptr() % 4 == 0 and t.nbytes % 4 == 0:
            batched.setdefault(t.device, []).append((name, t))
    if batched:
        from rltrain.kernels.triton_checksum import multi_block_rows  # noqa: PLC0415 - needs Triton: CUDA only

        for group in batched.values():
            sums = fold_rows(*multi_block_rows([t for _, t in group], BLOCK))
            for i, (name, t) in enumerate(group):
                out[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), Row(sums, i))
    for name, t in named:
        if name not in out:
            out[name] = entry(t)
    return {name: out[name] for name, _ in named}


class SideSums:
    """`entries` queued on a side stream of the tensors' GPU, after what the current stream has
    queued (the copies that wrote them), so the reads run beside the copies that follow instead
    of delaying them. `join` before the sums are fetched. `transient`: the tensors may be freed
    once summed (a sender's exported weights), so their memory is kept from reuse until the side
    stream has read it; the engine's weights live on and need not. Off a GPU: `entries`."""

    def __init__(self, transient: bool):
        self.transient = transient
        self.stream: torch.cuda.Stream | None = None

    def entries(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Entry]:
        named = list(named)
        device = next((t.device for _, t in named if t.device.type == "cuda"), None)
        if device is None:
            return entries(named)
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            if self.transient:
                for _, t in named:
                    if t.device == device:
                        t.record_stream(self.stream)
            return entries(named)

    def join(self) -> None:
        """The current stream waits for every sum queued so far (fetch after this)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def fetched(sums: dict[str, Entry]) -> dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]:
    """`sums` with every entry's sums brought to the host as ints, in one device-to-host transfer
    per device (to combine several subsets, or to send the entries to another process): the
    batches of `Row`s as they are, the other tensors' rows folded together first."""
    batches: dict[int, torch.Tensor] = {}  # id -> [n, 2] whole-tensor sums on a device
    loose: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}  # rows of partial sums, one tensor's each
    for name, (_, _, p) in sums.items():
        if isinstance(p, Row):
            batches.setdefault(id(p.batch), p.batch)
        elif isinstance(p, torch.Tensor):
            loose.setdefault(p.device, []).append((name, p))
    folded = {device: fold([t for _, t in group]) for device, group in loose.items()}
    for t in folded.values():
        batches[id(t)] = t
    on: dict[torch.device, list[torch.Tensor]] = {}
    for t in batches.values():
        on.setdefault(t.device, []).append(t)
    ints: dict[int, list[list[int]]] = {}  # id of a batch -> its rows as ints
    for tensors in on.values():
        host = torch.cat(tensors).tolist()  # one transfer per device
        start = 0
        for t in tensors:
            ints[id(t)] = host[start : start + t.shape[0]]
            start += t.shape[0]
    row_of: dict[str, list[int]] = {}
    for device, group in loose.items():
        row_of.update((name, r) for (name, _), r in zip(group, ints[id(folded[device])]))
    out = {}
    for n, (d, s, p) in sums.items():
        pair = ints[id(p.batch)][p.index] if isinstance(p, Row) else row_of[n] if isinstance(p, torch.Tensor) else p
        out[n] = (d, tuple(s), (int(pair[0]), int(pair[1])))
    return out


def combine(sums: dict[str, Entry]) -> str:
    """name -> `entry` (or an entry whose sums are already ints) to one hex digest."""
    h = xxhash.xxh3_128()
    host = fetched(sums)
    for name in sorted(host):
        dtype, shape, (s1, s2) = host[name]
        h.update(f"{name}|{dtype}|{list(shape)}|{s1}|{s2}\n".encode())
    return h.hexdigest()


def checksum(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> str:
    """Checksum of (name, tensor) pairs, each cast to `dtype` first (the receiver's dtype)."""
    return combine(dict(entries((n, t if dtype is None else t.to(dtype)) for n, t in named)))


class WeightMismatchError(RuntimeError):
    """The engine's weights after a sync differ from the trainer's."""
