"""The embedded engine's own behaviour: memory release/resume and server-side input checks.

Release/resume is covered here rather than in the contract suite: SGLang's release is CUDA-only
(its scheduler calls torch.cuda.synchronize), so on CPU only the embedded engine can run it.
"""

from __future__ import annotations

import pytest
import torch

from models import engine_greedy, hf_greedy, make_model
from rltrain.engine.client import EngineError
from rltrain.generation import SamplingParams

PROMPTS = [[1, 2, 3], [5, 6, 7, 8]]


def memory(srv) -> dict:
    return srv.client.memory_report()


def greedy(client):
    return engine_greedy(client, PROMPTS, 5)


def test_release_frees_memory_generate_fails_clearly_resume_restores(embedded, big_model):
    before = greedy(embedded.client)
    assert before == hf_greedy(big_model, PROMPTS, 5)
    m0 = memory(embedded)
    embedded.client.release(["weights", "kv_cache"])
    m1 = memory(embedded)
    assert m1["released"] == ["kv_cache", "weights"]
    assert m1["weight_bytes"] == 0 and m0["weight_bytes"] > 30e6
    # The weights' bytes left the process (backup went to disk, not to another buffer in RAM).
    assert m0["rss_bytes"] - m1["rss_bytes"] > 0.6 * m0["weight_bytes"], (m0, m1)
    failed = embedded.client.generate(PROMPTS, SamplingParams(max_new_tokens=5))
    assert all(not c.ok for c in failed)
    assert all("released" in c.error and "resume_memory_occupation" in c.error for c in failed)
    with pytest.raises(EngineError, match="resume weights before updating"):
        embedded.client.update_weights_from_disk(str(big_model))
    embedded.client.resume(["weights"])
    assert memory(embedded)["released"] == ["kv_cache"]
    assert all(not c.ok for c in embedded.client.generate(PROMPTS, SamplingParams(max_new_tokens=2)))
    embedded.client.resume(["kv_cache"])
    assert greedy(embedded.client) == before
    assert memory(embedded)["weight_bytes"] == m0["weight_bytes"]


def test_release_resume_repeatedly_keeps_outputs(embedded):
    before = greedy(embedded.client)
    for _ in range(3):
        embedded.client.release()
        embedded.client.resume()
    assert greedy(embedded.client) == before


def test_unknown_memory_tag_is_rejected(embedded):
    with pytest.raises(EngineError, match="unknown memory tags"):
        embedded.client.release(["weightz"])


def test_server_rejects_out_of_vocabulary_ids(embedded):
    bad = embedded.client.generate([[10**7]], SamplingParams(max_new_tokens=2))
    assert not bad[0].ok and "outside the vocabulary" in bad[0].error  # a failure with its reason, never a sample
    assert greedy(embedded.client)


def test_malformed_bodies_get_400_with_reason(embedded):
    http = embedded.client._http
    r = http.post("/generate", content=b"{not json")
    assert r.status_code == 400 and "not JSON" in r.json()["message"]
    r = http.post("/generate", json={"input_ids": [[1, 2]], "sampling_params": {"top_p": 0}})
    assert r.status_code == 400 and "top_p" in r.json()["message"]
    r = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["AAAA"]})
    assert r.status_code == 400 and "cannot deserialize" in r.json()["message"]
    assert greedy(embedded.client)


def test_corrupt_weight_file_is_a_clear_error_and_changes_nothing(embedded, big_model, tmp_path):
    before = greedy(embedded.client)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(EngineError, match="cannot read weight file"):
        embedded.client.update_weights_from_disk(str(tmp_path))
    partial = make_model(tmp_path / "other", seed=4)  # a different (smaller) architecture
    with pytest.raises(EngineError, match="shape|missing"):
        embedded.client.update_weights_from_disk(str(partial))
    assert greedy(embedded.client) == before  # nothing was half-loaded
    embedded.client.update_weights_from_disk(str(big_model), weight_version="default")
    assert greedy(embedded.client) == hf_greedy(big_model, PROMPTS, 5)


