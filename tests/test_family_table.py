"""One row per family: the runtime's processors, the tests' transformers reference and the bench's
transformers tower all come from the family tables (ModelSpec rows, mmenc.preprocess.PROCESSORS,
mmenc.testing.checkpoints.FAMILIES), checked against each other here."""
import functools

import pytest

from mmenc.bench.hf_reference import hf_tower_available, hf_vision
from mmenc.models import registry
from mmenc.models.base import _processor_of_kind
from mmenc.preprocess import PROCESSORS
from mmenc.testing import checkpoints as ck


def _specs():
    return list({id(s): s for arch in registry.supported_architectures() for s in registry.model_specs(arch)}.values())


def test_every_family_names_a_processor_kind_of_the_one_table():
    from mmenc.models.kimi_vit import kimi_vl_processor  # the one family without an mmenc processor

    for spec in _specs():
        made = spec.processor_from_hf
        if made is kimi_vl_processor:
            continue
        assert isinstance(made, functools.partial) and made.func is _processor_of_kind, (
            f"{spec.tower_cls.__name__}: processor_from_hf should be processor_for(kind), got {made!r}")
        assert made.args[0] in PROCESSORS, f"{spec.tower_cls.__name__}: kind {made.args[0]!r} is not in PROCESSORS"


# the architectures `mmenc bench` runs transformers' own tower beside (its projected ones aside)
BENCHED = ["CLIPModel", "CLIPVisionModel", "CLIPVisionModelWithProjection", "GlmOcrForConditionalGeneration",
           "Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration", "Llama4ForConditionalGeneration",
           "Ovis2ForConditionalGeneration", "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
           "Qwen3OmniMoeForConditionalGeneration", "Qwen3VLForConditionalGeneration",
           "Qwen3VLMoeForConditionalGeneration", "Siglip2Model", "Siglip2VisionModel", "SiglipModel",
           "SiglipVisionModel"]


def test_bench_reference_comes_from_the_family_table():
    covered = sorted(a for a in registry.supported_architectures() if hf_vision(a) is not None)
    assert covered == sorted(BENCHED)
    assert hf_vision("Kimi_K25ForConditionalGeneration") is None
    assert "no transformers tower registered" in hf_tower_available("Kimi_K25ForConditionalGeneration")
    # PaliGemma / Gemma 3: no tower row of their own; bench runs tower + projector (mmenc/bench/hf_projected.py)
    for arch in ("PaliGemmaForConditionalGeneration", "Gemma3ForConditionalGeneration"):
        assert hf_vision(arch) is None and hf_tower_available(arch) is None
    # the LLaVA-style families: the whole VLM with a one-layer language model (mmenc/bench/hf_vlm.py)
    from mmenc.bench.hf_vlm import HF_VLMS

    for arch, family in HF_VLMS.items():
        assert arch in registry.supported_architectures()
        assert hf_tower_available(arch, (family.vision_model_types or (None,))[0]) is None, arch


@pytest.mark.parametrize("key", sorted(k for k, c in ck.FAMILIES.items() if c.hf_vision and c.hf_tower))
def test_bench_tower_class_is_the_tests_reference_tower(key, tmp_path):
    """The tower `mmenc bench` builds for a family comes from the transformers module the tower tests compare
    with (CLIP's tests hold the projection too: CLIPVisionModelWithProjection beside the bench's CLIPVisionModel)."""
    case = ck.FAMILIES[key]
    try:
        _, hf_model = case.save(tmp_path)
    except ImportError as e:
        pytest.skip(f"transformers lacks {key}: {e}")
    module = case.hf_vision.module
    assert type(case.hf_tower(hf_model)).__module__ == f"transformers.models.{module}.modeling_{module}"
    assert hf_tower_available(case.architecture or key) is None
