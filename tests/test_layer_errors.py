"""MMEncoderAttention rejects bad construction and bad input with messages that name the value."""
import pytest
import torch

from mmenc.attention.layer import MMEncoderAttention
from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends.packing import make_cu_seqlens
from mmenc.config import MultiModalConfig
from mmenc.platforms.cpu import CpuPlatform

HEADS, KV_HEADS, D = 4, 2, 8


@pytest.fixture(params=[B.TORCH_SDPA, B.NAIVE])
def layer(request, use_platform):
    use_platform(CpuPlatform())
    config = MultiModalConfig(mm_encoder_attn_backend=request.param)
    return MMEncoderAttention(HEADS, D, num_kv_heads=KV_HEADS, prefix="blocks.3.attn", multimodal_config=config)


def qkv(batch=1, seq=6):
    return (torch.randn(batch, seq, HEADS * D), torch.randn(batch, seq, KV_HEADS * D),
            torch.randn(batch, seq, KV_HEADS * D))


@pytest.mark.parametrize("heads, kv_heads", [(4, 3), (6, 4), (3, 2)])
def test_heads_not_divisible_by_kv_heads(heads, kv_heads):
    with pytest.raises(ValueError) as e:
        MMEncoderAttention(heads, 8, num_kv_heads=kv_heads, prefix="visual.blocks.0.attn")
    msg = str(e.value)
    assert f"num_heads={heads}" in msg and f"num_kv_heads={kv_heads}" in msg and "visual.blocks.0.attn" in msg


@pytest.mark.parametrize("heads, kv_heads, head_size", [(0, None, 8), (4, 0, 8), (4, None, 0), (-2, None, 8)])
def test_non_positive_sizes(heads, kv_heads, head_size):
    with pytest.raises(ValueError, match="must all be positive"):
        MMEncoderAttention(heads, head_size, num_kv_heads=kv_heads)


@pytest.mark.parametrize("cu, expect", [
    ([1, 3, 6], "cu_seqlens[0]=1"),                     # does not start at 0
    ([0, 3, 5], "ends at 5"),                           # does not end at the token count
    ([0, 3, 7], "ends at 7"),
    ([0, 4, 2, 6], "cu_seqlens[1]=4 > cu_seqlens[2]=2"),  # decreasing
])
def test_malformed_cu_seqlens_values(layer, cu, expect):
    q, k, v = qkv()
    with pytest.raises(ValueError) as e:
        layer(q, k, v, cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=6)
    assert expect in str(e.value)
    if "ends at" in expect:
        assert "6 tokens" in str(e.value)


@pytest.mark.parametrize("cu, expect", [
    (torch.tensor([0.0, 3.0, 6.0]), "torch.float32"),
    (torch.tensor([False, True]), "torch.bool"),
    (torch.tensor([0, 3, 6]), "torch.int64"),
    (torch.tensor([[0, 3, 6]], dtype=torch.int32), "(1, 3)"),
    (torch.tensor(0, dtype=torch.int32), "()"),
    (torch.tensor([], dtype=torch.int32), "(0,)"),
])
def test_malformed_cu_seqlens_dtype_or_dim(layer, cu, expect):
    q, k, v = qkv()
    with pytest.raises(ValueError) as e:
        layer(q, k, v, cu_seqlens=cu, max_seqlen=6)
    assert expect in str(e.value) and "cu_seqlens" in str(e.value)


def test_good_plain_cu_seqlens_accepted(layer):
    q, k, v = qkv()
    out = layer(q, k, v, cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32), max_seqlen=4)
    assert out.shape == q.shape


@pytest.mark.parametrize("which, shape, expect", [
    ("query", (1, 6, HEADS * D + 1), f"query has shape (1, 6, {HEADS * D + 1})"),
    ("query", (1, 6, KV_HEADS, D), f"query has shape (1, 6, {KV_HEADS}, {D})"),
    ("query", (6, HEADS * D), f"query has shape (6, {HEADS * D})"),
    ("key", (1, 6, HEADS * D), f"key has shape (1, 6, {HEADS * D})"),
    ("value", (1, 6, KV_HEADS, D + 1), f"value has shape (1, 6, {KV_HEADS}, {D + 1})"),
    ("key", (1, 5, KV_HEADS * D), "key has batch/sequence (1, 5) but query has (1, 6)"),
    ("value", (2, 6, KV_HEADS * D), "value has batch/sequence (2, 6) but query has (1, 6)"),
])
def test_shape_mismatch(layer, which, shape, expect):
    tensors = dict(zip(("query", "key", "value"), qkv()))
    tensors[which] = torch.randn(shape)
    with pytest.raises(ValueError) as e:
        layer(**tensors)
    assert expect in str(e.value) and "blocks.3.attn" in str(e.value)


def test_batch_with_cu_seqlens(layer):
    q, k, v = qkv(batch=2, seq=3)
    cu, max_seqlen = make_cu_seqlens([3, 3])
    with pytest.raises(ValueError, match="batch=2"):
        layer(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen)


def test_missing_max_seqlen(layer):
    q, k, v = qkv()
    cu, _ = make_cu_seqlens([2, 4])
    with pytest.raises(ValueError, match="max_seqlen is required"):
        layer(q, k, v, cu_seqlens=cu)


def test_cu_seqlens_on_another_device(layer):
    q, k, v = qkv()
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError) as e:
        layer(q, k, v, cu_seqlens=cu, max_seqlen=6)
    assert "cu_seqlens is on meta" in str(e.value) and "query is on cpu" in str(e.value)


def test_four_dim_input_keeps_shape(layer):
    q = torch.randn(2, 5, HEADS, D)
    kv = torch.randn(2, 5, KV_HEADS, D)
    assert layer(q, kv, kv).shape == q.shape


def test_max_seqlen_must_match_the_pack(layer):
    cu, _ = make_cu_seqlens([3, 5], "cpu")
    q, k, v = qkv(seq=8)
    with pytest.raises(ValueError, match=r"max_seqlen=4 but the longest segment of cu_seqlens has 5 tokens"):
        layer(q, k, v, cu, 4)


@pytest.mark.parametrize("dtypes, expect", [
    ((torch.float32, torch.float16, torch.float32), "query float32, key float16, value float32"),
    ((torch.float32, torch.float32, torch.bfloat16), "query float32, key float32, value bfloat16"),
    ((torch.int64, torch.int64, torch.int64), "query int64, key int64, value int64"),
    ((torch.float32, torch.int32, torch.float32), "query float32, key int32, value float32"),
])
def test_qkv_must_share_one_floating_dtype(layer, dtypes, expect):
    """The same check for every backend (NAIVE alone would accept mixed or integer inputs)."""
    q, k, v = (x.to(dt) if dt.is_floating_point else x.to(dt) for x, dt in zip(qkv(), dtypes))
    with pytest.raises(ValueError, match="blocks.3.attn: query, key and value must share one floating-point dtype") as e:
        layer(q, k, v)
    assert expect in str(e.value)


def test_qkv_must_share_one_device(layer):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"must be on one device, got query on cpu, key on meta, value on cpu"):
        layer(q, k.to("meta"), v)
