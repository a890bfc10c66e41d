"""CustomOp: per-platform dispatch fixed at construction, custom_ops switches, register / register_oot."""
import pytest
import torch
import torch.nn as nn

import mmenc.custom_op as custom_op
from mmenc.attention.layer import MMEncoderAttention
from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import get_backend_class
from mmenc.config import MultiModalConfig
from mmenc.custom_op import CustomOp, op_enabled

OP_NAME = "test_dispatch_op"


@pytest.fixture
def op_cls():
    """A registered op whose every forward says which one ran (forward_hip inherits forward_cuda)."""
    class Probe(CustomOp):
        def forward_native(self):
            return "native"

        def forward_cuda(self):
            return "cuda"

        def forward_cpu(self):
            return "cpu"

        def forward_xpu(self):
            return "xpu"

        def forward_tpu(self):
            return "tpu"

        def forward_oot(self):
            return "oot"

    CustomOp.register(OP_NAME)(Probe)
    yield Probe
    custom_op._REGISTRY.pop(OP_NAME, None)


@pytest.fixture
def clean_oot():
    """Undo every register_oot made during the test."""
    before = dict(custom_op._OOT_REGISTRY)
    yield
    custom_op._OOT_REGISTRY.clear()
    custom_op._OOT_REGISTRY.update(before)


@pytest.mark.parametrize("key, expected", [
    ("cuda", "cuda"), ("hip", "cuda"), ("cpu", "cpu"), ("xpu", "xpu"), ("tpu", "tpu"), ("oot", "oot"),
    ("native", "native"),
])
def test_dispatch_by_platform_key(op_cls, use_platform, fake_platform_cls, key, expected):
    use_platform(fake_platform_cls(key)())
    assert op_cls()() == expected


def test_dispatch_fixed_at_construction(op_cls, use_platform, fake_platform_cls):
    use_platform(fake_platform_cls("cuda")())
    op = op_cls()
    use_platform(fake_platform_cls("cpu")())
    assert op() == "cuda"
    assert op_cls()() == "cpu"


def test_unimplemented_platform_forward_falls_back_to_native(use_platform, fake_platform_cls):
    class OnlyNative(CustomOp):
        def forward_native(self, x):
            return x + 1

    for key in ("cuda", "hip", "cpu", "xpu", "tpu", "oot"):
        use_platform(fake_platform_cls(key)())
        assert OnlyNative()(1) == 2, key


@pytest.mark.parametrize("custom_ops, enabled", [
    (("all",), True),
    (("none",), False),
    ((), True),
    (("none", f"+{OP_NAME}"), True),
    (("all", f"-{OP_NAME}"), False),
    (("all", "-other_op"), True),
    (("none", "+other_op"), False),
    ((f"-{OP_NAME}", f"+{OP_NAME}"), True),   # later entries win
    ((f"+{OP_NAME}", "none"), False),
])
def test_custom_ops_semantics(op_cls, use_platform, fake_platform_cls, custom_ops, enabled):
    assert op_enabled(OP_NAME, custom_ops) is enabled
    use_platform(fake_platform_cls("cuda")())
    assert op_cls(custom_ops=custom_ops)() == ("cuda" if enabled else "native")


def test_disabled_attention_runs_forward_native(use_platform, fake_platform_cls, monkeypatch):
    use_platform(fake_platform_cls("cpu", priority=(B.NAIVE,))())

    def boom(*args, **kwargs):
        raise AssertionError("the platform backend ran although the op is disabled")

    monkeypatch.setattr(get_backend_class(B.NAIVE), "forward", classmethod(boom))
    config = MultiModalConfig(mm_encoder_attn_backend="naive", custom_ops=("all", "-mm_encoder_attn"))
    layer = MMEncoderAttention(2, 8, multimodal_config=config)
    q = torch.randn(1, 5, 16)
    assert layer(q, q, q).shape == q.shape
    with pytest.raises(AssertionError, match="disabled"):
        MMEncoderAttention(2, 8, multimodal_config=MultiModalConfig(mm_encoder_attn_backend="naive"))(q, q, q)


def test_register_sets_name_and_lists(op_cls):
    assert op_cls.name == OP_NAME
    assert CustomOp.registered()[OP_NAME] is op_cls
    assert CustomOp.registered()["mm_encoder_attn"] is MMEncoderAttention
    CustomOp.register(OP_NAME)(op_cls)  # the same class again is fine


def test_register_duplicate_name_is_an_error(op_cls):
    class Other(CustomOp):
        pass

    with pytest.raises(ValueError) as e:
        CustomOp.register(OP_NAME)(Other)
    assert repr(OP_NAME) in str(e.value) and op_cls.__qualname__ in str(e.value)
    assert CustomOp.registered()[OP_NAME] is op_cls
    with pytest.raises(ValueError, match="mm_encoder_attn"):
        CustomOp.register("mm_encoder_attn")(Other)


