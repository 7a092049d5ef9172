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
