"""Test-only fault injection for real torchrun runs (tests/test_faults.py), loaded by putting
this directory on PYTHONPATH. RLTRAIN_TEST_FAULT="<rank>:<phase>:<step>:<kill|raise|term>" makes
that rank SIGKILL itself, raise, or send itself SIGTERM (a stop request) and go on, when the loop
enters that phase of that step. It fires in the
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
                if _action == "term":
                    os.kill(os.getpid(), signal.SIGTERM)
                    yield
                    return
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

    import rltrain.engine.embedded.server as _server

    _versions, _marks = _DIE.split(":", 1)
    _generate = _server.EmbeddedServer._generate

    def _dying_generate(self, body):
        if "logprob_start_len" in body:  # the sync's probe, not the rollout
            return _generate(self, body)
        version = str(self.engine.weight_version)
        mark = Path(_marks) / f"engine_died_at_v{version}"
        if version in _versions.split(",") and not mark.exists():
            mark.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return _generate(self, body)

    _server.EmbeddedServer._generate = _dying_generate

# RLTRAIN_TEST_BAD_GENERATE="<rank>:<k>" makes that rank's k-th /generate request (0-based) carry
# max_new_tokens=-1 in every row: the engine (real SGLang included) refuses it, and its samples
# must come back as failed generations, counted and never trained on.
_BAD = os.environ.get("RLTRAIN_TEST_BAD_GENERATE")
if _BAD and os.environ.get("RANK") is not None and os.environ["RANK"] == _BAD.split(":")[0]:
    import itertools
    import threading

    import rltrain.engine.client as _client

    _bad_call = int(_BAD.split(":")[1])
    _calls = itertools.count()
    _calls_lock = threading.Lock()
    _post = _client.EngineClient._post

    def _bad_post(self, endpoint, body=None, **kw):
        if endpoint == "/generate" and isinstance(body, dict) and isinstance(body.get("sampling_params"), list):
            with _calls_lock:
                k = next(_calls)
            if k == _bad_call:
                body = {**body, "sampling_params": [{**p, "max_new_tokens": -1} for p in body["sampling_params"]]}
        return _post(self, endpoint, body, **kw)

    _client.EngineClient._post = _bad_post

# RLTRAIN_TEST_RECORD_PAYLOADS=<dir>: every rank writes its pid to <dir>/rank<r>.pid, and each
# /update_weights_from_tensor request a rank sends is recorded in <dir>/requests<r>.jsonl with the
# pids of the processes whose shared memory each TP rank's payload names ("/torch_<pid>_..."
# in the pickled handle), read from the bytes without opening anything.
_REC = os.environ.get("RLTRAIN_TEST_RECORD_PAYLOADS")
if _REC and os.environ.get("RANK") is not None:
    import base64
    import json
    import re
    from pathlib import Path

    import rltrain.engine.client as _client

    Path(_REC).mkdir(parents=True, exist_ok=True)
    (Path(_REC) / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    _update = _client.EngineClient.update_weights_from_tensor

    def _recorded_update(self, serialized_named_tensors, *args, **kw):
        pids = [
            sorted({int(m) for m in re.findall(rb"/torch_(\d+)_", base64.b64decode(p))})
            for p in serialized_named_tensors
        ]
        with open(Path(_REC) / f"requests{os.environ['RANK']}.jsonl", "a") as f:
            f.write(json.dumps({"payload_pids": pids}) + "\n")
        return _update(self, serialized_named_tensors, *args, **kw)

    _client.EngineClient.update_weights_from_tensor = _recorded_update
