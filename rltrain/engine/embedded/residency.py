"""What of the embedded engine is in memory: release, resume, the weights' backup, the memory report.

    residency.release(["weights", "kv_cache"])   # SGLang's /release_memory_occupation (None: all)
    residency.resume(["weights"])                # /resume_memory_occupation
    residency.memory_report()                    # /memory

`release(["weights"])` backs the weights up (pinned host memory on GPU, a safetensors file on
CPU, so the process's RSS really drops), then frees every parameter; `resume` restores them. Like
SGLang without --enable-weights-cpu-backup, an engine started without `weights_backup` discards
them instead: after resume they are NaN until an update rewrites them, and generation is refused
until then. `release(["kv_cache"])` drops the paged KV pool (or the allocator's cached blocks: the
plain path's KV cache of the last batch). Generating while released is an error, never garbage
(state.py). Without the memory saver the paged path's CUDA graphs are dropped with any region:
they hold the weights' and the pool's addresses.

With the memory saver (saver.py: SGLang's --enable-memory-saver) nothing is freed or allocated
again: release unmaps the regions' pages (weights, KV pool, the graphs' memory; the weights
backed up first if kept) and resume maps new ones at the same addresses, so the captured CUDA
graphs stay valid.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors.torch import load_file, save_file

from rltrain.engine.embedded.fused import FusedProjections
from rltrain.engine.embedded.paged import PagedDecoder
from rltrain.engine.embedded.saver import TAGS, MemorySaver
from rltrain.engine.embedded.state import EngineState
from rltrain.engine.embedded.writer import WeightWriter
from rltrain.runtime.files import process_tempdir
from rltrain.runtime.memory import free_cuda_caches, trim_host_heap
from rltrain.runtime.pinned import all_pinned_host_bytes, pinned_like

log = logging.getLogger("rltrain.engine.embedded")
BACKUP_PREFIX = "rltrain-embedded-backup-"  # + pid: a dead process's directory is removed


class Residency:
    """Release and resume of one engine's weights, KV cache and graphs (module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        state: EngineState,
        writer: WeightWriter,
        aliases: list[list[str]],
        decoder: PagedDecoder | None,
        fused: FusedProjections | None,
        saver: MemorySaver | None,
        weights_backup: bool,
        backup_dir: str | None,
        context_bytes: int | None,
    ):
        self.model = model
        self.device = device
        self.state = state
        self.writer = writer  # restores the backup (checked copies, counted as updates are)
        self.aliases = aliases  # names that share one storage (tied embeddings)
        self.decoder = decoder
        self.fused = fused
        self.saver = saver
        self.context_bytes = context_bytes  # the CUDA context, measured at start (None: unknown)
        # name -> (shape, dtype) of every parameter: what a resume allocates again
        self.param_meta = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
        self.weights_backup = weights_backup
        self._backup_dir = Path(backup_dir) if backup_dir else None
        self._own_backup_dir = False  # made here (a temporary one): removed at shutdown
        self._backup: dict[str, torch.Tensor] | Path | None = None  # the released weights' values
        self._pinned: dict[str, torch.Tensor] | None = None
        self._paused_bytes: dict[str, tuple[int, int]] = {}  # region -> the allocator's (allocated, reserved)

    def release(self, tags: list[str] | None) -> None:
        tags = _tags(tags)
        t0 = time.perf_counter()
        with self.state.lock:
            locked = time.perf_counter()
            if self.device.type == "cuda":  # (nothing queued may run on what is freed)
                torch.cuda.synchronize(self.device)
            if self.saver is not None:
                self._pause(tags)
            else:
                if "weights" in tags and "weights" not in self.state.released:
                    self._backup_and_free_weights()
                if self.decoder is not None:  # graphs hold the weights' and the pool's addresses
                    self.decoder.free_memory(kv_cache="kv_cache" in tags)
                if self.device.type == "cuda":
                    free_cuda_caches()
                else:
                    trim_host_heap()
            self.state.released |= set(tags)
            self.state.changed()
        _said("released", tags, t0, locked)

    def resume(self, tags: list[str] | None) -> None:
        tags = _tags(tags)
        t0 = time.perf_counter()
        with self.state.lock:
            locked = time.perf_counter()
            if self.saver is not None:
                self.saver.resume(tags)
                if "weights" in tags and "weights" in self.state.released:
                    self._fill_weights()
            elif "weights" in tags and "weights" in self.state.released:
                self._restore_weights()
            self.state.released -= set(tags)
            self.state.changed()
        _said("resumed", tags, t0, locked)

    def remove_backup_dir(self) -> None:
        """At shutdown: the temporary backup directory, if this engine made one."""
        if self._own_backup_dir and self._backup_dir is not None:
            shutil.rmtree(self._backup_dir, ignore_errors=True)

    def _pause(self, tags: list[str]) -> None:
        """Release with the memory saver: the weights backed up (if kept), the caches emptied
        (no block of a region may be freed while it is paused), the regions unmapped. The
        captured graphs stay: every address they hold comes back at resume."""
        assert self.saver is not None
        if "weights" in tags and "weights" not in self.state.released:
            self._backup_weights()
        free_cuda_caches()
        fresh = [t for t in tags if t not in self.state.released]
        held = self._region_bytes(fresh)
        self.saver.pause(fresh)
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
        graphs = self.decoder.graphs.pool if self.decoder is not None and "cuda_graph" in starts else None
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
        self.writer.forget_landed()  # (what comes back is written by a restore or a sync, or NaN)
        state = {n: p.detach() for n, p in self.model.named_parameters()}
        if not self.weights_backup:
            self._backup = None
        elif self.device.type == "cuda":
            # Pinned buffers are allocated once and reused: pinning is the slow part
            # (page-locking host memory), the copy itself runs at the pinned-copy bandwidth.
            if self._pinned is None:
                self._pinned = dict(zip(state, pinned_like(list(state.values()))))
            for n, t in state.items():
                self._pinned[n].copy_(t, non_blocking=True)
            torch.cuda.synchronize(self.device)
            self._backup = self._pinned
        else:
            if self._backup_dir is None:
                self._backup_dir, self._own_backup_dir = process_tempdir(BACKUP_PREFIX), True
            path = self._backup_dir / "weights_backup.safetensors"
            save_file({n: t.contiguous() for n, t in state.items()}, str(path))
            self._backup = path
        del state
        if self.saver is None:  # (with the saver every view of the weights stays valid)
            self.writer.forget_views()
        log.info(
            "weights released (%s) in %.2fs",
            "discarded"
            if self._backup is None
            else "backed up to pinned host memory"
            if isinstance(self._backup, dict)
            else f"backed up to {self._backup}",
            time.perf_counter() - t0,
        )

    def _restore_weights(self) -> None:
        named = dict(self.model.named_parameters())
        fused = self.fused.params if self.fused is not None else set()
        for n, p in named.items():
            if id(p) not in fused:  # (those are views of their group's weight: allocated below)
                shape, dtype = self.param_meta[n]
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
        if self.fused is not None:
            self.fused.allocate()
        self._retie()
        self._fill_weights()

    def _fill_weights(self) -> None:
        """The resumed weights' values: their backup's, else NaN until an update writes them."""
        backup = self._backup
        if isinstance(backup, Path):
            self.writer.copy(load_file(str(backup), device=str(self.device)).items())
            backup.unlink(missing_ok=True)
        elif isinstance(backup, dict):
            self.writer.copy(backup.items())
        else:
            # What SGLang serves after a resume without a backup is whatever the memory holds;
            # NaN makes every parameter a sync missed show in generations, log-probs and checksums.
            for p in self.model.parameters():
                if p.is_floating_point():
                    p.data.fill_(float("nan"))
            self.state.weights_valid = False
        self._backup = None

    def _paused(self) -> set[str]:
        """The regions the memory saver has unmapped now."""
        return self.saver.paused if self.saver is not None else set()

    def _retie(self) -> None:
        """Give every alias group one storage again (release gave each its own empty tensor)."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        for group in self.aliases:
            head = named[group[0]]
            for other in group[1:]:
                named[other].data = head.data

    def memory_report(self) -> dict[str, Any]:
        """What this engine holds (bytes): its weights, the allocator blocks kept after the last
        batch (its KV cache: the plain path allocates the cache per batch), the rest of its
        allocations, its CUDA context as measured at start, and its RSS."""

        # each storage once (tied weights; a fused group's members are views of one)
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.model.parameters()}
        weights = sum(storages.values()) if "weights" not in self._paused() else 0
        rep: dict[str, Any] = {
            "released": sorted(self.state.released),
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


def _said(what: str, tags: list[str], t0: float, locked: float) -> None:
    """A release's or resume's seconds in the engine's log: the wait for the scheduler's lock
    (a step or a generation in flight) apart from the work (unmapping or mapping the regions'
    pages, the weights' backup or restore)."""
    end = time.perf_counter()
    log.info("%s %s in %.3f s (%.3f s waiting for the scheduler)", what, ", ".join(tags), end - t0, locked - t0)


def _tags(tags: list[str] | None) -> list[str]:
    """SGLang's memory regions (None: all). Without the memory saver, the paged path's CUDA
    graphs are dropped with any region (they hold the weights' and the KV pool's addresses) and
    captured again when needed; with it, `cuda_graph` is their memory pool, unmapped and mapped
    again. On the plain path that region holds nothing, but is released and resumed like the
    others (generation waits for it)."""
    tags = list(tags) if tags else list(TAGS)
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; expected weights, kv_cache, cuda_graph")
    return tags
