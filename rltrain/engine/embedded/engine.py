"""The embedded engine's model side: batched sampling with a KV cache, memory release, weight loads.

One scheduler thread owns the model. Requests queue up, and one of two paths generates:
- on CUDA (or `decode="paged"`), paged.py: a paged KV cache allocated once, decode steps replayed
  as CUDA graphs, continuous batching (rows leave when done, queued requests join between steps);
- otherwise (the CPU default, `decode="hf"`, or a model the paged path cannot run), `_generate`:
  the scheduler takes everything queued (up to `max_batch_size` sequences, each prompt expanded
  into its `n` samples), left-pads the distinct prompts, prefills each once and decodes step by
  step with transformers' own cache, then answers every request of the batch.
Both sample as sampling.py says; per-token log-probs are those of the distribution the token was
sampled from (log_softmax of logits / temperature; raw logits for greedy), as SGLang returns them.
No automatic garbage collection runs from taking a request to answering it (a full collection
stops the process for as long as it walks the heap: 0.3 s on the H200), and what start-up made is
frozen out of every later collection.

Memory. `release(["weights"])` backs the weights up (pinned host memory on GPU, a safetensors
file on CPU — so the process's RSS really drops), then frees every parameter; `resume` restores
them. `release(["kv_cache"])` drops the KV pool (paged) or the allocator's cached blocks (the KV
cache of the last batch) and refuses generation until resumed. Generating while released is an
error, never garbage. With the memory saver (`memory_saver`, saver.py: SGLang's
--enable-memory-saver) nothing is freed or allocated again: release unmaps the regions' pages
(weights, KV pool, the graphs' memory; the weights backed up first if kept) and resume maps new
ones at the same addresses, so the captured CUDA graphs stay valid.
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from rltrain.engine.embedded.fused import FusedProjections
from rltrain.engine.embedded.paged import PagedDecoder, unsupported
from rltrain.engine.embedded.rows import GenRequest, Row
from rltrain.engine.embedded.sampling import LogitShaper, SamplingPlan, sample, token_hash_of
from rltrain.engine.embedded.saver import MemorySaver, in_region
from rltrain.generation import SamplingParams
from rltrain.runtime import internals
from rltrain.runtime.dtypes import resolve_dtype
from rltrain.runtime.files import process_tempdir
from rltrain.runtime.ledger import measure_cuda_context
from rltrain.runtime.memory import free_cuda_caches, gc_paused, trim_host_heap
from rltrain.runtime.pinned import PinnedUpload, all_pinned_host_bytes, pinned_like
from rltrain.weights.bucket import BucketViews
from rltrain.weights.checksum import combine, entry, fetched
from rltrain.weights.hf_files import context_length_of
from rltrain.weights.names import checkpoint_index, classify, num_experts, write
from rltrain.weights.versions import read_weights

log = logging.getLogger("rltrain.engine.embedded")
BACKUP_PREFIX = "rltrain-embedded-backup-"  # + pid: a dead process's directory is removed


class EngineStateError(RuntimeError):
    """The request cannot run in the engine's current state (released, paused, no weights)."""


