"""The inference engines: the backend, their layout over a node's GPUs, SGLang's arguments and
the embedded engine's own settings (engine, engine.embedded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rltrain.config.errors import ConfigError


@dataclass
class EmbeddedEngineConfig:
    """Keys only the embedded engine reads (`engine.backend: embedded`); SGLang takes its own
    through `engine.extra_args`."""

    max_batch_size: int = 256  # sequences decoded together
    # On CUDA: the transformer blocks of decode steps and prefills torch.compiled (fused norms,
    # rotary and activations; start-up pays the compilation once).
    compile: bool = True
    # On CUDA: the weights, KV cache and CUDA graphs' memory through
    # torch_memory_saver (SGLang's --enable-memory-saver; SGLang on CUDA always has it), so they
    # are released and resumed at the same addresses and the captured graphs are kept, not
    # captured again at every rollout. auto: where torch_memory_saver is installed.
    memory_saver: bool | Literal["auto"] = "auto"
    # How the engine's process starts on the CPU. auto: forked from its rank, which has
    # imported torch and transformers already (no second import per engine), where a fork is
    # safe (engine/forked.py: no CUDA, no other thread in the rank), else a new interpreter;
    # exec: always a new interpreter. SGLang and engines on GPUs always start as new programs.
    start: Literal["auto", "exec"] = "auto"
    # HTTP (framing, JSON, the API key) in the engine's process, the model and its scheduler in a
    # child process of it, as SGLang splits its server (engine/embedded/split.py): the scheduler
    # then does not share the interpreter lock with the threads answering HTTP requests. auto: for
    # multi-turn rollouts on GPUs (1.7B, 512 trajectories x 4 turns on an H100: 65% of the
    # single-turn tokens/s against 55%, BENCHMARKS.md); elsewhere measured no faster (2 CPU cores).
    separate_http_process: bool | Literal["auto"] = "auto"

    def check(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError(f"engine.embedded.max_batch_size={self.max_batch_size}: expected >= 1")


@dataclass
class EngineConfig:
    """The node's rollout engine: real SGLang or the embedded engine, same HTTP protocol."""

    # auto: SGLang where it is installed and a GPU is present, else the embedded engine.
    backend: Literal["auto", "embedded", "sglang"] = "auto"
    # Empty: model.path.
    model_path: str = ""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Each engine's GPUs (its TP size): the node's GPUs are split into LOCAL_WORLD_SIZE /
    # gpus_per_engine engines (engine/layout.py). 0: SGLang one engine over the node, the
    # embedded engine one per GPU.
    gpus_per_engine: int = 0
    # Engines on GPUs of their own (needs loop.colocate=false): on each node, this many GPUs after
    # the trainer ranks' (torchrun --nproc-per-node of them) serve rollout, cut into engines of
    # gpus_per_engine (0 there: SGLang one engine over them all, the embedded engine one per GPU).
    # 0: the engines run on the ranks' own GPUs (engine/layout.py).
    gpus: int = 0
    # Share of GPU memory for weights + KV cache (SGLang; the embedded engine's paged path).
    mem_fraction_static: float = 0.8
    # Tokens in each engine's KV pool, at most (SGLang's --max-total-tokens; the embedded engine
    # takes the same flag): never more than mem_fraction_static gives. 0: what mem_fraction_static
    # gives (SGLang's default). auto: engines colocated on GPUs get what one step's rollout can
    # hold in them at once (`engine.pool.rollout_tokens`: the rows their ranks send, each a
    # prompt of data.max_prompt_tokens and its whole response or trajectory), so that the rest
    # of the device is the trainer's (loop.offload_trainer=auto keeps its state there when it
    # fits); elsewhere, or where engine.extra_args has --max-total-tokens, 0.
    max_total_tokens: int | Literal["auto"] = "auto"
    seed: int = 0
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    max_inflight: int = 32  # concurrent HTTP requests per rank
    prompts_per_request: int = 16
    retries: int = 3  # transport errors only
    # An engine process that dies during rollout is started again this many times per job (its
    # weights re-sent, the generations it lost retried); one more death stops the job with the
    # engine's log tail.
    max_restarts: int = 1
    extra_args: list[str] = field(default_factory=list)  # appended to the server command line
    # Batch-invariant rollouts: the embedded engine runs each request on its own (no batching
    # across requests), SGLang gets --enable-deterministic-inference. With per-step sampling
    # seeds this makes runs, and resumed runs, repeat exactly.
    deterministic: bool = False
    # Every endpoint of the engine then needs `Authorization: Bearer <api_key>` (servers bind to
    # loopback anyway). The embedded engine gets the key through its environment, SGLang through
    # its --api-key flag (visible in the process list: SGLang takes it no other way).
    api_key: str = ""
    # Release the engines' memory (weights, KV cache, CUDA graphs) while the trainer trains
    # (colocated). auto: on GPUs, where that device memory is what the trainer needs; an engine on
    # the CPU keeps its memory (what it would free is host memory, and release, resume and the
    # weights' rewrite would cost every step for it). SGLang releases on CUDA only.
    release: bool | Literal["auto"] = "auto"
    # Keep a host copy of the weights while they are released (SGLang's
    # --enable-weights-cpu-backup; the embedded engine's --weights-backup). Off: released weights
    # are discarded and come back as garbage until the sync rewrites every parameter — the
    # post-sync verification is what proves it did — and no step pays a device->host->device
    # copy of the whole model.
    weights_backup: bool = False
    embedded: EmbeddedEngineConfig = field(default_factory=EmbeddedEngineConfig)  # engine.embedded.*

    def check(self) -> None:
        if self.gpus < 0:
            raise ConfigError(f"engine.gpus={self.gpus}: expected >= 1 GPUs of the engines' own per node, or 0")
        if self.gpus_per_engine < 0:
            raise ConfigError(f"engine.gpus_per_engine={self.gpus_per_engine}: expected >= 1, or 0 for the default")
        for key in ("max_inflight", "prompts_per_request"):
            if getattr(self, key) < 1:
                raise ConfigError(f"engine.{key}={getattr(self, key)}: expected >= 1")
        for key in ("retries", "max_restarts"):
            if getattr(self, key) < 0:
                raise ConfigError(f"engine.{key}={getattr(self, key)}: expected >= 0")
        if not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"engine.mem_fraction_static={self.mem_fraction_static}: expected a fraction in (0, 1)")
        if self.max_total_tokens != "auto" and self.max_total_tokens < 0:
            raise ConfigError(
                f"engine.max_total_tokens={self.max_total_tokens}: expected tokens >= 1, 0 (from "
                "engine.mem_fraction_static) or auto (what a step's rollout holds at once)"
            )
        if "--max-total-tokens" in self.extra_args and self.max_total_tokens != "auto":
            raise ConfigError(
                f"engine.max_total_tokens={self.max_total_tokens} and --max-total-tokens in engine.extra_args: "
                "set one of them"
            )
        for key in ("startup_timeout_s", "request_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"engine.{key}={getattr(self, key)}: expected a positive number of seconds")
