"""The MultiModalConfig build context (mmenc.config.use_multimodal_config): towers and blocks take no
config; build_tower builds under one and MMEncoderAttention reads it when it is given none."""
import inspect
import pathlib

import pytest
import torch

from mmenc.attention import MMEncoderAttention
from mmenc.backends import AttentionBackendEnum as B
from mmenc.config import MultiModalConfig, current_multimodal_config, use_multimodal_config
from mmenc.engine.tower import build_tower
from mmenc.models.registry import builtin_model_names, get_builtin_config

MMENC = pathlib.Path(__file__).resolve().parents[1] / "mmenc"
NAIVE = MultiModalConfig(mm_encoder_attn_backend="NAIVE")
SDPA = MultiModalConfig(mm_encoder_attn_backend="TORCH_SDPA")
# one checkpoint per block kind: VisionBlock (Qwen2-VL), ViTEncoder (SigLIP, CLIP), the GLM blocks
MODELS = ("Qwen/Qwen2-VL-2B-Instruct", "google/siglip-base-patch16-224", "openai/clip-vit-base-patch16",
          "zai-org/GLM-4.1V-9B-Thinking")


def attention_layers(module: torch.nn.Module) -> list[MMEncoderAttention]:
    return [m for m in module.modules() if isinstance(m, MMEncoderAttention)]


def test_default_outside_any_context():
    assert current_multimodal_config() == MultiModalConfig()


def test_sets_nests_and_restores():
    with use_multimodal_config(NAIVE) as entered:
        assert entered is NAIVE and current_multimodal_config() is NAIVE
        with use_multimodal_config(SDPA):
            assert current_multimodal_config() is SDPA
        assert current_multimodal_config() is NAIVE
    assert current_multimodal_config() == MultiModalConfig()


def test_restores_on_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with use_multimodal_config(NAIVE):
            with use_multimodal_config(SDPA):
                raise RuntimeError("boom")
    assert current_multimodal_config() == MultiModalConfig()


def test_rejects_what_is_not_a_config():
    with pytest.raises(TypeError, match="expects a MultiModalConfig, got dict"):
        with use_multimodal_config({"mm_encoder_attn_backend": "NAIVE"}):
            pass
    assert current_multimodal_config() == MultiModalConfig()


def test_layer_reads_the_context_and_an_explicit_config_wins():
    assert MMEncoderAttention(2, 8, device="cpu").backend is B.TORCH_SDPA
    with use_multimodal_config(NAIVE):
        assert MMEncoderAttention(2, 8, device="cpu").backend is B.NAIVE
        assert MMEncoderAttention(2, 8, device="cpu", multimodal_config=SDPA).backend is B.TORCH_SDPA
    with use_multimodal_config(MultiModalConfig(custom_ops=("none",))):
        assert MMEncoderAttention(2, 8, device="cpu")._forward_method.__name__ == "forward_native"
    with use_multimodal_config(MultiModalConfig(batch_invariant=True)):
        assert MMEncoderAttention(2, 8, device="cpu").choice.batch_invariant
    layer = MMEncoderAttention(2, 8, device="cpu")  # built after the blocks: the default again
    assert layer.backend is B.TORCH_SDPA and not layer.choice.batch_invariant


@pytest.mark.parametrize("model", MODELS)
def test_build_tower_gives_every_attention_layer_the_forced_backend(model):
    loaded = build_tower(model, load_format="dummy", device="meta", multimodal_config=NAIVE)
    layers = attention_layers(loaded.tower)
    assert len(layers) == loaded.config.depth  # one per block
    assert {layer.backend for layer in layers} == {B.NAIVE}
    assert current_multimodal_config() == MultiModalConfig()  # build_tower left no context behind
    with use_multimodal_config(NAIVE):  # no config given: build_tower builds under the caller's
        assert {layer.backend for layer in attention_layers(build_tower(model, load_format="dummy",
                                                                        device="meta").tower)} == {B.NAIVE}
        explicit = build_tower(model, load_format="dummy", device="meta", multimodal_config=SDPA)
        assert {layer.backend for layer in attention_layers(explicit.tower)} == {B.TORCH_SDPA}


def test_tower_built_directly_under_the_context():
    spec, hf_config = get_builtin_config("Qwen/Qwen2-VL-2B-Instruct")
    config = spec.config_from_hf(hf_config)
    with use_multimodal_config(NAIVE):
        tower = spec.tower_cls(config, device="meta")
    assert {layer.backend for layer in attention_layers(tower)} == {B.NAIVE}
    assert not hasattr(tower, "multimodal_config")


def test_no_tower_takes_a_config():
    classes = {get_builtin_config(name)[0].tower_cls for name in builtin_model_names()}
    for cls in classes:
        assert "multimodal_config" not in inspect.signature(cls).parameters, cls.__name__


def test_models_and_layers_do_not_mention_multimodal_config():
    found = [f"{path.relative_to(MMENC.parent)}:{number}: {line.strip()}"
             for folder in ("models", "layers") for path in sorted((MMENC / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if "multimodal_config" in line]
    assert not found, ("towers and blocks take no MultiModalConfig; the layers that need it read "
                       "mmenc.config.current_multimodal_config() while built. Found:\n" + "\n".join(found))
