"""One contract, two servers: the embedded engine and real SGLang (CPU), endpoint by endpoint.

Every test runs against a live server process over HTTP (fixture `server`, parametrised over
"embedded" and "sglang"). Tests that change the served weights put model A back before they end.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from models import engine_greedy, hf_greedy
from rltrain.engine.client import EngineError
from rltrain.generation import SamplingParams
from rltrain.runtime.net import free_port
from rltrain.runtime.weight_group import close_weight_update_group, open_weight_update_group
from rltrain.weights import bucket as tensor_payload

PROMPTS = [[1, 2, 3], [5, 6], [7, 8, 9, 10, 11], [42]]


def greedy(client, prompts=PROMPTS):
    return engine_greedy(client, prompts, 6)


def state_of(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_health_and_health_generate(server):
    assert server.client.health()
    assert server.client.health_generate()


def test_an_idle_server_leaves_the_cpu_to_the_trainer(server):
    """Between rollouts the engine idles while the trainer works: none of its processes may spin
    (SGLang's scheduler busy-polls a whole core unless started with --sleep-on-idle)."""
    import time

    import psutil

    greedy(server.client)  # past start-up and first requests
    time.sleep(0.5)
    procs = [psutil.Process(server.process.proc.pid)]
    procs += procs[0].children(recursive=True)
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(2.0)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before)]
    assert max(used) < 0.5, [(p.name(), round(u, 2)) for p, u in zip(procs, used)]  # a spinning loop uses ~2.0


def test_greedy_generate_matches_transformers(server, model_a):
    assert greedy(server.client) == hf_greedy(model_a, PROMPTS, 6)


def test_generate_returns_logprobs_finish_reasons_and_n_samples_in_prompt_major_order(server):
    out = server.client.generate(PROMPTS[:2], SamplingParams(max_new_tokens=5, temperature=1.0, n=3, ignore_eos=True))
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(2) for s in range(3)]
    for c in out:
        assert c.ok and c.finish_reason == "length" and len(c.output_ids) == 5
        assert len(c.logprobs) == 5 and all(lp <= 0.0 for lp in c.logprobs)
        assert c.prompt_tokens == len(PROMPTS[c.prompt_index])


def test_greedy_logprobs_are_the_models_log_softmax(server, model_a):
    from transformers import AutoModelForCausalLM

    c = server.client.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))[0]
    model = AutoModelForCausalLM.from_pretrained(model_a, dtype=torch.float32).eval()
    seq = torch.tensor([PROMPTS[0] + c.output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].float(), -1)
    start = len(PROMPTS[0])
    ref = [logp[start - 1 + i, t].item() for i, t in enumerate(c.output_ids)]
    assert c.logprobs == pytest.approx(ref, abs=2e-3)


def test_stop_token_ends_generation_with_stop_reason(server):
    first = greedy(server.client, [PROMPTS[0]])[0]
    stop = first[2]
    c = server.client.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[stop]))[
        0
    ]
    assert c.ok and c.finish_reason == "stop" and c.output_ids[-1] == stop
    assert c.output_ids == first[: first.index(stop) + 1]


def test_sampling_respects_top_k_one_as_greedy(server):
    sampled = server.client.generate(
        PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, ignore_eos=True)
    )
    assert [c.output_ids for c in sampled] == greedy(server.client)


def test_update_weights_from_disk_serves_model_b(server, model_a, model_b):
    before = server.client.weight_version()
    try:
        server.client.update_weights_from_disk(str(model_b), weight_version="v-b")
        assert server.client.weight_version() == "v-b"
        assert greedy(server.client) == hf_greedy(model_b, PROMPTS, 6)
        c = server.client.generate([[1]], SamplingParams(max_new_tokens=1))[0]
        assert c.weight_version == "v-b"
    finally:
        server.client.update_weights_from_disk(str(model_a), weight_version=before)
    assert greedy(server.client) == hf_greedy(model_a, PROMPTS, 6)


def test_update_weights_from_tensor_flattened_bucket(server, model_a, model_b):
    state_b = state_of(model_b)
    bucket = tensor_payload.flatten_bucket(sorted(state_b.items()))
    payload = tensor_payload.serialize(bucket)
    try:
        with server.client.weight_update_session():
            server.client.update_weights_from_tensor([payload], load_format="flattened_bucket", weight_version="t-b")
        assert server.client.weight_version() == "t-b"
        assert greedy(server.client) == hf_greedy(model_b, PROMPTS, 6)
    finally:
        del bucket  # the buffer may go only after the engine answered
        server.client.update_weights_from_disk(str(model_a), weight_version="default")


