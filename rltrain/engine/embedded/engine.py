"""The embedded engine: a transformers causal LM behind SGLang's verbs, composed of parts.

    engine = EmbeddedEngine(model_path, device="cuda", dtype="bfloat16")
    engine.submit(input_ids, SamplingParams(...), return_logprob=True).result()
    engine.release(["weights"]); engine.resume(["weights"])
    engine.load_bucket(flat, metadata, weight_version="3")

This facade loads and owns the model, and holds one of each part, each with one job:
- `scheduler` (scheduler.py): the request queue and the thread that generates, through the paged
  path (batching.py over paged.py, graphs.py, kv_pool.py: on CUDA, or `decode="paged"`) or the
  plain one (plain.py: the CPU default, `decode="hf"`, or a model the paged path cannot run);
- `receiver` (receiver.py): weight updates of every transport, checked and copied in (writer.py),
  the expert layout they follow (experts.py), and the weights' checksums;
- `residency` (residency.py): release and resume of weights, KV cache and graphs, the weights'
  backup, the memory report; with the memory saver (saver.py) at the same addresses.
They share one `EngineState` (state.py): the lock, the regions released, the weights' version.
Both paths sample as sampling.py says; per-token log-probs are those of the distribution the
token was sampled from (log_softmax of logits / temperature; raw logits for greedy), as SGLang
returns them. The parts never import this module: what they need is passed in.
"""

from __future__ import annotations

import gc
import logging
from concurrent.futures import Future
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rltrain.engine.embedded.batching import ContinuousBatcher
from rltrain.engine.embedded.experts import ExpertLayout
from rltrain.engine.embedded.fused import FusedProjections
from rltrain.engine.embedded.paged import PagedDecoder, unsupported
from rltrain.engine.embedded.plain import PlainRunner
from rltrain.engine.embedded.receiver import WeightReceiver
from rltrain.engine.embedded.residency import Residency
from rltrain.engine.embedded.sampling import token_hash_of
from rltrain.engine.embedded.saver import MemorySaver, in_region
from rltrain.engine.embedded.scheduler import Scheduler
from rltrain.engine.embedded.scoring import SequenceScorer
from rltrain.engine.embedded.state import EngineState, EngineStateError
from rltrain.engine.embedded.writer import WeightWriter
from rltrain.generation import SamplingParams
from rltrain.runtime.dtypes import resolve_dtype
from rltrain.runtime.ledger import measure_cuda_context
from rltrain.weights.hf_files import context_length_of

__all__ = ["EmbeddedEngine", "EngineStateError"]

FLUSH_WAIT_S = 2.0

log = logging.getLogger("rltrain.engine.embedded")