def test_api_key_loopback_bind_and_weights_only_from_the_sync_directory(big_model, tmp_path):
    """Security defaults: the server listens on loopback only; with engine.api_key every endpoint
    refuses requests without it (the key travels in the environment, not on the command line);
    weight versions load only from the configured weights directory, `..` and symlinks resolved."""
    import shutil

    import psutil

    from conftest import engine_config
    from rltrain.engine.client import EngineClient
    from rltrain.engine.command import secret_environment, server_command
    from rltrain.engine.process import EngineProcess
    from rltrain.runtime.net import free_port

    cfg = engine_config("embedded", api_key="s3cret-key")
    root = tmp_path / "weights"
    (root / "weight_v000001").mkdir(parents=True)
    for f in big_model.iterdir():
        shutil.copy(f, root / "weight_v000001" / f.name)
    outside = tmp_path / "elsewhere"
    shutil.copytree(big_model, outside)
    (root / "link").symlink_to(outside, target_is_directory=True)
    port = free_port()
    cmd = server_command(cfg, str(big_model), port, weights_roots=[str(root)])
    assert "s3cret-key" not in " ".join(cmd)
    proc = EngineProcess.start(cmd, f"http://127.0.0.1:{port}", tmp_path / "engine.log", env=secret_environment(cfg))
    good, bad = EngineClient(proc.url, retries=0, api_key="s3cret-key"), EngineClient(proc.url, retries=0)
    try:
        good.wait_healthy(120, alive=lambda: proc.alive)
        listening = [c.laddr for c in psutil.Process(proc.proc.pid).net_connections("tcp") if c.status == "LISTEN"]
        assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
        assert not bad.health()
        with pytest.raises(EngineError, match="HTTP 401.*API key"):
            bad.weight_version()
        with pytest.raises(EngineError, match="HTTP 401"):
            bad.update_weights_from_disk(str(root / "weight_v000001"))
        failed = bad.generate(PROMPTS, SamplingParams(max_new_tokens=2))
        assert all(not c.ok and "401" in c.error for c in failed)
        assert all(c.ok for c in good.generate(PROMPTS, SamplingParams(max_new_tokens=2)))

        for path in (outside, root / ".." / "elsewhere", root / "link"):
            with pytest.raises(EngineError, match="outside the directories"):
                good.update_weights_from_disk(str(path), weight_version="x")
        assert good.weight_version() != "x"
        good.update_weights_from_disk(str(root / "weight_v000001"), weight_version="1")
        assert good.weight_version() == "1"
    finally:
        good.close()
        bad.close()
        proc.stop()


def test_a_retried_subset_of_prompts_gets_the_indices_and_seeds_it_had(embedded):
    """What an engine restart retries (`positions`): the same samples as in the full call."""
    from rltrain.engine.client import EngineClient

    prompts = [[1, 2, 3], [5, 6, 7], [9, 10, 11], [4, 4, 4]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, sampling_seed=1234, ignore_eos=True)
    client = EngineClient(embedded.process.url, prompts_per_request=1, max_inflight=1)
    try:
        full = client.generate(prompts, params)
        part = client.generate([prompts[1], prompts[3]], params, positions=[1, 3])
    finally:
        client.close()
    assert [(c.prompt_index, c.sample_index) for c in part] == [(1, 0), (1, 1), (3, 0), (3, 1)]
    assert [c.output_ids for c in part] == [c.output_ids for c in full if c.prompt_index in (1, 3)]
    assert len({tuple(c.output_ids) for c in full}) > 1  # sampled, not greedy: the seeds matter


