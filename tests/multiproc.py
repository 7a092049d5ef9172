"""Run a function on N real processes (torch.multiprocessing, spawn) with torchrun's environment.

Each rank's return value (or exception text) is written to a file; the parent waits with a
deadline, kills whatever is still alive after it, and reports per-rank outcomes. Used by every
multi-process test: the processes and the gloo groups are real, nothing is mocked.

The ranks are forked from a fork server (multiprocessing's "forkserver" start method) that has
imported torch, transformers and rltrain once: a spawned rank spent ~5-10 s of CPU on those
imports (2 cores in CI), more than most tests' own work. The server forks before any thread or
OpenMP pool exists in it; each rank gets the parent's environment as it is at the call.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from rltrain.runtime.net import free_port


@dataclass
class RankOutcome:
    rank: int
    exitcode: int | None  # None: killed at the deadline
    value: Any = None
    error: str | None = None  # "ExcType: message" plus traceback

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


# Imported once by the fork server (failures are ignored there: a rank then imports it itself).
PRELOAD = ["torch", "torch.distributed", "transformers", "safetensors.torch", "rltrain.loop", "models", "multiproc"]


def _entry(fn: Callable, rank: int, world_size: int, port: int, out: str, env: dict, args: tuple) -> None:
    os.environ.clear()  # the fork server's is the parent's when the server started
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **env,
    )
    try:
        result = ("value", fn(rank, world_size, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    # Skip interpreter teardown: a rank whose peers failed may hold gloo state whose
    # destructors block; the test already has its answer.
    os._exit(0)


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    deadline_s: float = 120.0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> list[RankOutcome]:
    """Start `fn(rank, world_size, *args)` on `world_size` processes; wait at most `deadline_s`.
    `fresh`: spawned interpreters instead of forks of the preloaded server, for a test that
    measures its process's own memory (a fork's RSS grows as it first touches the libraries'
    pages, which a spawned process counts in its baseline)."""
    ctx = mp.get_context("spawn" if fresh else "forkserver")
    if not fresh:
        ctx.set_forkserver_preload(PRELOAD)
    port = free_port()
    env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, port, out, env, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        # Poll the pids (waitpid), not `join()`: join waits on a pipe that a grandchild such as
        # torch's shared-memory manager (CPU tensor handles) keeps open after the rank exited.
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            time.sleep(0.05)
        outcomes = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                outcomes.append(RankOutcome(r, None, error=f"still running after the {deadline_s:.0f}s deadline"))
                continue
            f = Path(out, f"rank{r}.pkl")
            if not f.exists():
                outcomes.append(RankOutcome(r, p.exitcode, error=f"exited with code {p.exitcode} without a result"))
                continue
            kind, payload = pickle.loads(f.read_bytes())
            outcomes.append(
                RankOutcome(r, p.exitcode, **({"value": payload} if kind == "value" else {"error": payload}))
            )
        return outcomes


def values(outcomes: list[RankOutcome]) -> list[Any]:
    """Every rank's value, or an AssertionError listing each failed rank's error."""
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise AssertionError("\n".join(f"rank {o.rank} (exit {o.exitcode}): {o.error}" for o in bad))
    return [o.value for o in outcomes]


def run_torchrun(
    cwd: Path,
    entry: list[str],
    args: list[str],
    nproc: int = 2,
    timeout_s: float = 280,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node=nproc <entry> <args>` in its own session: on a timeout the
    whole tree (agent, ranks, engine) is killed, not orphaned, and the test fails with its stderr.
    A master port that another process took between `free_port` and the agent's bind (its store
    cannot listen: no rank has started) is given up for another, twice at most."""
    for attempt in range(3):
        port = free_port()
        launch = [f"--nproc-per-node={nproc}", f"--master-port={port}", *entry, *args]
        result = _torchrun(cwd, launch, " ".join(entry), timeout_s, env)
        err = result.stderr
        taken = "failed to listen" in err and f"port: {port}," in err and "EADDRINUSE" in err
        if result.returncode == 0 or not taken or attempt == 2:
            return result
    raise AssertionError("unreachable")


def _torchrun(
    cwd: Path, args: list[str], what: str, timeout_s: float, env: dict[str, str] | None
) -> subprocess.CompletedProcess:
    """One torchrun. Its output goes to files, not pipes: a process that outlives the agent (an
    engine in its own session, a compile worker) cannot hold the test on a pipe it inherited. On a
    timeout every process under the agent is sent SIGABRT first (rltrain's ranks dump every
    thread's stack through faulthandler), then the whole tree is killed, and the test fails with
    the stacks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    with tempfile.TemporaryDirectory(prefix="torchrun-") as logs:
        out_path, err_path = Path(logs, "stdout"), Path(logs, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            tree = descendants(proc.pid)
            for pid in tree:
                _signal(pid, signal.SIGABRT)  # faulthandler: every thread's stack, to the rank's stderr
            time.sleep(3)
            for pid in [proc.pid, *tree]:
                _signal(pid, signal.SIGKILL)
            _signal(-proc.pid, signal.SIGKILL)  # the agent's process group, anything forked since
            proc.wait(timeout=30)
            stderr = err_path.read_text(errors="replace")
            raise AssertionError(f"{what} did not finish in {timeout_s:.0f} s:\n{stderr[-12000:]}") from None
        stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def descendants(pid: int) -> list[int]:
    """Every live process under `pid`, in any session or process group (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        if pid < 0:
            os.killpg(-pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
