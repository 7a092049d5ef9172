"""`EngineClient`: SGLang's native HTTP API, used the same way against SGLang and the embedded engine.

Failure policy. Transport errors (connection refused or reset, server gone mid-request) are
retried with exponential backoff; HTTP errors are not (the server understood and said no)
(transport.py). A generate request that still fails is returned as failed `Completion`s with the reason: the
caller can count and exclude them, and nothing downstream ever sees an empty or zero-reward
sample in their place.

What an engine can do beyond SGLang's API (the embedded engine's extensions, SGLang's
/weights_checker) is asked of the engine itself, through the same endpoints that serve it:
`EngineClient.capabilities()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from rltrain.engine.transport import EngineError, EngineTransport, json_or_text
from rltrain.generation import (
    Completion,
    ProtocolError,
    SamplingParams,
    generate_body,
    logprob,
    parse_generate_response,
)


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond the API both engines share, as its endpoints show it
    (`EngineClient.capabilities`). SGLang has none of the embedded engine's extensions; the
    embedded engine has no /weights_checker (it checksums what it owns instead)."""

    dtype: str | None = None  # its weights' torch dtype ("bfloat16"), as its /server_info says (None: "auto")
    checksums: bool = False  # it reports weight checksums (/weights_checksum)
    synchronous: bool = False  # its update requests answer only after the copies out of the sender's buffers
    slots: int = 0  # buffers it keeps by slot number within a weight-update session (weights/bucket.py)
    verifies_files: bool = False  # it checks a disk version's files against the version's manifest
    weights_checker: bool = False  # it answers SGLang's /weights_checker (per-TP-rank sha256 of its parameters)
    # Its tensor updates open and close the weight-update session themselves, and a session's end
    # scores a probe sequence (the embedded engine's "weight_update_sessions": "inline").
    inline_sessions: bool = False

    @staticmethod
    def shared(caps: Sequence[EngineCapabilities]) -> EngineCapabilities:
        """What every one of several engines can do: the weakest decides (the dtype: the first's)."""
        if not caps:
            return EngineCapabilities()
        return EngineCapabilities(
            dtype=caps[0].dtype,
            checksums=all(c.checksums for c in caps),
            synchronous=all(c.synchronous for c in caps),
            slots=min(c.slots for c in caps),
            verifies_files=all(c.verifies_files for c in caps),
            weights_checker=all(c.weights_checker for c in caps),
            inline_sessions=all(c.inline_sessions for c in caps),
        )