def test_log_probs_as_values_are_sglangs_triples_values(embedded):
    """The engine's `logprob_format: "values"` (what the loop's client asks of it): the same
    samples, their log-probs as one list of values instead of [log-prob, token, null] per token;
    a client asking so reads the same completions."""
    from rltrain.engine.client import EngineClient
    from rltrain.generation import generate_body

    assert embedded.client.server_info()["logprob_formats"] == ["triples", "values"]
    params = SamplingParams(max_new_tokens=6, n=3, sampling_seed=11, ignore_eos=True)
    triples = embedded.client._post("/generate", generate_body(PROMPTS, params))
    values = embedded.client._post("/generate", generate_body(PROMPTS, params, logprob_values=True))
    assert [x["output_ids"] for x in triples] == [y["output_ids"] for y in values]
    for x, y in zip(triples, values):
        assert "output_token_logprobs" not in y["meta_info"]
        assert y["meta_info"]["output_token_logprob_values"] == [e[0] for e in x["meta_info"]["output_token_logprobs"]]
        assert [e[1] for e in x["meta_info"]["output_token_logprobs"]] == y["output_ids"]
    lean = EngineClient(embedded.process.url, logprob_values=True)
    try:
        got, want = lean.generate(PROMPTS, params), embedded.client.generate(PROMPTS, params)
    finally:
        lean.close()
    assert [(c.output_ids, c.logprobs, c.finish_reason) for c in got] == [
        (c.output_ids, c.logprobs, c.finish_reason) for c in want
    ]
    assert all(c.ok and len(c.logprobs) == 6 for c in got)
    # A null value (JSON has no NaN) reads as NaN, as in SGLang's triples.
    from rltrain.generation import parse_generate_response

    item = {
        "output_ids": [4, 5],
        "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprob_values": [-1.5, None]},
    }
    (c,) = parse_generate_response([item], 1, 1)
    assert c.logprobs[0] == -1.5 and c.logprobs[1] != c.logprobs[1] and c.ok


def test_seeded_sampling_noise_is_uniform_and_samples_the_softmax():
    """The counter-based noise behind seeded sampling: uniform, different per step and seed, and
    its Gumbel-max draws follow the softmax."""
    from rltrain.engine.embedded.sampling import seeded_uniform

    seeds = torch.arange(40000) * 1_000_003 + 12345
    u = seeded_uniform(seeds, step=3, vocab=8)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.005
    assert float((seeded_uniform(seeds, step=4, vocab=8) != u).double().mean()) > 0.999
    assert torch.equal(seeded_uniform(seeds[7:9], step=3, vocab=8), u[7:9])  # no dependence on the batch
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 0.5, -2.0, 1.5])
    drawn = torch.argmax(logits - torch.log(-torch.log(u)).float(), dim=-1)
    freq = torch.bincount(drawn, minlength=8).double() / len(seeds)
    assert torch.allclose(freq, torch.softmax(logits.double(), -1), atol=0.01), freq


@pytest.fixture(scope="module")
def discarding(model_a, tmp_path_factory):
    """The embedded engine as the loop runs it: released weights are discarded, as SGLang does
    without --enable-weights-cpu-backup."""
    from conftest import start_engine

    # A context beyond the model's 1024 positions (RoPE extends): room for a request that is
    # still decoding when the release aborts it.
    srv = start_engine(
        "embedded", model_a, tmp_path_factory.mktemp("discarding_logs"), extra_args=["--context-length", "8192"]
    )
    yield srv
    srv.client.close()
    srv.process.stop()


def test_released_weights_are_discarded_and_garbage_until_every_parameter_is_synced(discarding, model_a, model_b):
    """What a real engine serves after a resume without a backup: nothing until weights are
    loaded, and wherever a sync missed a parameter, garbage that the verification catches (the
    probe's log-probs are not finite, the checksum differs). No host copy is made on release."""
    from safetensors.torch import load_file

    from rltrain.weights.bucket import serialize

    client = discarding.client
    probe = [3, 1, 4, 1, 5, 9, 2, 6]
    good_score = client.score(probe)
    sums = client.weights_checksum()
    client.release()
    report = client.memory_report()
    assert report["released"] == ["cuda_graph", "kv_cache", "weights"] and report["weight_bytes"] == 0
    assert not list((discarding.process.log_path.parent).glob("**/weights_backup*"))
    assert "discarded" in discarding.process.log_tail()
    client.resume(["weights"])
    client.resume(["kv_cache", "cuda_graph"])
    failed = client.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    assert all(not c.ok and "update the weights" in c.error for c in failed)
    # A sync that misses one parameter: the engine serves, but not what the trainer has.
    state = load_file(str(model_a / "model.safetensors"))
    missed = "model.norm.weight"
    named = [(n, t) for n, t in sorted(state.items()) if n != missed]
    client.update_weights_from_tensor([serialize(named)], load_format="direct", weight_version="partial")
    assert not all(torch.isfinite(torch.tensor(client.score(probe))))
    assert client.weights_checksum()["checksum"] != sums["checksum"]
    client.update_weights_from_disk(str(model_a), weight_version="default")  # every parameter
    assert client.score(probe) == pytest.approx(good_score, abs=1e-6)
    assert client.weights_checksum()["checksum"] == sums["checksum"]