def test_update_weights_from_distributed_over_gloo(server, model_a, model_b):
    state_b = sorted(state_of(model_b).items())
    port = free_port()
    joined: dict = {}

    def trainer_side():
        joined["pg"] = open_weight_update_group("127.0.0.1", port, 0, 2, "wug", "gloo", timeout_s=60)

    t = threading.Thread(target=trainer_side, daemon=True)
    t.start()
    server.client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="wug", backend="gloo")
    t.join(60)
    pg = joined["pg"]
    try:

        def send():
            for _, tensor in state_b:
                torch.distributed.broadcast(tensor.contiguous(), group=pg, group_src=0)

        sender = threading.Thread(target=send, daemon=True)
        with server.client.weight_update_session():
            sender.start()
            server.client.update_weights_from_distributed(
                [n for n, _ in state_b],
                [str(v.dtype).removeprefix("torch.") for _, v in state_b],
                [list(v.shape) for _, v in state_b],
                group_name="wug",
                weight_version="d-b",
            )
        sender.join(60)
        assert not sender.is_alive()
        assert greedy(server.client) == hf_greedy(model_b, PROMPTS, 6)
        assert server.client.weight_version() == "d-b"
    finally:
        server.client.destroy_weights_update_group("wug")
        close_weight_update_group(pg)
        server.client.update_weights_from_disk(str(model_a), weight_version="default")


def test_bad_requests_are_clear_errors_and_the_server_survives(server, tmp_path):
    with pytest.raises(EngineError) as e:
        server.client.update_weights_from_disk(str(tmp_path / "missing"))
    assert e.value.status == 400 or "missing" in str(e.value)
    # Out-of-vocabulary ids never reach the server (one would kill SGLang's scheduler).
    server.client.vocab_size = 256
    try:
        with pytest.raises(ValueError, match=r"token ids \[1000000\] are outside the vocabulary \[0, 256\)"):
            server.client.generate([[1, 10**6]], SamplingParams(max_new_tokens=2))
    finally:
        server.client.vocab_size = None
    assert greedy(server.client)  # still serving


def test_pause_in_place_holds_requests_until_continue(server):
    server.client.pause(mode="in_place")
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(greedy, server.client, [PROMPTS[0]])
            done_while_paused = fut.done() or _wait_done(fut, 2.0)
            server.client.continue_generation()
            assert fut.result(timeout=60)
    finally:
        server.client.continue_generation()
    assert not done_while_paused


def _wait_done(fut, seconds: float) -> bool:
    try:
        fut.result(timeout=seconds)
        return True
    except Exception:
        return False


def test_flush_cache(server):
    server.client.flush_cache()
    assert greedy(server.client)


def test_a_flush_that_waits_for_the_engine_to_be_idle_is_taken(server):
    """SGLang's deferred flush (`/flush_cache?timeout=`), which the client sends after an update
    whose flush was refused for a request just answered (transport.py's NOT_FLUSHED): both
    servers take it and flush an idle engine."""
    greedy(server.client)
    resp = server.client._request("POST", "/flush_cache?timeout=5")
    assert resp.status_code == 200


def test_concurrent_clients_get_their_own_results(server):
    prompts = [[(7 * i + k) % 200 + 1 for k in range(1 + i % 5)] for i in range(24)]
    expected = greedy(server.client, prompts)
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda p: greedy(server.client, [p])[0], prompts))
    assert got == expected


def test_every_sample_is_its_own_request_row_with_its_own_seed(server):
    """n samples of a prompt go as n rows of n=1, each with its own sampling seed (SGLang copies a
    request's params to its n samples and seeds by (seed, position): one seed for n would make
    them one sample n times; n > 1 also takes its slow batch path). They differ on both engines."""
    from rltrain.generation import generate_body

    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=4, sampling_seed=1000, ignore_eos=True)
    body = generate_body(PROMPTS[:2], params, first=5)
    assert body["input_ids"] == [PROMPTS[0]] * 4 + [PROMPTS[1]] * 4
    assert {p["n"] for p in body["sampling_params"]} == {1}
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [
        1000 + (5 + i) * 4 + j for i in range(2) for j in range(4)
    ]
    out = server.client.generate(PROMPTS[:2], params)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(2) for s in range(4)]
    for p in range(2):
        assert len({tuple(c.output_ids) for c in out if c.prompt_index == p}) > 1


def test_probe_scores_are_the_models_log_softmax_and_tell_other_weights_apart(server, model_a, model_b):
    """What the post-sync probe relies on: the engine's log-probs of a fixed sequence (at
    temperature 1, whatever the request's) are transformers' own, and weights other than the
    trainer's fail the probe."""
    from transformers import AutoModelForCausalLM

    from rltrain.sync.probe import probe_error, random_tokens

    probe = random_tokens(256, 24)
    model = AutoModelForCausalLM.from_pretrained(model_a, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([probe])).logits[0, :-1].float(), -1)
    ref = logp.gather(-1, torch.tensor(probe[1:])[:, None])[:, 0]
    assert probe_error("engine", server.client.score(probe), ref, 1e-3) is None
    before = server.client.weight_version()
    try:
        server.client.update_weights_from_disk(str(model_b), weight_version="v-b")
        error = probe_error("node0-engine0", server.client.score(probe), ref, 1e-3)
        assert error is not None and error.startswith("node0-engine0's log-probs of the probe sequence differ")
    finally:
        server.client.update_weights_from_disk(str(model_a), weight_version=before)


