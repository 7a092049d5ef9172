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
    _lean_generate = _client.EngineClient._lean_generate

    def _spoiled(body):
        """The body, spoiled if it is the k-th /generate request (a rollout's: a list of params)."""
        if isinstance(body, dict) and isinstance(body.get("sampling_params"), list):
            with _calls_lock:
                k = next(_calls)
            if k == _bad_call:
                return {**body, "sampling_params": [{**p, "max_new_tokens": -1} for p in body["sampling_params"]]}
        return body

    def _bad_post(self, endpoint, body=None, **kw):
        return _post(self, endpoint, _spoiled(body) if endpoint == "/generate" else body, **kw)

    def _bad_lean_generate(self, body):  # (a call of one request: the lean connection)
        return _lean_generate(self, _spoiled(body))

    _client.EngineClient._post = _bad_post
    _client.EngineClient._lean_generate = _bad_lean_generate

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

# RLTRAIN_TEST_SYNC_DROP="<checkpoint name>[,<name>...]": every rank's weight sync leaves these
# weights out of what it sends, after checksumming them as a sender that believes it sent them
# would: a sync that misses a parameter, or one half of a weight the engine fuses.
_DROP = os.environ.get("RLTRAIN_TEST_SYNC_DROP")
if _DROP and os.environ.get("RANK") is not None:
    import rltrain.sync.weight_sync as _weight_sync

    _dropped = set(_DROP.split(","))
    _tensors = _weight_sync.WeightSync._tensors

    def _dropping_tensors(self, names, sums):
        for name, t in _tensors(self, names, sums):
            if name not in _dropped:
                yield name, t

    _weight_sync.WeightSync._tensors = _dropping_tensors

# RLTRAIN_TEST_ENGINE_ORDER="<dir>:<rank>:<seconds>" records, on every rank, when its trainer is put
# away (TrainerCycle.make_room, put_away) and brought back (bring_back), and when it asks its engine
# to release or resume memory (EngineClient.release, resume), as JSON lines in <dir>/rank<r>.jsonl
# (time.time() at start and end); <rank>'s put-aways and every release take <seconds> longer.
# What an engine's ranks must wait for shows in the times (tests/test_engine_ranks.py).
_ORDER = os.environ.get("RLTRAIN_TEST_ENGINE_ORDER")
if _ORDER and os.environ.get("RANK") is not None:
    import functools
    import json
    import time

    import rltrain.between_steps as _between
    import rltrain.engine.client as _client

    _dir, _slow_rank, _delay = _ORDER.rsplit(":", 2)
    _record_path = os.path.join(_dir, f"rank{os.environ['RANK']}.jsonl")
    os.makedirs(_dir, exist_ok=True)

    def _recorded(cls, name, slow, detail=lambda *a: None):
        original = getattr(cls, name)

        @functools.wraps(original)
        def run(self, *args, **kw):
            start = time.time()
            try:
                return original(self, *args, **kw)
            finally:
                if slow:
                    time.sleep(float(_delay))
                with open(_record_path, "a") as f:
                    event = {"what": name, "start": start, "end": time.time(), "detail": detail(*args)}
                    f.write(json.dumps(event) + "\n")

        setattr(cls, name, run)

    _slow = os.environ["RANK"] == _slow_rank
    _recorded(_between.TrainerCycle, "make_room", _slow)
    _recorded(_between.TrainerCycle, "put_away", _slow)
    _recorded(_between.TrainerCycle, "bring_back", False)
    _recorded(_client.EngineClient, "release", True, lambda tags=None: tags)
    _recorded(_client.EngineClient, "resume", False, lambda tags=None: tags)

# RLTRAIN_TEST_SGLANG_CPU_RELEASE=1: the ranks ask SGLang on CPU to release and resume its memory
# when engine.release=true, as on CUDA (SGLang answers, frees nothing: its memory saver is
# CUDA-only), so that the phase verbs' order runs against real SGLang on a CPU.
if os.environ.get("RLTRAIN_TEST_SGLANG_CPU_RELEASE") == "1" and os.environ.get("RANK") is not None:
    import rltrain.engine.launcher as _launcher

    _releases = _launcher.engine_releases
    _launcher.engine_releases = lambda cfg, backend, device: cfg.release is True or _releases(cfg, backend, device)

# RLTRAIN_TEST_SGLANG_CPU_DETERMINISTIC=1: SGLang's deterministic inference starts on a CPU
# (sglang_cpu_deterministic.py says what stands in for what), in SGLang's processes only.
if os.environ.get("RLTRAIN_TEST_SGLANG_CPU_DETERMINISTIC") == "1" and os.environ.get("RANK") is None:
    import sglang_cpu_deterministic  # noqa: F401

# RLTRAIN_TEST_END_FAULT="<rank>:<module>:<Class.method>:<raise|kill>" makes that rank raise in
# (or SIGKILL itself on entering) that method, which the job calls once its last step is
# recorded: a failure at the end of a run, as an out-of-memory while a part is closed or a crash
# in a teardown would be. It fires in the first attempt only, like RLTRAIN_TEST_FAULT.
_END = os.environ.get("RLTRAIN_TEST_END_FAULT")
if _END and os.environ.get("RANK") == _END.split(":")[0] and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import importlib
    import signal

    _, _end_module, _end_method, _end_action = _END.split(":")
    _end_cls = getattr(importlib.import_module(_end_module), _end_method.split(".")[0])

    def _failing_at_the_end(self, *args, **kw):
        if _end_action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"fault injected by the test in {_end_method} at the end of the run")

    setattr(_end_cls, _end_method.split(".")[1], _failing_at_the_end)

# RLTRAIN_TEST_ENGINE_STEP_S=<seconds>: the embedded engine's plain path sleeps that long at every
# decode step, so that a rollout is still in flight when the loop's next weight update comes
# (loop.in_flight_update: the update cuts it).
_STEP_S = os.environ.get("RLTRAIN_TEST_ENGINE_STEP_S")
if _STEP_S and os.environ.get("RANK") is None:
    import time as _time

    import rltrain.engine.embedded.plain as _plain

    _sample = _plain.sample

    def _slow_sample(*args, **kw):
        _time.sleep(float(_STEP_S))
        return _sample(*args, **kw)

    _plain.sample = _slow_sample
