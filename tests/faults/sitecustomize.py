"""Test-only fault injection for real torchrun runs (tests/test_faults.py), loaded by putting
this directory on PYTHONPATH. RLTRAIN_TEST_FAULT="<rank>:<phase>:<step>:<kill|raise>" makes that
rank SIGKILL itself, or raise, when the loop enters that phase of that step. It fires in the
first attempt only (TORCHELASTIC_RESTART_COUNT=0), so a job restarted by torchrun runs clean.
Nothing of this is in the package."""

import os

_FAULT = os.environ.get("RLTRAIN_TEST_FAULT")
if _FAULT and os.environ.get("RANK") is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import contextlib
    import signal

    import rltrain.metrics as _metrics

    _rank, _where, _step, _action = _FAULT.split(":")
    _original = _metrics.PhaseClock.phase

    @contextlib.contextmanager
    def _phase(self, name):
        with _original(self, name):
            if (name, self.step, self.rank) == (_where, int(_step), int(_rank)):
                if _action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"fault injected by the test in phase {name} of step {self.step}")
            yield

    _metrics.PhaseClock.phase = _phase

# RLTRAIN_TEST_ENGINE_DIE="<version>[,<version>...]:<marker dir>" makes the embedded engine
# SIGKILL itself on the first /generate request it serves at each of those weight versions — a
# crash in the middle of a rollout. A marker file per version makes it die once per job (the
# restarted engine serves that version again).
_DIE = os.environ.get("RLTRAIN_TEST_ENGINE_DIE")
if _DIE and os.environ.get("RANK") is None:
    import signal
    from pathlib import Path

    import rltrain.engine.native.server as _server

    _versions, _marks = _DIE.split(":", 1)
    _generate = _server.NativeServer._generate

    def _dying_generate(self, body):
        version = str(self.engine.weight_version)
        mark = Path(_marks) / f"engine_died_at_v{version}"
        if version in _versions.split(",") and not mark.exists():
            mark.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return _generate(self, body)

    _server.NativeServer._generate = _dying_generate
