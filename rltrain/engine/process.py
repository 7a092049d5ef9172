"""An engine server as a child process of its rank: started, watched, stopped, never orphaned.

`EngineProcess.start` runs a command (`engine/command.py` says which) in its own process group,
its output appended to a log file, with the parent-death signal set to SIGKILL, so the server
dies with the rank even when the rank is SIGKILLed. The embedded CPU engine may be forked from
its rank instead of exec'd (`engine/forked.py`). The child gets its rank's environment without
torchrun's variables: the engine is not a rank. A server that dies is reported (`EngineCrashed`)
with the tail of its log.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rltrain.engine import forked

log = logging.getLogger("rltrain.engine")


class EngineCrashed(RuntimeError):
    """The engine process exited; the message carries the tail of its log."""


TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def engine_environment() -> dict[str, str]:
    """This process's environment without torchrun's rank variables: the engine is not a rank,
    and e.g. TORCHELASTIC_USE_AGENT_STORE would make its weight-update rendezvous wait for a
    store that torchrun's agent does not serve."""
    return {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}


def _engine_preexec(parent_pid: int) -> None:
    """preexec_fn: the job's stop signals (runtime/stop.py) are for the ranks, which stop the
    engine themselves: a scheduler signals every process of the job, and an engine gone before
    its rank's checkpoint would fail that step. SIGTERM and SIGUSR1 stay ignored across exec
    (SGLang's server still takes SIGTERM: it installs its own handler). SIGINT, how the rank
    stops it (`EngineProcess.stop`), is back to its default: a job started in the background of
    a non-interactive shell (`nohup torchrun ... &`) inherits it ignored, and the engine would
    then be killed after the grace period every time, its clean-up skipped. And SIGKILL this
    child when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


@dataclass
class EngineProcess:
    """A running engine server owned by this process."""

    proc: subprocess.Popen | forked.ForkedProcess
    url: str
    log_path: Path
    _ps: psutil.Process | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls,
        cmd: list[str],
        url: str,
        log_path: Path,
        env: dict[str, str | None] | None = None,
        fork: bool = False,
    ) -> EngineProcess:
        """`env`: added to this process's environment (without torchrun's variables); a None
        value removes the variable. `fork`: the embedded CPU engine is forked from this process
        where that is safe (`engine/forked.py`), else started as a new interpreter."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {k: v for k, v in {**engine_environment(), **(env or {})}.items() if v is not None}
        parent = os.getpid()
        why_not = forked.blocker(cmd) if fork else "engine.embedded.start=exec"
        how = "forked from its rank" if why_not is None else "a new interpreter"
        with open(log_path, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} ({how}) {' '.join(cmd)}\n".encode())
            out.flush()
            proc: subprocess.Popen | forked.ForkedProcess
            if why_not is None:
                proc = forked.fork_engine(cmd, str(log_path), full_env, lambda: _engine_preexec(parent))
            else:
                proc = subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=full_env,
                    start_new_session=True,
                    preexec_fn=lambda: _engine_preexec(parent),
                )
        log.info(
            "engine started: pid %d, %s, log %s (%s)",
            proc.pid,
            url,
            log_path,
            how + (f": {why_not}" if why_not else ""),
        )
        return cls(proc, url, log_path)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int | None:
        """The server's resident memory (bytes; None once it is gone): its process's and its
        children's (the embedded engine's with `--separate-http-process`). Read after every
        phase: the process handle is made once."""
        try:
            if self._ps is None:
                self._ps = psutil.Process(self.proc.pid)
            total = int(self._ps.memory_info().rss)
        except psutil.Error:
            return None
        for child in self._ps.children(recursive=True):
            try:
                total += int(child.memory_info().rss)
            except psutil.Error:  # (gone meanwhile)
                pass
        return total

    def listens_on(self, port: int) -> bool | None:
        """Whether this engine's process, or one of its children, listens on TCP `port`: that
        the server answering there is this engine, not another that bound the port first
        (`free_port` only says it was free a moment before). None where it cannot be told."""
        try:
            root = psutil.Process(self.proc.pid)
            for proc in (root, *root.children(recursive=True)):
                for conn in proc.net_connections(kind="tcp"):
                    if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                        return True
        except psutil.AccessDenied:
            return None
        except psutil.Error:  # (gone: it did not bind it)
            return False
        return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_bytes()[-65536:].decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def crashed_error(self, what: str) -> EngineCrashed:
        return EngineCrashed(
            f"engine process {self.proc.pid} {what} (exit code {self.proc.poll()}); "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGINT the server's whole process group (SIGTERM it ignores: `_engine_preexec`),
        SIGKILL what is left after `grace_s`."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Children of the server (SGLang's scheduler/detokenizer) share its process group.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
