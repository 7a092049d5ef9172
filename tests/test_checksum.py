"""Weight checksums (weights/checksum.py) against a plain-Python reference of their definition."""

import pytest
import torch

from rltrain.weights.checksum import BLOCK, COLS, combine, entry, tensor_sums


def _signed64(x: int) -> int:
    x %= 1 << 64
    return x - (1 << 64) if x >= 1 << 63 else x


def _reference(t: torch.Tensor) -> tuple[int, int]:
    """The definition: the bytes as little-endian int32 words (zero-padded), sum and sum of
    (1-based position * word), modulo 2**64 as signed int64."""
    raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    raw += b"\0" * (-len(raw) % 4)
    words = [int.from_bytes(raw[i : i + 4], "little", signed=True) for i in range(0, len(raw), 4)]
    return _signed64(sum(words)), _signed64(sum((i + 1) * w for i, w in enumerate(words)))


@pytest.mark.parametrize("n", [0, 1, 3, COLS - 1, COLS, COLS + 1, 3 * COLS + 17])
def test_sums_match_the_definition_across_row_boundaries(n):
    g = torch.Generator().manual_seed(n)
    t = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    assert tensor_sums(t) == _reference(t)


def test_sums_wrap_around_and_pad_odd_byte_counts():
    extreme = torch.full((5 * COLS + 3,), 2**31 - 1, dtype=torch.int32)
    assert tensor_sums(extreme) == _reference(extreme)
    for t in (
        torch.randn(7, 13).to(torch.bfloat16),
        torch.arange(11, dtype=torch.uint8),
        torch.randn(3, dtype=torch.float64),
    ):
        assert tensor_sums(t) == _reference(t)
    # Large enough that the weighted sum wraps many times over.
    big = torch.full((1 << 22,), -(2**31), dtype=torch.int32)
    s1, s2 = tensor_sums(big)
    assert s1 == _signed64(-(2**31) * (1 << 22)) and s2 == _signed64(-(2**31) * (1 << 22) * ((1 << 22) + 1) // 2)


def test_a_swap_or_a_changed_word_changes_the_checksum():
    t = torch.randn(4 * COLS + 5)
    swapped = t.clone()
    swapped[[10, COLS + 3]] = swapped[[COLS + 3, 10]]
    changed = t.clone()
    changed[-1] += 1
    base = combine({"w": entry(t)})
    assert combine({"w": entry(swapped)}) != base
    assert combine({"w": entry(changed)}) != base
    assert tensor_sums(swapped)[0] == tensor_sums(t)[0]  # the plain sum cannot see a swap; the weighted one does
    # Sums fetched lazily (tensors) and given as ints hash the same.
    assert combine({"w": ("float32", tuple(t.shape), tensor_sums(t))}) == base


def test_sums_are_the_same_when_rows_are_widened_in_several_blocks(monkeypatch):
    from rltrain.weights import checksum as integrity

    t = torch.randint(
        -(2**31), 2**31 - 1, (7 * COLS + 5,), dtype=torch.int32, generator=torch.Generator().manual_seed(1)
    )
    monkeypatch.setattr(integrity, "ROWS", 2)  # 7 rows in blocks of 2, 2, 2, 1
    assert tensor_sums(t) == _reference(t)


def test_host_and_torch_paths_give_the_definitions_sums(monkeypatch):
    """A small host tensor is summed by numpy, a large one (or a device one) by torch ops:
    both are the definition, the numpy one also in several blocks (wrapping in each)."""
    from rltrain.weights import checksum as integrity

    g = torch.Generator().manual_seed(2)
    for n in (1, 5, COLS + 3, integrity.HOST_WORDS, integrity.HOST_WORDS + 1):
        t = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
        ref = _reference(t)
        assert tensor_sums(t) == ref
        assert tuple(integrity._torch_sums(t).tolist()) == ref
        assert integrity._host_sums(t.numpy()) == ref
    monkeypatch.setattr(integrity, "HOST_BLOCK", 7)  # 3 * COLS + 2 words in blocks of 7
    extreme = torch.full((3 * COLS + 2,), -(2**31), dtype=torch.int32)
    assert integrity._host_sums(extreme.numpy()) == _reference(extreme)


def test_reading_weights_for_a_checksum_a_file_or_a_delta_leaves_their_storage_resizable(tmp_path):
    """The sync reads the trainer's own parameters (gathered once, then freed by FSDP2 resizing
    their storage to 0): a reader that claims the storage (as `Tensor.numpy()` does) breaks
    that free. Each reader's bytes stay right, and every storage stays resizable."""
    from rltrain.weights.delta import DeltaPublisher
    from rltrain.weights.hf_files import write_safetensors

    g = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)}
    sums = {n: tensor_sums(t) for n, t in weights.items()}
    assert sums == {n: _reference(t) for n, t in weights.items()}
    write_safetensors(tmp_path / "w.safetensors", weights)
    publisher = DeltaPublisher(full_every=2)
    publisher.write(tmp_path / "v1", "1", weights.items(), config_from="")
    from safetensors.torch import load_file

    assert all(torch.equal(load_file(tmp_path / "w.safetensors")[n], t) for n, t in weights.items())
    for t in weights.values():
        assert t.untyped_storage().resizable()
        t.untyped_storage().resize_(0)  # what FSDP2's reshard does


