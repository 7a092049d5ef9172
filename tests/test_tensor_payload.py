"""The flattened-bucket payload: layout, views, and refusal of metadata that do not fit."""

import types

import pytest
import torch

from rltrain.weights import bucket as tensor_payload
from rltrain.weights.bucket import BucketViews, bucket_layout, flatten_bucket, unflatten_bucket


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),   # 30 bytes: the next start is padded
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(2, 3, generator=g)),                        # float32 after bfloat16: a new run
        ("d", torch.randint(0, 1 << 40, (3,), generator=g)),          # int64
        ("e", torch.tensor(2.5)),                                     # 0-d
        ("f", torch.empty(0, 4)),                                     # empty
        ("g", torch.arange(5, dtype=torch.uint8)),
        ("h", torch.randn(4, 4, generator=g).t()),                    # not contiguous
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
    assert [run[0] for run in layout.runs] == [torch.bfloat16, torch.float32, torch.int64, torch.float32, torch.uint8,
                                                torch.float32]
    assert layout.tensor_bytes == sum(m.end_idx - m.start_idx for m in metadata)


def _meta(name, shape, dtype, start, end):
    return types.SimpleNamespace(name=name, shape=torch.Size(shape), dtype=dtype, start_idx=start, end_idx=end, numel=end - start)


@pytest.mark.parametrize("metadata, match", [
    ([_meta("x", (4,), torch.float32, 2, 18)], "inconsistent"),                     # misaligned for float32
    ([_meta("x", (4,), torch.float32, 0, 12)], "inconsistent"),                     # range is not the shape
    ([_meta("x", (4,), torch.float32, 0, 16), _meta("y", (2,), torch.float32, 8, 16)], "overlaps"),
    ([_meta("x", (64,), torch.float32, 0, 256)], "cannot hold"),                    # beyond the buffer
])
def test_metadata_that_do_not_fit_the_buffer_are_refused(metadata, match):
    with pytest.raises(ValueError, match=match):
        unflatten_bucket({"flattened_tensor": torch.zeros(64, dtype=torch.uint8), "metadata": metadata})


def test_a_buffer_that_is_not_bytes_is_refused():
    metadata, _ = bucket_layout([("x", torch.zeros(4))])
    with pytest.raises(ValueError, match="1-D uint8"):
        BucketViews(metadata).views(torch.zeros(4))
