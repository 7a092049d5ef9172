"""The flattened-bucket protocol, both ends: the sender's format (layout, views, refusal of
metadata that do not fit) and the embedded engine's receiving side (kept mappings, buffer slots,
bad buckets refused whole, payloads that carry code refused)."""

import types

import pytest
import torch

from rltrain.engine.client import EngineError
from rltrain.weights import bucket as tensor_payload
from rltrain.weights.bucket import BucketViews, bucket_layout, flatten_bucket, unflatten_bucket


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: the next start is padded
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(2, 3, generator=g)),  # float32 after bfloat16: a new run
        ("d", torch.randint(0, 1 << 40, (3,), generator=g)),  # int64
        ("e", torch.tensor(2.5)),  # 0-d
        ("f", torch.empty(0, 4)),  # empty
        ("g", torch.arange(5, dtype=torch.uint8)),
        ("h", torch.randn(4, 4, generator=g).t()),  # not contiguous
    ]


def test_mixed_dtypes_round_trip_bit_exactly_into_fresh_and_reused_buffers():
    named = _mixed()
    for out in (None, torch.full((4096,), 0xAB, dtype=torch.uint8)):
        bucket = flatten_bucket(named, out=out)
        assert all(m.start_idx % tensor_payload.ALIGN == 0 for m in bucket["metadata"])
        back = unflatten_bucket(bucket)
        assert [n for n, _ in back] == [n for n, _ in named]
        for (_, want), (_, got) in zip(named, back):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    # Passing the layout and its Layout, as a sender that keeps them does, gives the same tensors.
    layout = bucket_layout(named)
    again = unflatten_bucket(flatten_bucket(named, layout=layout, views=BucketViews(layout[0])))
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(again, named))


def test_views_come_one_split_per_run_of_a_dtype():
    metadata, _ = bucket_layout(_mixed())
    layout = BucketViews(metadata)
    assert [run[0] for run in layout.runs] == [
        torch.bfloat16,
        torch.float32,
        torch.int64,
        torch.float32,
        torch.uint8,
        torch.float32,
    ]
    assert layout.tensor_bytes == sum(m.end_idx - m.start_idx for m in metadata)


def _meta(name, shape, dtype, start, end):
    return types.SimpleNamespace(
        name=name, shape=torch.Size(shape), dtype=dtype, start_idx=start, end_idx=end, numel=end - start
    )


@pytest.mark.parametrize(
    "metadata, match",
    [
        ([_meta("x", (4,), torch.float32, 2, 18)], "inconsistent"),  # misaligned for float32
        ([_meta("x", (4,), torch.float32, 0, 12)], "inconsistent"),  # range is not the shape
        ([_meta("x", (4,), torch.float32, 0, 16), _meta("y", (2,), torch.float32, 8, 16)], "overlaps"),
        ([_meta("x", (64,), torch.float32, 0, 256)], "cannot hold"),  # beyond the buffer
    ],
)
def test_metadata_that_do_not_fit_the_buffer_are_refused(metadata, match):
    with pytest.raises(ValueError, match=match):
        unflatten_bucket({"flattened_tensor": torch.zeros(64, dtype=torch.uint8), "metadata": metadata})


def test_a_buffer_that_is_not_bytes_is_refused():
    metadata, _ = bucket_layout([("x", torch.zeros(4))])
    with pytest.raises(ValueError, match="1-D uint8"):
        BucketViews(metadata).views(torch.zeros(4))


# --------------------------------------------------------------------------- the engine's side


def test_tensor_payload_refuses_code(embedded):
    import base64
    import os
    import pickle

    evil = base64.b64encode(pickle.dumps(os.system)).decode()
    r = embedded.client._http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
    assert r.status_code == 400 and "not allowed" in r.json()["message"]


