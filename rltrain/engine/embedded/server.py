"""HTTP front of the embedded engine: SGLang's native endpoints over the standard library server.

    python -m rltrain.engine.embedded --model-path DIR --port 30000 [--device cuda] [--dtype bfloat16]

Each HTTP request runs in its own thread; generation requests are queued to the engine's
scheduler, so concurrent clients are batched together and each gets exactly its own results.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import gc
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from rltrain.engine.embedded.engine import EmbeddedEngine, EngineStateError
from rltrain.engine.embedded.requests import LOGPROB_FORMATS, BadRequest, Limits, parse_generate
from rltrain.generation import SamplingParams
from rltrain.runtime.weight_group import close_weight_update_group, open_weight_update_group
from rltrain.weights.bucket import BucketViews, deserialize

log = logging.getLogger("rltrain.engine.embedded")


BUCKET_PAYLOAD = "a flattened_bucket payload is {'flattened_tensor': uint8 tensor, 'metadata': [...]}"
KEEP_MAPPED = 4  # tensor payload buffers kept mapped during a weight-update session (the sender uses 3)


class EmbeddedServer:
    """Routes SGLang endpoints to a `EmbeddedEngine`."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        tp_rank: int = 0,
        weights_roots: list[str] | tuple[str, ...] = (),
        api_key: str = "",
    ):
        self.engine = engine
        self.tp_rank = tp_rank
        # Weight versions load only from these directories (and the engine's own model); none
        # given: from anywhere (a standalone server).
        self.weights_roots = [Path(r).resolve() for r in weights_roots]
        if self.weights_roots:
            self.weights_roots.append(Path(engine.model_path).resolve())
        self.api_key = api_key
        self.groups: dict[str, Any] = {}
        self.group_ranks: dict[str, int] = {}
        self.started = time.time()
        # Inside a weight-update session the last few tensor payloads stay mapped: a sender that
        # refills a few buffers in turn (it may: this engine answers only after its copies are
        # done) is then served from torch's handle cache instead of mapping and unmapping each
        # bucket. At most KEEP_MAPPED of the sender's buffers are held, until the session ends.
        self.in_update = False
        self.mapped: collections.deque[Any] = collections.deque(maxlen=KEEP_MAPPED)
        self.mapped_lock = threading.Lock()
        self.slots: dict[int, torch.Tensor] = {}  # the sender's buffers by slot number (`_slot`)
        self.decoded: dict[str, dict[str, Any]] = {}  # handle-less payloads, decoded (`_update_from_tensor`)

    # ------------------------------------------------------------------ endpoints

    def get(self, path: str) -> tuple[int, Any]:
        if path in ("/health", "/ready"):
            return 200, None
        if path == "/health_generate":
            fut = self.engine.submit([[0]], SamplingParams(max_new_tokens=1, temperature=0.0), False)
            fut.result(timeout=60)
            return 200, None
        if path in ("/model_info", "/get_model_info"):
            return 200, {
                "model_path": self.engine.model_path,
                "weight_version": self.engine.weight_version,
                "is_generation": True,
                "engine": "rltrain.embedded",
                "architectures": getattr(self.engine.config, "architectures", None),
            }
        if path in ("/server_info", "/get_server_info"):
            return 200, {
                "engine": "rltrain.embedded",
                "device": str(self.engine.device),
                "dtype": str(self.engine.dtype),
                "max_batch_size": self.engine.max_batch_size,
                "context_length": self.engine.context_length,
                "weight_version": self.engine.weight_version,
                # Update requests answer after every copy out of the sender's buffers is done.
                "weight_updates": "synchronous",
                # A buffer's handle is sent once per weight-update session, then its slot (`_slot`).
                "weight_buffer_slots": KEEP_MAPPED,
                # A tensor update may open and close the weight-update session itself, and a
                # session's end may score a probe sequence (`_update_in_session`).
                "weight_update_sessions": "inline",
                # /generate's log-probs as SGLang gives them, or as a list of values (requests.py).
                "logprob_formats": list(LOGPROB_FORMATS),
                # A published disk version's files are checked against its manifest on load.
                "weight_files": "verified",
                # Its parallel layout, in SGLang's field names (the sync's router reads them). One
                # process on one device: with --tp-size it takes SGLang's per-TP-rank payloads
                # (experts split over --ep-size of its ranks); with --ep-size alone it is EP rank
                # ep_rank of a group of engines.
                "tp_size": self.engine.tp_size,
                "dp_size": 1,
                "ep_size": self.engine.ep_size,
                "ep_rank": self.engine.ep_rank if self.engine.ep_size > 1 and self.engine.tp_size == 1 else None,
                "enable_eplb": False,
                "ep_num_redundant_experts": 0,
                "moe_a2a_backend": "none",
                # SGLang's flag: weights, KV cache and graphs' memory released and resumed at the
                # same addresses (saver.py)
                "enable_memory_saver": self.engine.saver is not None,
                # The paged path's counts since start-up: prefills, decode steps, graph captures
                # and their seconds, tokens (None: the plain transformers path)
                "decode_stats": dict(self.engine.decoder.stats) if self.engine.decoder is not None else None,
            }
        if path == "/memory":
            return 200, self.engine.memory_report()
        if path == "/weights_checksum":
            return 200, self.engine.weights_checksum()
        if path == "/flush_cache":
            return 200, "Cache flushed."
        return 404, {"error": {"message": f"unknown endpoint GET {path}"}}

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        e = self.engine
        if path == "/generate":
            return 200, self._generate(body)
        if path == "/release_memory_occupation":
            return 200, e.release(_tags(body))
        if path == "/resume_memory_occupation":
            return 200, e.resume(_tags(body))
        if path == "/update_weights_from_disk":
            n = e.load_from_disk(self._allowed(_need(body, "model_path", str)), _version(body))
            return 200, {"success": True, "message": f"loaded {n} tensors", "num_paused_requests": 0}
        if path == "/update_weights_from_tensor":
            return 200, self._update_in_session(body)
        if path == "/init_weights_update_group":
            return 200, self._init_group(body)
        if path == "/update_weights_from_distributed":
            return 200, self._update_from_distributed(body)
        if path == "/destroy_weights_update_group":
            name = _group_name(body)
            pg = self.groups.pop(name, None)
            if pg is None:
                raise BadRequest(f"no weight update group named {name!r}")
            close_weight_update_group(pg)
            return 200, {"success": True, "message": f"destroyed {name}"}
        if path == "/pause_generation":
            e.pause(_need(body, "mode", str) if "mode" in body else "abort")
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            e.resume_generation()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/flush_cache":
            return 200, "Cache flushed."  # no prefix cache to flush
        if path == "/update_weight_version":
            e.weight_version = str(_need(body, "new_version", str))
            return 200, {
                "success": True,
                "message": f"Weight version updated to {e.weight_version}",
                "new_version": e.weight_version,
            }
        if path == "/begin_weight_update":
            self._session(True)
            return 200, {"success": True, "message": "no quantized weights to repack"}
        if path == "/end_weight_update":
            report, probe = self._end_fields(body)
            self._session(False)
            return 200, {"success": True, "message": "no quantized weights to repack", **self._ended(report, probe)}
        return 404, {"error": {"message": f"unknown endpoint POST {path}"}}

    def _allowed(self, model_path: str) -> str:
        """`model_path` if it lies inside a weights root once symlinks and `..` are resolved."""
        if not self.weights_roots:
            return model_path
        real = Path(model_path).resolve()
        if not any(real == root or root in real.parents for root in self.weights_roots):
            raise BadRequest(
                f"model_path {model_path!r} is outside the directories this engine loads weights from "
                f"({', '.join(str(r) for r in self.weights_roots)})"
            )
        return str(real)

    def authorized(self, header: str | None) -> bool:
        return not self.api_key or hmac.compare_digest(header or "", f"Bearer {self.api_key}")

    def _generate(self, body: dict[str, Any]) -> Any:
        """SGLang's /generate, every field checked before anything is queued (`requests.py`)."""
        e = self.engine
        req = parse_generate(body, Limits(e.config.vocab_size, e.context_length, e.max_batch_size))
        samples = e.submit(req.prompts, req.params, req.return_logprob, req.ids, req.logprob_values).result()
        if req.return_logprob and req.logprob_start_len >= 0:
            # SGLang's input_token_logprobs: from logprob_start_len on, untempered, the first of
            # them without a log-prob (as SGLang answers, whatever the start).
            for k, prompt in enumerate(req.prompts):
                scored = [None, *e.score(prompt)]
                entries = [[lp, t, None] for lp, t in zip(scored, prompt)][req.logprob_start_len :]
                if entries:
                    entries[0][0] = None
                for sample in samples[k * req.n : (k + 1) * req.n]:
                    sample["meta_info"]["input_token_logprobs"] = entries
        return samples[0] if req.single else samples

    def _session(self, begin: bool) -> None:
        """Begin or end a weight-update session: either way the sender's buffers kept mapped
        and the slots are let go."""
        self.in_update = begin
        with self.mapped_lock:
            self.mapped.clear()  # unmaps the sender's buffers
            self.slots.clear()

    def _end_fields(self, body: dict[str, Any]) -> tuple[bool, list[int] | None]:
        """What a session's end is asked to report (this engine's extension, the sync's checks
        without requests of their own): `weights_checksum` (true: the /weights_checksum report)
        and `probe_input_ids` (a sequence to score, as /generate's input_token_logprobs,
        once the session's weights are in). Checked before anything is loaded or ended."""
        report = body.get("weights_checksum", False)
        if not isinstance(report, bool):
            raise BadRequest(f"weights_checksum must be true or false, got {report!r}")
        probe = body.get("probe_input_ids")
        if probe is not None:
            vocab = self.engine.config.vocab_size
            if (
                not isinstance(probe, list)
                or len(probe) < 2
                or any(type(t) is not int or not 0 <= t < vocab for t in probe)
            ):
                raise BadRequest(
                    f"probe_input_ids: expected a list of at least 2 token ids in [0, {vocab}), got {str(probe)[:80]}"
                )
            if len(probe) > self.engine.context_length:
                raise BadRequest(f"probe_input_ids: {len(probe)} tokens exceed the context length")
        return report, probe

    def _ended(self, report: bool, probe: list[int] | None) -> dict[str, Any]:
        """The end-of-session reports asked for: the checksum report, and the probe's log-probs
        of tokens 1.. (or why the engine could not score it: `probe_error`)."""
        out: dict[str, Any] = {}
        if report:
            out["weights_checksum"] = self.engine.weights_checksum()
        if probe is not None:
            try:
                out["probe_logprobs"] = self.engine.score(probe)
            except (EngineStateError, RuntimeError) as err:
                out["probe_error"] = f"{type(err).__name__}: {err}"
        return out

    def _update_in_session(self, body: dict[str, Any]) -> dict[str, Any]:
        """/update_weights_from_tensor, which may open the weight-update session first
        (`begin_weight_update: true`) and close it after (`end_weight_update: true`, with what
        /end_weight_update reports): this engine's extension ("weight_update_sessions": "inline"
        in /server_info), a one-bucket sync in one request. A session asked to close is closed
        whether or not the bucket loaded (its buffers unmapped); a bad field changes nothing."""
        begin, end = (body.get(k, False) for k in ("begin_weight_update", "end_weight_update"))
        if not isinstance(begin, bool) or not isinstance(end, bool):
            raise BadRequest(f"begin_weight_update and end_weight_update must be true or false, got {begin!r}, {end!r}")
        report, probe = self._end_fields(body) if end else (False, None)
        if begin:
            self._session(True)
        try:
            out = self._update_from_tensor(body)
        finally:
            if end:
                self._session(False)
        return {**out, **self._ended(report, probe)} if end else out

    def _update_from_tensor(self, body: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        payloads = _need(body, "serialized_named_tensors", list)
        if self.engine.tp_size > 1:
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
                if len(self.decoded) >= 4096:
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
            n = self.engine.load_bucket(data["flattened_tensor"], data["metadata"], _version(body))
        else:
            n = self.engine.load_named_tensors(named, _version(body))
        t2 = time.perf_counter()
        if self.in_update and fmt == "flattened_bucket" and "buffer" not in data:
            ptr = data["flattened_tensor"].untyped_storage().data_ptr()
            with self.mapped_lock:
                fresh = all(ptr != d["flattened_tensor"].untyped_storage().data_ptr() for d in self.mapped)
                self.mapped.append(data)
        del named, data  # unmaps the sender's buffer (CUDA IPC) or shared-memory file, unless kept above
        if log.isEnabledFor(logging.DEBUG):
            parts = " ".join(f"{k} {v:.2f}" for k, v in self.engine.last_update_ms.items())
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
        tp = self.engine.tp_size
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
        n = self.engine.load_per_rank(entries, _version(body))
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

    def _init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        name = _group_name(body)
        if name in self.groups:
            raise BadRequest(f"weight update group {name!r} exists; destroy it first")
        if self.engine.tp_size > 1:
            raise BadRequest(
                f"this engine's {self.engine.tp_size} TP ranks are one process: it cannot join a weight-update "
                "group as each of them; use sync.transport=tensor or disk"
            )
        rank = int(_need(body, "rank_offset", int)) + self.tp_rank
        backend = _need(body, "backend", str) if "backend" in body else "nccl"
        if backend not in ("nccl", "gloo"):
            raise BadRequest(f"backend={backend!r}: expected nccl or gloo")
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise BadRequest("backend nccl needs a CUDA engine; use gloo on CPU")
        self.groups[name] = open_weight_update_group(
            _need(body, "master_address", str),
            int(_need(body, "master_port", int)),
            rank,
            int(_need(body, "world_size", int)),
            name,
            backend,
        )
        return {"success": True, "message": f"joined {name} as rank {rank}"}

    def _update_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:

        name = _group_name(body)
        pg = self.groups.get(name)
        if pg is None:
            raise BadRequest(f"no weight update group named {name!r}; call /init_weights_update_group first")
        names, dtypes, shapes = _need(body, "names", list), _need(body, "dtypes", list), _need(body, "shapes", list)
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        for k, (n, d, shape) in enumerate(zip(names, dtypes, shapes)):
            if not isinstance(n, str) or not isinstance(d, str) or not isinstance(getattr(torch, d, None), torch.dtype):
                raise BadRequest(f"entry {k}: name {n!r} with dtype {d!r}: expected a name and a torch dtype name")
            if not isinstance(shape, list) or any(type(x) is not int or x < 0 for x in shape):
                raise BadRequest(f"entry {k} ({n}): shape {shape!r} is not a list of sizes")
        dev = self.engine.device
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
        count = self.engine.load_named_tensors(named, _version(body))
        return {"success": True, "message": f"loaded {count} tensors"}


def dumps(payload: Any) -> bytes:
    """JSON of an answer: orjson (~15x json's speed on a rollout's answer of 512 x 256 tokens with
    log-probs, where the encoding is on the request's critical path), json where orjson refuses
    (integers past 64 bits)."""
    try:
        return orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(payload).encode()


def _version(body: dict[str, Any]) -> str | None:
    """The request's weight_version: a string, or absent (the engine's stays)."""
    v = body.get("weight_version")
    if v is not None and not isinstance(v, str):
        raise BadRequest(f"weight_version={v!r}: expected a string")
    return v


def _tags(body: dict[str, Any]) -> list[str] | None:
    tags = body.get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
        raise BadRequest(f"tags={tags!r}: expected a list of memory regions (weights, kv_cache, cuda_graph)")
    return tags


def _group_name(body: dict[str, Any]) -> str:
    return _need(body, "group_name", str) if "group_name" in body else "weight_update_group"


def _need(body: dict[str, Any], key: str, kind: type) -> Any:
    if key not in body:
        raise BadRequest(f"{key} is required")
    v = body[key]
    if kind is int and isinstance(v, (int, str)) and str(v).lstrip("-").isdigit():
        return int(v)
    if not isinstance(v, kind):
        raise BadRequest(f"{key}: expected {kind.__name__}, got {type(v).__name__}")
    return v


MAX_BODY_BYTES = 256 << 20  # a weight-update request carries handles and names, not tensors: far below this
READ_TIMEOUT_S = 60.0  # a client that stops sending mid-request is dropped (its thread freed) after this
BACKLOG = 1024  # pending connections the kernel queues (the standard library's 5 reset a burst of clients)


class HTTPError(Exception):
    """A request the server cannot read (framing): answered with `status` and the connection closed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EngineHTTPServer(ThreadingHTTPServer):
    """A thread per connection, daemon threads, a listen backlog sized for many clients at once."""

    daemon_threads = True
    request_queue_size = BACKLOG


def make_handler(server: EmbeddedServer, max_body: int = MAX_BODY_BYTES) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body leave in two writes; with Nagle's algorithm the body then waits for
        # the client's delayed ACK on every keep-alive request (every sync bucket).
        disable_nagle_algorithm = True
        timeout = READ_TIMEOUT_S  # on the socket: reads and writes, not the engine's work

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, payload: Any) -> None:
            if payload is None:
                data, ctype = b"", "text/plain"
            elif isinstance(payload, str):
                data, ctype = payload.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = dumps(payload), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            """The request body, framed by Content-Length or chunked, at most `max_body` bytes;
            `HTTPError` otherwise (the connection is then closed: where the next request starts
            in the stream is unknown)."""
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                return self._chunked()
            text = self.headers.get("Content-Length")
            if text is None:
                return b""
            text = text.strip()
            if not text.isdigit():
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"Content-Length {text[:40]!r} is not a byte count")
            length = int(text)
            if length > max_body:
                raise HTTPError(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"request body of {length} bytes; this server takes at most {max_body} (--max-body-mb)",
                )
            data = self.rfile.read(length)
            if len(data) != length:
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"request body ended after {len(data)} of {length} bytes")
            return data

        def _chunked(self) -> bytes:
            parts, total = [], 0
            while True:
                size_text = self.rfile.readline(1024).strip().split(b";", 1)[0]
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise HTTPError(HTTPStatus.BAD_REQUEST, f"bad chunk size {size_text[:20]!r}") from None
                if size < 0:
                    raise HTTPError(HTTPStatus.BAD_REQUEST, f"negative chunk size {size}")
                if total + size > max_body:
                    raise HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"chunked body over {max_body} bytes")
                if size == 0:
                    while self.rfile.readline(1024).strip():  # trailers, up to the blank line
                        pass
                    return b"".join(parts)
                chunk = self.rfile.read(size)
                if len(chunk) != size or self.rfile.readline(1024).strip():
                    raise HTTPError(HTTPStatus.BAD_REQUEST, "a chunk ended before its size, or without CRLF")
                parts.append(chunk)
                total += size

        def _dispatch(self, method: str) -> None:
            t0 = time.perf_counter()
            path = self.path.split("?", 1)[0]
            try:
                raw = self._body() if method != "GET" else b""
            except (HTTPError, OSError) as err:  # (a socket timeout is an OSError)
                self.close_connection = True
                status = err.status if isinstance(err, HTTPError) else int(HTTPStatus.REQUEST_TIMEOUT)
                msg = str(err) or "the request body did not arrive in time"
                self._send(int(status), {"success": False, "message": msg, "error": {"message": msg}})
                return
            if not server.authorized(self.headers.get("Authorization")):
                msg = "missing or wrong API key: send Authorization: Bearer <engine.api_key>"
                self._send(int(HTTPStatus.UNAUTHORIZED), {"success": False, "message": msg, "error": {"message": msg}})
                return
            try:
                if method == "GET":
                    status, payload = server.get(path)
                else:
                    try:
                        body = json.loads(raw) if raw.strip() else {}
                    except (json.JSONDecodeError, UnicodeDecodeError) as err:
                        raise BadRequest(f"request body is not JSON: {err}") from None
                    if not isinstance(body, dict):
                        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
                    status, payload = server.post(path, body)
            except (BadRequest, EngineStateError, ValueError, KeyError, FileNotFoundError) as err:
                msg = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
                status, payload = (
                    HTTPStatus.BAD_REQUEST,
                    {"success": False, "message": msg, "error": {"message": msg, "type": type(err).__name__}},
                )
            except Exception as err:  # noqa: BLE001 - the client gets the reason, the log the trace
                log.error("%s %s failed:\n%s", method, path, traceback.format_exc())
                msg = f"{type(err).__name__}: {err}"
                status, payload = (
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    {"success": False, "message": msg, "error": {"message": msg}},
                )
            self._send(int(status), payload)
            log.debug("%s %s handled in %.2f ms", method, path, (time.perf_counter() - t0) * 1e3)

        def do_GET(self) -> None:  # noqa: N802
            self._dispatch("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch("POST")

        do_PUT = do_POST

    return Handler


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent (the rank that launched us) is gone — a second guard next to PDEATHSIG."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            log.error("parent process %d is gone; shutting down", parent_pid)
            os._exit(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rltrain.engine.embedded",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="run each request as its own batch, so results do not depend on what else is queued",
    )
    ap.add_argument(
        "--ep-size", type=int, default=1, help="expert ownership: this engine holds experts of rank --ep-rank"
    )
    ap.add_argument("--ep-rank", type=int, default=0)
    ap.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="take SGLang's per-TP-rank weight payloads for this many TP ranks (one process, one device; "
        "with --ep-size, experts split over the ranks as SGLang splits them)",
    )
    ap.add_argument("--backup-dir", default=None, help="where released weights are backed up on CPU")
    ap.add_argument(
        "--weights-backup",
        action="store_true",
        help="keep released weights in host memory and restore them on resume (default: discard them, "
        "as SGLang does without --enable-weights-cpu-backup: garbage until updated)",
    )
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    ap.add_argument(
        "--weights-root",
        action="append",
        default=[],
        help="load weight versions only from inside this directory (repeatable; none: anywhere)",
    )
    ap.add_argument(
        "--context-length",
        type=int,
        default=0,
        help="prompt + new tokens per sequence (SGLang's flag; 0: the model config's own)",
    )
    ap.add_argument(
        "--decode",
        default="auto",
        choices=["auto", "paged", "hf"],
        help="paged: paged KV cache, CUDA graphs, continuous batching; hf: transformers' own cache, a batch at "
        "a time; auto: paged on CUDA where the model passes its start-up probe, else hf",
    )
    ap.add_argument(
        "--max-total-tokens", type=int, default=0, help="tokens in the paged KV cache (0: from --mem-fraction-static)"
    )
    ap.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.8,
        help="share of the GPU for weights + paged KV cache, as SGLang's flag",
    )
    ap.add_argument("--disable-cuda-graph", action="store_true", help="paged decode without CUDA graphs")
    ap.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="paged decode with the transformer blocks torch.compiled (as SGLang's flag; compiles at start-up)",
    )
    ap.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="CUDA: weights, KV cache and graphs' memory through torch_memory_saver (SGLang's flag): released "
        "and resumed at the same addresses, so captured graphs are kept (saver.py)",
    )
    ap.add_argument("--max-body-mb", type=int, default=MAX_BODY_BYTES >> 20, help="largest request body taken")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    faulthandler.enable()  # a crash in native code (CUDA, a driver) leaves its Python stack in the log
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s embedded-engine %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    torch.set_num_threads(max(1, int(os.environ.get("RLTRAIN_ENGINE_THREADS", torch.get_num_threads()))))

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    engine = EmbeddedEngine(
        args.model_path,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
        backup_dir=args.backup_dir,
        weights_backup=args.weights_backup,
        deterministic=args.deterministic,
        ep_size=args.ep_size,
        ep_rank=args.ep_rank,
        tp_size=args.tp_size,
        context_length=args.context_length,
        decode=args.decode,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        cuda_graphs=not args.disable_cuda_graph,
        compile=args.enable_torch_compile,
        memory_saver=args.enable_memory_saver,
    )
    api_key = os.environ.pop("RLTRAIN_ENGINE_API_KEY", "")  # every endpoint needs it when set
    httpd = EngineHTTPServer(
        (args.host, args.port),
        make_handler(EmbeddedServer(engine, weights_roots=args.weights_root, api_key=api_key), args.max_body_mb << 20),
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        # Started by rltrain's launcher SIGTERM is ignored (the job's stop signal is for its
        # ranks, which stop this server with SIGINT): kept so.
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda *_: threading.Thread(target=httpd.shutdown, daemon=True).start())
    log.info(
        "serving %s on http://%s:%d (%s, %s) after %.1fs",
        args.model_path,
        args.host,
        httpd.server_address[1],
        engine.device,
        engine.dtype,
        time.perf_counter() - t0,
    )
    gc.freeze()  # (the model's and the libraries' objects: no full collection walks them again)
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        engine.shutdown()
        httpd.server_close()
    return 0
