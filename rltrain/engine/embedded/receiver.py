"""The receiving end of every weight transport of the embedded engine, and its checksums.

    receiver = WeightReceiver(writer, state, aliases, dtype)   # held by the engine (engine.py)
    payloads = PayloadReceiver(receiver, device, tp_rank)       # held by its server (server.py)

`WeightReceiver` takes what arrived: named tensors, flattened buckets, a weight directory, or one
payload per TP rank of an engine over several (per-rank checks below); it refuses updates while
the weights are released, copies through writer.py (a bad update changes nothing), marks the
weights loaded (state.py) and reports the checksum of what the engine holds (weights/checksum.py):
inside a weight-update session each bucket's weights are summed as they land (writer.py's
`landed`), so the report at the session's end reads only the weights no bucket of it wrote.

`PayloadReceiver` is the server's half: it opens an /update_weights_from_tensor request's
payloads (CUDA IPC or shared-memory handles, weights/bucket.py) and the tensors of
/update_weights_from_distributed (a weight-update group, runtime/weight_group.py), with this
engine's extensions to SGLang's protocol ("weight_buffer_slots" and "weight_update_sessions" in
/get_server_info): inside a weight-update session the sender's last few buffers stay mapped, and a
buffer's handle is sent once, then its slot number (`_slot`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rltrain.engine.embedded.requests import BadRequest, required, weight_version_of
from rltrain.engine.embedded.state import EngineState
from rltrain.engine.embedded.writer import WeightWriter
from rltrain.runtime.weight_group import close_weight_update_group, open_weight_update_group
from rltrain.weights.bucket import BucketViews, deserialize
from rltrain.weights.checksum import Entry, combine, entries, fetched
from rltrain.weights.names import classify
from rltrain.weights.versions import read_weights

log = logging.getLogger("rltrain.engine.embedded")

BUCKET_PAYLOAD = "a flattened_bucket payload is {'flattened_tensor': uint8 tensor, 'metadata': [...]}"
KEEP_MAPPED = 4  # tensor payload buffers kept mapped during a weight-update session (the sender uses 3)
KEPT_DECODED = 4096  # handle-less payload strings kept decoded


class WeightReceiver:
    """What the engine does with received weights (module doc)."""

    def __init__(self, writer: WeightWriter, state: EngineState, aliases: list[list[str]], dtype: torch.dtype):
        self.writer = writer
        self.layout = writer.layout
        self.state = state
        self.aliases = aliases  # names sharing one storage (tied embeddings): a checkpoint may carry either
        self.dtype = dtype
        self.rank_bytes_loaded = [0] * self.layout.tp_size  # bytes each TP rank's payloads held (updates)
        # The weights this engine owns, by checkpoint name (the layout is fixed); names that share
        # a storage with another are summed afresh in every report (a write of one changes both).
        self.owned = {n: v for n, v in writer.checkpoint_names.items() if self.layout.owns(n)}
        self.shared = {n for group in aliases if len(group) > 1 for n in group}

    def session(self, begin: bool, summing: bool = False) -> None:
        """A weight-update session begins (where `summing`, the weights it writes are summed as
        they land: its end is to report the checksum) or ends (their sums are kept for its
        report, until anything else writes them)."""
        if begin:
            self.writer.forget_landed()
        self.writer.summing = begin and summing

    def load_named_tensors(self, named: Any, weight_version: str | None) -> int:
        with self.state.lock:
            self.state.check_weights_held("updating")
            n = self.writer.copy(named, wait=False)
            self.state.loaded(weight_version)
        # Outside the lock: one request's copy runs while the next one is checked and queued
        # (generation queues behind the copies on the same stream).
        self.writer.wait()
        return n

    def load_bucket(self, flat: torch.Tensor, metadata: list[Any], weight_version: str | None) -> int:
        """A flattened bucket (SGLang's `flattened_bucket`: a uint8 buffer and per-tensor metadata;
        writer.py's `copy_bucket`)."""
        key = self.writer.bucket_key(metadata)
        with self.state.lock:
            self.state.check_weights_held("updating")
            n = self.writer.copy_bucket(key, flat, metadata)
            self.state.loaded(weight_version)
        self.writer.wait()
        return n

    def load_from_disk(self, model_path: str, weight_version: str | None) -> int:
        """Load a weight directory: a published version is checked against its manifest as it is
        read (`"weight_files": "verified"` in /get_server_info), so the trainer need not read it
        first. Nothing is changed unless every file and tensor is good."""
        owns = self.layout.owns
        state = read_weights(Path(model_path))
        state = {n: t for n, t in state.items() if owns(n)}  # an EP rank loads its experts only
        expected = {n for n in self.writer.checkpoint_names if owns(n)}
        covered = set()
        for group in self.aliases:
            if any(n in state for n in group):
                covered |= set(group)
        missing = sorted(n for n in expected - set(state) - covered)
        if missing:
            raise ValueError(f"{model_path}: missing {len(missing)} parameters, e.g. {missing[:5]}")
        with self.state.lock:
            self.state.check_weights_held("updating")
            n = self.writer.copy(state.items())
            self.state.loaded(weight_version)
            self.state.model_path = model_path
            return n

    def load_per_rank(self, entries: list[list[tuple[str, torch.Tensor]]], weight_version: str | None) -> int:
        """One update request of an engine over several TP ranks: entry k is what TP rank k was
        sent. Everything is checked before anything is copied (a bad update changes nothing):
        each rank is sent only weights it holds, at most once; the ranks of one EP rank are sent
        the same names, every rank the same non-expert names; a weight sent to several ranks is
        the same tensor in each. Then each weight is copied once. Returns the tensors copied."""
        layout = self.layout
        if len(entries) != layout.tp_size:
            raise ValueError(f"{len(entries)} per-rank payloads; this engine has {layout.tp_size} TP ranks")
        first: dict[str, torch.Tensor] = {}
        names_of: list[set[str]] = []
        for k, named in enumerate(entries):
            names = [n for n, _ in named]
            mine = set(names)
            if len(mine) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(f"TP rank {k}'s payload carries {twice[:5]} more than once")
            foreign = sorted(n for n in mine if not layout.rank_owns(k, n))
            if foreign:
                raise ValueError(
                    f"TP rank {k} (EP rank {layout.rank_ep[k]} of {layout.ep_size}) was sent experts it does not "
                    f"hold: {foreign[:5]}"
                )
            for n, t in named:
                seen = first.setdefault(n, t)
                if seen is not t and (seen.shape != t.shape or seen.dtype != t.dtype or not torch.equal(seen, t)):
                    raise ValueError(f"TP ranks' copies of {n!r} differ (rank {k}'s is not rank 0's)")
            names_of.append(mine)
        # (each name classified once; at EP 1 every weight is every rank's, whatever its name)
        dense_names = {n for n in first if layout.ep_size <= 1 or classify(n).expert is None}
        dense0 = names_of[0] & dense_names
        for k, mine in enumerate(names_of):
            dense = mine & dense_names
            peer = layout.rank_ep.index(layout.rank_ep[k])  # the first TP rank of k's EP rank
            if dense != dense0 or mine - dense != names_of[peer] - dense0:
                lacks = sorted((dense0 - dense) | (names_of[peer] - mine))
                extra = sorted((dense - dense0) | (mine - names_of[peer]))
                raise ValueError(
                    f"TP rank {k}'s payload differs from its peers': it lacks {lacks[:5]}, and has {extra[:5]} "
                    "that they lack (every rank is sent every non-expert weight of the request, each EP rank's "
                    "ranks the same experts)"
                )
        count = self.load_named_tensors(list(first.items()), weight_version)
        for k, named in enumerate(entries):
            self.rank_bytes_loaded[k] += sum(t.numel() * t.element_size() for _, t in named)
        return count

    @torch.no_grad()
    def checksum(self) -> dict[str, Any]:
        """The checksum (weights/checksum.py) of every weight this engine owns, by checkpoint name."""
        layout, state = self.layout, self.state
        with state.lock:
            state.check_weights_held("checking")
            tensors, landed = self.writer.tensors, self.writer.landed
            fresh = []
            for name, (module_name, index, shape) in self.owned.items():
                if name in landed and name not in self.shared:
                    continue
                t = tensors[module_name]
                fresh.append((name, t if index is None else t.reshape(-1)[index.to(t.device)].reshape(shape)))
            self.writer.side.join()  # (the landed sums are read after their side stream's work)
            on_device = entries(fresh)  # one launch for them all on a GPU
            on_device.update((n, landed[n]) for n in self.owned if n not in on_device)
            sums: dict[str, Entry] = dict(fetched(on_device))  # once: the ranks' checksums combine subsets
            rep: dict[str, Any] = {
                "checksum": combine(sums),
                "count": len(sums),
                "dtype": str(self.dtype).removeprefix("torch."),
                "weight_version": state.weight_version,
                "bytes_loaded": self.writer.bytes_loaded,
                "ep_rank": layout.ep_rank,
                "ep_size": layout.ep_size,
            }
            if layout.tp_size > 1:  # what each TP rank holds: its EP rank's experts and every other weight
                rep["ranks"] = []
                for k in range(layout.tp_size):
                    held = {n: v for n, v in sums.items() if layout.rank_owns(k, n)}
                    rep["ranks"].append(
                        {
                            "tp_rank": k,
                            "ep_rank": layout.rank_ep[k],
                            "checksum": combine(held),
                            "count": len(held),
                            "bytes_loaded": self.rank_bytes_loaded[k],
                        }
                    )
            return rep


class PayloadReceiver:
    """The server's end of the tensor and distributed transports (module doc)."""

    def __init__(self, receiver: WeightReceiver, device: torch.device, tp_rank: int = 0):
        self.receiver = receiver
        self.device = device
        self.tp_rank = tp_rank
        self.tp_size = receiver.layout.tp_size
        self.groups: dict[str, Any] = {}  # weight-update groups joined, by name
        # Inside a weight-update session the last few tensor payloads stay mapped: a sender that
        # refills a few buffers in turn (it may: this engine answers only after its copies are
        # done) is then served from torch's handle cache instead of mapping and unmapping each
        # bucket. At most KEEP_MAPPED of the sender's buffers are held, until the session ends.
        self.in_update = False
        self.mapped: collections.deque[Any] = collections.deque(maxlen=KEEP_MAPPED)
        self.mapped_lock = threading.Lock()
        self.slots: dict[int, torch.Tensor] = {}  # the sender's buffers by slot number (`_slot`)
        self.decoded: dict[str, dict[str, Any]] = {}  # handle-less payloads, decoded (`update_from_tensor`)

    def session(self, begin: bool, summing: bool = False) -> None:
        """Begin or end a weight-update session: either way the sender's buffers kept mapped
        and the slots are let go; where `summing`, the weights' sums are taken as they land
        (`WeightReceiver.session`)."""
        self.in_update = begin
        self.receiver.session(begin, summing)
        with self.mapped_lock:
            self.mapped.clear()  # unmaps the sender's buffers
            self.slots.clear()

    def update_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        """/update_weights_from_tensor's payload for this engine's TP rank, opened and loaded."""
        t0 = time.perf_counter()
        payloads = required(body, "serialized_named_tensors", list)
        if self.tp_size > 1:
            return self._update_per_rank(body, payloads)
        if not 0 <= self.tp_rank < len(payloads):
            raise BadRequest(
                f"serialized_named_tensors has {len(payloads)} entries; this engine is tp rank {self.tp_rank}"
            )
        raw = payloads[self.tp_rank]
        kept = self.decoded.get(raw) if isinstance(raw, str) else None
        if kept is not None:
            data = dict(kept)  # (`_slot` fills in the buffer)
        else:
            try:
                data = deserialize(raw)
            except Exception as err:
                raise BadRequest(f"cannot deserialize the tensor payload: {err}") from None
            if (
                isinstance(data, dict)
                and "buffer" in data
                and data.get("flattened_tensor") is None
                and isinstance(data.get("metadata"), list)
            ):
                # A handle-less payload holds no tensor: the same string every sync, decoded once.
                if len(self.decoded) >= KEPT_DECODED:
                    self.decoded.clear()
                self.decoded[raw] = dict(data)
        t_open = time.perf_counter()
        fmt = body.get("load_format")
        fresh = True
        if fmt == "flattened_bucket":
            if not isinstance(data, dict) or not isinstance(data.get("metadata"), list):
                raise BadRequest(BUCKET_PAYLOAD)
            if "buffer" in data:
                fresh = self._slot(data)
            elif not isinstance(data.get("flattened_tensor"), torch.Tensor):
                raise BadRequest(BUCKET_PAYLOAD)
            named = None
        elif fmt in (None, "direct"):
            named = list(data.items()) if isinstance(data, dict) else list(data)
        else:
            raise BadRequest(f"load_format {fmt!r}: expected flattened_bucket, direct or null")
        t1 = time.perf_counter()
        if named is None:
            n = self.receiver.load_bucket(data["flattened_tensor"], data["metadata"], weight_version_of(body))
        else:
            n = self.receiver.load_named_tensors(named, weight_version_of(body))
        t2 = time.perf_counter()
        if self.in_update and fmt == "flattened_bucket" and "buffer" not in data:
            ptr = data["flattened_tensor"].untyped_storage().data_ptr()
            with self.mapped_lock:
                fresh = all(ptr != d["flattened_tensor"].untyped_storage().data_ptr() for d in self.mapped)
                self.mapped.append(data)
        del named, data  # unmaps the sender's buffer (CUDA IPC) or shared-memory file, unless kept above
        if log.isEnabledFor(logging.DEBUG):
            parts = " ".join(f"{k} {v:.2f}" for k, v in self.receiver.writer.last_update_ms.items())
            log.debug(
                "update_weights_from_tensor: %d tensors, open %.2f ms, unpack %.2f ms, load %.2f ms (%s), free %.2f ms",
                n,
                (t_open - t0) * 1e3,
                (t1 - t0) * 1e3,
                (t2 - t1) * 1e3,
                parts,
                (time.perf_counter() - t2) * 1e3,
            )
        # mapped: whether the sender's buffer had to be mapped (False: a kept mapping was reused).
        return {"success": True, "message": f"loaded {n} tensors", "mapped": fresh}

    def _update_per_rank(self, body: dict[str, Any], payloads: list[Any]) -> dict[str, Any]:
        """An engine over several TP ranks: entry k is TP rank k's payload (as SGLang's TP rank k
        reads it), each a fresh buffer of its own (no buffer slots: every rank's sender builds its
        payload anew per bucket)."""
        tp = self.tp_size
        if len(payloads) != tp:
            raise BadRequest(
                f"serialized_named_tensors has {len(payloads)} entries; this engine has {tp} TP ranks (one each)"
            )
        fmt = body.get("load_format")
        entries = []
        for k, raw in enumerate(payloads):
            try:
                data = deserialize(raw)
            except Exception as err:
                raise BadRequest(f"cannot deserialize TP rank {k}'s tensor payload: {err}") from None
            if fmt == "flattened_bucket":
                if (
                    not isinstance(data, dict)
                    or not isinstance(data.get("metadata"), list)
                    or not isinstance(data.get("flattened_tensor"), torch.Tensor)
                    or "buffer" in data
                ):
                    raise BadRequest(f"TP rank {k}: {BUCKET_PAYLOAD} (buffer slots need a one-rank engine)")
                views = BucketViews(data["metadata"]).views(data["flattened_tensor"])
                entries.append([(m.name, v.view(m.shape)) for m, v in zip(data["metadata"], views)])
            elif fmt in (None, "direct"):
                entries.append(list(data.items()) if isinstance(data, dict) else list(data))
            else:
                raise BadRequest(f"load_format {fmt!r}: expected flattened_bucket, direct or null")
        n = self.receiver.load_per_rank(entries, weight_version_of(body))
        del entries, data  # unmaps the senders' buffers
        return {"success": True, "message": f"loaded {n} tensors", "mapped": True}

    def _slot(self, data: dict[str, Any]) -> bool:
        """The buffer-slot extension (this engine's; `"weight_buffer_slots"` in /get_server_info):
        a sender that refills a few buffers sends each one's handle once per weight-update
        session, with its slot number, and after that the slot number alone. Neither side then
        pays for sharing and opening the handle again on every bucket. Fills `data`'s
        "flattened_tensor"; returns whether the buffer came with this request."""
        slot = data["buffer"]
        if not self.in_update:
            raise BadRequest("buffer slots are kept for a weight-update session: call /begin_weight_update first")
        if not isinstance(slot, int) or not 0 <= slot < KEEP_MAPPED:
            raise BadRequest(f"buffer slot {slot!r}: expected an int in [0, {KEEP_MAPPED})")
        flat = data.get("flattened_tensor")
        with self.mapped_lock:
            if flat is None:
                flat = self.slots.get(slot)
                if flat is None:
                    raise BadRequest(f"buffer slot {slot} has no buffer in this weight-update session; send it first")
                data["flattened_tensor"] = flat
                return False
            if not isinstance(flat, torch.Tensor):
                raise BadRequest(BUCKET_PAYLOAD)
            self.slots[slot] = flat
            return True

    def init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        """/init_weights_update_group: join the trainer's weight-update group."""
        name = _group_name(body)
        if name in self.groups:
            raise BadRequest(f"weight update group {name!r} exists; destroy it first")
        if self.tp_size > 1:
            raise BadRequest(
                f"this engine's {self.tp_size} TP ranks are one process: it cannot join a weight-update "
                "group as each of them; use sync.transport=tensor or disk"
            )
        rank = int(required(body, "rank_offset", int)) + self.tp_rank
        backend = required(body, "backend", str) if "backend" in body else "nccl"
        if backend not in ("nccl", "gloo"):
            raise BadRequest(f"backend={backend!r}: expected nccl or gloo")
        if backend == "nccl" and self.device.type != "cuda":
            raise BadRequest("backend nccl needs a CUDA engine; use gloo on CPU")
        self.groups[name] = open_weight_update_group(
            required(body, "master_address", str),
            int(required(body, "master_port", int)),
            rank,
            int(required(body, "world_size", int)),
            name,
            backend,
        )
        return {"success": True, "message": f"joined {name} as rank {rank}"}

    def update_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        """/update_weights_from_distributed: the named tensors broadcast by the group's rank 0."""
        name = _group_name(body)
        pg = self.groups.get(name)
        if pg is None:
            raise BadRequest(f"no weight update group named {name!r}; call /init_weights_update_group first")
        names = required(body, "names", list)
        dtypes, shapes = required(body, "dtypes", list), required(body, "shapes", list)
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        for k, (n, d, shape) in enumerate(zip(names, dtypes, shapes)):
            if not isinstance(n, str) or not isinstance(d, str) or not isinstance(getattr(torch, d, None), torch.dtype):
                raise BadRequest(f"entry {k}: name {n!r} with dtype {d!r}: expected a name and a torch dtype name")
            if not isinstance(shape, list) or any(type(x) is not int or x < 0 for x in shape):
                raise BadRequest(f"entry {k} ({n}): shape {shape!r} is not a list of sizes")
        dev = self.device
        if body.get("load_format") == "flattened_bucket":
            specs, offset = [], 0
            for n, d, s in zip(names, dtypes, shapes):
                dt = getattr(torch, d)
                size = torch.Size(s).numel() * dt.itemsize
                specs.append((n, dt, s, offset, size))
                offset += size
            flat = torch.empty(offset, dtype=torch.uint8, device=dev)
            dist.broadcast(flat, group=pg, group_src=0)
            named = [(n, flat[o : o + sz].view(dt).reshape(s)) for n, dt, s, o, sz in specs]
        else:
            named = []
            for n, d, s in zip(names, dtypes, shapes):
                t = torch.empty(s, dtype=getattr(torch, d), device=dev)
                dist.broadcast(t, group=pg, group_src=0)
                named.append((n, t))
        count = self.receiver.load_named_tensors(named, weight_version_of(body))
        return {"success": True, "message": f"loaded {count} tensors"}

    def destroy_group(self, body: dict[str, Any]) -> dict[str, Any]:
        """/destroy_weights_update_group: leave the group."""
        name = _group_name(body)
        pg = self.groups.pop(name, None)
        if pg is None:
            raise BadRequest(f"no weight update group named {name!r}")
        close_weight_update_group(pg)
        return {"success": True, "message": f"destroyed {name}"}


def _group_name(body: dict[str, Any]) -> str:
    return required(body, "group_name", str) if "group_name" in body else "weight_update_group"