def test_release_memory_pauses_with_abort_and_frees_every_region(discarding, model_a):
    """The loop's release: a request still in flight (its client gave up on it) is aborted
    first — a failed completion, never a sample — then weights, KV cache and CUDA graphs go;
    resume brings the weights back, then KV cache and graphs, and generation continues."""
    import threading
    import time

    from rltrain.engine.launcher import NodeEngine
    from rltrain.runtime.world import World

    world = World(backend="gloo", timeout=60)
    node = NodeEngine(discarding.client, discarding.process.url, discarding.process, world)
    out: list = []
    slow = threading.Thread(
        target=lambda: out.extend(
            discarding.client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4000, ignore_eos=True))
        )
    )
    try:
        slow.start()
        time.sleep(1.0)
        node.release_memory()
        slow.join(60)
        assert out and not out[0].ok and "abort" in out[0].error, out
        assert discarding.client.memory_report()["released"] == ["cuda_graph", "kv_cache", "weights"]
        node.resume_weights()
        discarding.client.update_weights_from_disk(str(model_a), weight_version="default")
        node.resume_kv()
        assert discarding.client.memory_report()["released"] == []
        assert greedy(discarding.client)
    finally:
        world.close()


def test_the_kv_resume_waits_for_the_worlds_teardown_only_where_the_rollout_left_no_room(discarding, monkeypatch):
    """The loop skips its wait for the background NCCL teardown where the last rollout left room
    for that memory beside the KV cache (`TrainerCycle.room_for`); the engine's KV resume must not
    wait for it anyway (it did: a teardown's remaining 0.02-0.3 s sat in every step's
    engine_resume_kv on an H100, reported as 0 s waited). Without room it waits. (The teardown is
    made slow here, test-only.)"""
    import threading
    import time

    from rltrain.engine.launcher import NodeEngine
    from rltrain.runtime.world import World

    world = World(backend="gloo", timeout=60)
    node = NodeEngine(discarding.client, discarding.process.url, discarding.process, world)
    teardown = world._teardown
    slow = threading.Event()

    def slow_teardown() -> None:
        slow.wait(30)
        teardown()

    monkeypatch.setattr(world, "_teardown", slow_teardown)
    try:
        for room in (True, False):
            node.release_memory()
            node.resume_weights()
            world.destroy(block=False)
            release = threading.Timer(1.5, slow.set)
            release.start()
            t0 = time.perf_counter()
            node.resume_kv(room)
            took = time.perf_counter() - t0
            assert discarding.client.memory_report()["released"] == []
            if room:
                assert took < 1.0 and world._destroyer is not None and world._destroyer.is_alive(), took
            else:
                assert took >= 1.0 and world._destroyer is None, took
            world.rebuild()  # (joins a teardown still running)
            slow.clear()
            release.cancel()
    finally:
        slow.set()
        world.close()