class EngineClient(EngineTransport):
    """Client of one engine server (real SGLang or `rltrain.engine.embedded`)."""

    def __init__(
        self,
        url: str,
        *,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_inflight: int = 32,
        prompts_per_request: int = 16,
        retries: int = 3,
        backoff_s: float = 0.5,
        vocab_size: int | None = None,
        api_key: str = "",
        logprob_values: bool = False,
    ):
        super().__init__(url, request_timeout_s, connect_timeout_s, max_inflight, retries, backoff_s, api_key)
        # Ask for the log-probs as a list of values (the embedded engine's `logprob_format`; SGLang
        # answers [log-prob, token, null] per token, a rollout's answer several times slower to parse).
        self.logprob_values = logprob_values
        # Token ids are checked here before they are sent: an id outside the vocabulary
        # kills SGLang's scheduler process (IndexError in the embedding), not just the request.
        self.vocab_size = vocab_size
        self.max_inflight = max_inflight
        self.prompts_per_request = prompts_per_request
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------------ health

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def health_generate(self) -> bool:
        """Health that runs one tiny generation (SGLang's /health_generate)."""
        try:
            return self._http.get("/health_generate", timeout=30.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float, alive: Callable[[], bool] | None = None, interval_s: float = 0.5) -> float:
        """Poll /health until 200; `alive()` False (server process exited) stops early. Returns seconds."""
        t0 = time.monotonic()
        while True:
            if self.health():
                return time.monotonic() - t0
            if alive is not None and not alive():
                raise EngineError("/health", "the engine process exited before it became healthy")
            if time.monotonic() - t0 > timeout_s:
                raise EngineError("/health", f"not healthy after {timeout_s:.0f}s")
            time.sleep(interval_s)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        input_ids: list[list[int]],
        params: SamplingParams,
        return_logprob: bool = True,
        positions: list[int] | None = None,
    ) -> list[Completion]:
        """Sample `params.n` continuations of every prompt; result in prompt-major order.

        Prompts go out in requests of `prompts_per_request`, at most `max_inflight` requests of this
        call at once; a call of one request is sent from the caller's own thread, so that callers
        on threads of their own (multi-turn trajectories) each have their turn in flight, all at once.
        A request that fails after retries yields failed completions (`ok` False, `error` set).
        `positions`: the prompts' places in an earlier call that is being retried in part; their
        completions carry those indices and, with a sampling seed, the seeds they had there.
        """
        params.validate()
        self._check_prompts(input_ids)
        positions = list(range(len(input_ids))) if positions is None else list(positions)
        if len(positions) != len(input_ids):
            raise ValueError(f"{len(positions)} positions for {len(input_ids)} prompts")
        # A request holds consecutive positions (seeds follow a prompt's position in the call).
        chunks, start = [], 0
        for i in range(1, len(positions) + 1):
            if i == len(positions) or i - start == self.prompts_per_request or positions[i] != positions[i - 1] + 1:
                chunks.append((positions[start], input_ids[start:i]))
                start = i

        single = len(chunks) == 1

        def one(chunk: tuple[int, list[list[int]]]) -> list[Completion]:
            first, ids = chunk
            try:
                body = generate_body(ids, params, return_logprob, first, self.logprob_values)
                # (a call of one request: on the caller's thread, through the lean connection)
                data = self._lean_generate(body) if single else self._post("/generate", body, retry_read_errors=True)
                return parse_generate_response(data, len(ids), params.n, first)
            except (EngineError, ProtocolError) as e:
                return [Completion(first + i, j, error=str(e)) for i in range(len(ids)) for j in range(params.n)]

        results = [one(chunks[0])] if single else list(self._executor().map(one, chunks))
        return [c for r in results for c in r]

    def _check_prompts(self, input_ids: list[list[int]]) -> None:
        for i, p in enumerate(input_ids):
            if not isinstance(p, list) or not p:
                raise ValueError(f"prompt {i}: expected a non-empty list of token ids, got {str(p)[:80]}")
            if self.vocab_size is not None:
                bad = [t for t in p if not isinstance(t, int) or not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(
                        f"prompt {i}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
                    )

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_inflight, thread_name_prefix="rltrain-engine-client")
            return self._pool

    # ------------------------------------------------------------------ memory

    def release(self, tags: list[str] | None = None) -> None:
        """Free engine memory: tags from {"weights", "kv_cache", "cuda_graph"}; None: all."""
        self._post("/release_memory_occupation", {"tags": tags})

    def resume(self, tags: list[str] | None = None) -> None:
        self._post("/resume_memory_occupation", {"tags": tags})

    # ------------------------------------------------------------------ weights

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> dict:
        return self._checked(
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache},
        )

    def begin_weight_update(self, checksum: bool = False) -> dict:
        """Open a weight-update session (SGLang requires one around tensor updates). The embedded
        engine's extension: `checksum`, its buckets are checksummed as they land, for the report
        the session's end is asked for (`end_weight_update(checksum=True)`)."""
        return self._checked("/begin_weight_update", {"weights_checksum": True} if checksum else {})

    def end_weight_update(self, checksum: bool = False, probe: list[int] | None = None) -> dict:
        """Close the weight-update session. The embedded engine's extensions, taken as the
        session ends: `checksum`, its /weights_checksum report in the answer (`weights_checksum`);
        `probe`, its log-probs of the sequence's tokens 1.. (`probe_logprobs`, or `probe_error`)."""
        return self._checked("/end_weight_update", session_end(checksum, probe))

    @contextlib.contextmanager
    def weight_update_session(self) -> Iterator[None]:
        """`with client.weight_update_session(): client.update_weights_from_tensor(...)` — ends it on error too."""
        self.begin_weight_update()
        try:
            yield
        finally:
            self.end_weight_update()

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = "flattened_bucket",
        weight_version: str | None = None,
        flush_cache: bool = True,
        begin_session: bool = False,
        end_session: bool = False,
        checksum: bool = False,
        probe: list[int] | None = None,
    ) -> dict:
        """One serialized payload per engine TP rank (see `rltrain.weights.bucket`). The embedded
        engine's extension ("weight_update_sessions": "inline"): `begin_session` opens the
        weight-update session before this bucket (its buckets checksummed as they land where
        `checksum`); `end_session` closes it after, with the reports `end_weight_update` gives for
        `checksum` and `probe` in the answer."""
        body: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }
        if begin_session:
            body["begin_weight_update"] = True
            if checksum:
                body["weights_checksum"] = True
        if end_session:
            body.update(session_end(checksum, probe), end_weight_update=True)
        return self._lean_post("/update_weights_from_tensor", body)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict:
        return self._checked(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> dict:
        """`load_format="flattened_bucket"`: one uint8 broadcast holding the tensors back to back."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            body["load_format"] = load_format
        return self._checked("/update_weights_from_distributed", body)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._checked("/destroy_weights_update_group", {"group_name": group_name})

    def weight_version(self) -> str | None:
        data = json_or_text(self._request("GET", "/model_info"))
        return data.get("weight_version") if isinstance(data, dict) else None

    def weights_checksum(self) -> dict:
        """The embedded engine's checksum of the weights it owns (GET /weights_checksum; SGLang has none)."""
        return json_or_text(self._request("GET", "/weights_checksum"))

    def weights_checker(self) -> list[dict[str, Any]]:
        """SGLang's /weights_checker checksum: one entry per TP rank of the engine, each with its
        `tp_rank`, `tp_size`, `checksum` (sha256 over that rank's parameters) and `tensors`
        (parameter name, in the engine's own fused layout -> its hash)."""
        data = self._checked("/weights_checker", {"action": "checksum"})
        ranks = data.get("ranks")
        if not isinstance(ranks, list):
            raise EngineError("/weights_checker", f"no per-rank checksums in the answer: {str(data)[:200]}")
        out = []
        for r in ranks:
            info = r.get("parallelism_info") if isinstance(r, dict) else None
            info = info[0] if isinstance(info, list) and info else info
            if not isinstance(info, dict) or "per_gpu_checksum" not in r:
                raise EngineError("/weights_checker", f"malformed rank entry: {str(r)[:200]}")
            tensors = r.get("checksums")
            out.append(
                {
                    "tp_rank": info["tp_rank"],
                    "tp_size": info["tp_size"],
                    "checksum": r["per_gpu_checksum"],
                    "tensors": tensors if isinstance(tensors, dict) else {},
                }
            )
        return sorted(out, key=lambda e: e["tp_rank"])

    def reset_weights(self) -> None:
        """SGLang's /weights_checker `reset_tensors`: every parameter (its non-persistent buffers
        aside) overwritten with random values, on every TP rank. Before a sync, so that a
        parameter the sync does not write is garbage the checks see, not a stale copy that
        passes for the new one."""
        self._checked("/weights_checker", {"action": "reset_tensors"})

    def greedy(self, input_ids: list[int], max_new_tokens: int) -> list[int]:
        """The engine's greedy continuation of `input_ids`: exactly `max_new_tokens` tokens (its
        end-of-sequence token does not stop it). Raises EngineError where it gives none."""
        self._check_prompts([input_ids])
        body = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": False,
        }
        data = self._post("/generate", body, retry_read_errors=True)
        item = data[0] if isinstance(data, list) and data else data
        ids = item.get("output_ids") if isinstance(item, dict) else None
        if not isinstance(ids, list) or len(ids) != max_new_tokens:
            raise EngineError("/generate", f"no greedy continuation of {max_new_tokens} tokens: {str(data)[:200]}")
        return [int(t) for t in ids]

    def score(self, input_ids: list[int]) -> list[float]:
        """The engine's log-probs of `input_ids[1:]`, each given the tokens before it, at
        temperature 1 (SGLang's input_token_logprobs: untempered). A prefill only: nothing is
        generated (max_new_tokens 0, SGLang's prefill-only request)."""
        body = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        data = self._post("/generate", body, retry_read_errors=True)
        meta = data.get("meta_info", {}) if isinstance(data, dict) else {}
        lps = meta.get("input_token_logprobs")
        if not isinstance(lps, list) or len(lps) != len(input_ids):
            raise EngineError("/generate", f"no input_token_logprobs for {len(input_ids)} tokens: {str(data)[:200]}")
        return [logprob(e[0]) for e in lps[1:]]

    def memory_report(self) -> dict:
        """The embedded engine's memory figures (GET /memory; SGLang has no such endpoint)."""
        return json_or_text(self._request("GET", "/memory"))

    def server_info(self) -> dict:
        """GET /server_info (SGLang's current name; it logs a deprecation warning for every
        /get_server_info), or /get_server_info where the engine has only the older name."""
        try:
            data = json_or_text(self._request("GET", "/server_info"))
        except EngineError as e:
            if e.status != 404:
                raise
            data = json_or_text(self._request("GET", "/get_server_info"))
        return data if isinstance(data, dict) else {}

    def model_info(self) -> dict:
        return json_or_text(self._request("GET", "/model_info"))

    def capabilities(self) -> EngineCapabilities:
        """What this engine can do, asked of it without touching its weights (they may be
        released: SGLang's memory saver unmaps them, and a hash over unmapped memory is an
        illegal-address fault on a GPU): its /server_info (the embedded engine's extensions and
        dtype), and whether it serves SGLang's /weights_checker (`has_weights_checker`). An
        engine whose /server_info fails is taken as having no extension."""
        try:
            info = self.server_info()
        except (EngineError, ValueError, TypeError):
            info = {}
        synchronous = info.get("weight_updates") == "synchronous"
        slots = info.get("weight_buffer_slots", 0) if synchronous else 0
        checksums = info.get("weights_checksum") is True
        return EngineCapabilities(
            dtype=_float_dtype(info.get("dtype")),
            checksums=checksums,
            synchronous=synchronous,
            slots=slots if isinstance(slots, int) else 0,
            verifies_files=info.get("weight_files") == "verified",
            weights_checker=not checksums and self.has_weights_checker(),  # SGLang's; the embedded engine has its own
            inline_sessions=info.get("weight_update_sessions") == "inline",
        )

    def has_weights_checker(self) -> bool:
        """Whether the engine serves SGLang's /weights_checker, asked with an action no engine
        knows (`NO_ACTION`): SGLang 0.5.23 refuses it before it looks at any weight (HTTP 400,
        "Unsupported action", and a warning in its log); an engine without the endpoint answers
        404 (405: not for POST). Any other answer is an error naming it."""
        try:
            self._post("/weights_checker", {"action": NO_ACTION})
            return True  # (an engine that ignores actions it does not know: it has the endpoint)
        except EngineError as e:
            if e.status == 400:
                return True
            if e.status in (404, 405):
                return False
            raise EngineError(
                "/weights_checker",
                f"expected HTTP 400 (SGLang refusing the unknown action {NO_ACTION!r}) or 404 (no such "
                f"endpoint) to the capability check, got: {e}",
                e.status,
            ) from e

    # ------------------------------------------------------------------ scheduling

    def pause(self, mode: str = "abort") -> None:
        """Stop generating: "abort" ends in-flight requests; "in_place"/"retract" hold them."""
        self._post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._post("/continue_generation", {})

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        super().close()


# The action `has_weights_checker` sends: none an engine knows, so nothing is computed.
NO_ACTION = "rltrain-capability-check"


def _float_dtype(name: Any) -> str | None:
    """A floating torch dtype's name ("bfloat16") from an engine's "dtype" ("torch.bfloat16",
    "bfloat16"); None for anything else (SGLang's "auto")."""
    if not isinstance(name, str):
        return None
    name = name.removeprefix("torch.")
    return name if name in ("float32", "float64", "bfloat16", "float16") else None


def session_end(checksum: bool = False, probe: list[int] | None = None) -> dict[str, Any]:
    """The fields of a weight-update session's end: the checksum report and a probe to score."""
    body: dict[str, Any] = {}
    if checksum:
        body["weights_checksum"] = True
    if probe:
        body["probe_input_ids"] = list(probe)
    return body