def test_a_prefill_only_request_scores_the_prompt_and_generates_nothing(server, model_a):
    """max_new_tokens 0 (the probe's request): SGLang's prefill-only answer, the input log-probs
    and no output token, on both servers."""
    prompt = PROMPTS[2]
    status, out = post(
        server,
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert status == 200, out
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    scored = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in scored] == prompt and scored[0][0] is None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_a, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    ref = logp.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert [lp for lp, _, _ in scored[1:]] == pytest.approx(ref.tolist(), abs=1e-3)


def test_sglang_weights_checker_digests_follow_the_weights(server, model_a, model_b):
    """SGLang's /weights_checker, as the sync's agreement check uses it: one digest per TP rank,
    the same for the same weights (across calls and reloads), different for other weights — so
    an engine that missed an update disagrees with the engines that did not."""
    if server.kind != "sglang":
        pytest.skip("SGLang's endpoint; the embedded engine has its own checksum (test_sync.py)")
    from rltrain.sync.verify import EngineDigest, disagreements

    a = server.client.weights_checker()
    assert [(e["tp_rank"], e["tp_size"]) for e in a] == [(0, 1)] and len(a[0]["checksum"]) == 64
    assert server.client.weights_checker() == a
    before = server.client.weight_version()
    try:
        server.client.update_weights_from_disk(str(model_b), weight_version="v-b")
        b = server.client.weights_checker()
    finally:
        server.client.update_weights_from_disk(str(model_a), weight_version=before)
    assert b != a and server.client.weights_checker() == a
    digests = [EngineDigest(f"node{k}-engine0", 1, (d[0]["checksum"],)) for k, d in enumerate([a, b, a])]
    assert disagreements(digests) == [
        f"node1-engine0 holds a different TP-rank-0 shard (sha256 {b[0]['checksum'][:16]}…) than 2 of the 3 "
        f"engines of TP size 1 ({a[0]['checksum'][:16]}…)"
    ]
    assert disagreements(digests[:2]) and len(disagreements(digests[:2])) == 2  # two that differ: both named


def test_engine_reports_its_parallel_layout_in_sglangs_field_names(server):
    """The sync's router reads each engine's layout from the engine (never from how many
    receivers there are): both engines answer /server_info with SGLang's fields."""
    from rltrain.sync.plan import EngineParallelism

    info = server.client.server_info()
    assert {"tp_size", "ep_size", "dp_size", "enable_eplb", "ep_num_redundant_experts", "moe_a2a_backend"} <= set(info)
    assert EngineParallelism.from_server_info(info) == EngineParallelism()  # one process, no EP


# ---------------------------------------------------------------------------- SGLang's fields and bad input

META_KEYS = {  # what SGLang 0.5.23 sends in every answer's meta_info
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_versions",
    "cached_tokens_details",
    "dp_rank",
    "e2e_latency",
    "response_sent_to_client_ts",
}
LOGPROB_KEYS = {"input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"}


def post(server, body, path="/generate", raw: bytes | None = None):
    import httpx

    with httpx.Client(timeout=120) as c:
        if raw is not None:
            r = c.post(server.process.url + path, content=raw, headers={"Content-Type": "application/json"})
        else:
            r = c.post(server.process.url + path, json=body)
    return r.status_code, (r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text)


