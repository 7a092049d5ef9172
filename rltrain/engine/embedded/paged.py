"""The embedded engine's fast path: the model's forward over a paged KV cache.

    decoder = PagedDecoder(model, device, max_rows, context_length, pool_tokens, mem_fraction, ...)
    decoder.verify()                                     # at start-up: the path matches transformers
    logits = decoder.prefill_forward(prompts, tables)    # the prompts' keys and values into their pages
    logits = decoder.decode(tokens, pos, table)          # one decode step of every row

The KV pool (kv_pool.py) is allocated at the first generation (`allocate`) and dropped by
`free_memory`; decode steps are captured as CUDA graphs and replayed (graphs.py), and with
`prefill_graphs` (by default with the memory saver) prefills of up to 8,192 new tokens too, from
static inputs padded to a bucket (`PrefillGraphs`); the scheduling around them (admission, continuous
batching, sampling) is batching.py's.

**The model.** transformers' own modules run the forward: the layers' attention goes through
transformers' attention interface to `_paged_attention` (registered under its own name). Prefill
packs every admitted prompt into one sequence (no padding), writes the prompts' keys and values
into their pages (in the attention, before it attends) and runs causal attention per group of
equal-length prompts; prompts that extend keys already in their pages (a later turn, a
prefix-cache hit) attend through `paged_extend_attention` on CUDA, which reads every one's keys
in its pages in one kernel per layer (elsewhere their pages are gathered for SDPA). Decode runs
`paged_decode_attention` (kernels/), which stores each row's new key and value in its last slot
and reads the row's pages up to its length, in one kernel per layer. Each layer's q/k/v and
gate/up projections run as one GEMM each (fused.py, set up by the engine for this path). At
start-up a probe checks the path against transformers' plain forward (`verify`); a model whose
attention does not go through the interface fails it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel

from rltrain.engine.embedded.graphs import CHUNK, DecodeGraphs, PrefillGraphs, PrefillInputs, StepGraph
from rltrain.engine.embedded.kv_pool import PAGE_SIZE, KVPool, head_dim_of, pool_pages
from rltrain.engine.embedded.pieces import boundary
from rltrain.engine.embedded.prefix_cache import PrefixCache
from rltrain.engine.embedded.sampling import device_tensor
from rltrain.engine.embedded.saver import MemorySaver, in_region
from rltrain.engine.embedded.steps import ExtendRows, Extends, Step
from rltrain.kernels.decode_attention import paged_decode_attention
from rltrain.kernels.extend_attention import paged_extend_attention
from rltrain.runtime import internals

log = logging.getLogger("rltrain.engine.embedded")

ATTENTION = "rltrain_paged"


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


_current = threading.local()  # the running forward's Step (each engine's scheduler is its own thread)

# A prefill's attention shapes change with every batch of prompts. cuDNN's attention, which SDPA
# prefers on a Hopper GPU for masked attention, builds an execution plan for every new shape: on
# the H200 a multi-turn rollout's extend prefills spent ~0.1 s of host time each in it
# (docs/benchmarks). Flash and memory-efficient attention take any shape as it comes.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class _PagedCache:
    """The cache object transformers' layers update: it hands the keys and values back unchanged
    (the attention op writes them into the pool and reads the pool itself) and counts the calls
    when not compiled (`verify` checks that every layer made one)."""

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            _current.updates += 1
        return k, v


def _paged_attention(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q [B, H, L, D] -> [B, L, H, D], by one custom op that
    compiled blocks call in their graph (no graph break: a block is one compiled graph)."""
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    layer = cast(int, module.layer_idx)  # (transformers' attention modules carry their layer's index)
    return torch.ops.rltrain.paged_attention(q, k, v, layer, scale), None