@pytest.mark.parametrize("n", [0, 1, 1023, 1025, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17])  # CHUNK, BLOCK edges
def test_the_gpu_kernels_block_rows_fold_to_the_definitions_sums(n):
    """kernels/triton_checksum.block_sums (the CUDA path; here under Triton's interpreter): its
    rows of partial sums, folded with other tensors' rows in one `fold`, are the definition, at
    extreme words too (where a wrong widening or wrap would show)."""
    from rltrain.kernels.triton_checksum import block_sums
    from rltrain.weights import checksum as integrity

    g = torch.Generator().manual_seed(n)
    t = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    extreme = torch.full((n + 5,), -(2**31), dtype=torch.int32)
    small = torch.arange(9, dtype=torch.int32)
    rows = [block_sums(t, integrity.BLOCK), block_sums(extreme, integrity.BLOCK), integrity._device_sums(small)]
    assert rows[0].shape == (max(1, -(-n // integrity.BLOCK)), 2)
    folded = [tuple(p) for p in integrity.fold(rows).tolist()]
    assert folded == [_reference(t), _reference(extreme), _reference(small)]
    with pytest.raises(ValueError, match="int32"):
        block_sums(t.to(torch.int64), integrity.BLOCK)


@pytest.mark.parametrize(("block", "chunk"), [(1024, 256), (16384, 2048), (1 << 21, 4096)])
def test_the_folded_sums_do_not_depend_on_the_kernels_block_or_chunk(block, chunk):
    """Whatever block and chunk the GPU kernels read with (here under Triton's interpreter), the
    folded sums are the definition's: a block of 2**21 extreme words wraps its weighted sum
    inside the kernel (2**31 x 2**41 > 2**63), which is harmless because the sums and the fold
    are both taken modulo 2**64."""
    from rltrain.kernels.triton_checksum import block_sums, multi_block_rows

    extreme = torch.full((block + 3,), -(2**31), dtype=torch.int32)  # a whole block and three words
    g = torch.Generator().manual_seed(block)
    other = torch.randint(-(2**31), 2**31 - 1, (5 * 1024 + 1,), dtype=torch.int32, generator=g)
    want = [_reference(extreme), _reference(other)]

    def folded(rows: list[torch.Tensor]) -> list[tuple[int, int]]:
        counts = torch.tensor([r.shape[0] for r in rows])
        first = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        out = torch.cat(rows)
        index = torch.arange(out.shape[0])
        owner = torch.searchsorted(first[1:], index, right=True)
        plain = torch.zeros(len(rows), dtype=torch.int64).index_add_(0, owner, out[:, 0])
        local = (index - first[owner]) * block * out[:, 0] + out[:, 1]
        weighted = torch.zeros(len(rows), dtype=torch.int64).index_add_(0, owner, local)
        return [(int(a), int(b)) for a, b in zip(plain, weighted)]

    assert folded([block_sums(t, block, chunk) for t in (extreme, other)]) == want
    rows, first = multi_block_rows([extreme, other], block, chunk=chunk)
    assert folded(list(rows.tensor_split(first[1:-1].tolist()))) == want


def test_a_view_that_starts_inside_a_word_is_summed_as_its_own_bytes():
    """A tensor viewed at an offset that is not a multiple of 4 bytes (a bf16 slice of another)
    is summed as a copy of its bytes would be, instead of failing to be read as int32 words."""
    base = torch.randn(4096 * 3 + 3).to(torch.bfloat16)
    view = base[1:]  # 24,580 bytes: a whole number of words, from byte 2 of its storage
    assert tensor_sums(view) == tensor_sums(view.clone()) == _reference(view.clone())
