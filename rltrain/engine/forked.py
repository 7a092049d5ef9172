"""The embedded CPU engine started by forking its rank, not as a new interpreter.

A new interpreter spends seconds of CPU importing torch and transformers before the engine loads
a model; its rank has imported both already. On a small CPU machine (two cores, two ranks, two
engines) those imports are most of the job's start-up, so `engine.embedded.start: auto` forks the rank
instead, where a fork is safe:

  - the engine is the embedded one, on the CPU (a child of a process that may have touched CUDA
    cannot use it; SGLang is its own program);
  - the rank runs no other Python thread, and torch runs one intra-op thread (a child of a
    process with a live OpenMP pool can hang in its first parallel region);
  - CUDA is not initialised in the rank.

Otherwise (and for a restart in the middle of a run, when the rank has threads of its own) the
engine is a new interpreter, as always. The child is what `python -m rltrain.engine.embedded` would
be: its own session, its log on stdout and stderr, stdin from /dev/null, the environment the
launcher gives it, `sitecustomize` run again under that environment (as a new interpreter would
run it), the same signal set-up and parent-death signal, and `os._exit` at the end (the rank's
exit handlers are not the engine's). It keeps the rank's other open descriptors (the world's
sockets among them; torch's shared-memory client is one the engine uses): the parent-death
signal ends it with its rank, so none of them outlives the rank.
"""

from __future__ import annotations

import gc
import importlib
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

MODULE = "rltrain.engine.embedded"


def blocker(cmd: list[str]) -> str | None:
    """Why `cmd` (a server command line) cannot be started by a fork of this process; None if it can."""
    if cmd[1:3] != ["-m", MODULE]:
        return "not the embedded engine"
    if "--device" not in cmd or cmd[cmd.index("--device") + 1] != "cpu":
        return "not on the CPU"
    if not hasattr(os, "fork"):
        return "no fork on this platform"
    if torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads run in this process"
    if torch.get_num_threads() > 1:
        return f"torch runs {torch.get_num_threads()} intra-op threads here (an OpenMP pool does not survive a fork)"
    return None


class ForkedProcess:
    """The forked engine, as much of `subprocess.Popen` as the launcher uses (pid, poll, wait)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, its status unknown
                self.returncode = -1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(MODULE, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def fork_engine(cmd: list[str], log_path: str, env: dict[str, str], preexec: Callable[[], None]) -> ForkedProcess:
    """Fork this process into the engine server `cmd` would start (`blocker(cmd)` must be None)."""
    sys.stdout.flush()
    sys.stderr.flush()
    # The child inherits the rank's objects frozen: its collections (the engine collects once at
    # start-up) do not walk them, nor copy their pages by writing their GC headers.
    gc.freeze()
    pid = os.fork()
    if pid:
        gc.unfreeze()
        return ForkedProcess(pid)
    code = 1
    try:
        os.setsid()
        out = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        preexec()
        os.environ.clear()
        os.environ.update(env)
        args = cmd[3:]
        sys.argv = [MODULE, *args]
        custom = sys.modules.get("sitecustomize")
        if custom is not None:
            importlib.reload(custom)
        from rltrain.engine.embedded.main import main  # noqa: PLC0415 - in the child only

        code = main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child reports and exits, never returns into the rank
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
