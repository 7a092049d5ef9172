"""The first error of a failed torchrun job, read from its log: what a benchmark prints of a loop
run that failed, instead of the log's last lines (torchrun's own report, or a restart's output).

A torchrun log holds every rank's output in the order it was written. The first sign of a failure
in it is the first of: a rank's error line (`HH:MM:SS [rank R] name ERROR: ...`, which rltrain
writes when an error leaves a phase: `rank R failed in WHERE: ...`), a rank's traceback (torch
prefixes its lines with `[rankR]:`), a bare traceback that is not the agent's own, a crash
dumped by faulthandler, a line rltrain prints when it refuses to run (`rltrain: ...`), or the
agent's `failed (exitcode: N) local_rank: R` (a rank killed by a signal writes nothing itself).
The excerpt is that line with the failing rank's traceback after it, and the first rank the
agent saw exit.
"""

from __future__ import annotations

import re
from pathlib import Path

ERROR_LINE = re.compile(r"^\d\d:\d\d:\d\d \[rank (\d+)\] \S+ (?:ERROR|CRITICAL): ")
RANK_TRACEBACK = re.compile(r"^\[rank(\d+)\]: Traceback \(most recent call last\):")
TRACEBACK = "Traceback (most recent call last):"
FATAL = "Fatal Python error:"
REFUSAL = "rltrain: "
AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
AGENT_CODE = ("torch/distributed/run.py", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
# Lines that end a bare traceback: a log line, the agent's, another rank's.
FOREIGN = re.compile(r"^(\d\d:\d\d:\d\d \[rank|[WEI]\d{4} |\[rank\d+\]: |\*{5}|={5})")
CHAINED = ("The above exception was the direct cause", "During handling of the above exception")
MAX_LINES = 80


def first_error(text: str) -> str | None:
    """The first failure in a torchrun log, with its rank and traceback (None: no failure in it)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if error := ERROR_LINE.match(line):
            return _with_agent(lines, [line, *_traceback_after(lines, i + 1, f"[rank{error.group(1)}]: ")])
        if RANK_TRACEBACK.match(line):
            prefix = line[: line.index("Traceback")]
            return _with_agent(lines, _block(lines, i, prefix))
        if line.startswith(TRACEBACK):
            block = _block(lines, i, "")
            if not any(code in b for b in block for code in AGENT_CODE):
                return _with_agent(lines, block)
        if line.startswith(FATAL):
            return _with_agent(lines, _block(lines, i, ""))
        if line.startswith(REFUSAL):
            return _with_agent(lines, [line])
        if AGENT_FAILED.search(line):
            return line.strip()
    return None


def failed_run_report(what: str, returncode: int, log: Path) -> str:
    """What a benchmark prints of a run that failed: its first error, or the log's last lines
    where no error is in it (a job killed from outside, a hang cut short)."""
    text = log.read_text(errors="replace")
    found = first_error(text)
    if found is not None:
        return f"{what} failed (exit {returncode}); the first error in {log}:\n{found}"
    tail = "\n".join(text.splitlines()[-40:])
    return f"{what} failed (exit {returncode}) with no error in {log}; its last lines:\n{tail}"


def _traceback_after(lines: list[str], start: int, prefix: str) -> list[str]:
    """The traceback the rank that logged an error printed next (its lines carry `prefix`; a
    bare one where torch does not prefix them)."""
    for j in range(start, min(start + 400, len(lines))):
        if lines[j].startswith(prefix + TRACEBACK) or lines[j].startswith(TRACEBACK):
            block = _block(lines, j, prefix if lines[j].startswith(prefix) else "")
            if not any(code in b for b in block for code in AGENT_CODE):
                return block
    return []


def _block(lines: list[str], start: int, prefix: str) -> list[str]:
    """A traceback (chained ones included) or a crash dump from `start`: the lines that carry
    `prefix`, or for a bare one the lines up to the next foreign line or unchained blank line."""
    out = [lines[start]]
    for j in range(start + 1, min(start + MAX_LINES * 4, len(lines))):
        line = lines[j]
        if not line.strip():  # the end, unless a chained exception's header is next to it
            near = (out[-1], next((x for x in lines[j + 1 : j + 3] if x.strip()), ""))
            if not any(c in x for x in near for c in CHAINED):
                break
        elif prefix and not line.startswith(prefix):
            break
        elif not prefix and FOREIGN.match(line):
            break
        out.append(line)
    return out[:MAX_LINES] + ([f"... ({len(out) - MAX_LINES} more lines)"] if len(out) > MAX_LINES else [])


def _with_agent(lines: list[str], excerpt: list[str]) -> str:
    """The excerpt, and the first rank the torchrun agent saw fail (its exit code: a signal
    where it was killed)."""
    seen = next((m.group(0) for x in lines if (m := AGENT_FAILED.search(x))), None)
    return "\n".join(excerpt) + (f"\ntorchrun saw first: {seen}" if seen else "")
