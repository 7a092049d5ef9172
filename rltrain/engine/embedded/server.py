"""HTTP routes of the embedded engine: SGLang's native endpoints, each answered by its engine.

    server = EmbeddedServer(engine, weights_roots=[...], api_key=...)
    status, payload = server.post("/generate", body)     # or server.get("/get_server_info")

main.py serves it with http.py (framing: bodies, status codes, the API key header). Each HTTP
request runs in its own thread; generation requests are queued to the engine's scheduler, so
concurrent clients are batched together and each gets exactly its own results. Weight updates
over tensor payloads and weight-update groups are opened by receiver.py's `PayloadReceiver`.
"""

from __future__ import annotations

import hmac
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rltrain.engine.embedded.engine import EmbeddedEngine
from rltrain.engine.embedded.receiver import KEEP_MAPPED, PayloadReceiver
from rltrain.engine.embedded.requests import (
    LOGPROB_FORMATS,
    BadRequest,
    Limits,
    parse_generate,
    required,
    weight_version_of,
)
from rltrain.engine.embedded.state import EngineStateError
from rltrain.generation import SamplingParams
from rltrain.runtime.memory import allocator_counts


def key_matches(api_key: str, header: str | None) -> bool:
    """Whether an Authorization header carries the engine's API key (any header, where it has none)."""
    return not api_key or hmac.compare_digest(header or "", f"Bearer {api_key}")


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
        # Weight versions load only from these directories (and the engine's own model); none
        # given: from anywhere (a standalone server).
        self.weights_roots = [Path(r).resolve() for r in weights_roots]
        if self.weights_roots:
            self.weights_roots.append(Path(engine.model_path).resolve())
        self.api_key = api_key
        self.payloads = PayloadReceiver(engine.receiver, engine.device, tp_rank)

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
            return 200, self._server_info()
        if path == "/memory":
            return 200, self.engine.memory_report()
        if path == "/weights_checksum":
            return 200, self.engine.weights_checksum()
        if path == "/flush_cache":
            self.engine.flush_cache()
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
            n = e.load_from_disk(self._allowed(required(body, "model_path", str)), weight_version_of(body))
            return 200, {"success": True, "message": f"loaded {n} tensors", "num_paused_requests": 0}
        if path == "/update_weights_from_tensor":
            return 200, self._update_in_session(body)
        if path == "/init_weights_update_group":
            return 200, self.payloads.init_group(body)
        if path == "/update_weights_from_distributed":
            return 200, self.payloads.update_from_distributed(body)
        if path == "/destroy_weights_update_group":
            return 200, self.payloads.destroy_group(body)
        if path == "/pause_generation":
            e.pause(required(body, "mode", str) if "mode" in body else "abort")
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            e.resume_generation()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/flush_cache":
            e.flush_cache()
            return 200, "Cache flushed."
        if path == "/update_weight_version":
            e.weight_version = str(required(body, "new_version", str))
            return 200, {
                "success": True,
                "message": f"Weight version updated to {e.weight_version}",
                "new_version": e.weight_version,
            }
        if path == "/begin_weight_update":
            self.payloads.session(True, summing=_flag(body, "weights_checksum"))
            return 200, {"success": True, "message": "no quantized weights to repack"}
        if path == "/end_weight_update":
            report, probe = self._end_fields(body)
            self.payloads.session(False)
            return 200, {"success": True, "message": "no quantized weights to repack", **self._ended(report, probe)}
        return 404, {"error": {"message": f"unknown endpoint POST {path}"}}

    def _server_info(self) -> dict[str, Any]:
        e = self.engine
        layout = e.layout
        return {
            "engine": "rltrain.embedded",
            "device": str(e.device),
            "dtype": str(e.dtype),
            "max_batch_size": e.max_batch_size,
            "context_length": e.context_length,
            # Tokens its KV pool holds (SGLang's field; None: no paged pool, the hf path).
            "max_total_num_tokens": e.decoder.max_total_num_tokens() if e.decoder is not None else None,
            "weight_version": e.weight_version,
            # Update requests answer after every copy out of the sender's buffers is done.
            "weight_updates": "synchronous",
            # A buffer's handle is sent once per weight-update session, then its slot (receiver.py).
            "weight_buffer_slots": KEEP_MAPPED,
            # A tensor update may open and close the weight-update session itself, and a
            # session's end may score a probe sequence (`_update_in_session`).
            "weight_update_sessions": "inline",
            # /generate's log-probs as SGLang gives them, or as a list of values (requests.py).
            "logprob_formats": list(LOGPROB_FORMATS),
            # A published disk version's files are checked against its manifest on load.
            "weight_files": "verified",
            # GET /weights_checksum: the checksum of the weights it owns (weights/checksum.py).
            "weights_checksum": True,
            # Its parallel layout, in SGLang's field names (the sync's router reads them). One
            # process on one device: with --tp-size it takes SGLang's per-TP-rank payloads
            # (experts split over --ep-size of its ranks); with --ep-size alone it is EP rank
            # ep_rank of a group of engines (experts.py).
            "tp_size": layout.tp_size,
            "dp_size": 1,
            "ep_size": layout.ep_size,
            "ep_rank": layout.ep_rank if layout.ep_size > 1 and layout.tp_size == 1 else None,
            "enable_eplb": False,
            "ep_num_redundant_experts": 0,
            "moe_a2a_backend": "none",
            # SGLang's flag: weights, KV cache and graphs' memory released and resumed at the
            # same addresses (saver.py)
            "enable_memory_saver": e.saver is not None,
            # The paged path's counts since start-up: prefills, decode steps, graph captures
            # and their seconds, tokens (None: the plain transformers path)
            # (with the process's allocator counters on CUDA: runtime.memory.allocator_counts)
            "decode_stats": {**e.decoder.stats, **allocator_counts(e.device)} if e.decoder is not None else None,
        }

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
        return key_matches(self.api_key, header)

    def generate_async(self, body: dict[str, Any]) -> Future | None:
        """/generate without a thread waiting for it: the future of its answer, or None where the
        answer needs work after the samples (the prompt's log-probs: `post`). Raises what `post`
        would for a bad request."""
        e = self.engine
        req = parse_generate(body, Limits(e.config.vocab_size, e.context_length, e.max_batch_size))
        if req.return_logprob and req.logprob_start_len >= 0:
            return None
        samples = e.submit(req.prompts, req.params, req.return_logprob, req.ids, req.logprob_values)
        answer: Future = Future()

        def done(f: Future) -> None:
            err = f.exception()
            if err is not None:
                answer.set_exception(err)
            else:
                answer.set_result(f.result()[0] if req.single else f.result())

        samples.add_done_callback(done)
        return answer

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
        summing = _flag(body, "weights_checksum")
        if begin:
            self.payloads.session(True, summing=summing)
        try:
            out = self.payloads.update_from_tensor(body)
        finally:
            if end:
                self.payloads.session(False)
        return {**out, **self._ended(report, probe)} if end else out

    def _end_fields(self, body: dict[str, Any]) -> tuple[bool, list[int] | None]:
        """What a session's end is asked to report (this engine's extension, the sync's checks
        without requests of their own): `weights_checksum` (true: the /weights_checksum report)
        and `probe_input_ids` (a sequence to score, as /generate's input_token_logprobs,
        once the session's weights are in). Checked before anything is loaded or ended."""
        report = _flag(body, "weights_checksum")
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


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, got {value!r}")
    return value


def _tags(body: dict[str, Any]) -> list[str] | None:
    tags = body.get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
        raise BadRequest(f"tags={tags!r}: expected a list of memory regions (weights, kv_cache, cuda_graph)")
    return tags