def test_the_backup_directory_is_removed_at_stop_and_a_dead_engines_is_removed_at_the_next_start(big_model, tmp_path):
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from conftest import start_engine  # noqa: PLC0415
    from rltrain.engine.embedded.residency import BACKUP_PREFIX  # noqa: PLC0415

    tmp = Path(tempfile.gettempdir())
    stale = tmp / f"{BACKUP_PREFIX}999999999-left"  # a pid no process has: its engine was killed
    stale.mkdir()
    (stale / "weights_backup.safetensors").write_bytes(b"x" * 1000)
    srv = start_engine("embedded", big_model, tmp_path / "logs", weights_backup=True)
    try:
        srv.client.release(["weights"])  # the CPU backup goes to a file
        mine = list(tmp.glob(f"{BACKUP_PREFIX}{srv.process.proc.pid}-*"))
        assert len(mine) == 1 and (mine[0] / "weights_backup.safetensors").is_file()
        assert not stale.exists()
        srv.client.resume(["weights"])
    finally:
        srv.client.close()
        srv.process.stop()
    assert not mine[0].exists()


def test_a_prompt_sent_as_many_rows_is_prefilled_once_and_each_row_decodes_as_if_alone(discarding, model_a):
    """Rows with the same prompt (the n samples of a group) share one prefill and its KV cache,
    copied per row: greedy rows still continue exactly as transformers does for each prompt
    alone, with the same log-probs across the copies, and seeded rows stay their own samples."""
    discarding.client.update_weights_from_disk(str(model_a), weight_version="default")
    prompts = [[3, 4, 5], [9, 8], [3, 4, 5], [3, 4, 5], [7]]
    out = discarding.client.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    ref = hf_greedy(model_a, prompts, 8)
    assert [c.output_ids for c in out] == ref
    # (equal up to float rounding: a row's place in the batch may change a matmul's summation order)
    assert out[2].logprobs == pytest.approx(out[0].logprobs, abs=1e-5)
    assert out[3].logprobs == pytest.approx(out[0].logprobs, abs=1e-5)
    seeded = discarding.client.generate(
        [[3, 4, 5]], SamplingParams(max_new_tokens=8, temperature=1.0, n=4, sampling_seed=11, ignore_eos=True)
    )
    alone = [
        discarding.client.generate(
            [[3, 4, 5]], SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=11 + j, ignore_eos=True)
        )[0]
        for j in range(4)
    ]
    assert [c.output_ids for c in seeded] == [c.output_ids for c in alone]
    assert len({tuple(c.output_ids) for c in seeded}) > 1


# SGLang 0.5.23's spellings (srt/server_args.py) of the flags the embedded engine shares with it.
SGLANG_FLAGS = [
    "--model", "/m", "--random-seed", "3", "--max-running-requests", "8", "--enable-deterministic-inference",
    "--enable-weights-cpu-backup", "--tensor-parallel-size", "2", "--expert-parallel-size", "2", "--dtype", "half",
    "--device", "cuda", "--base-gpu-id", "1", "--disable-decode-cuda-graph", "--weight-version", "v0",
    "--skip-tokenizer-init", "--sleep-on-idle", "--log-level", "info",
]  # fmt: skip
OWN_FLAGS = [
    "--model-path", "/m", "--seed", "3", "--max-batch-size", "8", "--deterministic", "--weights-backup",
    "--tp-size", "2", "--ep-size", "2", "--dtype", "float16", "--device", "cuda:1", "--disable-cuda-graph",
    "--weight-version", "v0", "--log-level", "INFO",
]  # fmt: skip


