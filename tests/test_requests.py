"""The embedded engine's /generate request model (engine/embedded/requests.py): every field checked
before anything is queued, errors naming the field, the value and what is allowed."""

from __future__ import annotations

import pytest

from rltrain.engine.embedded.requests import BadRequest, Limits, parse_generate

LIMITS = Limits(vocab_size=256, context_length=64, max_rows=32)


def parse(body):
    return parse_generate(body, LIMITS)


BAD = [
    # (body, words the message must hold)
    ({}, ["input_ids is required"]),
    ({"input_ids": "abc"}, ["input_ids", "list of token ids"]),
    ({"input_ids": []}, ["input_ids", "non-empty"]),
    ({"input_ids": [[1, 2], []]}, ["input_ids[1]", "non-empty"]),
    ({"input_ids": [1, 2, 999]}, ["input_ids", "999", "[0, 256)"]),
    ({"input_ids": [1, 2.5]}, ["input_ids", "2.5"]),
    ({"input_ids": [1, True]}, ["input_ids", "True"]),
    ({"input_ids": [1], "sampling_params": "hello"}, ["sampling_params", "'hello'", "object"]),
    ({"input_ids": [1], "sampling_params": [{}, {}]}, ["one object per prompt (1)", "got 2"]),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, 3]}, ["sampling_params[1]", "expected an object"]),
    ({"input_ids": [1], "sampling_params": {"temperature": float("inf")}}, ["temperature", "inf", "finite"]),
    ({"input_ids": [1], "sampling_params": {"temperature": float("nan")}}, ["temperature", "finite"]),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, ["temperature", ">= 0"]),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, ["temperature", "'hot'", "number"]),
    ({"input_ids": [1], "sampling_params": {"min_p": 2}}, ["min_p must be in [0, 1], got 2.0."]),
    ({"input_ids": [1], "sampling_params": {"min_p": "x"}}, ["min_p", "'x'", "number"]),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, ["top_p must be in (0, 1]"]),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, ["top_k must be -1 (disable) or at least 1"]),
    ({"input_ids": [1], "sampling_params": {"n": 1.5}}, ["n=1.5", "integer"]),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, ["n=0", ">= 1"]),
    ({"input_ids": [1], "sampling_params": {"n": True}}, ["n=True", "integer"]),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": 5}}, ["stop_token_ids=5", "list of token ids"]),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [1, -2]}}, ["stop_token_ids", "-2"]),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": 1.5}}, ["sampling_seed=1.5", "integer"]),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}, ["sampling_seed", "in [-"]),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, ["max_new_tokens=-1", ">= 0"]),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, ["max_new_tokens='8'", "integer"]),
    (
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 62}},
        ["Requested token count exceeds the model's maximum context length of 64 tokens", "65 tokens"],
    ),
    ({"input_ids": list(range(64))}, ["The input (64 tokens) is longer than the model's context length (64 tokens)."]),
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 8}}, ["min_new_tokens must be"]),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 5}}, ["frequency_penalty must be in [-2, 2]"]),
    ({"input_ids": [1], "sampling_params": {"presence_penalty": -3}}, ["presence_penalty must be in [-2, 2]"]),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, ["repetition_penalty must be in (0, 2]"]),
    ({"input_ids": [1], "sampling_params": {"logit_bias": {"999": 1.0}}}, ["logit_bias must has keys in [0, 255]"]),
    ({"input_ids": [1], "sampling_params": {"logit_bias": {"x": 1.0}}}, ["logit_bias", "'x'", "token id"]),
    ({"input_ids": [1], "sampling_params": {"logit_bias": {"3": "big"}}}, ["logit_bias[3]", "finite number"]),
    ({"input_ids": [1], "sampling_params": {"logit_bias": [1, 2]}}, ["logit_bias", "object"]),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}, ["ignore_eos", "true or false"]),
    ({"input_ids": [1], "sampling_params": {"bogus": 1}}, ["unknown field 'bogus'", "max_new_tokens"]),
    ({"input_ids": [1], "sampling_params": {"stop": "###"}}, ["not supported by the embedded engine", "stop"]),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, ["not supported by the embedded engine", "regex"]),
    ({"input_ids": [1], "stream": True}, ["not supported by the embedded engine: stream=True"]),
    ({"input_ids": [1], "text": "hello"}, ["not supported", "text", "input_ids"]),
    ({"input_ids": [1], "top_logprobs_num": 5}, ["not supported by the embedded engine: top_logprobs_num=5"]),
    ({"input_ids": [1], "lora_path": "x"}, ["not supported by the embedded engine: lora_path"]),
    ({"input_ids": [1], "return_logprobs": True}, ["unknown field 'return_logprobs'"]),
    ({"input_ids": [1], "return_logprob": "yes"}, ["return_logprob", "true or false"]),
    ({"input_ids": [1], "logprob_format": "flat"}, ["logprob_format='flat'", "triples, values"]),
    ({"input_ids": [1], "logprob_start_len": -2}, ["logprob_start_len=-2", ">= -1"]),
    ({"input_ids": [1, 2], "logprob_start_len": 5}, ["logprob_start_len=5", "past the end"]),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, ["rid", "1 ids for a batch of 2"]),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, ["rid", "duplicate", "'a'"]),
    ({"input_ids": [1], "rid": 7}, ["rid=7", "string"]),
    (
        {"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 3}]},
        ["n must be the same for every prompt", "[2, 3]"],
    ),
    ({"input_ids": [[1]] * 5, "sampling_params": {"n": 8}}, ["40 sequences", "5 prompts x n=8", "at most 32"]),
]