def test_register_oot_subclass_replaces_attention(clean_oot, use_platform, fake_platform_cls):
    use_platform(fake_platform_cls("oot")())
    calls = []

    @CustomOp.register_oot(name="MMEncoderAttention")
    class AcmeAttention(MMEncoderAttention):
        def __init__(self, *args, **kwargs):
            calls.append((args, kwargs))
            super().__init__(*args, **kwargs)

        def forward_oot(self, query, key, value, cu_seqlens=None, max_seqlen=None):
            return torch.zeros_like(query)

    layer = MMEncoderAttention(2, 8, prefix="blocks.0.attn")
    assert type(layer) is AcmeAttention
    assert calls == [((2, 8), {"prefix": "blocks.0.attn"})]  # __init__ ran once, with the arguments given
    assert layer.num_heads == 2 and layer.prefix == "blocks.0.attn"
    q = torch.randn(1, 3, 16)
    assert torch.equal(layer(q, q, q), torch.zeros_like(q))
    assert type(AcmeAttention(2, 8)) is AcmeAttention  # constructing the plugin's class directly still works


def test_register_oot_by_registered_name(clean_oot):
    @CustomOp.register_oot(name="mm_encoder_attn")
    class ByOpName(MMEncoderAttention):
        pass

    assert type(MMEncoderAttention(2, 8)) is ByOpName


@pytest.mark.parametrize("called", [False, True], ids=["bare", "called"])
def test_register_oot_on_the_class_replaces_that_class(clean_oot, mmenc_caplog, called):
    """vLLM's semantics: `@MMEncoderAttention.register_oot` (no name) replaces MMEncoderAttention,
    whatever the plugin class is called; its subclasses stay themselves."""
    class TowerAttention(MMEncoderAttention):
        pass

    class AcmeAttention(MMEncoderAttention):
        pass

    decorate = MMEncoderAttention.register_oot() if called else MMEncoderAttention.register_oot
    assert decorate(AcmeAttention) is AcmeAttention
    assert type(MMEncoderAttention(2, 8)) is AcmeAttention
    assert type(TowerAttention(2, 8)) is TowerAttention
    assert "custom op MMEncoderAttention replaced by out-of-tree" in mmenc_caplog.text
    assert "AcmeAttention" in mmenc_caplog.text


def test_register_oot_on_a_subclass_replaces_only_the_subclass(clean_oot):
    class TowerAttention(MMEncoderAttention):
        pass

    @TowerAttention.register_oot
    class AcmeTowerAttention(TowerAttention):
        pass

    assert type(TowerAttention(2, 8)) is AcmeTowerAttention
    assert type(MMEncoderAttention(2, 8)) is MMEncoderAttention


def test_register_oot_on_customop_without_name_is_an_error(clean_oot):
    class AcmeAttention(MMEncoderAttention):
        pass

    with pytest.raises(ValueError, match=r"without name=.*@MMEncoderAttention.register_oot.*name='MMEncoderAttention'"):
        CustomOp.register_oot(AcmeAttention)
    assert "CustomOp" not in custom_op._OOT_REGISTRY
    assert type(MMEncoderAttention(2, 8)) is MMEncoderAttention


def test_register_oot_unrelated_class(clean_oot):
    inits = []

    @CustomOp.register_oot(name="MMEncoderAttention")
    class Standalone(nn.Module):
        def __init__(self, num_heads, head_size, **kwargs):
            super().__init__()
            inits.append((num_heads, head_size))

    layer = MMEncoderAttention(4, 16)
    assert type(layer) is Standalone and inits == [(4, 16)]


def test_register_oot_keeps_subclasses_of_the_replaced_op(clean_oot):
    class TowerAttention(MMEncoderAttention):  # inherits the registered name "mm_encoder_attn"
        pass

    @CustomOp.register_oot(name="MMEncoderAttention")
    class AcmeAttention(MMEncoderAttention):
        pass

    assert type(MMEncoderAttention(2, 8)) is AcmeAttention
    assert type(TowerAttention(2, 8)) is TowerAttention
    custom_op._OOT_REGISTRY.clear()
    CustomOp.register_oot(name="mm_encoder_attn")(AcmeAttention)
    assert type(MMEncoderAttention(2, 8)) is AcmeAttention
    assert type(TowerAttention(2, 8)) is TowerAttention


def test_registry_clean_after_oot_tests():
    assert type(MMEncoderAttention(2, 8)) is MMEncoderAttention
    assert "MMEncoderAttention" not in custom_op._OOT_REGISTRY


def test_unknown_platform_key_is_a_clear_error(op_cls, use_platform, fake_platform_cls):
    use_platform(fake_platform_cls("npu", name="acme")())
    with pytest.raises(ValueError, match=r"platform 'acme' has custom_op_key='npu'.*forward_npu"):
        op_cls()


def test_unknown_custom_op_name_is_reported(op_cls, use_platform, fake_platform_cls, mmenc_caplog):
    use_platform(fake_platform_cls("cuda")())
    op_cls(custom_ops=("all", "-mm_encoder_atn"))
    assert "custom_ops names ['mm_encoder_atn'], which no registered op has" in mmenc_caplog.text