def test_sglang_spellings_of_shared_flags_set_what_the_engines_own_do():
    """A command line written for SGLang starts the embedded engine with the same settings as the
    engine's own spellings; SGLang's flags without an effect here are accepted and change nothing."""
    from rltrain.engine.embedded.main import engine_options, parse

    sglang, own = parse(SGLANG_FLAGS), parse(OWN_FLAGS)
    assert (sglang.model_path, sglang.log_level.upper()) == (own.model_path, own.log_level) == ("/m", "INFO")
    assert engine_options(sglang) == engine_options(own)
    opts = engine_options(sglang)
    assert (opts["seed"], opts["max_batch_size"], opts["deterministic"], opts["weights_backup"]) == (3, 8, True, True)
    assert (opts["tp_size"], opts["ep_size"], opts["dtype"], opts["device"]) == (2, 2, "float16", "cuda:1")
    assert (opts["cuda_graphs"], opts["weight_version"]) == (False, "v0")
    assert engine_options(parse(["--model", "/m", "--ep", "4", "--cuda-graph-backend-decode", "disabled"])) == (
        engine_options(parse(["--model-path", "/m", "--ep-size", "4", "--disable-cuda-graph"]))
    )
    plain = engine_options(parse(["--model-path", "/m"]))
    noop = engine_options(parse(["--model-path", "/m", "--skip-tokenizer-init", "--sleep-on-idle"]))
    assert noop == plain and (plain["device"], plain["cuda_graphs"]) == ("cpu", True)
    assert engine_options(parse(["--model-path", "/m", "--base-gpu-id", "3"]))["device"] == "cpu"  # (CUDA only)
    assert plain["overlap"] and not engine_options(parse(["--model", "/m", "--disable-overlap-schedule"]))["overlap"]
    # prefill graphs: by default where the memory saver keeps them (None: the engine decides), or as asked
    assert plain["prefill_cuda_graph"] is None
    for flag, value in (("--enable-prefill-cuda-graph", True), ("--disable-prefill-cuda-graph", False)):
        assert engine_options(parse(["--model-path", "/m", flag]))["prefill_cuda_graph"] is value


@pytest.mark.parametrize(
    "argv,error",
    [
        (["--model-path", "/m", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--model-path", "/m", "--enable-weight-cpu-backup"], "unrecognized arguments: --enable-weight-cpu-backup"),
        (["--model-path", "/m", "--device", "cuda:0", "--base-gpu-id", "1"], "give the device's index once"),
        (["--model-path", "/m", "--cuda-graph-backend-decode", "breakable"], "invalid choice: 'breakable'"),
        (["--random-seed", "1"], "required: --model-path/--model"),
        (
            ["--model-path", "/m", "--enable-prefill-cuda-graph", "--disable-prefill-cuda-graph"],
            "--enable-prefill-cuda-graph with --disable-prefill-cuda-graph: give one",
        ),
    ],
)
def test_an_unknown_or_conflicting_flag_is_a_clear_error(argv, error, capsys):
    from rltrain.engine.embedded.main import parse

    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    assert error in capsys.readouterr().err


def test_the_engine_serves_when_started_with_sglang_spellings(model_a, tmp_path):
    """`python -m rltrain.engine.embedded` with SGLang's spellings only (the API key on the command
    line, as SGLang takes it): it serves, with the settings those flags name."""
    import sys

    from rltrain.engine.client import EngineClient
    from rltrain.engine.process import EngineProcess
    from rltrain.runtime.net import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "rltrain.engine.embedded", "--model", str(model_a), "--port", str(port)]
    cmd += ["--device", "cpu", "--dtype", "float", "--random-seed", "5", "--max-running-requests", "6"]
    cmd += ["--enable-deterministic-inference", "--enable-weights-cpu-backup", "--skip-tokenizer-init"]
    cmd += ["--sleep-on-idle", "--weight-version", "v0", "--api-key", "k3y", "--log-level", "info"]
    proc = EngineProcess.start(cmd, f"http://127.0.0.1:{port}", tmp_path / "engine.log")
    good, bad = EngineClient(proc.url, retries=0, api_key="k3y"), EngineClient(proc.url, retries=0)
    try:
        good.wait_healthy(120, alive=lambda: proc.alive)
        info = good.server_info()
        assert (info["max_batch_size"], info["dtype"], info["weight_version"]) == (6, "torch.float32", "v0")
        with pytest.raises(EngineError, match="HTTP 401"):
            bad.weight_version()
        assert greedy(good) == hf_greedy(model_a, PROMPTS, 5)
        good.release(["weights"])  # backed up (--enable-weights-cpu-backup): resume serves the same
        good.resume(["weights"])
        assert greedy(good) == hf_greedy(model_a, PROMPTS, 5)
    finally:
        good.close()
        bad.close()
        proc.stop()
