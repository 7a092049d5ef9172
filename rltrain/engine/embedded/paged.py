"""The embedded engine's fast path: a paged KV cache, decode steps replayed as CUDA graphs, and
continuous batching.

    decoder = PagedDecoder(model, device, max_rows, context_length, pool_tokens, cuda_graphs)
    decoder.serve(first_request, take_queued, ...)   # until nothing runs and nothing waits

**KV pages.** One pool per engine, allocated once (`KVPool`: every layer's keys and values,
[layers, pages, kv_heads, page_size, head_dim]); page 0 is scratch, where the padding rows of
a graph write. A row reserves at admission the pages its prompt plus `max_new_tokens` can fill,
so decoding never waits for memory; requests that do not fit wait until rows finish. The n
samples of one prompt share the prompt's full pages (prefilled once) and each gets a copy of
its last, partial page (copy-on-write at the fork).

**The model.** transformers' own modules run the forward: the layers' attention goes through
transformers' attention interface to `_paged_attention` (registered under its own name). Prefill
packs every admitted prompt into one sequence (no padding), writes the prompts' keys and values
into their pages (the cache object the model updates) and runs causal attention per group of
equal-length prompts; decode runs `paged_decode_attention` (kernels/), which stores each row's
new key and value in its last slot and reads the row's pages up to its length, in one kernel per
layer. Each layer's q/k/v and gate/up projections run as one GEMM each (fused.py, set up by the
engine for this path). At start-up a probe checks the path against transformers' plain forward
(`verify`); a model whose attention does not go through the interface fails it.

**CUDA graphs.** A decode step (every layer and the LM head) is captured once per batch-size
bucket and replayed: its inputs are static tensors (token, position, page table, length) filled
before each replay; rows past the batch point at the scratch page; a captured graph serves
batches down to a quarter of its size. Sampling runs after the replay, batched, in one pass over
the logits on CUDA (sampling.py). Graphs hold the weights' and the pool's addresses. With the
memory saver (saver.py: SGLang's, for this engine) those addresses, and the graphs' own memory,
come back at resume: the graphs are kept through releases. Without it they are dropped whenever
either is released, and a growing batch after a release is captured once at the largest size
captured before (`_graph_for`).

**Continuous batching.** Between decode steps, finished rows leave (their requests are answered
at once, their pages freed) and queued requests join (prefilled, then decoding with the rest).

**Overlap.** Step t+1 is queued (its input tokens are step t's samples, on the device) before the
host reads step t's tokens, so Python's per-step work runs while the device computes (`_serve`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from rltrain.engine.embedded.rows import GenRequest, Row
from rltrain.engine.embedded.sampling import LogitShaper, SamplingPlan, device_tensor, sample
from rltrain.engine.embedded.saver import MemorySaver, in_region
from rltrain.kernels.decode_attention import paged_decode_attention
from rltrain.runtime import internals

log = logging.getLogger("rltrain.engine.embedded")

PAGE_SIZE = 64  # tokens per KV page
ATTENTION = "rltrain_paged"
PREFILL_TOKENS = 16384  # prompt tokens per prefill forward (SGLang's chunked_prefill_size, larger)
_BUCKETS = sorted({s for k in range(14) for s in (1 << k, 3 << k >> 1) if s >= 1})


def unsupported(config: Any) -> str | None:
    """Why the paged path cannot run this model (None: it can): sliding windows, cross attention,
    head sizes the kernel does not take."""
    types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in types) or getattr(config, "use_sliding_window", False):
        return "it has sliding-window or other non-full attention layers"
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder"
    if not hasattr(config, "num_hidden_layers") or not hasattr(config, "num_attention_heads"):
        return "its config has no num_hidden_layers / num_attention_heads"
    d = head_dim_of(config)
    if d & (d - 1) or d < 16:
        return f"its head dim {d} is not a power of two >= 16"
    return None


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class KVPool:
    """Every layer's keys and values in pages of `page_size` tokens, with a free list and
    reference counts (a prompt's pages are shared by its samples). Page 0 is never handed out."""

    def __init__(self, config: Any, pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        kvh = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        shape = (config.num_hidden_layers, pages, kvh, page_size, head_dim_of(config))
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.pages = pages
        self._free = list(range(pages - 1, 0, -1))
        self._refs = [0] * pages

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool: {n} pages asked, {len(self._free)} free")  # callers check `free` first
        got = [self._free.pop() for _ in range(n)]
        for p in got:
            self._refs[p] = 1
        return got

    def share(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    @staticmethod
    def page_bytes(config: Any, page_size: int, dtype: torch.dtype) -> int:
        kvh = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        size = torch.tensor([], dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * kvh * page_size * head_dim_of(config) * size


@dataclass
class _Step:
    """What one forward's attention and cache read. Decode: each row's page table and length
    (the attention kernel writes the new key and value at the row's last slot). Prefill: the
    slot each prompt token's key goes to (page, offset), and the groups of equal-length prompts
    in the packed sequence (start, count, length), host ints."""

    pool: KVPool
    table: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    page: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    groups: list[tuple[int, int, int]] | None = None


_current = threading.local()  # the running forward's _Step (each engine's scheduler is its own thread)


class _PagedCache:
    """The cache object transformers' layers update: in prefill it writes the new keys and values
    into the pool; in decode the attention kernel writes them (one kernel, not two scatters).
    Either way it hands them back unchanged (the attention reads the pool itself). Runs eagerly
    in compiled blocks (it reads the running forward's thread-local step)."""

    @torch.compiler.disable
    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        step: _Step = _current.step
        _current.updates += 1
        if step.groups is None:  # decode: `_paged_attention` stores them
            return k, v
        # k, v [B, kv_heads, L, D] -> one [tokens, kv_heads, D] row per slot
        kk = k.transpose(1, 2).reshape(-1, k.shape[1], k.shape[3])
        vv = v.transpose(1, 2).reshape(-1, v.shape[1], v.shape[3])
        step.pool.k[layer_idx][step.page, :, step.offset] = kk
        step.pool.v[layer_idx][step.page, :, step.offset] = vv
        return k, v


@torch.compiler.disable
def _paged_attention(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q [B, H, L, D] -> [B, L, H, D]."""
    step: _Step = _current.step
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    layer = module.layer_idx  # type: ignore[attr-defined]
    _current.attentions += 1
    if step.groups is None:  # decode: one new token per row, stored, then attended over its pages
        assert step.table is not None and step.lens is not None
        pool = step.pool
        out = paged_decode_attention(
            q[:, :, 0], pool.k[layer], pool.v[layer], step.table, step.lens, scale, k[:, :, 0], v[:, :, 0]
        )
        return out[:, None], None
    # prefill: the packed prompts [1, H, T, D], causal within each, one SDPA per length group
    outs = []
    for start, count, length in step.groups:
        end = start + count * length
        qs, ks, vs = (x[0, :, start:end].unflatten(1, (count, length)).transpose(0, 1) for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(o.transpose(1, 2).reshape(count * length, q.shape[1], q.shape[3]))
    return torch.cat(outs)[None], None


AttentionInterface.register(ATTENTION, _paged_attention)


@dataclass
class _Seq:
    """A decoding row and its pages (its prompt's shared full pages first, then its own)."""

    row: Row
    pages: list[int]


@dataclass
class _Launched:
    """A decode step queued on the device: its rows, and their sampled tokens and log-probs
    ([2, rows] float64) being copied to the host, there once `ready` has passed (None: there)."""

    seqs: list[_Seq]
    host: torch.Tensor
    ready: Any


def _to_host(tokens: torch.Tensor, logps: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start copying (tokens, log-probs) to the host: (the host tensor, the event after which it
    holds them; None on CPU)."""
    both = torch.stack([tokens.double(), logps.double()])
    if not both.is_cuda:
        return both, None
    host = both.to("cpu", non_blocking=True)  # (pinned, from the caching host allocator)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class _Graph:
    """One captured decode step for batches of up to `size` rows (static inputs and logits)."""

    def __init__(self, size: int, max_pages: int, device: torch.device):
        self.size = size
        self.ids = torch.zeros(size, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(size, 1, dtype=torch.long, device=device)
        self.table = torch.zeros(size, max_pages, dtype=torch.int32, device=device)
        self.lens = torch.ones(size, dtype=torch.int32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class PagedDecoder:
    """The paged, graph-replayed, continuously batched generation of one engine (module doc).
    Its pool is made at the first generation (`allocate`) and dropped by `free_memory`."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        max_rows: int,
        context_length: int,
        pool_tokens: int,
        mem_fraction: float,
        cuda_graphs: bool,
        compile: bool,
        generator: torch.Generator,
        token_hash: Callable[[int], torch.Tensor | None],
        eos_ids: set[int],
        deterministic: bool = False,
        saver: MemorySaver | None = None,
    ):
        self.model = model
        self.config = model.config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        head = model.get_output_embeddings()
        self.vocab = head.weight.shape[0] if head is not None else model.config.vocab_size
        self.max_rows = max_rows
        self.page_size = PAGE_SIZE
        self.max_pages = -(-context_length // PAGE_SIZE)
        self.pool_tokens = pool_tokens
        self.mem_fraction = mem_fraction
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        # Decode steps run the transformer blocks torch.compiled (dynamic batch size: one graph
        # serves every bucket): inductor fuses the norms, rotary and activation around the
        # matmuls, which eager runs as ~20 small kernels per block. The attention and the cache
        # writes stay eager between the compiled halves of a block.
        if compile:  # (the blocks pass their layer index to the cache: one graph for all of them)
            internals.get("torch._dynamo.config").allow_unspec_int_on_nn_module = True
        blocks = set(getattr(model, "_no_split_modules", None) or [])
        self._compiled = (
            [
                (m, m.forward, torch.compile(m.forward, dynamic=True))
                for m in model.modules()
                if type(m).__name__ in blocks
            ]
            if compile
            else []
        )
        self.generator = generator
        self.token_hash = token_hash
        self.eos_ids = eos_ids
        self.deterministic = deterministic
        # With the memory saver (saver.py) the pool and the graphs' memory keep their addresses
        # through release and resume: the graphs are kept, not captured again.
        self.saver = saver
        self.pool: KVPool | None = None
        self.graphs: dict[int, _Graph] = {}
        self._captured: set[int] = set()  # every size captured so far (kept across releases)
        self._rows = 0  # rows of the last decode step (0 when a serve starts)
        self._graph_pool: Any = None
        self.waiting: deque[GenRequest] = deque()  # taken from the queue, not yet admitted
        self.stats = {"prefills": 0, "decode_steps": 0, "graph_captures": 0, "capture_s": 0.0, "tokens": 0}

    # ------------------------------------------------------------------ memory

    def allocate(self) -> None:
        """The pool, if released (or never made): `pool_tokens` tokens, or on CUDA what
        `mem_fraction` of the device leaves after this process's allocations (as SGLang's
        --mem-fraction-static), within what is free now less a margin for activations and
        graphs; on CPU 1 GiB. Never more than `max_rows` sequences of the whole context need."""
        if self.pool is not None:
            return
        P = self.page_size
        page_bytes = KVPool.page_bytes(self.config, P, self.dtype)
        if self.pool_tokens:
            pages = self.pool_tokens // P + 1
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = min(
                self.mem_fraction * total - torch.cuda.memory_allocated(self.device),
                free - max(2 << 30, 0.05 * total),
            )
            pages = int(budget // page_bytes)
        else:
            pages = (1 << 30) // page_bytes
        pages = min(pages, self.max_rows * self.max_pages + 1)
        if pages < 2:
            raise RuntimeError(
                f"no memory left for the KV cache (a page of {P} tokens is {page_bytes / 2**20:.1f} MiB); lower "
                "what else runs on the device, or raise --mem-fraction-static"
            )
        with in_region(self.saver, "kv_cache"):
            self.pool = KVPool(self.config, pages, P, self.dtype, self.device)
        log.info("KV cache: %d tokens in pages of %d (%.2f GiB)", (pages - 1) * P, P, self.pool.nbytes / 2**30)

    def free_memory(self, kv_cache: bool) -> None:
        """Drop the captured graphs (they hold the pool's and the weights' addresses: any region
        released invalidates them) and, with `kv_cache`, the pool."""
        self._drop_graphs()
        if kv_cache:
            self.pool = None

    def _drop_graphs(self) -> None:
        """Forget every captured graph and their memory pool (a pool handle outliving all of its
        graphs must not be captured into again), once no replay runs."""
        if self.graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self._graph_pool = None

    @property
    def graph_pool(self) -> Any:
        """The captured graphs' memory pool (None: none captured)."""
        return self._graph_pool

    @property
    def compiled(self) -> bool:
        """Whether decode steps run the transformer blocks torch.compiled."""
        return bool(self._compiled)

    @property
    def kv_bytes(self) -> int:
        return self.pool.nbytes if self.pool is not None else 0

    # ------------------------------------------------------------------ forwards

    def _forward(self, step: _Step, **inputs: Any) -> torch.Tensor:
        """The model's forward with its attention on the pool; counts that every layer wrote its
        keys and attended through the interface (`verify` checks the counts)."""
        _current.step, _current.updates, _current.attentions = step, 0, 0
        # (transformers reads the attention implementation from the config at every forward; a
        # private field: runtime/internals.py)
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = ATTENTION
        try:
            return self.model(
                past_key_values=_PagedCache(),
                attention_mask={"full_attention": None},
                use_cache=True,
                **inputs,
            ).logits
        finally:
            config._attn_implementation = before
            _current.step = None

    def _prefill_forward(self, prompts: list[list[int]], tables: list[list[int]]) -> torch.Tensor:
        """Packed prefill of `prompts` (written to `tables`' pages): the last position's logits of
        each, [len(prompts), vocab] float32. Prompts of one length run as one SDPA batch."""
        assert self.pool is not None
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        ids, pos, page, offset, groups, last = [], [], [], [], [], [0] * len(prompts)
        P = self.page_size
        for i in order:
            n = len(prompts[i])
            if groups and groups[-1][2] == n:
                s, c, _ = groups[-1]
                groups[-1] = (s, c + 1, n)
            else:
                groups.append((len(ids), 1, n))
            ids += prompts[i]
            pos += range(n)
            page += [tables[i][t // P] for t in range(n)]
            offset += [t % P for t in range(n)]
            last[i] = len(ids) - 1
        dev = self.device
        tensor = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        step = _Step(self.pool, page=tensor(page), offset=tensor(offset), groups=groups)
        logits = self._forward(
            step, input_ids=tensor(ids)[None], position_ids=tensor(pos)[None], logits_to_keep=tensor(last)
        )
        self.stats["prefills"] += 1
        return logits[0].float()

    def _decode_eager(self, g: _Graph, n: int) -> torch.Tensor:
        step = _Step(self.pool, g.table[:n], g.lens[:n])  # type: ignore[arg-type]
        for block, _, compiled in self._compiled:
            block.forward = compiled
        try:
            return self._forward(step, input_ids=g.ids[:n], position_ids=g.pos[:n])[:, -1]
        finally:
            for block, plain, _ in self._compiled:
                block.forward = plain

    def _graph_for(self, n: int) -> _Graph:
        """The graph for `n` rows: a captured one of up to 4x as many rows (its extra rows cost
        little next to a capture, which every bucket would need after each release), else one
        captured now: for a growing batch, of the largest size within 4x that this decoder has
        captured before (a rollout's batch grows as its requests arrive: after a release, the
        range the last rollout grew through takes one capture, not one per size); else of the
        smallest bucket."""
        near = [s for s in self.graphs if n <= s <= 4 * n and self.graphs[s].graph is not None]
        before = [s for s in self._captured if n <= s <= 4 * n] if n > self._rows else []
        self._rows = n
        size = min(near) if near else max(before) if before else next((s for s in _BUCKETS if s >= n), n)
        g = self.graphs.get(size)
        if g is None:
            g = self.graphs[size] = _Graph(size, self.max_pages, self.device)
        if self.cuda_graphs and g.graph is None:
            t0 = time.perf_counter()
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                # warm-up outside the capture: lazy inits and compilation the first time this
                # size runs; once more before a capture again (after a release)
                for _ in range(1 if size in self._captured else 2):
                    self._decode_eager(g, size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            capture = self.saver.graph if self.saver is not None else torch.cuda.graph
            with capture(graph, pool=self._graph_pool):
                g.logits = self._decode_eager(g, size)
            g.graph = graph
            self._captured.add(size)
            self.stats["graph_captures"] += 1
            self.stats["capture_s"] += time.perf_counter() - t0  # (host time: the capture syncs)
        return g

    def _decode(self, tokens: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """One decode step of rows [B] (their last token, its position, their page tables):
        their logits [B, vocab], in the model's dtype. A graph's logits are its output buffer:
        read them (queue what reads them) before the next step, which overwrites them."""
        n = tokens.shape[0]
        g = self._graph_for(n)
        g.ids[:n, 0] = tokens
        g.pos[:n, 0] = pos
        g.table[:n] = table
        g.lens[:n] = (pos + 1).to(torch.int32)
        if g.graph is not None:
            if n < g.size:  # rows past the batch: one token on the scratch page
                g.table[n:] = 0
                g.lens[n:] = 1
            g.graph.replay()
            assert g.logits is not None
            logits = g.logits[:n]
        else:
            logits = self._decode_eager(g, n)
        self.stats["decode_steps"] += 1
        return logits

    # ------------------------------------------------------------------ checks

    @torch.no_grad()
    def verify(self) -> float:
        """Run a probe (a prompt across a page boundary, then greedy decode steps) through the
        paged path and through transformers' plain forward; raise if they disagree or a layer
        bypassed the attention interface. Returns the largest logit difference."""
        vocab = self.config.vocab_size
        prompt = [(7 * i + 3) % vocab for i in range(self.page_size + 3)]
        kept, self.pool = self.pool, KVPool(self.config, 4, self.page_size, self.dtype, self.device)
        pages = self.pool.alloc(3)
        try:
            layers = self.config.num_hidden_layers
            got = [self._prefill_forward([prompt], [pages])[0]]
            if (_current.updates, _current.attentions) != (layers, layers):
                raise RuntimeError(
                    f"{type(self.model).__name__}: {_current.updates} of {layers} layers wrote the paged cache and "
                    f"{_current.attentions} attended through transformers' attention interface"
                )
            seq = list(prompt)
            table = torch.tensor([pages + [0] * (self.max_pages - len(pages))], dtype=torch.int32, device=self.device)
            # One row, then copies of it: compiled blocks trace both the batch of one and the
            # dynamic batch size here, not at the first rollout. Inductor tunes each kernel's
            # launch once, at its first run: compiled, the copies are as many as a rollout's
            # decode batch (uncompiled, nothing is tuned: two).
            many = min(self.max_rows, 512) if self.compiled else 2
            for rows in (1, many, many):
                seq.append(int(got[-1].argmax()))
                pos = torch.full((rows,), len(seq) - 1, device=self.device)
                logits = self._decode(torch.full((rows,), seq[-1], device=self.device), pos, table.expand(rows, -1))
                got.append(logits[0].to(torch.float32, copy=True))
            ref = self.model(input_ids=torch.tensor([seq], device=self.device)).logits[0, len(prompt) - 1 :].float()
            diff = float((torch.stack(got) - ref).abs().max())
            scale = max(1.0, float(ref.abs().max()))
            tol = 1e-3 if self.dtype == torch.float32 else 5e-2
            if not diff <= tol * scale:
                raise RuntimeError(
                    f"{type(self.model).__name__}: paged decode differs from transformers' forward by {diff:.3g} "
                    f"(logits up to {scale:.3g})"
                )
            return diff
        finally:
            self.pool = kept
            self._drop_graphs()

    # ------------------------------------------------------------------ scheduling

    def serve(
        self,
        take: Callable[[], GenRequest | None],
        can_run: Callable[[GenRequest], bool],
        running: threading.Event,
        abort: threading.Event,
        weight_version: Callable[[], str],
    ) -> None:
        """Generate until nothing runs and nothing waits. `take()`: the next queued request or
        None; `can_run(req)`: False when the engine's state refuses it (the request has been
        answered). While `running` is clear: with `abort` set, in-flight rows end now (finish
        reason abort) and the waiting requests stay for later; else in-flight rows are held.
        If anything fails, every request in flight or waiting gets the exception."""
        remaining: dict[int, list[Any]] = {}  # id(request) -> [its rows, how many still run]
        self._rows = 0
        try:
            self._serve(take, can_run, running, abort, weight_version, remaining)
        except BaseException as e:
            log.exception("generation failed; failing %d requests", len(remaining) + len(self.waiting))
            for rows, _ in remaining.values():
                if not rows[0].req.future.done():
                    rows[0].req.future.set_exception(e)
            while self.waiting:
                self.waiting.popleft().future.set_exception(e)
            self.pool = None  # its pages' owners are gone: a fresh pool next time
            self._drop_graphs()
            if not isinstance(e, Exception):
                raise

    def _serve(
        self,
        take: Callable[[], GenRequest | None],
        can_run: Callable[[GenRequest], bool],
        running: threading.Event,
        abort: threading.Event,
        weight_version: Callable[[], str],
        remaining: dict[int, list[Any]],
    ) -> None:
        """The scheduling loop. Decode steps overlap the host: step t+1 is launched (its inputs
        are step t's sampled tokens, on the device) before the host reads step t's tokens,
        appends them to the rows and answers the rows that finished, so the device never waits
        for Python between steps. A row that finishes at step t has had step t+1 computed for
        it too: that token is dropped, its key written to the row's own (reserved) page, which
        is handed out again only after (the stream orders the writes). The host syncs with the
        step in flight (`settle`) only where it must: before admitting queued requests, when
        paused, and at every step where sampling reads host state (a min_new_tokens hold) or
        the engine runs `deterministic`."""
        seqs: list[_Seq] = []
        state: dict[str, Any] = {}  # the batch's device tensors, rebuilt when rows join
        pending: _Launched | None = None  # the step in flight, its tokens not yet read
        freed = True  # rows finished (or none ran) since the last try to admit
        t0, before = time.perf_counter(), dict(self.stats)

        def done(row: Row) -> None:
            entry = remaining[id(row.req)]
            entry[1] -= 1
            if entry[1] == 0:
                del remaining[id(row.req)]
                now = time.time()
                row.req.future.set_result([r.result(weight_version(), now) for r in entry[0]])

        def settle() -> None:
            """Read the step in flight; drop the rows that finished from the batch (and from its
            device tensors: the next step's inputs stay on the device)."""
            nonlocal pending, seqs, freed
            if pending is not None:
                self._collect(pending, done)
                pending = None
            keep = [b for b, s in enumerate(seqs) if s.row.finish is None]
            if len(keep) < len(seqs):
                freed = True
                seqs = [seqs[b] for b in keep]
                if state:
                    self._subset(state, seqs, keep)

        while True:
            while not running.is_set():
                settle()
                if abort.is_set():
                    for s in seqs:
                        s.row.finish = {"type": "abort", "message": "generation paused with mode=abort"}
                        assert self.pool is not None
                        self.pool.release(s.pages)
                        done(s.row)
                    return
                if not seqs:
                    return
                running.wait(0.05)
            while (req := take()) is not None:
                self.waiting.append(req)
                freed = True
            admitted = 0
            if self.waiting and freed and not (self.deterministic and seqs):
                settle()
                freed = False
                joined, admitted = self._admit(can_run, len(seqs), remaining, done)
                if joined:
                    seqs += joined
                    state.clear()
            if not seqs:
                settle()  # (nothing may run on the device once this returns: a release may follow)
                if admitted or not self.waiting:
                    if not self.waiting:
                        n, dt = self.stats["tokens"] - before["tokens"], time.perf_counter() - t0
                        log.info(
                            "decoded %d tokens in %.2f s (%.0f tokens/s; %d graph captures took %.2f s of it)",
                            n,
                            dt,
                            n / max(dt, 1e-9),
                            self.stats["graph_captures"] - before["graph_captures"],
                            self.stats["capture_s"] - before["capture_s"],
                        )
                        return
                    freed = True
                    continue
                req = self.waiting.popleft()  # it does not fit even with nothing else running
                assert self.pool is not None
                need = sum(len(p) + q.max_new_tokens * q.n for p, q in zip(req.input_ids, req.params))
                req.future.set_exception(
                    ValueError(
                        f"the request's {need} tokens (prompts + max_new_tokens x n) do not fit the KV cache "
                        f"({(self.pool.pages - 1) * self.page_size} tokens); raise --max-total-tokens or "
                        "--mem-fraction-static, or send fewer samples per request"
                    )
                )
                freed = True
                continue
            if pending is not None and all(len(s.row.out) + 1 >= s.row.max_new for s in seqs):
                settle()  # every row ends with the step in flight: none after it
                continue
            if not state:
                state.update(self._batch_state(seqs))
            launched = self._launch(seqs, state)
            settle()  # the step before it, read while this one runs
            pending = launched
            if self.deterministic or state["shaper"].hold:
                settle()

    def _launch(self, seqs: list[_Seq], state: dict[str, Any]) -> _Launched:
        """Queue one decode step and its sampling for the rows; advance the batch's device
        tensors to the next step (its input tokens are this step's samples) and start copying
        the samples to the host."""
        logits = self._decode(state["tokens"], state["pos"], state["table"])
        shaper = state["shaper"]
        shaped = shaper.shape(logits, [len(s.row.out) for s in seqs] if shaper.hold else 0)
        tokens, logps = sample(shaped, state["plan"], state["steps"], self.generator)
        shaper.count(tokens)
        state["tokens"], state["pos"], state["steps"] = tokens, state["pos"] + 1, state["steps"] + 1
        return _Launched(seqs, *_to_host(tokens, logps))

    def _collect(self, launched: _Launched, done: Callable[[Row], None]) -> None:
        """The launched step's tokens join their rows (rows that finished before it drop
        theirs); a row that finishes gives its pages back and is answered."""
        assert self.pool is not None
        if launched.ready is not None:
            launched.ready.synchronize()
        toks, lps = launched.host.tolist()
        for b, s in enumerate(launched.seqs):
            if s.row.finish is not None:
                continue
            self.stats["tokens"] += 1
            if s.row.append(int(toks[b]), lps[b]):
                self.pool.release(s.pages)
                done(s.row)

    def _subset(self, state: dict[str, Any], seqs: list[_Seq], keep: list[int]) -> None:
        """The batch's device tensors for the rows `keep` (indices into the batch before), with
        no host sync (the step in flight may still be running)."""
        index = device_tensor(keep, torch.long, self.device)
        for key in ("tokens", "pos", "table", "steps"):
            state[key] = state[key][index]
        state["plan"] = self._plan([s.row for s in seqs])
        state["shaper"] = state["shaper"].subset(index, keep)

    def _plan(self, rows: list[Row]) -> SamplingPlan:
        """The rows' sampling plan (what stays the same at every step of this set of rows)."""
        return SamplingPlan(
            [r.params for r in rows], [r.seed for r in rows], self.vocab, self.device, self.token_hash(self.vocab)
        )

    def _batch_state(self, seqs: list[_Seq]) -> dict[str, Any]:
        """Device tensors of the rows' next step: last token, its position, page tables, steps;
        their sampling plan and logit shaper."""
        dev = self.device
        table = torch.zeros(len(seqs), self.max_pages, dtype=torch.int32)
        for b, s in enumerate(seqs):
            table[b, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
        rows = [s.row for s in seqs]
        return {
            "tokens": torch.tensor([r.out[-1] for r in rows], device=dev),
            "pos": torch.tensor([len(r.prompt) + len(r.out) - 1 for r in rows], device=dev),
            "table": table.to(dev),
            "steps": torch.tensor([len(r.out) for r in rows], device=dev),
            "plan": self._plan(rows),
            "shaper": LogitShaper(
                [r.params for r in rows], [r.stops for r in rows], self.vocab, dev, [r.out for r in rows]
            ),
        }

    def _admit(
        self,
        can_run: Callable[[GenRequest], bool],
        running: int,
        remaining: dict[int, list[Any]],
        done: Callable[[Row], None],
    ) -> tuple[list[_Seq], int]:
        """Queued requests that fit (rows and pages), prefilled, their first tokens sampled: (the
        rows that go on decoding, how many requests were admitted). Requests are admitted whole
        and in order."""
        P = self.page_size
        batch: list[tuple[GenRequest, list[Row]]] = []
        tokens = 0
        free = -1
        while self.waiting:
            req = self.waiting[0]
            if not can_run(req):
                self.waiting.popleft()
                continue
            if free < 0:
                self.allocate()
                assert self.pool is not None
                free = self.pool.free
            rows = req.rows(self.eos_ids)
            pages = 0
            for prompt in {tuple(r.prompt) for r in rows if r.finish is None}:
                pages += len(prompt) // P
            pages += sum(-(-(len(r.prompt) + r.max_new) // P) - len(r.prompt) // P for r in rows if r.finish is None)
            new_tokens = sum(len(p) for p in {tuple(r.prompt) for r in rows})
            if running + len(rows) > self.max_rows and (running or batch):
                break
            if pages > free or (batch and tokens + new_tokens > PREFILL_TOKENS):
                break
            self.waiting.popleft()
            batch.append((req, rows))
            free -= pages
            tokens += new_tokens
            running += len(rows)
            if self.deterministic:
                break
        if not batch:
            return [], 0
        return self._prefill(batch, remaining, done), len(batch)

    def _prefill(
        self, batch: list[tuple[GenRequest, list[Row]]], remaining: dict[int, list[Any]], done: Callable[[Row], None]
    ) -> list[_Seq]:
        assert self.pool is not None
        P = self.page_size
        live: list[_Seq] = []
        prompts: dict[tuple[int, ...], list[_Seq]] = {}
        for req, rows in batch:
            remaining[id(req)] = [rows, len(rows)]
            for r in rows:
                if r.finish is not None:
                    continue
                key = tuple(r.prompt)
                group = prompts.setdefault(key, [])
                full = len(r.prompt) // P
                shared = group[0].pages[:full] if group else self.pool.alloc(full)
                if group:
                    self.pool.share(shared)
                own = self.pool.alloc(-(-(len(r.prompt) + r.max_new) // P) - full)
                s = _Seq(r, shared + own)
                group.append(s)
                live.append(s)
        for rows in [rows for _, rows in batch]:
            for r in rows:
                if r.finish is not None:  # max_new_tokens 0
                    done(r)
        if not prompts:
            return []
        groups = list(prompts.values())
        logits = self._prefill_forward([list(k) for k in prompts], [g[0].pages for g in groups])
        # the prompt's last, partial page: copied from the first sample's to the others'
        src, dst = [], []
        for g in groups:
            n = len(g[0].row.prompt)
            if n % P:
                for s in g[1:]:
                    src.append(g[0].pages[n // P])
                    dst.append(s.pages[n // P])
        if src:
            si, di = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
            self.pool.k[:, di] = self.pool.k[:, si]
            self.pool.v[:, di] = self.pool.v[:, si]
        of_seq = [u for u, g in enumerate(groups) for _ in g]
        seqs = [s for g in groups for s in g]
        rows = [s.row for s in seqs]
        row_logits = logits[torch.tensor(of_seq, device=self.device)]
        shaper = LogitShaper([r.params for r in rows], [r.stops for r in rows], self.vocab, self.device)
        tokens, logps = sample(shaper.shape(row_logits, 0), self._plan(rows), 0, self.generator)
        self._collect(_Launched(seqs, *_to_host(tokens, logps)), done)
        return [s for s in seqs if s.row.finish is None]
