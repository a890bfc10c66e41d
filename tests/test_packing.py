"""make_cu_seqlens / pack_info: the host view of a pack, computed once and never read back."""
import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmenc.attention.layer import MMEncoderAttention
from mmenc.backends.packing import make_cu_seqlens, pack_info
from mmenc.platforms.cpu import CpuPlatform


def test_make_cu_seqlens():
    cu, max_seqlen = make_cu_seqlens([3, 0, 5])
    assert cu.dtype == torch.int32 and cu.dim() == 1
    assert cu.tolist() == [0, 3, 3, 8]
    assert max_seqlen == 5 and type(max_seqlen) is int


def test_make_cu_seqlens_empty_and_device():
    cu, max_seqlen = make_cu_seqlens([], device="cpu")
    assert cu.tolist() == [0] and max_seqlen == 0 and cu.device.type == "cpu"
    assert pack_info(cu, 0).lengths == ()


def test_make_cu_seqlens_accepts_tensor_lengths():
    cu, max_seqlen = make_cu_seqlens(torch.tensor([2, 4]))
    assert cu.tolist() == [0, 2, 6] and max_seqlen == 4


def test_negative_length_named():
    with pytest.raises(ValueError, match=r"\[2, -1, 3\]"):
        make_cu_seqlens([2, -1, 3])


def test_pack_info_fields():
    cu, _ = make_cu_seqlens([2, 3, 0, 2, 3, 2])
    info = pack_info(cu, 12)
    assert info.lengths == (2, 3, 0, 2, 3, 2)
    assert info.max_seqlen == 3 and info.total == 12
    assert info.starts() == [0, 2, 5, 5, 7, 10]
    # Zero-length segments belong to no group; groups ascend by length, segments in order.
    assert info.length_groups() == [(2, [0, 3, 5]), (3, [1, 4])]


def test_pack_info_of_plain_tensor_matches():
    info = pack_info(torch.tensor([0, 2, 5, 5, 7], dtype=torch.int32), 7)
    assert info.lengths == (2, 3, 0, 2) and info.max_seqlen == 3
    assert info.length_groups() == [(2, [0, 3]), (3, [1])]


def test_pack_info_wrong_total_named():
    cu, _ = make_cu_seqlens([2, 3])
    with pytest.raises(ValueError) as e:
        pack_info(cu, 6)
    assert "ends at 5" in str(e.value) and "6 tokens" in str(e.value)


@contextlib.contextmanager
def no_device_reads():
    """Inside, any read of tensor values back to the host raises."""
    def forbidden(self, *args, **kwargs):
        raise AssertionError("a tensor was read back to the host")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("tolist", "item", "__int__", "__index__", "__bool__", "numpy"):
            mp.setattr(torch.Tensor, name, forbidden)
        yield


def test_made_pack_costs_no_read():
    cu, max_seqlen = make_cu_seqlens([4, 1, 4])
    plain = torch.tensor([0, 9], dtype=torch.int32)
    with no_device_reads():
        info = pack_info(cu, 9)
        with pytest.raises(AssertionError, match="read back"):  # the patch works: a plain tensor is read
            pack_info(plain, 9)
    assert info.lengths == (4, 1, 4) and info.max_seqlen == max_seqlen == 4


def test_plain_tensor_read_once_then_remembered():
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    assert pack_info(cu, 9).lengths == (3, 6)
    with no_device_reads():
        info = pack_info(cu, 9)
    assert info.lengths == (3, 6)


@pytest.mark.parametrize("lengths", [[4, 1, 4, 3], [5, 5, 5], [1], [0, 3, 0]])
def test_layer_forward_reads_nothing_back(use_platform, lengths):
    use_platform(CpuPlatform())
    layer = MMEncoderAttention(2, 8)
    cu, max_seqlen = make_cu_seqlens(lengths)
    x = torch.randn(1, sum(lengths), 16)
    expected = layer(x, x, x, cu_seqlens=cu, max_seqlen=max_seqlen)
    cu, max_seqlen = make_cu_seqlens(lengths)  # a fresh pack, nothing remembered from the first call
    with no_device_reads():
        out = layer(x, x, x, cu_seqlens=cu, max_seqlen=max_seqlen)
    torch.testing.assert_close(out, expected)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=40), max_size=12))
def test_pack_roundtrip(lengths):
    cu, max_seqlen = make_cu_seqlens(lengths)
    total = sum(lengths)
    info = pack_info(cu, total)
    assert info.lengths == tuple(lengths) and info.max_seqlen == max(lengths, default=0)
    assert cu.tolist() == [0, *info.starts()[1:], total] if lengths else cu.tolist() == [0]
    plain = pack_info(cu.clone(), total)  # read back from the tensor: the same view
    assert plain.lengths == info.lengths and plain.max_seqlen == info.max_seqlen
    grouped = sorted(i for _, segs in info.length_groups() for i in segs)
    assert grouped == [i for i, n in enumerate(lengths) if n > 0]
    assert all(lengths[i] == n for n, segs in info.length_groups() for i in segs)
