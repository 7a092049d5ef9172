"""Release that keeps every address: the embedded engine's memory through torch_memory_saver.

    python -m rltrain.engine.embedded --device cuda --enable-memory-saver ...   # as SGLang's flag

SGLang's memory saver, for the embedded engine. The engine's weights, its paged KV pool and its
CUDA graphs' memory pool are allocated through torch_memory_saver: preloaded into the engine's
process, it serves those regions' cudaMalloc with virtual memory whose physical pages can be
unmapped and mapped again. Release unmaps a region's pages (the device memory goes back);
resume maps new pages at the same addresses. So the CUDA graphs captured before a release are
still valid after it: a rollout replays the graphs of the last one instead of capturing again
(without the saver the weights and the pool come back at new addresses, and every rollout after
a release pays one capture; see BENCHMARKS.md).

What resume maps is new memory, its contents undefined: the weights are restored from their
backup or rewritten by the next update (NaN until then, as without the saver), the KV cache and
the graphs' intermediates hold nothing from one generation to the next. Nothing of a region may
be read, written or freed while it is paused: the engine refuses generation and updates while
released, and empties the allocator's caches before it pauses anything.

The preloaded library must be in the process from its start (LD_PRELOAD): `exec_preloaded`
starts the engine's program again with it when it was not.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PRELOAD = "torch_memory_saver_hook_mode_preload"
FLAG = "--enable-memory-saver"
TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory regions


def installed() -> bool:
    """Whether torch_memory_saver can be imported here (without importing it)."""
    return importlib.util.find_spec("torch_memory_saver") is not None


def preloaded() -> bool:
    return any(PRELOAD in Path(p).name for p in os.environ.get("LD_PRELOAD", "").split(":") if p)


def preload_environment() -> dict[str, str]:
    """LD_PRELOAD with the saver's library for this torch's CUDA, and the directories of the CUDA
    runtime torch was installed with on LD_LIBRARY_PATH (the library links against it and is
    loaded before torch has put it in the process)."""
    import torch  # noqa: PLC0415 - the engine's program imports it after this module's exec
    from torch_memory_saver.utils import get_binary_path_from_package  # noqa: PLC0415 - optional, CUDA only

    library = str(get_binary_path_from_package(PRELOAD))
    major = (torch.version.cuda or "").split(".")[0]
    runtime = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        runtime += sorted({str(p.parent) for p in Path(root).glob(f"**/libcudart.so.{major}*")})
    env = {"LD_PRELOAD": ":".join(x for x in (library, os.environ.get("LD_PRELOAD", "")) if x)}
    if runtime:
        env["LD_LIBRARY_PATH"] = ":".join(x for x in (*runtime, os.environ.get("LD_LIBRARY_PATH", "")) if x)
    return env


def exec_preloaded(argv: list[str]) -> None:
    """With the saver asked for (`FLAG` in `argv`) and not preloaded: start this program again,
    the same arguments, with it preloaded (never returns). Otherwise return. Without the package
    installed: SystemExit with what to install."""
    if FLAG not in argv or preloaded():
        return
    if not installed():
        raise SystemExit(
            f"{FLAG}: torch_memory_saver is not installed (pip install torch_memory_saver); or start the engine "
            "without it (its graphs are then captured again after each release)"
        )
    env = {**os.environ, **preload_environment()}
    os.execve(sys.executable, [sys.executable, "-m", "rltrain.engine.embedded", *argv], env)


class MemorySaver:
    """The engine's regions (`TAGS`) through torch_memory_saver, and which are paused now."""

    def __init__(self) -> None:
        if not preloaded():
            raise RuntimeError(
                f"the memory saver needs {PRELOAD} preloaded into the engine's process from its start: "
                f"start it as `python -m rltrain.engine.embedded {FLAG} ...`, which does that"
            )
        from torch_memory_saver import torch_memory_saver  # noqa: PLC0415 - optional, CUDA only

        self._tms = torch_memory_saver
        self.paused: set[str] = set()

    def region(self, tag: str) -> contextlib.AbstractContextManager[Any]:
        """Allocations made inside belong to region `tag` (their own memory pool)."""
        assert tag in TAGS
        return self._tms.region(tag=tag)

    @contextlib.contextmanager
    def graph(self, graph: Any, pool: Any) -> Iterator[None]:
        """torch.cuda.graph(graph, pool=pool), the memory it allocates in region cuda_graph."""
        with self._tms.cuda_graph(graph, pool=pool, tag="cuda_graph"):
            yield

    def pause(self, tags: list[str]) -> None:
        """Unmap the regions' pages (the caller has synchronised and emptied the caches)."""
        for tag in tags:
            if tag not in self.paused:
                self._tms.pause(tag)
                self.paused.add(tag)

    def resume(self, tags: list[str]) -> None:
        """Map new pages under the regions' addresses (contents undefined)."""
        for tag in tags:
            if tag in self.paused:
                self._tms.resume(tag)
                self.paused.discard(tag)


def in_region(saver: MemorySaver | None, tag: str) -> contextlib.AbstractContextManager[Any]:
    """Where region `tag`'s memory is allocated: `saver`'s region, or anywhere without one."""
    return saver.region(tag) if saver is not None else contextlib.nullcontext()