class EmbeddedEngine:
    """A transformers causal LM behind a batching scheduler thread (module doc)."""

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
        weight_version: str = "default",
        overlap: bool = True,
        prefill_pieces: bool = False,
        prefill_cuda_graph: bool | None = None,
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)  # the first visible device (asking torch would touch the GPU)
        # Measured before anything else touches the GPU (the memory ledger shows it).
        context_bytes = measure_cuda_context(self.device)[0]
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
        self.eos_ids = _eos_ids(self.model)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._token_hash = token_hash_of(self.config.vocab_size, self.device)  # seeded sampling's, per token
        self.state = EngineState(model_path, weight_version)
        aliases = _alias_groups(self.model)  # names sharing one storage (tied embeddings)
        self.layout = ExpertLayout(self.config, ep_size, ep_rank, tp_size)
        writer = WeightWriter(self.model, self.device, self.layout)
        self.receiver = WeightReceiver(writer, self.state, aliases, self.dtype)
        # Prefills replayed from CUDA graphs (graphs.py) by default where the graphs last: with the
        # memory saver (1.7B, 512 multi-turn trajectories on an H100: 69% of single-turn's
        # tokens/s against 60% queued eagerly, BENCHMARKS.md).
        prefill_graphs = self.saver is not None if prefill_cuda_graph is None else prefill_cuda_graph
        self.decoder = self._paged_decoder(
            decode, max_total_tokens, mem_fraction_static, cuda_graphs, compile, prefill_graphs
        )
        self.residency = Residency(
            self.model,
            self.device,
            self.state,
            writer,
            aliases,
            self.decoder,
            self.fused,
            self.saver,
            weights_backup,
            backup_dir,
            context_bytes,
        )
        self.scorer = SequenceScorer(self.model, self.device, self.saver, graphs=cuda_graphs)  # the syncs' probe
        paged = None
        if self.decoder is not None:
            paged = ContinuousBatcher(
                self.decoder, self._generator, self.token_hash, self.eos_ids, deterministic, overlap, prefill_pieces
            )
        plain = PlainRunner(self.model, self.device, self._generator, self.token_hash, self.eos_ids)
        self.scheduler = Scheduler(
            self.state, self.config.vocab_size, self.context_length, max_batch_size, deterministic, plain, paged
        )
        # What start-up made (modules, the model, compiled code: millions of objects with
        # torch.compile) lives as long as the engine: collected once, then no collection walks
        # it again (generation runs with no automatic collection at all: `gc_paused`).
        gc.collect()
        gc.freeze()
        self.scheduler.start()

    def _paged_decoder(
        self,
        decode: str,
        max_total_tokens: int,
        mem_fraction: float,
        cuda_graphs: bool,
        compile: bool,
        prefill_graphs: bool = False,
    ) -> PagedDecoder | None:
        """The paged path (paged.py) where asked for, or by default on CUDA where the model runs on
        it: it must pass its start-up probe against transformers' own forward. None: the plain
        transformers path (plain.py), one batch at a time."""
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
                self.saver,
                prefill_graphs,
            )
            try:
                diff = _verify(decoder)
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

    # ------------------------------------------------------------------ generation (scheduler.py)

    def submit(
        self,
        input_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        return_logprob: bool,
        ids: list[str] | None = None,
        logprob_values: bool = False,
    ) -> Future:
        """Queue `n` samples of each prompt (scheduler.py's `submit`): the future's result is the
        list of every sample's SGLang result dict, prompt-major."""
        return self.scheduler.submit(input_ids, params, return_logprob, ids, logprob_values)

    @torch.no_grad()
    def score(self, input_ids: list[int]) -> list[float]:
        """Log-probs of `input_ids[1:]`, each given the tokens before it, at temperature 1
        (SGLang's input_token_logprobs): one forward over the sequence (on CUDA, replayed from
        the graph captured for that sequence: scoring.py)."""
        with self.state.lock:  # (checked under it: a release may take the lock first)
            self.state.check_can_generate()
            return self.scorer.score(input_ids)

    def token_hash(self, vocab: int) -> torch.Tensor | None:
        """Seeded sampling's token hash, kept for the model's vocabulary (None: another width)."""
        return self._token_hash if self._token_hash.numel() == vocab else None

    def flush_cache(self) -> None:
        """Empty the prefix cache (SGLang's /flush_cache): refused while requests run (after
        FLUSH_WAIT_S for the scheduler to let go of the engine: it answers a batch's requests
        before it leaves it)."""
        if not self.state.lock.acquire(timeout=FLUSH_WAIT_S):
            raise EngineStateError(
                "cache not flushed: requests are running (SGLang flushes only an idle engine); flush after the rollout"
            )
        try:
            self.state.changed()
            if self.decoder is not None:
                self.decoder.forget_prefixes()
        finally:
            self.state.lock.release()

    def pause(self, mode: str) -> None:
        """abort: in-flight rows end now with finish reason abort; in_place/retract: hold them."""
        self.scheduler.pause(mode)

    def resume_generation(self) -> None:
        self.scheduler.resume()

    def shutdown(self) -> None:
        self.scheduler.stop()
        self.residency.remove_backup_dir()

    # ------------------------------------------------------------------ memory (residency.py)

    def release(self, tags: list[str] | None) -> dict[str, Any]:
        if self.saver is None:  # (with the saver, the graph's memory is paused with its region)
            with self.state.lock:
                self.scorer.drop(for_good=True)
        self.residency.release(tags)
        return self.memory_report()

    def resume(self, tags: list[str] | None) -> dict[str, Any]:
        self.residency.resume(tags)
        return self.memory_report()

    def memory_report(self) -> dict[str, Any]:
        return self.residency.memory_report()

    # ------------------------------------------------------------------ weights (receiver.py)

    def load_named_tensors(self, named: list[tuple[str, torch.Tensor]] | Any, weight_version: str | None) -> int:
        return self.receiver.load_named_tensors(named, weight_version)

    def load_bucket(self, flat: torch.Tensor, metadata: list[Any], weight_version: str | None) -> int:
        return self.receiver.load_bucket(flat, metadata, weight_version)

    def load_per_rank(self, entries: list[list[tuple[str, torch.Tensor]]], weight_version: str | None) -> int:
        return self.receiver.load_per_rank(entries, weight_version)

    def load_from_disk(self, model_path: str, weight_version: str | None) -> int:
        return self.receiver.load_from_disk(model_path, weight_version)

    def weights_checksum(self) -> dict[str, Any]:
        return self.receiver.checksum()

    def param_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self.residency.param_meta)

    # ------------------------------------------------------------------ state (state.py)

    @property
    def model_path(self) -> str:
        """The directory the weights were last loaded from (start-up or /update_weights_from_disk)."""
        return self.state.model_path

    @property
    def weight_version(self) -> str:
        return self.state.weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        self.state.weight_version = version

    @property
    def released(self) -> set[str]:
        return self.state.released

    @property
    def weights_valid(self) -> bool:
        return self.state.weights_valid


def _paged_wanted(decode: str, device: torch.device) -> bool:
    """Whether `decode` asks for the paged path on `device` (auto: on CUDA)."""
    if decode not in ("auto", "paged", "hf"):
        raise ValueError(f"decode={decode!r}: expected auto, paged or hf")
    return decode == "paged" or (decode == "auto" and device.type == "cuda")


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


def _verify(decoder: PagedDecoder) -> float:
    """The paged path's start-up probe (`PagedDecoder.verify`). Where the extend kernel does not
    build or agree on this device, extending prompts attend over gathered pages instead, said
    loudly (tests/test_gpu.py asserts the kernel is the one in use)."""
    if decoder.extend_impl == "triton":
        try:
            return decoder.verify()
        except Exception as e:  # noqa: BLE001 - a kernel that fails to build or to agree here, whatever it raises
            log.warning(
                "the paged extend kernel failed the start-up probe (%s: %s): prompts that extend cached keys "
                "attend over their pages gathered instead (slower)",
                type(e).__name__,
                e,
            )
            decoder.extend_impl = "torch"
    return decoder.verify()