@pytest.mark.parametrize("body,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_each_bad_field_is_refused_naming_the_field_and_what_is_allowed(body, words):
    with pytest.raises(BadRequest) as err:
        parse(body)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_defaults_are_sglangs():
    g = parse({"input_ids": [1, 2, 3]})
    (p,) = g.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.n, p.min_new_tokens, p.repetition_penalty) == (
        1.0,
        1.0,
        -1,
        0.0,
        1,
        0,
        1.0,
    )
    assert p.max_new_tokens == 61  # SGLang's 128 stops at the context's end (64 - 3 prompt tokens)
    wide = parse_generate({"input_ids": [1, 2, 3]}, Limits(256, 4096, 32))
    assert wide.params[0].max_new_tokens == 128
    assert g.single and not g.return_logprob and g.logprob_start_len == -1 and len(g.ids[0]) == 32  # a uuid4 hex


def test_max_new_tokens_null_is_what_the_context_leaves_and_tiny_temperatures_are_greedy():
    g = parse({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": None, "temperature": 1e-310}})
    assert g.params[0].max_new_tokens == 61 and g.params[0].temperature == 0.0


def test_fields_with_nothing_to_do_here_are_taken_at_any_value_and_sglang_fields_at_their_default():
    g = parse(
        {
            "input_ids": [1],
            "log_metrics": False,
            "priority": 3,
            "stream": False,
            "lora_path": None,
            "top_logprobs_num": 0,
            "return_hidden_states": False,
            "sampling_params": {"skip_special_tokens": False, "stop": None, "json_schema": ""},
        }
    )
    assert g.single


def test_one_object_applies_to_every_prompt_and_a_list_gives_each_its_own():
    g = parse({"input_ids": [[1], [2, 3]], "sampling_params": {"max_new_tokens": 4, "n": 2}})
    assert [p.max_new_tokens for p in g.params] == [4, 4] and g.n == 2 and not g.single
    g = parse({"input_ids": [[1], [2, 3]], "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 7}]})
    assert [p.max_new_tokens for p in g.params] == [4, 7]


def test_request_ids_follow_sglang():
    assert parse({"input_ids": [1], "rid": "abc"}).ids == ["abc"]
    assert parse({"input_ids": [[1], [2]], "rid": "r"}).ids == ["r_0", "r_1"]
    assert parse({"input_ids": [[1], [2]], "rid": ["a", "b"]}).ids == ["a", "b"]
    assert parse({"input_ids": [[1], [2]], "rid": ["a", "b"], "sampling_params": {"n": 2}}).ids == [
        "a_0",
        "a_1",
        "b_0",
        "b_1",
    ]


def test_logit_bias_keys_become_token_ids():
    g = parse({"input_ids": [1], "sampling_params": {"logit_bias": {"5": 2.5, "7": -1}}})
    assert g.params[0].logit_bias == {5: 2.5, 7: -1.0} and g.params[0].penalized
