"""MultiModalConfig validation and compute_hash; AttentionBackendEnum.from_name."""
import dataclasses

import pytest

from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends.linear import LinearBackendEnum as L
from mmenc.config import MultiModalConfig


@pytest.mark.parametrize("spelling", ["torch_sdpa", "TORCH_SDPA", "Torch_Sdpa", " torch-sdpa ", B.TORCH_SDPA])
def test_backend_any_spelling_becomes_enum(spelling):
    config = MultiModalConfig(mm_encoder_attn_backend=spelling)
    assert config.mm_encoder_attn_backend is B.TORCH_SDPA


@pytest.mark.parametrize("member", list(B))
def test_every_member_round_trips(member):
    assert MultiModalConfig(mm_encoder_attn_backend=member.name.lower()).mm_encoder_attn_backend is member
    assert MultiModalConfig(mm_encoder_attn_backend=member).mm_encoder_attn_backend is member
    assert B.from_name(member.value) is member


def test_backend_none_means_platform_chooses():
    assert MultiModalConfig().mm_encoder_attn_backend is None


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError) as e:
        MultiModalConfig(mm_encoder_attn_backend="flash_attention_9")
    msg = str(e.value)
    assert "flash_attention_9" in msg
    for member in B:
        assert member.name in msg


@pytest.mark.parametrize("bad", [3, 1.5, object()])
def test_backend_of_wrong_type_is_named(bad):
    with pytest.raises(ValueError, match="attention backend"):
        B.from_name(bad)


def test_from_name():
    assert B.from_name("xformers") is B.XFORMERS
    assert B.from_name("ROCM_AITER_FA") is B.ROCM_AITER_FA
    assert B.from_name(B.PALLAS) is B.PALLAS
    with pytest.raises(ValueError, match=r"'nope'.*TORCH_SDPA"):
        B.from_name("nope")


@pytest.mark.parametrize("mode, expected", [
    ("weights", "weights"), ("weight", "weights"), ("WEIGHTS", "weights"), ("Weight", "weights"),
    ("data", "data"), ("DATA", "data"),
])
def test_tp_mode_normalised(mode, expected):
    assert MultiModalConfig(mm_encoder_tp_mode=mode).mm_encoder_tp_mode == expected


@pytest.mark.parametrize("bad", ["tensor", "", "datas", None, 1])
def test_tp_mode_invalid_named(bad):
    with pytest.raises(ValueError) as e:
        MultiModalConfig(mm_encoder_tp_mode=bad)
    assert repr(bad) in str(e.value)
    assert "'weights'" in str(e.value) and "'data'" in str(e.value)


@pytest.mark.parametrize("spec, expected", [
    (("all",), ("all",)),
    ("all", ("all",)),
    ("none,+mm_encoder_attn", ("none", "+mm_encoder_attn")),
    ("all, -mm_encoder_attn", ("all", "-mm_encoder_attn")),
    ("all,-mm_encoder_attn,", ("all", "-mm_encoder_attn")),
    ("all, ", ("all",)),
    (["none", " +rms_norm "], ("none", "+rms_norm")),
    ((), ()),
])
def test_custom_ops_parsed(spec, expected):
    assert MultiModalConfig(custom_ops=spec).custom_ops == expected


@pytest.mark.parametrize("bad", ["some", "+", "-", "all,every", ("all", "mm_encoder_attn")])
def test_custom_ops_invalid_named(bad):
    with pytest.raises(ValueError) as e:
        MultiModalConfig(custom_ops=bad)
    entry = [s.strip() for s in (bad.split(",") if isinstance(bad, str) else bad)
             if s.strip() not in ("all", "none") and not (len(s.strip()) > 1 and s.strip()[0] in "+-")][0]
    assert repr(entry) in str(e.value)
    assert "'+name'" in str(e.value)


def test_custom_ops_non_string_entry_named():
    with pytest.raises(ValueError, match="42"):
        MultiModalConfig(custom_ops=("all", 42))


def test_config_is_frozen():
    config = MultiModalConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mm_encoder_tp_mode = "data"


def test_hash_stable_for_equal_configs():
    a = MultiModalConfig(mm_encoder_attn_backend="torch_sdpa", mm_encoder_tp_mode="weight", custom_ops="all")
    b = MultiModalConfig(mm_encoder_attn_backend=B.TORCH_SDPA, mm_encoder_tp_mode="weights", custom_ops=("all",))
    assert a == b
    assert a.compute_hash() == b.compute_hash()
    assert MultiModalConfig().compute_hash() == MultiModalConfig().compute_hash()
    assert isinstance(a.compute_hash(), str) and a.compute_hash()


def test_hash_differs_when_any_field_differs():
    base = MultiModalConfig()
    variants = {
        "mm_encoder_attn_backend": [B.NAIVE, B.TORCH_SDPA, B.FLASH_ATTN],
        "mm_encoder_tp_mode": ["data"],
        "custom_ops": [("none",), ("all", "-mm_encoder_attn"), ("none", "+mm_encoder_attn")],
        "compile": [True],
        "cuda_graphs": [True],
        "batch_invariant": [True],
        "linear_backend": [L.NATIVE, L.ONEDNN, L.FP8],
        "quantization": ["fp8", "fp8-all"],
        "fused_kernels": [True],
    }
    # Every field of the dataclass must be covered here, so a new field cannot be forgotten.
    assert set(variants) == {f.name for f in dataclasses.fields(MultiModalConfig)}
    hashes = {base.compute_hash()}
    count = 1
    for field, values in variants.items():
        for value in values:
            config = dataclasses.replace(base, **{field: value})
            assert config.compute_hash() != base.compute_hash(), f"{field}={value!r} does not change the hash"
            hashes.add(config.compute_hash())
            count += 1
    assert len(hashes) == count, "two different configs share a hash"