class EmbeddedEngine:
    """A transformers causal LM behind a batching scheduler thread."""

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: str = "auto",
        max_batch_size: int = 256,
        seed: int = 0,
        backup_dir: str | None = None,
        weights_backup: bool = True,
        deterministic: bool = False,
        ep_size: int = 1,
        ep_rank: int = 0,
        tp_size: int = 1,
        context_length: int = 0,
        decode: str = "auto",
        max_total_tokens: int = 0,
        mem_fraction_static: float = 0.8,
        cuda_graphs: bool = True,
        compile: bool = False,
        memory_saver: bool = False,
    ):

        self.model_path = model_path
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)  # the first visible device (asking torch would touch the GPU)
        # Measured before anything else touches the GPU (the memory ledger shows it).
        self.context_bytes = measure_cuda_context(self.device)[0]
        torch_dtype = resolve_dtype(dtype, self.device)
        if memory_saver and self.device.type != "cuda":
            raise ValueError(f"--enable-memory-saver: CUDA only (the device is {self.device})")
        self.saver = MemorySaver() if memory_saver else None  # saver.py
        self.config = AutoConfig.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
        self.fused: FusedProjections | None = None  # the paged path's fused projections (fused.py)
        with in_region(self.saver, "weights"):
            if _paged_wanted(decode, self.device) and unsupported(self.config) is None:
                self.fused = FusedProjections(model, self.device)
            for p in model.parameters():  # (tied ones once; the fused ones are on the device already)
                p.data = p.data.to(self.device)
        # its buffers (rotary frequencies): outside the weights' region, which release discards
        self.model = model.to(self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.max_batch_size = max_batch_size
        # Prompt + new tokens per sequence (SGLang's --context-length; 0: the model's own).
        self.context_length = context_length or context_length_of(self.config)
        self.deterministic = deterministic
        self.weight_version = "default"
        self.eos_ids = _eos_ids(self.model)
        # transformers 5.2x renamed `past_key_values` to `cache` (in and out); accept both.
        forward = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward else "past_key_values"
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._token_hash = token_hash_of(self.config.vocab_size, self.device)  # seeded sampling's, per token
        # The prefill computes logits for the last position only, where the model can.
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        # Released weights: backed up (pinned host memory on GPU, a file on CPU) and restored on
        # resume, or — like SGLang without --enable-weights-cpu-backup — discarded, and garbage
        # (NaN) after resume until updates rewrite them.
        self.weights_backup = weights_backup
        self._backup_dir = Path(backup_dir) if backup_dir else None
        self._own_backup_dir = False  # made here (a temporary one): removed at shutdown
        # name -> (shape, dtype) of every parameter; names that share storage (tied embeddings)
        # are grouped so a checkpoint may carry either name.
        self._param_meta = {
            n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters(remove_duplicate=False)
        }
        self._aliases = _alias_groups(self.model)
        # Updates may name weights as checkpoints do (per-expert MoE names; see weights/names.py).
        self._checkpoint_names = checkpoint_index(self.model)
        # Parameter and buffer objects outlive release/resume (only their .data changes): looked
        # up once, not per update (walking the module tree is dear per bucket).
        self._tensors = dict(self.model.named_parameters(remove_duplicate=False)) | dict(self.model.named_buffers())
        self._targets: dict[str, tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]] = {}
        # Flattened buckets by layout: the bucket's views and the parameters they go to, checked
        # once. A sync sends the same layouts every time. Holds views of the weights, so it is
        # emptied when they are released.
        self._bucket_plans: dict[tuple, tuple[Any, list[torch.Tensor] | None]] = {}
        self._bucket_keys: dict[int, tuple[list[Any], tuple]] = {}  # id(metadata) -> (metadata, its key)
        self._local = threading.local()  # per request thread: its last update's copies and times
        self._upload: PinnedUpload | None = None  # disk loads: host-to-device through page-locked buffers
        # Expert ownership (the receiving end of routed sync), in one of two layouts:
        # - one engine of a group (`ep_rank`, tp_size 1): as EP rank r of ep_size it takes updates
        #   only for its contiguous block of experts and checksums what it owns;
        # - SGLang's layout (tp_size > 1): one engine over tp_size TP ranks, experts split over
        #   ep_size of them (TP rank k is EP rank (k // (tp_size / ep_size)) % ep_size). An update
        #   carries one payload per TP rank; each may hold only its own EP rank's experts, and every
        #   rank's copy of a dense weight must be the same (`load_per_rank`). The ranks live in this
        #   one process on one device (it has no tensor-parallel forward): they receive, hold and
        #   checksum per rank what SGLang's TP ranks would, and together serve the whole model.
        # The engine has no expert-parallel forward: in the first layout its weights of other
        # experts stay as loaded (it is used so to receive and verify routed syncs).
        self.ep_size, self.ep_rank, self.tp_size = ep_size, ep_rank, tp_size
        experts = num_experts(self.config)
        if tp_size > 1:
            if ep_rank or tp_size % ep_size or (ep_size > 1 and (experts == 0 or experts % ep_size)):
                raise ValueError(
                    f"tp_size={tp_size}, ep_size={ep_size}, ep_rank={ep_rank}: EP inside the engine needs "
                    f"ep_size dividing tp_size and the model's {experts} experts, and no --ep-rank"
                )
        elif ep_size > 1 and (experts == 0 or experts % ep_size or not 0 <= ep_rank < ep_size):
            raise ValueError(f"ep_size={ep_size}, ep_rank={ep_rank}: the model has {experts} experts")
        self._experts_per_rank = experts // ep_size if ep_size > 1 else 0
        # The EP rank of each TP rank (SGLang's MoE groups; one TP rank: this engine's EP rank).
        self.rank_ep = [(k // (tp_size // ep_size)) % ep_size for k in range(tp_size)] if tp_size > 1 else [ep_rank]
        self.rank_bytes_loaded = [0] * tp_size  # bytes each TP rank's payloads held (updates)
        self.bytes_loaded = 0  # bytes of weights received by updates, for sync accounting
        self.released: set[str] = set()
        self._paused_bytes: dict[str, tuple[int, int]] = {}  # region -> the allocator's (allocated, reserved)
        self.weights_valid = True  # False after resume without a backup, until weights are loaded
        self._weights_backup: dict[str, torch.Tensor] | Path | None = None
        self._pinned: dict[str, torch.Tensor] | None = None
        self._queue: queue.Queue[GenRequest | None] = queue.Queue()
        self._model_lock = threading.RLock()  # held while a batch runs and for every state change
        self._running = threading.Event()
        self._running.set()
        self._abort_inflight = threading.Event()
        self._stop = threading.Event()
        self.decoder = self._paged_decoder(decode, max_total_tokens, mem_fraction_static, cuda_graphs, compile)
        # What start-up made (modules, the model, compiled code: millions of objects with
        # torch.compile) lives as long as the engine: collected once, then no collection walks
        # it again (generation runs with no automatic collection at all: `gc_paused`).
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._loop, name="rltrain-embedded-scheduler", daemon=True)
        self._thread.start()

    def _paged_decoder(
        self, decode: str, max_total_tokens: int, mem_fraction: float, cuda_graphs: bool, compile: bool
    ) -> PagedDecoder | None:
        """The paged path (paged.py) where asked for, or by default on CUDA where the model runs on
        it: it must pass its start-up probe against transformers' own forward. None: the plain
        transformers path (`_generate`), one batch at a time."""
        if not _paged_wanted(decode, self.device):
            return None
        why = unsupported(self.config)
        if why is None:
            decoder = PagedDecoder(
                self.model,
                self.device,
                self.max_batch_size,
                self.context_length,
                max_total_tokens,
                mem_fraction,
                cuda_graphs,
                compile,
                self._generator,
                self.token_hash,
                self.eos_ids,
                self.deterministic,
                self.saver,
            )
            try:
                diff = decoder.verify()
                log.info(
                    "paged decode (CUDA graphs %s, compiled blocks %s): probe within %.2g of transformers",
                    decoder.cuda_graphs,
                    decoder.compiled,
                    diff,
                )
                return decoder
            except RuntimeError as e:
                why = str(e)
        if decode == "paged":
            raise ValueError(f"--decode paged: {why}")
        log.warning("paged decode off (%s): generating with transformers' own cache, one batch at a time", why)
        return None

    # ------------------------------------------------------------------ scheduling

    def submit(
        self,
        input_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        return_logprob: bool,
        ids: list[str] | None = None,
        logprob_values: bool = False,
    ) -> Future:
        """Sample `n` continuations of each prompt, with its own `params` (one for all: seeds
        `sampling_seed + i * n` for prompt i). HTTP requests are checked by `requests.py` first;
        this re-checks what the engine relies on."""
        if isinstance(params, SamplingParams):
            params = [
                p if p.sampling_seed is None else replace(p, sampling_seed=p.sampling_seed + i * p.n)
                for i, p in enumerate([params] * len(input_ids))
            ]
        if len(params) != len(input_ids) or len({p.n for p in params}) != 1:
            raise ValueError(f"{len(params)} sampling params for {len(input_ids)} prompts, all of one n")
        if not input_ids or any(not isinstance(p, list) or not p for p in input_ids):
            raise ValueError("input_ids must be a non-empty list of non-empty token-id lists")
        vocab = self.config.vocab_size
        for prompt, p in zip(input_ids, params):
            p.validate()
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            if p.max_new_tokens is None or len(prompt) + p.max_new_tokens > self.context_length:
                raise ValueError(
                    f"{len(prompt)} prompt tokens + max_new_tokens={p.max_new_tokens} exceed the context length "
                    f"({self.context_length})"
                )
        self._check_can_generate()
        req = GenRequest(input_ids, params, return_logprob, ids, logprob_values)
        self._queue.put(req)
        return req.future

    @torch.no_grad()
    def score(self, input_ids: list[int]) -> list[float]:
        """Log-probs of `input_ids[1:]`, each given the tokens before it, at temperature 1
        (SGLang's input_token_logprobs): one forward over the sequence."""
        self._check_can_generate()
        with self._model_lock:
            ids = torch.tensor([input_ids], device=self.device)
            logits = self.model(input_ids=ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        return logp.cpu().tolist()

    def token_hash(self, vocab: int) -> torch.Tensor | None:
        """Seeded sampling's token hash, kept for the model's vocabulary (None: another width)."""
        return self._token_hash if self._token_hash.numel() == vocab else None

    def _check_can_generate(self) -> None:
        if self.released:
            raise EngineStateError(
                f"engine memory is released ({', '.join(sorted(self.released))}); "
                "call /resume_memory_occupation before generating"
            )
        if not self.weights_valid:
            raise EngineStateError("engine weights were resumed without a backup; update the weights before generating")

    def _loop(self) -> None:
        """Take requests and generate; from taking work to answering it, no automatic garbage
        collection pauses the process (memory.gc_paused)."""
        while not self._stop.is_set():
            if self.decoder is not None and self.decoder.waiting and self._running.is_set():
                with gc_paused():
                    self._serve_paged()  # requests kept waiting by an abort
                continue
            try:
                first = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if first is None:
                break
            self._running.wait()
            with gc_paused():
                if self.decoder is not None:
                    self.decoder.waiting.append(first)
                    self._serve_paged()
                    continue
                batch, rows = [first], len(first.input_ids) * first.params[0].n
                while rows < self.max_batch_size and not self.deterministic:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._stop.set()
                        break
                    batch.append(nxt)
                    rows += len(nxt.input_ids) * nxt.params[0].n
                self._run_batch(batch)

    def _serve_paged(self) -> None:
        """Continuous batching (paged.py) until nothing runs and nothing waits."""
        assert self.decoder is not None

        def take() -> GenRequest | None:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return None
            if req is None:
                self._stop.set()
            return req

        def can_run(req: GenRequest) -> bool:
            try:
                self._check_can_generate()
                return True
            except EngineStateError as e:
                req.future.set_exception(e)
                return False

        captures = self.decoder.stats["graph_captures"]
        with self._model_lock, torch.no_grad():
            self.decoder.serve(take, can_run, self._running, self._abort_inflight, lambda: self.weight_version)
        if self.decoder.stats["graph_captures"] != captures:
            # Compiling and capturing leave ~millions of long-lived objects: frozen, a full
            # collection (triggered by the rows' results) no longer walks them (the suspected
            # cause of answers of 512 x 256 tokens arriving up to 0.5 s late on the H200).
            gc.freeze()

    def _run_batch(self, batch: list[GenRequest]) -> None:
        """Run one batch; each request's future gets the list of its samples (prompt-major)."""
        with self._model_lock:
            live = []
            for req in batch:
                try:
                    self._check_can_generate()
                    live.append(req)
                except EngineStateError as e:
                    req.future.set_exception(e)
            if not live:
                return
            try:
                results = self._generate(live)
            except Exception as e:  # noqa: BLE001 - every waiting request learns why
                log.exception("batch of %d requests failed", len(live))
                for req in live:
                    if not req.future.done():
                        req.future.set_exception(e)
                return
            for req, res in zip(live, results):
                req.future.set_result(res)

    def pause(self, mode: str) -> None:
        """abort: in-flight rows end now with finish reason abort; in_place/retract: hold them."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"pause mode {mode!r}: expected abort, in_place or retract")
        if mode == "abort":
            self._abort_inflight.set()
        self._running.clear()

    def resume_generation(self) -> None:
        self._abort_inflight.clear()
        self._running.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._running.set()
        self._queue.put(None)
        self._thread.join(timeout=30)
        if self._own_backup_dir and self._backup_dir is not None:
            shutil.rmtree(self._backup_dir, ignore_errors=True)

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def _generate(self, reqs: list[GenRequest]) -> list[list[dict[str, Any]]]:
        """Per request, its samples as SGLang result dicts, prompt-major."""
        every = [row for req in reqs for row in req.rows(self.eos_ids)]
        rows = [r for r in every if r.finish is None]  # max_new_tokens=0 (a prefill-only score): done
        if rows:
            self._decode(rows)
        results: list[list[dict[str, Any]]] = [[] for _ in reqs]
        index = {id(req): k for k, req in enumerate(reqs)}
        now = time.time()
        for r in every:
            results[index[id(r.req)]].append(r.result(self.weight_version, now))
        return results

    def _decode(self, rows: list[Row]) -> None:
        """Prefill the rows' prompts and sample until every row has finished."""
        B = len(rows)
        # Each distinct prompt is prefilled once: the n samples of a prompt (rows of their own,
        # with their own seeds) then start from its logits and its KV cache, copied per row.
        unique: dict[tuple[int, ...], int] = {}
        of_row = [unique.setdefault(tuple(r.prompt), len(unique)) for r in rows]
        L = max(len(p) for p in unique)
        ids = torch.zeros(len(unique), L, dtype=torch.long)
        mask = torch.zeros(len(unique), L, dtype=torch.long)
        for u, prompt in enumerate(unique):
            ids[u, L - len(prompt) :] = torch.tensor(prompt)
            mask[u, L - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)

        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **self._last_logits_only)
        past, logits = getattr(out, self._cache_kw), out.logits[:, -1, :].float()
        if len(unique) < B:  # one row per sample again (transformers' public cache reorder, as beam search uses)
            rows_of = torch.tensor(of_row, device=self.device)
            logits, mask, pos = logits[rows_of], mask[rows_of], pos[rows_of]
            if any(r.max_new > 1 for r in rows):
                past.reorder_cache(rows_of)
        params = [r.params for r in rows]
        plan = SamplingPlan(
            params, [r.seed for r in rows], logits.shape[-1], self.device, self.token_hash(logits.shape[-1])
        )
        shaper = LogitShaper(params, [r.stops for r in rows], logits.shape[-1], self.device)
        step = 0
        while any(r.finish is None for r in rows):
            if not self._running.is_set():
                if self._abort_inflight.is_set():
                    for r in rows:
                        if r.finish is None:
                            r.finish = {"type": "abort", "message": "generation paused with mode=abort"}
                    break
                self._running.wait()
            tokens, logps = sample(shaper.shape(logits, step), plan, step, self._generator)
            shaper.count(tokens)
            tok_list, lp_list = tokens.tolist(), logps.tolist()
            for b, r in enumerate(rows):
                if r.finish is not None:
                    continue
                r.append(tok_list[b], lp_list[b])
            step += 1
            if all(r.finish is not None for r in rows):
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=self.device)], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                **{self._cache_kw: past},
            )
            past, logits = getattr(out, self._cache_kw), out.logits[:, -1, :].float()
        del past, out

    # ------------------------------------------------------------------ memory

    def release(self, tags: list[str] | None) -> dict[str, Any]:
        tags = _tags(tags)
        with self._model_lock:
            if self.device.type == "cuda":  # (nothing queued may run on what is freed)
                torch.cuda.synchronize(self.device)
            if self.saver is not None:
                self._pause(tags)
            else:
                if "weights" in tags and "weights" not in self.released:
                    self._backup_and_free_weights()
                if self.decoder is not None:  # graphs hold the weights' and the pool's addresses
                    self.decoder.free_memory(kv_cache="kv_cache" in tags)
                if self.device.type == "cuda":
                    free_cuda_caches()
                else:
                    trim_host_heap()
            self.released |= set(tags)
        return self.memory_report()

    def resume(self, tags: list[str] | None) -> dict[str, Any]:
        tags = _tags(tags)
        with self._model_lock:
            if self.saver is not None:
                self.saver.resume(tags)
                if "weights" in tags and "weights" in self.released:
                    self._fill_weights()
            elif "weights" in tags and "weights" in self.released:
                self._restore_weights()
            self.released -= set(tags)
        return self.memory_report()

    def _pause(self, tags: list[str]) -> None:
        """Release with the memory saver: the weights backed up (if kept), the caches emptied
        (no block of a region may be freed while it is paused), the regions unmapped. The
        captured graphs stay: every address they hold comes back at resume."""
        if "weights" in tags and "weights" not in self.released:
            self._backup_weights()
        free_cuda_caches()
        fresh = [t for t in tags if t not in self.released]
        held = self._region_bytes(fresh)
        self.saver.pause(fresh)  # type: ignore[union-attr]
        for tag in fresh:
            self._paused_bytes[tag] = held[tag]

    def _region_bytes(self, tags: list[str]) -> dict[str, tuple[int, int]]:
        """(allocated, reserved) bytes of the allocator's segments in each memory region of
        `tags` (each region's segments are its own: the saver gives it its own pool)."""
        starts: dict[str, list[int]] = {t: [] for t in tags}
        if "weights" in starts:
            starts["weights"] = [p.untyped_storage().data_ptr() for p in self.model.parameters()]
        pool = self.decoder.pool if self.decoder is not None else None
        if "kv_cache" in starts and pool is not None:
            starts["kv_cache"] = [pool.k.data_ptr(), pool.v.data_ptr()]
        graphs = self.decoder.graph_pool if self.decoder is not None and "cuda_graph" in starts else None
        out = dict.fromkeys(tags, (0, 0))
        for seg in torch.cuda.memory_snapshot():
            lo, hi = seg["address"], seg["address"] + seg["total_size"]
            for tag, ptrs in starts.items():
                mine = any(lo <= p < hi for p in ptrs)
                if tag == "cuda_graph":
                    mine = graphs is not None and tuple(seg["segment_pool_id"]) == tuple(graphs)
                if mine:
                    a, r = out[tag]
                    out[tag] = (a + seg["allocated_size"], r + seg["total_size"])
                    break
        return out

    def _backup_and_free_weights(self) -> None:
        self._backup_weights()
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        if self.fused is not None:
            self.fused.release()

    def _backup_weights(self) -> None:
        t0 = time.perf_counter()
        state = {n: p.detach() for n, p in self.model.named_parameters()}
        if not self.weights_backup:
            self._weights_backup = None
        elif self.device.type == "cuda":
            # Pinned buffers are allocated once and reused: pinning is the slow part
            # (page-locking host memory), the copy itself runs at the pinned-copy bandwidth.
            if self._pinned is None:
                self._pinned = dict(zip(state, pinned_like(list(state.values()))))
            for n, t in state.items():
                self._pinned[n].copy_(t, non_blocking=True)
            torch.cuda.synchronize(self.device)
            self._weights_backup = self._pinned
        else:
            if self._backup_dir is None:
                self._backup_dir, self._own_backup_dir = process_tempdir(BACKUP_PREFIX), True
            path = self._backup_dir / "weights_backup.safetensors"
            save_file({n: t.contiguous() for n, t in state.items()}, str(path))
            self._weights_backup = path
        del state
        if self.saver is None:  # (with the saver every view of the weights stays valid)
            self._bucket_plans.clear()
        log.info(
            "weights released (%s) in %.2fs",
            "discarded"
            if self._weights_backup is None
            else "backed up to pinned host memory"
            if isinstance(self._weights_backup, dict)
            else f"backed up to {self._weights_backup}",
            time.perf_counter() - t0,
        )

    def _restore_weights(self) -> None:
        named = dict(self.model.named_parameters())
        fused = self.fused.params if self.fused is not None else set()
        for n, p in named.items():
            if id(p) not in fused:  # (those are views of their group's weight: allocated below)
                shape, dtype = self._param_meta[n]
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
        if self.fused is not None:
            self.fused.allocate()
        self._retie()
        self._fill_weights()

    def _fill_weights(self) -> None:
        """The resumed weights' values: their backup's, else NaN until an update writes them."""
        backup = self._weights_backup
        if isinstance(backup, Path):
            self._copy_into(load_file(str(backup), device=str(self.device)).items())
            backup.unlink(missing_ok=True)
        elif isinstance(backup, dict):
            self._copy_into(backup.items())
        else:
            # What SGLang serves after a resume without a backup is whatever the memory holds;
            # NaN makes every parameter a sync missed show in generations, log-probs and checksums.
            for p in self.model.parameters():
                if p.is_floating_point():
                    p.data.fill_(float("nan"))
            self.weights_valid = False
        self._weights_backup = None

    def _paused(self) -> set[str]:
        """The regions the memory saver has unmapped now."""
        return self.saver.paused if self.saver is not None else set()

    def _retie(self) -> None:
        """Give every alias group one storage again (release gave each its own empty tensor)."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        for group in self._aliases:
            head = named[group[0]]
            for other in group[1:]:
                named[other].data = head.data

    def memory_report(self) -> dict[str, Any]:
        """What this engine holds (bytes): its weights, the allocator blocks kept after the last
        batch (its KV cache: the embedded engine allocates the cache per batch), the rest of its
        allocations, its CUDA context as measured at start, and its RSS."""

        # each storage once (tied weights; a fused group's members are views of one)
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.model.parameters()}
        weights = sum(storages.values()) if "weights" not in self._paused() else 0
        rep: dict[str, Any] = {
            "released": sorted(self.released),
            "pid": os.getpid(),
            "device": str(self.device),
            "weight_bytes": weights,
            "rss_bytes": psutil.Process().memory_info().rss,
        }
        kv = self.decoder.kv_bytes if self.decoder is not None and "kv_cache" not in self._paused() else 0
        if self.decoder is not None:
            rep["kv_cache_bytes"] = kv  # the paged pool
        if self.device.type == "cuda":
            rep["host_pinned_bytes"] = all_pinned_host_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            allocated, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
            for tag in self._paused():  # (the allocator counts them still: their pages are unmapped)
                allocated -= self._paused_bytes[tag][0]
                reserved -= self._paused_bytes[tag][1]
            rep.update(
                cuda_allocated=allocated,
                cuda_reserved=reserved,
                cuda_used=total - free,
                kv_cache_bytes=kv if self.decoder is not None else reserved - allocated,
                other_bytes=allocated - weights - kv,
                # Blocks its allocator holds free (the CUDA graphs' pool among them); without the
                # paged pool they are the KV cache of the last batch, counted above.
                cached_bytes=reserved - allocated if self.decoder is not None else 0,
                context_bytes=self.context_bytes,
            )
        return rep

    # ------------------------------------------------------------------ weights

    def load_named_tensors(self, named: list[tuple[str, torch.Tensor]] | Any, weight_version: str | None) -> int:
        with self._model_lock:
            if "weights" in self.released:
                raise EngineStateError("weights are released; resume weights before updating them")
            n = self._copy_into(named, wait=False)
            self.weights_valid = True
            if weight_version is not None:
                self.weight_version = str(weight_version)
        # Outside the lock: one request's copy runs while the next one is checked and queued
        # (generation queues behind the copies on the same stream).
        self._wait_copies()
        return n

    def load_bucket(self, flat: torch.Tensor, metadata: list[Any], weight_version: str | None) -> int:
        """A flattened bucket (SGLang's `flattened_bucket`: a uint8 buffer and per-tensor metadata).
        Its layout is checked against the model once and kept: a bucket whose every tensor has
        its parameter's dtype and needs no index is then one split and one fused copy."""
        hit = self._bucket_keys.get(id(metadata))  # the server passes a kept payload's same list
        if hit is not None and hit[0] is metadata:
            key = hit[1]
        else:
            key = tuple((m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx) for m in metadata)
            if len(self._bucket_keys) >= 4096:
                self._bucket_keys.clear()
            self._bucket_keys[id(metadata)] = (metadata, key)  # (held: its id stays its own)
        with self._model_lock:
            if "weights" in self.released:
                raise EngineStateError("weights are released; resume weights before updating them")
            plan = self._bucket_plans.get(key)
            if plan is None:
                plan = self._bucket_plan(metadata)
                if len(self._bucket_plans) >= 4096:  # layouts change only with the sender's plan
                    self._bucket_plans.clear()
                self._bucket_plans[key] = plan
            layout, dsts = plan
            views = layout.views(flat)
            if dsts is None:
                n = self._copy_into([(m.name, v.view(m.shape)) for m, v in zip(metadata, views)], wait=False)
            else:
                t0 = time.perf_counter()
                internals.foreach_copy_(dsts, views, non_blocking=True)
                self._queued(layout.tensor_bytes, t0, t0)
                n = len(views)
            self.weights_valid = True
            if weight_version is not None:
                self.weight_version = str(weight_version)
        self._wait_copies()
        return n

    def _bucket_plan(self, metadata: list[Any]) -> tuple[Any, list[torch.Tensor] | None]:
        """(the bucket's `BucketViews`, each tensor's destination as a 1-D view of its parameter, or
        None when some tensor needs a cast or an index: those go through `_copy_into`)."""
        layout = BucketViews(metadata)
        dsts: list[torch.Tensor] | None = []
        for m in metadata:
            target, index = self._checked_target(m.name, m.shape)
            data = target.data
            if dsts is not None and index is None and m.dtype == data.dtype and data.is_contiguous():
                dsts.append(data.view(-1))
            else:
                dsts = None
        return layout, dsts

    def load_from_disk(self, model_path: str, weight_version: str | None) -> int:
        """Load a weight directory: a published version is checked against its manifest as it is
        read (`"weight_files": "verified"` in /get_server_info), so the trainer need not read it
        first. Nothing is changed unless every file and tensor is good."""
        state = read_weights(Path(model_path))
        state = {n: t for n, t in state.items() if self.owns(n)}  # an EP rank loads its experts only
        expected = {n for n in self._checkpoint_names if self.owns(n)}
        covered = set()
        for group in self._aliases:
            if any(n in state for n in group):
                covered |= set(group)
        missing = sorted(n for n in expected - set(state) - covered)
        if missing:
            raise ValueError(f"{model_path}: missing {len(missing)} parameters, e.g. {missing[:5]}")
        with self._model_lock:
            if "weights" in self.released:
                raise EngineStateError("weights are released; resume weights before updating them")
            n = self._copy_into(state.items())
            self.weights_valid = True
            self.model_path = model_path
            if weight_version is not None:
                self.weight_version = str(weight_version)
            return n

    def _target(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
        """(parameter or buffer, index into it or None, checkpoint shape) for a weight name."""
        hit = self._targets.get(name)
        if hit is not None:
            return hit
        target, index, shape = self._tensors.get(name), None, None
        if target is None and name in self._checkpoint_names:
            module_name, index, shape = self._checkpoint_names[name]
            target = self._tensors.get(module_name)
            index = None if index is None else index.to(self.device)
        if target is None:
            raise KeyError(f"unknown parameter {name!r} for {type(self.model).__name__}")
        hit = self._targets[name] = (target, index, tuple(shape if shape is not None else target.shape))
        return hit

    def _copy_into(self, named: Any, wait: bool = True) -> int:
        """Check every name and shape first, then copy: a bad update changes nothing. Returns
        once the copies are done, or with `wait=False` once queued (`_wait_copies`)."""
        t0 = time.perf_counter()
        plan, nbytes = [], 0
        for name, t in named:
            target, index = self._checked_target(name, t.shape)
            plan.append((target, index, t, index is None and (t.dtype, t.device) == (target.dtype, target.device)))
            nbytes += t.numel() * t.element_size()
        t1 = time.perf_counter()
        direct, staged = [], []  # staged: from pageable host memory (a disk load), through page-locked buffers
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
            self._wait_copies()
        return len(plan)

    def _checked_target(self, name: str, shape: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_target` of a weight an update sends, refused unless this engine owns it in that shape."""
        target, index, expected = self._target(name)
        if not self.owns(name):
            raise ValueError(
                f"parameter {name!r} belongs to another EP rank (this engine is EP rank "
                f"{self.ep_rank} of {self.ep_size})"
            )
        if tuple(shape) != expected:
            raise ValueError(f"parameter {name!r}: shape {tuple(shape)} does not match the model's {expected}")
        return target, index

    def _queued(self, nbytes: int, t0: float, t1: float) -> None:
        """Copies of `nbytes` are queued (checked from t0, copying from t1): count them, and mark
        where this thread's `_wait_copies` waits to."""
        self.bytes_loaded += nbytes
        self._local.copied = None
        if self.device.type == "cuda":
            self._local.copied = torch.cuda.Event()
            self._local.copied.record()
        self._local.update_ms = {"check": (t1 - t0) * 1e3, "copy": (time.perf_counter() - t1) * 1e3}

    def _wait_copies(self) -> None:
        """Wait for this thread's last `_copy_into` (the sender may reuse its buffers after)."""
        t0 = time.perf_counter()
        if self._local.copied is not None:
            self._local.copied.synchronize()
        self._local.update_ms["wait"] = (time.perf_counter() - t0) * 1e3

    @property
    def last_update_ms(self) -> dict[str, float]:
        """This thread's last weight update: check, copy (launch) and wait, ms."""
        return getattr(self._local, "update_ms", {})

    def owns(self, name: str) -> bool:
        """Whether this engine holds `name` as one EP rank of a group of engines (always, in any
        other layout: an engine over several TP ranks holds every rank's experts)."""
        if self.ep_size <= 1 or self.tp_size > 1:
            return True
        expert = classify(name).expert
        return expert is None or expert // self._experts_per_rank == self.ep_rank

    def rank_owns(self, tp_rank: int, name: str) -> bool:
        """Whether TP rank `tp_rank` of this engine holds `name`: its EP rank's experts, and every
        weight that is not a routed expert."""
        if self.ep_size <= 1:
            return True
        expert = classify(name).expert
        return expert is None or expert // self._experts_per_rank == self.rank_ep[tp_rank]

    def load_per_rank(self, entries: list[list[tuple[str, torch.Tensor]]], weight_version: str | None) -> int:
        """One update request of an engine over several TP ranks: entry k is what TP rank k was
        sent. Everything is checked before anything is copied (a bad update changes nothing):
        each rank is sent only weights it holds, at most once; the ranks of one EP rank are sent
        the same names, every rank the same non-expert names; a weight sent to several ranks is
        the same tensor in each. Then each weight is copied once. Returns the tensors copied."""
        if len(entries) != self.tp_size:
            raise ValueError(f"{len(entries)} per-rank payloads; this engine has {self.tp_size} TP ranks")
        first: dict[str, torch.Tensor] = {}
        names_of: list[set[str]] = []
        for k, named in enumerate(entries):
            names = [n for n, _ in named]
            mine = set(names)
            if len(mine) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})
                raise ValueError(f"TP rank {k}'s payload carries {twice[:5]} more than once")
            foreign = sorted(n for n in mine if not self.rank_owns(k, n))
            if foreign:
                raise ValueError(
                    f"TP rank {k} (EP rank {self.rank_ep[k]} of {self.ep_size}) was sent experts it does not "
                    f"hold: {foreign[:5]}"
                )
            for n, t in named:
                seen = first.setdefault(n, t)
                if seen is not t and (seen.shape != t.shape or seen.dtype != t.dtype or not torch.equal(seen, t)):
                    raise ValueError(f"TP ranks' copies of {n!r} differ (rank {k}'s is not rank 0's)")
            names_of.append(mine)
        dense_names = {n for n in first if classify(n).expert is None}  # each name classified once
        dense0 = names_of[0] & dense_names
        for k, mine in enumerate(names_of):
            dense = mine & dense_names
            peer = self.rank_ep.index(self.rank_ep[k])  # the first TP rank of k's EP rank
            if dense != dense0 or mine - dense != names_of[peer] - dense0:
                lacks = sorted((dense0 - dense) | (names_of[peer] - mine))
                extra = sorted((dense - dense0) | (mine - names_of[peer]))
                raise ValueError(
                    f"TP rank {k}'s payload differs from its peers': it lacks {lacks[:5]}, and has {extra[:5]} "
                    "that they lack (every rank is sent every non-expert weight of the request, each EP rank's "
                    "ranks the same experts)"
                )
        n = self.load_named_tensors(list(first.items()), weight_version)
        for k, named in enumerate(entries):
            self.rank_bytes_loaded[k] += sum(t.numel() * t.element_size() for _, t in named)
        return n

    @torch.no_grad()
    def weights_checksum(self) -> dict[str, Any]:
        """The checksum (weights/checksum.py) of every weight this engine owns, by checkpoint name."""
        with self._model_lock:
            if "weights" in self.released:
                raise EngineStateError("weights are released; resume weights before checking them")
            tensors = self._tensors
            sums = {}
            for name, (module_name, index, shape) in self._checkpoint_names.items():
                if not self.owns(name):
                    continue
                t = tensors[module_name]
                sums[name] = entry(t if index is None else t.reshape(-1)[index.to(t.device)].reshape(shape))
            sums = fetched(sums)  # once: the ranks' checksums below combine subsets of them
            rep: dict[str, Any] = {
                "checksum": combine(sums),
                "count": len(sums),
                "dtype": str(self.dtype).removeprefix("torch."),
                "weight_version": self.weight_version,
                "bytes_loaded": self.bytes_loaded,
                "ep_rank": self.ep_rank,
                "ep_size": self.ep_size,
            }
            if self.tp_size > 1:  # what each TP rank holds: its EP rank's experts and every other weight
                rep["ranks"] = []
                for k in range(self.tp_size):
                    held = {n: v for n, v in sums.items() if self.rank_owns(k, n)}
                    rep["ranks"].append(
                        {
                            "tp_rank": k,
                            "ep_rank": self.rank_ep[k],
                            "checksum": combine(held),
                            "count": len(held),
                            "bytes_loaded": self.rank_bytes_loaded[k],
                        }
                    )
            return rep

    def param_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._param_meta)


def _paged_wanted(decode: str, device: torch.device) -> bool:
    """Whether `decode` asks for the paged path on `device` (auto: on CUDA)."""
    if decode not in ("auto", "paged", "hf"):
        raise ValueError(f"decode={decode!r}: expected auto, paged or hf")
    return decode == "paged" or (decode == "auto" and device.type == "cuda")


def _tags(tags: list[str] | None) -> list[str]:
    """SGLang's memory regions (None: all). Without the memory saver, the paged path's CUDA
    graphs are dropped with any region (they hold the weights' and the KV pool's addresses) and
    captured again when needed; with it, `cuda_graph` is their memory pool, unmapped and mapped
    again. On the plain path that region holds nothing, but is released and resumed like the
    others (generation waits for it)."""
    tags = list(tags) if tags else ["weights", "kv_cache", "cuda_graph"]
    bad = [t for t in tags if t not in ("weights", "kv_cache", "cuda_graph")]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; expected weights, kv_cache, cuda_graph")
    return tags


def _eos_ids(model: Any) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids |= {int(x) for x in e}
    return ids


def _alias_groups(model: torch.nn.Module) -> list[list[str]]:
    by_ptr: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_ptr.setdefault(p.data_ptr(), []).append(n)
    return [names for names in by_ptr.values() if len(names) > 1]