def test_a_reused_buffer_is_mapped_once_per_session_and_read_afresh(embedded, big_model):
    """The sync's buffer reuse against this engine: inside a session a refilled buffer is served
    from the kept mapping, and the engine copies what the buffer holds now, not what it held."""
    from safetensors.torch import load_file

    from rltrain.weights import bucket as tensor_payload
    from rltrain.weights.checksum import combine, entry

    state = {}
    for f in sorted(big_model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    name_a, name_b = "model.norm.weight", "model.layers.0.input_layernorm.weight"
    ring = [torch.empty(1 << 16, dtype=torch.uint8).share_memory_() for _ in range(2)]
    mapped = []
    with pytest.raises(EngineError, match="weights_checksum must be true or false") as bad:
        embedded.client._checked("/begin_weight_update", {"weights_checksum": 1})
    assert bad.value.status == 400
    try:
        embedded.client.begin_weight_update(checksum=True)  # its buckets summed as they land
        for slot, (name, value) in enumerate([(name_a, 1.0), (name_b, 3.0), (name_a, 2.0)]):
            bucket = tensor_payload.flatten_bucket([(name, torch.full_like(state[name], value))], out=ring[slot % 2])
            rep = embedded.client.update_weights_from_tensor([tensor_payload.serialize(bucket)], weight_version="reuse")
            mapped.append(rep["mapped"])
    finally:
        # The session's end can carry the engine's checksum report (the sync asks so).
        ended = embedded.client.end_weight_update(checksum=True)
    assert mapped == [True, True, False]
    expected = dict(state, **{name_a: torch.full_like(state[name_a], 2.0), name_b: torch.full_like(state[name_b], 3.0)})
    rep = embedded.client.weights_checksum()
    assert rep["checksum"] == combine({n: entry(t) for n, t in expected.items()})
    assert ended["weights_checksum"] == rep and rep["weight_version"] == "reuse"
    with pytest.raises(EngineError, match="weights_checksum must be true or false") as bad:
        embedded.client._checked("/end_weight_update", {"weights_checksum": "yes"})
    assert bad.value.status == 400
    embedded.client.update_weights_from_disk(str(big_model))  # the module's other tests expect the base weights
    assert embedded.client.weights_checksum()["checksum"] == combine({n: entry(t) for n, t in state.items()})


def test_buffer_slots_carry_a_handle_once_per_session_and_are_refused_outside_it(embedded, big_model):
    """The engine's buffer-slot extension (what the sync uses against it): a buffer's handle
    comes once with its slot number, later buckets name the slot only and are read from what the
    buffer holds now; a slot never sent, one out of range, or a slot outside a session is a 400
    naming the fix, and the session's end forgets the slots."""
    from safetensors.torch import load_file

    from rltrain.weights import bucket as tensor_payload
    from rltrain.weights.checksum import combine, entry

    assert embedded.client.server_info()["weight_buffer_slots"] >= 3
    state = {}
    for f in sorted(big_model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    name_a, name_b = "model.norm.weight", "model.layers.0.input_layernorm.weight"
    buf = torch.empty(1 << 16, dtype=torch.uint8).share_memory_()

    def send(name, value, slot, handle):
        md = tensor_payload.flatten_bucket([(name, torch.full_like(state[name], value))], out=buf)["metadata"]
        payload = {"flattened_tensor": buf if handle else None, "metadata": md, "buffer": slot}
        return embedded.client.update_weights_from_tensor([tensor_payload.serialize(payload)], weight_version="slots")

    with pytest.raises(EngineError, match="begin_weight_update"):
        send(name_a, 1.0, 0, True)
    try:
        embedded.client.begin_weight_update()
        with pytest.raises(EngineError, match="slot 1 has no buffer"):
            send(name_a, 1.0, 1, False)
        with pytest.raises(EngineError, match=r"expected an int in \[0, "):
            send(name_a, 1.0, 99, True)
        assert send(name_a, 1.0, 1, True)["mapped"] is True
        assert send(name_b, 3.0, 1, False)["mapped"] is False  # the same buffer, refilled
        assert send(name_a, 2.0, 1, False)["mapped"] is False
    finally:
        embedded.client.end_weight_update()
    expected = dict(state, **{name_a: torch.full_like(state[name_a], 2.0), name_b: torch.full_like(state[name_b], 3.0)})
    assert embedded.client.weights_checksum()["checksum"] == combine({n: entry(t) for n, t in expected.items()})
    try:
        embedded.client.begin_weight_update()
        with pytest.raises(EngineError, match="slot 1 has no buffer"):  # the last session's slots are gone
            send(name_a, 5.0, 1, False)
    finally:
        embedded.client.end_weight_update()
    embedded.client.update_weights_from_disk(str(big_model))  # the module's other tests expect the base weights
    assert embedded.client.weights_checksum()["checksum"] == combine({n: entry(t) for n, t in state.items()})


def test_one_request_opens_loads_and_closes_a_session_with_its_reports(embedded, big_model):
    """The inline-session extension (what the sync uses against this engine): one update request
    opens the weight-update session, loads its bucket into a slot, closes the session and
    answers with the checksum report and the probe's scores, as /weights_checksum and a scoring
    /generate give them after. A bad session field is a 400 before anything opens or loads; a
    request whose bucket is refused still closes the session it was asked to close."""
    from safetensors.torch import load_file

    from rltrain.weights import bucket as tensor_payload
    from rltrain.weights.checksum import combine, entry

    assert embedded.client.server_info()["weight_update_sessions"] == "inline"
    state = {}
    for f in sorted(big_model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    base = combine({n: entry(t) for n, t in state.items()})
    name = "model.norm.weight"
    buf = torch.empty(1 << 16, dtype=torch.uint8).share_memory_()

    def payload(value, slot=0, handle=True):
        md = tensor_payload.flatten_bucket([(name, torch.full_like(state[name], value))], out=buf)["metadata"]
        return tensor_payload.serialize({"flattened_tensor": buf if handle else None, "metadata": md, "buffer": slot})

    probe = [3, 17, 400, 9, 2]
    for bad, match in [
        ({"end_session": True, "probe": [1]}, "probe_input_ids"),
        ({"end_session": True, "probe": [1, 8192]}, r"in \[0, 8192\)"),
    ]:
        with pytest.raises(EngineError, match=match) as err:
            embedded.client.update_weights_from_tensor([payload(5.0)], weight_version="bad", begin_session=True, **bad)
        assert err.value.status == 400
    with pytest.raises(EngineError, match="must be true or false") as err:
        embedded.client._lean_post(
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [payload(5.0)], "load_format": "flattened_bucket", "end_weight_update": 1},
        )
    assert err.value.status == 400
    assert embedded.client.weights_checksum()["checksum"] == base  # nothing loaded
    with pytest.raises(EngineError, match="begin_weight_update"):  # and no session was left open
        embedded.client.update_weights_from_tensor([payload(5.0, handle=False)], weight_version="bad")

    answer = embedded.client.update_weights_from_tensor(
        [payload(2.0)], weight_version="inline", begin_session=True, end_session=True, checksum=True, probe=probe
    )
    expected = dict(state, **{name: torch.full_like(state[name], 2.0)})
    rep = embedded.client.weights_checksum()
    assert rep["weight_version"] == "inline" and rep["checksum"] == combine({n: entry(t) for n, t in expected.items()})
    assert answer["weights_checksum"] == rep
    assert answer["probe_logprobs"] == embedded.client.score(probe)
    with pytest.raises(EngineError, match="begin_weight_update"):  # closed: its slot is gone
        embedded.client.update_weights_from_tensor([payload(3.0, handle=False)], weight_version="after")

    # A bucket the engine refuses (no such slot) in a request asked to close the session: closed all the same.
    embedded.client.update_weights_from_tensor([payload(4.0, slot=1)], begin_session=True)
    with pytest.raises(EngineError, match="slot 2 has no buffer"):
        embedded.client.update_weights_from_tensor([payload(1.0, slot=2, handle=False)], end_session=True)
    with pytest.raises(EngineError, match="begin_weight_update"):
        embedded.client.update_weights_from_tensor([payload(1.0, slot=1, handle=False)])
    embedded.client.update_weights_from_disk(str(big_model))  # the module's other tests expect the base weights
    assert embedded.client.weights_checksum()["checksum"] == base


def test_a_bad_flattened_bucket_changes_nothing_and_a_cast_one_loads(embedded, big_model):
    """A bucket naming an unknown weight or the wrong shape is refused whole (nothing of it is
    copied, also when its layout was seen before); a bucket in another dtype goes through the
    casting path and loads."""
    from safetensors.torch import load_file

    from rltrain.weights import bucket as tensor_payload
    from rltrain.weights.checksum import combine, entry

    state = {}
    for f in sorted(big_model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    good, other = "model.norm.weight", "model.layers.0.input_layernorm.weight"
    base = combine({n: entry(t) for n, t in state.items()})
    send = lambda named: embedded.client.update_weights_from_tensor(  # noqa: E731
        [tensor_payload.serialize(tensor_payload.flatten_bucket(named))], weight_version="bad"
    )
    with pytest.raises(EngineError, match="unknown parameter 'model.nope'"):
        send([(good, torch.full_like(state[good], 7.0)), ("model.nope", torch.zeros(3))])
    wrong = torch.zeros(state[other].numel() + 1)
    for _ in range(2):  # the second time from the kept layout check
        with pytest.raises(EngineError, match="does not match the model's"):
            send([(good, torch.full_like(state[good], 7.0)), (other, wrong)])
    assert embedded.client.weights_checksum()["checksum"] == base
    send([(good, torch.full_like(state[good], 0.5, dtype=torch.float64))])
    expected = dict(state, **{good: torch.full_like(state[good], 0.5)})
    assert embedded.client.weights_checksum()["checksum"] == combine({n: entry(t) for n, t in expected.items()})
    embedded.client.update_weights_from_disk(str(big_model))  # the module's other tests expect the base weights
    assert embedded.client.weights_checksum()["checksum"] == base


def test_a_sessions_report_uses_the_sums_taken_as_its_buckets_landed_and_any_other_write_drops_them(model_a):
    """engine/embedded: inside a weight-update session each bucket's weights are summed as they
    land (writer.py's `landed`), and the session's checksum report reads only the rest. The
    report is always what the engine holds: a weight written twice in the session, written
    after it outside a session (a bucket or named tensors), restored by a resume or refilled
    from disk is summed as it is now, never from a stale landed sum."""
    from rltrain.engine.embedded.engine import EmbeddedEngine
    from rltrain.weights.checksum import combine, entry

    engine = EmbeddedEngine(str(model_a), weights_backup=True)
    receiver, writer = engine.receiver, engine.receiver.writer
    state = {n: t.clone() for n, t in engine.model.state_dict().items() if n in receiver.owned}

    def truth():
        return combine({n: entry(t) for n, t in state.items()})

    def bucket(named):
        b = tensor_payload.flatten_bucket(named)
        return b["flattened_tensor"], b["metadata"]

    assert engine.weights_checksum()["checksum"] == truth()
    a, b = "model.norm.weight", "model.layers.0.mlp.down_proj.weight"
    receiver.session(True)  # a session whose end asks for no checksum: nothing summed as it lands
    receiver.load_bucket(*bucket([(a, state[a])]), "v0")
    receiver.session(False)
    assert not writer.landed
    receiver.session(True, summing=True)
    for name, value in [(a, 1.0), (b, 2.0), (a, 3.0)]:  # `a` twice: its last sums count
        state[name] = torch.full_like(state[name], value)
        receiver.load_bucket(*bucket([(name, state[name])]), "v1")
    receiver.session(False)
    assert set(writer.landed) == {a, b}  # the report reads these from their landing
    assert engine.weights_checksum()["checksum"] == truth()

    state[a] = torch.full_like(state[a], 4.0)  # a bucket outside a session
    receiver.load_bucket(*bucket([(a, state[a])]), "v2")
    assert a not in writer.landed and engine.weights_checksum()["checksum"] == truth()
    state[b] = torch.full_like(state[b], 5.0)  # named tensors
    receiver.load_named_tensors([(b, state[b])], "v3")
    assert not writer.landed and engine.weights_checksum()["checksum"] == truth()

    receiver.session(True, summing=True)
    receiver.load_bucket(*bucket([(b, torch.full_like(state[b], 6.0))]), "v4")
    receiver.session(False)
    state[b] = torch.full_like(state[b], 6.0)
    engine.release(["weights"])  # backed up, freed: the landed sums go with the weights
    assert not writer.landed
    engine.resume(["weights"])
    assert engine.weights_checksum()["checksum"] == truth()
    receiver.session(True, summing=True)
    receiver.load_bucket(*bucket([(b, torch.full_like(state[b], 7.0))]), "v5")
    receiver.load_from_disk(str(model_a), "base")  # every weight rewritten from the files
    receiver.session(False)
    assert not writer.landed
    assert engine.weights_checksum()["checksum"] == combine({n: entry(t) for n, t in _files(model_a).items()})


def _files(model):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(model.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