def reference_greedy(path, prompt, steps, stop=(), min_new=0, bias=None, frequency=0.0, presence=0.0, repetition=1.0):
    """Greedy decoding with SGLang's documented logit processing, by hand on the transformers
    model: penalties over the generated tokens, stop tokens held back until min_new tokens,
    then the logit bias."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
        seen = counts > 0
        logits = logits - frequency * counts - presence * seen
        logits = torch.where(seen, torch.where(logits < 0, logits * repetition, logits / repetition), logits)
        if len(out) < min_new:
            logits[list(stop)] = float("-inf")
        for t, b in (bias or {}).items():
            logits[t] += b
        token = int(logits.argmax())
        out.append(token)
        if token in stop and len(out) >= min_new:
            break
    return out


def test_an_answer_carries_sglangs_keys_and_input_log_probs(server, model_a):
    from transformers import AutoModelForCausalLM

    prompt = [3, 17, 42, 9]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 1,
        "rid": "req-1",
    }
    status, out = post(server, body)
    assert status == 200 and set(out) == {"output_ids", "meta_info"}, out
    meta = out["meta_info"]
    assert set(meta) == META_KEYS | LOGPROB_KEYS, set(meta) ^ (META_KEYS | LOGPROB_KEYS)
    assert meta["id"] == "req-1" and meta["completion_tokens"] == 3 and meta["prompt_tokens"] == 4
    assert meta["output_token_logprobs_length"] == 3 and isinstance(meta["cached_tokens"], int)
    model = AutoModelForCausalLM.from_pretrained(model_a, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    # From position 1 on; SGLang leaves the first entry of the range without a log-prob.
    expected = [logp[k - 1, prompt[k]].item() for k in range(2, 4)]
    got = meta["input_token_logprobs"]
    assert [e[1] for e in got] == prompt[1:] and got[0][0] is None
    assert [e[0] for e in got[1:]] == pytest.approx(expected, abs=2e-3)
    status, out = post(server, {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 1}, "rid": "r"})
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["r_0", "r_1"]
    assert all(set(o["meta_info"]) == META_KEYS for o in out)


@pytest.mark.parametrize(
    "sampling",
    [
        {"logit_bias": {"7": 100.0}},
        {"min_new_tokens": 4, "stop_token_ids": "first two greedy tokens"},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 2.0},
        {"temperature": 1e-310},  # below SGLang's 1e-6: greedy
    ],
    ids=["logit_bias", "min_new_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty", "tiny-temp"],
)
def test_sglangs_logit_processing_gives_the_hand_computed_greedy_answer(server, model_a, sampling):
    prompt = [1, 2, 3]  # model A's greedy answer repeats tokens from its 4th on: the penalties change it
    plain = reference_greedy(model_a, prompt, 8)
    sampling = dict(sampling)
    if sampling.get("stop_token_ids") == "first two greedy tokens":
        sampling["stop_token_ids"] = plain[:2]
    ref = reference_greedy(
        model_a,
        prompt,
        8,
        stop=tuple(sampling.get("stop_token_ids", ())),
        min_new=sampling.get("min_new_tokens", 0),
        bias={int(k): v for k, v in sampling.get("logit_bias", {}).items()},
        frequency=sampling.get("frequency_penalty", 0.0),
        presence=sampling.get("presence_penalty", 0.0),
        repetition=sampling.get("repetition_penalty", 1.0),
    )
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, **sampling}}
    if "stop_token_ids" not in sampling:
        body["sampling_params"]["ignore_eos"] = True
    status, out = post(server, body)
    if server.kind == "sglang" and "min_new_tokens" in sampling:  # SGLang's own limit, in its words
        assert status == 400 and "skip_tokenizer_init" in out["error"]["message"], out
        return
    assert status == 200, out
    assert out["output_ids"] == ref
    if "temperature" not in sampling:
        assert ref != plain  # the processing changed the answer: the test can tell


BAD_FOR_BOTH = [  # each answered 400 by SGLang (seen) and by the embedded engine
    {"input_ids": [1, 2, 3], "sampling_params": {"min_p": 2}},
    {"input_ids": [1, 2, 3], "sampling_params": {"min_p": "x"}},
    {"input_ids": [1, 2, 3], "sampling_params": {"n": 1.5}},
    {"input_ids": [1, 2, 3], "sampling_params": {"stop_token_ids": 5}},
    {"input_ids": [1, 2, 3], "sampling_params": {"sampling_seed": 1.5}},
    {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 100000}},
    {"input_ids": list(range(1, 200)) * 10, "sampling_params": {"max_new_tokens": 1}},
    {"input_ids": [1, 2, 3], "sampling_params": "hello"},
    {"input_ids": [1, 2, 3], "sampling_params": {"logit_bias": {"999999": 1.0}}},
    {"input_ids": [1, 2, 3], "sampling_params": {"frequency_penalty": 5}},
    {"input_ids": [1, 2, 3], "sampling_params": {"bogus": 1}},
    b"[1, 2]",  # not an object
    b'{"input_ids": [1, 2',  # not JSON
]


def test_bad_input_is_a_400_and_the_requests_beside_it_are_still_served(server):
    """Every class of bad input gets a 400 with a message, sent while good requests run beside
    it; the good ones come back as if alone, and the server answers afterwards."""
    good_body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
    }
    expected = greedy(server.client, [PROMPTS[0]])[0]

    def send(body):
        if isinstance(body, bytes):
            return post(server, None, raw=body)
        return post(server, body)

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(send, good_body) for _ in range(8)]
        bads = [pool.submit(send, b) for b in BAD_FOR_BOTH]
        for body, f in zip(BAD_FOR_BOTH, bads):
            status, out = f.result()
            assert status == 400 and out, (body, status, out)
        for f in goods:
            status, out = f.result()
            assert status == 200 and out["output_ids"] == expected
    assert server.client.health() and greedy(server.client, [PROMPTS[0]])[0] == expected