@torch.library.custom_op("rltrain::paged_attention", mutates_args=())
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """One layer's attention on the pool for the running forward's step (thread-local, read at
    run time: the compiler sees only the shapes, from `_attend_shape`). Decode: one new token per
    row, stored, then attended over its pages, in one kernel. Prefill: the prompts' new keys and
    values written into their slots, then attended (extending prompts read them in their pages)."""
    step: Step = _current.step
    _current.attentions += 1
    if step.groups is None:
        assert step.table is not None and step.lens is not None
        pool = step.pool
        out = paged_decode_attention(
            q[:, :, 0], pool.k[layer], pool.v[layer], step.table, step.lens, scale, k[:, :, 0], v[:, :, 0]
        )
        return out[:, None]
    # k, v [1, kv_heads, T, D] -> one [T, kv_heads, D] row per slot
    step.pool.k[layer][step.page, :, step.offset] = k[0].transpose(0, 1)
    step.pool.v[layer][step.page, :, step.offset] = v[0].transpose(0, 1)
    with sdpa_kernel(PREFILL_BACKENDS):
        return _prefill_attention(step, layer, q, k, v, scale)


@_attend.register_fake
def _attend_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])


def _prefill_attention(
    step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """The packed prompts [1, H, T, D] -> [1, T, H, D]: causal within each, one SDPA per
    length group; then the prompts that extend cached keys."""
    H, D = q.shape[1], q.shape[3]
    outs = []
    for start, count, length in step.groups or []:
        end = start + count * length
        qs, ks, vs = (x[0, :, start:end].unflatten(1, (count, length)).transpose(0, 1) for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(o.transpose(1, 2).reshape(count * length, H, D))
    if step.extend_rows is not None:  # read in place by the extend kernel, every prompt at once
        x = step.extend_rows
        o = paged_extend_attention(
            q[0].transpose(0, 1),
            step.pool.k[layer],
            step.pool.v[layer],
            x.table,
            x.q_start,
            x.q_len,
            x.ctx_len,
            scale,
            x.max_q_len,
            impl=x.impl,
        )
        outs.append(o[x.begin :])
    # prompts extending cached keys: their new tokens against their pages' keys (the new ones
    # written there by the cache above), one SDPA per group of equal page counts. The G query
    # heads of a key head are folded into its rows of queries (no GQA: the memory-efficient
    # kernel takes the mask), the mask repeated for each.
    for ext in step.extends:
        count, pages = ext.table.shape
        kvh, P = step.pool.k.shape[2], step.pool.k.shape[3]
        G, Lq = H // kvh, ext.index.shape[1]
        qs = q[0][:, ext.index].transpose(0, 1).reshape(count, kvh, G * Lq, D)
        ks, vs = (
            pool[layer][ext.table].transpose(1, 2).reshape(count, kvh, pages * P, D)
            for pool in (step.pool.k, step.pool.v)
        )
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=ext.mask.repeat(1, 1, G, 1), scale=scale
        )
        outs.append(o.reshape(count, H, Lq, D).transpose(1, 2).reshape(-1, H, D)[ext.valid])
    return torch.cat(outs)[None]


AttentionInterface.register(ATTENTION, _paged_attention)


def _piece_boundary(module: torch.nn.Module, args: Any) -> None:
    """A transformer block's pre-hook: where a prefill run in pieces may pause (pieces.py)."""
    boundary()


class PagedDecoder:
    """The paged forward of one engine (module doc). Its pool is made at the first generation
    (`allocate`) and dropped by `free_memory`; `stats` counts its work since start-up."""

    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        max_rows: int,
        context_length: int,
        pool_tokens: int,
        mem_fraction: float,
        cuda_graphs: bool,
        compile: bool,
        saver: MemorySaver | None = None,
        prefill_graphs: bool = False,
    ):
        self.model = model
        self.config: Any = model.config  # (a model's own config class: its fields are read by name)
        self.device = device
        self.dtype = next(model.parameters()).dtype
        head = model.get_output_embeddings()
        self.vocab: int = head.weight.shape[0] if head is not None else self.config.vocab_size
        self.max_rows = max_rows
        self.page_size = PAGE_SIZE
        self.context_length = context_length
        self.max_pages = -(-context_length // PAGE_SIZE)
        self.pool_tokens = pool_tokens
        self.mem_fraction = mem_fraction
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        # How a prefill's prompts that extend cached keys attend: "triton", the extend kernel
        # reading their keys in their pages, all at once (CUDA); "torch", their pages' keys gathered
        # for one SDPA per group of equal page counts (the CPU; the tests also run the kernel on
        # the CPU, interpreted).
        self.extend_impl = "triton" if device.type == "cuda" else "torch"
        # Decode steps and prefills run the transformer blocks torch.compiled (dynamic shapes: one
        # graph serves every decode bucket, one every prefill's packed length): inductor fuses the
        # norms, rotary and activation around the matmuls, which eager runs as ~20 small kernels
        # per block, each queued by the host (a multi-turn rollout's extend prefills were
        # host-bound). The attention (with its cache writes) is one custom op in the block's graph,
        # opaque to the compiler: a block is one compiled graph, entered once per layer.
        if compile:  # (the blocks pass their layer index to the attention op: one graph for all of them)
            internals.get("torch._dynamo.config").allow_unspec_int_on_nn_module = True
        kinds = set(getattr(model, "_no_split_modules", None) or [])
        blocks = [m for m in model.modules() if type(m).__name__ in kinds]
        self._compiled = [(m, m.forward, torch.compile(m.forward, dynamic=True)) for m in blocks] if compile else []
        self._compiled_lock, self._compiled_users = threading.Lock(), 0
        self._blocks, self._pausable = blocks, False
        # With the memory saver (saver.py) the pool and the graphs' memory keep their addresses
        # through release and resume: the graphs are kept, not captured again.
        self.saver = saver
        self.pool: KVPool | None = None
        self.pool_size = 0  # tokens the last pool made holds (SGLang's max_total_num_tokens)
        self.prefixes: PrefixCache | None = None  # the pool's (prefix_cache.py)
        self.stats = {
            "prefills": 0,
            "prefill_tokens": 0,
            "decode_steps": 0,
            "graph_captures": 0,
            "prefill_graph_captures": 0,
            "capture_s": 0.0,
            "tokens": 0,
            # host seconds admitting requests (their prefill and first tokens included: those
            # wait for the device) and rebuilding the batch's device state after rows joined
            "admits": 0,  # tries to admit queued requests
            # of them, with the rows' first tokens read after the next step is queued behind the
            # prefill (batching.py); the others read them first and rebuild the batch's state
            "admits_unread": 0,
            "admit_s": 0.0,
            # of it: queuing the prefill forwards, and waiting for them (and their first tokens)
            "prefill_launch_s": 0.0,
            # (of the queuing, the scheduler thread's CPU time: the rest it waited, for the
            # interpreter lock or for the device where a call synchronises)
            "prefill_launch_cpu_s": 0.0,
            # (of the queuing: the prompts packed and their index tensors sent; the model's
            # forward queued, and of that the thread's CPU time; the rest is the first tokens'
            # sampling and the pages' copies)
            "prefill_pack_s": 0.0,
            "prefill_model_s": 0.0,
            "prefill_model_cpu_s": 0.0,
            # prefills queued in pieces between decode steps (batching.py), and their pieces
            "prefills_in_pieces": 0,
            "prefill_pieces": 0,
            "prefill_wait_s": 0.0,
            "batch_state_s": 0.0,
            "subset_s": 0.0,  # the batch's device state cut to the rows that go on (rows finished)
            # host seconds queuing decode steps, waiting for a decode step's tokens (the
            # device's time the host could not hide), and the rest of reading a step's tokens
            # (rows appended, finished rows cached and answered; prefills' first tokens too)
            "launch_s": 0.0,
            "wait_s": 0.0,
            "collect_s": 0.0,
            "serve_s": 0.0,  # seconds generating (batching.py's serve)
            # of them, the scheduler thread on a CPU (a device wait spins on it: counted); the
            # rest it was blocked: mostly waiting for the interpreter lock, which the HTTP
            # handler threads of its process hold between its Python statements
            "serve_cpu_s": 0.0,
        }
        self.graphs = DecodeGraphs(
            self.max_pages, device, self.cuda_graphs, saver, self.stats, self._decode_eager, max_rows
        )
        # (prefills from static inputs, replayed on CUDA: graphs.py; engine.py says when)
        self.prefill_graphs = (
            PrefillGraphs(max_rows, self.max_pages, device, self.cuda_graphs, self.graphs, self._prefill_static)
            if prefill_graphs
            else None
        )

    # ------------------------------------------------------------------ memory

    def allocate(self) -> None:
        """The pool, if released (or never made): as large as kv_pool.py's `pool_pages` says."""
        if self.pool is not None:
            return
        P = self.page_size
        pages = self._pool_pages()
        with in_region(self.saver, "kv_cache"):
            self.pool = KVPool(self.config, pages, P, self.dtype, self.device)
        self.prefixes = PrefixCache(self.pool)
        self.pool_size = (pages - 1) * P  # (the scratch page holds no row's tokens)
        log.info("KV cache: %d tokens in pages of %d (%.2f GiB)", self.pool_size, P, self.pool.nbytes / 2**30)

    def max_total_num_tokens(self) -> int:
        """Tokens the pool holds (SGLang's server-info field): the last pool made, or before the
        first admission makes one, what it would be made with now."""
        return self.pool_size or (self._pool_pages() - 1) * self.page_size

    def _pool_pages(self) -> int:
        """Pages a pool made now would have (kv_pool.py's `pool_pages`)."""
        return pool_pages(
            self.config, self.dtype, self.device, self.max_rows, self.max_pages, self.pool_tokens, self.mem_fraction
        )

    def free_memory(self, kv_cache: bool) -> None:
        """Drop the captured graphs (they hold the pool's and the weights' addresses: any region
        released invalidates them) and, with `kv_cache`, the pool."""
        self._drop_graphs()
        if kv_cache:
            self.pool = None
            self.prefixes = None

    def _drop_graphs(self) -> None:
        if self.prefill_graphs is not None:
            self.prefill_graphs.drop()
        self.graphs.drop()

    def forget_prefixes(self) -> None:
        """Empty the prefix cache (the keys it holds were computed with other weights, or their
        memory was released)."""
        if self.prefixes is not None:
            self.prefixes.clear()

    @property
    def compiled(self) -> bool:
        """Whether decode steps and prefills run the transformer blocks torch.compiled."""
        return bool(self._compiled)

    def pausable(self) -> None:
        """A prefill run in pieces between decode steps (batching.py) may pause before any
        transformer block from now on (a pre-hook on each: only where pieces are on, since a
        hooked module's call costs more on every forward)."""
        if not self._pausable:
            for m in self._blocks:
                m.register_forward_pre_hook(_piece_boundary)
            self._pausable = True

    @contextlib.contextmanager
    def _blocks_compiled(self) -> Iterator[None]:
        """Inside, the transformer blocks run their compiled forwards (where `compile`). Counted:
        a prefill paused between its pieces (batching.py) is inside while decode steps enter
        and leave."""
        with self._compiled_lock:
            if not self._compiled_users:
                for block, _, compiled in self._compiled:
                    block.forward = compiled
            self._compiled_users += 1
        try:
            yield
        finally:
            with self._compiled_lock:
                self._compiled_users -= 1
                if not self._compiled_users:
                    for block, plain, _ in self._compiled:
                        block.forward = plain

    @property
    def kv_bytes(self) -> int:
        return self.pool.nbytes if self.pool is not None else 0

    # ------------------------------------------------------------------ forwards

    def _forward(self, step: Step, **inputs: Any) -> torch.Tensor:
        """The model's forward with its attention on the pool; counts that every layer wrote its
        keys and attended through the interface (`verify` checks the counts)."""
        _current.step, _current.updates, _current.attentions = step, 0, 0
        # (transformers reads the attention implementation from the config at every forward; a
        # private field: runtime/internals.py)
        config = self.config
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

    def prefill_forward(
        self,
        prompts: list[list[int]],
        tables: list[list[int]],
        starts: list[int] | None = None,
        *,
        compiled: bool = True,
    ) -> torch.Tensor:
        """Packed prefill of `prompts` (written to `tables`' pages): the last position's logits of
        each, [len(prompts), vocab] float32. `starts[i]`: how many of prompt i's first tokens
        already have their keys in its pages (the prefix cache; 0 by default): only the rest runs.
        Whole prompts of one length run as one SDPA batch, extending ones by their page count.
        `compiled=False`: the blocks' plain forwards even where compiled ones are made."""
        assert self.pool is not None
        t0 = time.perf_counter()
        starts = starts if starts is not None else [0] * len(prompts)
        whole = sorted((i for i in range(len(prompts)) if not starts[i]), key=lambda i: len(prompts[i]))
        P = self.page_size
        extending = sorted((i for i in range(len(prompts)) if starts[i]), key=lambda i: -(-len(prompts[i]) // P))
        ids: list[int] = []
        pos: list[int] = []
        page: list[int] = []
        offset: list[int] = []
        last = [0] * len(prompts)

        def pack(i: int) -> int:
            """Prompt i's tokens from its first uncached one onto the packed sequence (their
            positions and key slots too); where they begin there."""
            first, n, s0 = len(ids), len(prompts[i]), starts[i]
            ids.extend(prompts[i][s0:])
            pos.extend(range(s0, n))
            page.extend(tables[i][t // P] for t in range(s0, n))
            offset.extend(t % P for t in range(s0, n))
            last[i] = len(ids) - 1
            return first

        graphs = self.prefill_graphs
        # (captured only over the extend kernel: its gathered-pages fallback reads lengths on the host)
        static = graphs is not None and compiled and (self.extend_impl == "triton" or not self.cuda_graphs)
        if static and graphs is not None and graphs.fits(sum(map(len, prompts)) - sum(starts), len(prompts)):
            spans = [(pack(i), len(prompts[i]) - starts[i], starts[i]) for i in range(len(prompts))]
            t1, cpu1 = time.perf_counter(), time.thread_time()
            logits = graphs.run(ids, pos, page, offset, last, spans, tables)
            return self._prefilled(logits, len(ids), t0, t1, cpu1)
        groups: list[tuple[int, int, int]] = []
        for i in whole:
            n = len(prompts[i])
            if groups and groups[-1][2] == n:
                s, c, _ = groups[-1]
                groups[-1] = (s, c + 1, n)
            else:
                groups.append((len(ids), 1, n))
            pack(i)
        dev = self.device
        # (from pinned memory, no host sync: a prefill in pieces must not wait for the device)
        tensor = lambda x: device_tensor(x, torch.long, dev)  # noqa: E731
        extends: list[Extends] = []
        rows: ExtendRows | None = None
        if extending and self.extend_impl == "triton":  # every extending prompt at once, read in its pages
            begin = len(ids)
            firsts = [pack(i) for i in extending]
            width = max(-(-len(prompts[i]) // P) for i in extending)
            int32 = lambda x: device_tensor(x, torch.int32, dev)  # noqa: E731
            rows = ExtendRows(
                int32([tables[i][:width] + [0] * (width - len(tables[i][:width])) for i in extending]),
                int32(firsts),
                int32([len(prompts[i]) - starts[i] for i in extending]),
                int32([starts[i] for i in extending]),
                max(len(prompts[i]) - starts[i] for i in extending),
                begin,
            )
            extending = []
        for _, members in itertools.groupby(extending, key=lambda i: -(-len(prompts[i]) // P)):
            group = list(members)
            width = max(len(prompts[i]) - starts[i] for i in group)
            index, mask_rows, valid = [], [], []
            pages = -(-len(prompts[group[0]]) // P)
            for b, i in enumerate(group):
                n, s0 = len(prompts[i]), starts[i]
                first = pack(i)
                index.append([first + min(r, n - s0 - 1) for r in range(width)])
                mask_rows.append([s0 + min(r, n - s0 - 1) for r in range(width)])  # each query's position
                valid += [b * width + r for r in range(n - s0)]
            keys = torch.arange(pages * P, device=dev)
            mask = keys[None, None, :] <= tensor(mask_rows)[:, :, None]  # [count, Lq, keys]
            table = tensor([tables[i][:pages] for i in group])
            extends.append(Extends(tensor(index), table, mask[:, None], tensor(valid)))
        step = Step(
            self.pool, page=tensor(page), offset=tensor(offset), groups=groups, extends=extends, extend_rows=rows
        )
        inputs = {"input_ids": tensor(ids)[None], "position_ids": tensor(pos)[None], "logits_to_keep": tensor(last)}
        t1, cpu1 = time.perf_counter(), time.thread_time()
        with self._blocks_compiled() if compiled else contextlib.nullcontext():
            logits = self._forward(step, **inputs)[0]
        return self._prefilled(logits, len(ids), t0, t1, cpu1)

    def _prefilled(self, logits: torch.Tensor, tokens: int, t0: float, t1: float, cpu1: float) -> torch.Tensor:
        """A prefill's logits (float32, its own), counted: packed from t0, its forward queued from
        t1 (cpu1: the thread's CPU time then)."""
        self.stats["prefill_pack_s"] += t1 - t0
        self.stats["prefill_model_s"] += time.perf_counter() - t1
        self.stats["prefill_model_cpu_s"] += time.thread_time() - cpu1
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += tokens
        return logits.float()

    def _prefill_static(self, g: PrefillInputs) -> torch.Tensor:
        """A prefill from a bucket's static inputs (graphs.py's PrefillGraphs): every prompt's new
        tokens attend as chunks extending their cached keys, in the extend kernel."""
        assert self.pool is not None
        rows = ExtendRows(g.table, g.q_start, g.q_len, g.ctx, CHUNK, 0, self.extend_impl)
        step = Step(self.pool, page=g.page, offset=g.offset, groups=[], extend_rows=rows)
        with self._blocks_compiled():
            return self._forward(step, input_ids=g.ids, position_ids=g.pos, logits_to_keep=g.keep)

    def _decode_eager(self, g: StepGraph, n: int) -> torch.Tensor:
        step = Step(self.pool, g.table[:n], g.lens[:n])  # type: ignore[arg-type]
        with self._blocks_compiled():
            return self._forward(step, input_ids=g.ids[:n], position_ids=g.pos[:n])[:, -1]

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """One decode step of rows [B] (their last token, its position, their page tables): their
        logits [B, vocab], in the model's dtype, replayed from a graph where one is captured
        (graphs.py: read them before the next step, which overwrites them)."""
        logits = self.graphs.run(tokens, pos, table)
        self.stats["decode_steps"] += 1
        return logits

    # ------------------------------------------------------------------ checks

    @torch.no_grad()
    def verify(self) -> float:
        """Run a probe (a prompt across a page boundary, then greedy decode steps, then the whole
        sequence again extending half a page of cached keys) through the paged path and through
        transformers' plain forward; raise if they disagree or a layer
        bypassed the attention interface. Returns the largest logit difference. The probe fits
        the engine's context (a model of a 128-token context has rows of two pages)."""
        vocab = self.config.vocab_size
        steps = 3  # decode steps after the prompt
        prompt = [(7 * i + 3) % vocab for i in range(max(1, min(self.page_size + 3, self.context_length - steps)))]
        need = -(-(len(prompt) + steps) // self.page_size)
        kept, self.pool = self.pool, KVPool(self.config, 2 * need + 1, self.page_size, self.dtype, self.device)
        pages = self.pool.alloc(need)
        # (the probe's graphs go with its pool: the few sizes it runs, not every bucket)
        lasting = [(g, g.lasting) for g in (self.graphs, self.prefill_graphs) if g is not None]
        for g, _ in lasting:
            g.lasting = False
        try:
            layers = self.config.num_hidden_layers
            # (plain blocks: a compiled one makes the cache's update call in its trace, not here)
            got = [self.prefill_forward([prompt], [pages], compiled=False)[0]]
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
                logits = self.decode(torch.full((rows,), seq[-1], device=self.device), pos, table.expand(rows, -1))
                got.append(logits[0].to(torch.float32, copy=True))
            # The prefix cache's path: half a page prefilled, then the rest extending its keys.
            half, extra = min(self.page_size // 2, len(seq) - 1), self.pool.alloc(need)
            self.prefill_forward([seq[:half]], [extra])
            got.append(self.prefill_forward([seq], [extra], starts=[half])[0])
            ref = self.model(input_ids=torch.tensor([seq], device=self.device)).logits[0, len(prompt) - 1 :].float()
            ref = torch.cat([ref, ref[-1:]])
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
            for g, was in lasting:
                g.lasting = was
