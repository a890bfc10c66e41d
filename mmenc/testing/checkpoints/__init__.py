"""Tiny random-weight Hugging Face checkpoints written to a folder, for tests and benchmarks.

Each `save_*` builds the full transformers model (vision tower + a one-layer text model) from a
tiny config, seeds its weights, `save_pretrained`s it (real checkpoint naming, optional sharding)
and returns (folder, hf_model). `FAMILIES` is the one table of families that tests and benchmarks read:
per registered architecture, its saver, transformers' reference call, its pixel layout, its compile and
CUDA-graph grids and transformers' tower class for `mmenc bench` (HFVision). Nothing is
downloaded; transformers (a test extra) is imported inside the functions that need it.

    from mmenc.testing import checkpoints as ck
    case = ck.FAMILIES["Qwen2_5_VLForConditionalGeneration"]
    folder, hf_model = case.save(tmp_path)
    embeddings, deepstack = case.reference(hf_model, case.pixels(grid_thw), grid_thw)
"""
import dataclasses
import functools
import math
import pathlib
from collections.abc import Callable
from typing import Any

import torch

from mmenc.testing.compare import relative_error  # noqa: F401  (kept importable as ck.relative_error)
from mmenc.testing.checkpoints.base import (  # noqa: F401  (ck.<name> for tests and benchmarks)
    TINY_TEXT, _TINY_ROPE, _randomise_position_table, _save, _seeded, _unit_scale,
    random_pixels, rewrite_checkpoint)
from mmenc.testing.checkpoints.qwen import (  # noqa: F401  (ck.<name> for tests and benchmarks)
    TINY_DEEPSEEK_TEXT, TINY_GLM4V_VISION, TINY_KIMI_VISION, TINY_OMNI_AUDIO, TINY_QWEN2_5_VISION, TINY_QWEN2_VISION,
    TINY_QWEN3_VISION, hf_glm4v_outputs, hf_kimi_embeddings, hf_kimi_outputs, hf_omni_outputs, hf_omni_vision,
    hf_tower_output, hf_tower_outputs, hf_vision, save_glm4v, save_kimi_k25, save_qwen2_5_vl,
    save_qwen2_vl, save_qwen3_omni, save_qwen3_vl)
from mmenc.testing.checkpoints.ocr import (  # noqa: F401  (ck.<name> for tests and benchmarks)
    TINY_ERNIE_VISION, TINY_GLM_OCR_VISION, TINY_HUNYUAN_VISION, TINY_PADDLEOCR_VISION, hf_ernie_features, hf_hunyuan_features,
    hf_image_features, save_ernie4_5_vl, save_glm_ocr, save_hunyuan_vl, save_paddleocr_vl)
from mmenc.testing.checkpoints.tiles import (  # noqa: F401  (ck.<name> for tests and benchmarks)
    TINY_LLAMA4_TEXT, TINY_LLAMA4_VISION, TINY_OVIS2_VISION, hf_llama4_outputs, hf_ovis2_outputs, save_llama4,
    save_ovis2, square_tiles)
from mmenc.testing.checkpoints.siglip import (  # noqa: F401  (ck.<name> for tests and benchmarks)
    TINY_SIGLIP2_VISION, TINY_SIGLIP_TEXT, TINY_SIGLIP_VISION, hf_siglip2_batch, hf_siglip2_outputs, hf_siglip_outputs,
    save_siglip, siglip_frames, siglip_vision)
from mmenc.testing.checkpoints.clip import (  # noqa: F401  (ck.<name> for tests and benchmarks)
    TINY_CLIP_TEXT, TINY_CLIP_VISION, TINY_LLAVA_SIGLIP_VISION, clip_vision, frame_images, hf_clip_outputs,
    hf_clip_pooled, hf_llava_outputs, save_clip, save_llava, save_tiny_tokenizer, TINY_NEXT_PINPOINTS,
    TINY_ONEVISION_PINPOINTS, anyres_grid, hf_anyres_outputs, save_llava_anyres, TINY_IDEFICS3_VISION,
    hf_idefics3_outputs, save_idefics3, hf_vipllava_outputs, save_vipllava, hf_aya_outputs, save_aya_vision)
from mmenc.testing.checkpoints.gemma import (  # noqa: F401  (ck.<name> for tests and benchmarks)
    TINY_GEMMA3_VISION, TINY_PALIGEMMA_VISION, hf_gemma_vlm_outputs, save_gemma_vlm)
from mmenc.testing.checkpoints.pixtral import (  # noqa: F401  (ck.<name> for tests and benchmarks)
    TINY_INTERNVL_VISION, TINY_MISTRAL_TEXT, TINY_PIXTRAL_VISION, hf_internvl_outputs, hf_pixtral_outputs, pixtral_images,
    save_internvl, save_pixtral)


@dataclasses.dataclass(frozen=True)
class HFVision:
    """transformers' own vision tower of a family at any size, built from a config.json's vision_config:
    transformers.models.<module>'s `tower` class over its `config` class (what `mmenc bench` runs beside
    mmenc, mmenc.bench.hf_reference). `architectures`: the checkpoint architectures it stands for (empty:
    the row's own)."""

    module: str
    tower: str
    config: str
    architectures: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class FamilyCase:
    """What the generic tower tests need to know about one checkpoint architecture.

    save: (folder) -> (folder, transformers model), a tiny random checkpoint written there.
    reference: (hf_model, pixel_values, grid_thw) -> (embeddings [tokens, out_hidden], extra feature
        list, e.g. Qwen3-VL's deepstack [tokens, out_hidden] each, or []) from transformers.
    patch_shape: one row of pixel_values as the model's processor gives it, e.g. (1176,) or (3, 14, 14).
    aliases: architectures served by the same tower that transformers cannot write (built-ins only).
    builtin_prefix: every built-in name of this row's architectures starts with it.
    hf_tower: hf_model -> the transformers module holding exactly the parameters of mmenc's tower
        (built again at the built-ins' sizes on the meta device to compare parameter counts),
        or None where no transformers module does (MoonViT: tower and projector live apart).
    grid: the grid_thw rows the generic tests run (None: their mixed-size GRID); fixed-size towers
        give rows of their tile size, e.g. Llama 4's (tiles, s, s).
    meta_grid: grid_thw rows for the built-in sizes on the meta device (None: [[1, 4, 4], [1, 4, 6]]).
    architecture: the checkpoint architecture when the row's key is not one (several rows of one
        architecture, one per vision tower: "LlavaForConditionalGeneration+clip").
    vision_model_type: the built-ins this row covers have this vision_config.model_type (None: any).
    output_width: config.json dict -> the tower's output width (None: the language model's width;
        image-embedding towers such as CLIP give the vision width).
    hf_vision: transformers' tower class for the benchmarks' side-by-side runs (None: none, or the
        projected reference of mmenc.bench.hf_projected).
    compile_grids: (mixed, dense) grid_thw rows the compile and CUDA-graph tests run: a mixed packing and
        a dense batch of equal frames (the [B, S] path of fixed-size towers and of SigLIP); None:
        DEFAULT_COMPILE_GRIDS.
    """

    save: Callable[..., tuple[pathlib.Path, Any]]
    reference: Callable[[Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, list]]
    patch_shape: tuple[int, ...]
    builtin_prefix: str
    aliases: tuple[str, ...] = ()
    hf_tower: Callable[[Any], Any] | None = hf_vision
    grid: tuple[tuple[int, int, int], ...] | None = None
    meta_grid: tuple[tuple[int, int, int], ...] | None = None
    architecture: str | None = None
    vision_model_type: str | None = None
    output_width: Callable[[dict], int] | None = None
    compile_grids: tuple[list[list[int]], list[list[int]]] | None = None
    hf_vision: HFVision | None = None

    @property
    def patch_features(self) -> int:
        return math.prod(self.patch_shape)

    @property
    def grids_to_compile(self) -> tuple[list[list[int]], list[list[int]]]:
        return self.compile_grids or DEFAULT_COMPILE_GRIDS

    def pixels(self, grid_thw: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """Random pixel_values [sum(t*h*w), *patch_shape] float32 for grid_thw."""
        return random_pixels(grid_thw, self.patch_features, seed=seed).view(-1, *self.patch_shape)


def hf_tower_parameters(case: FamilyCase, hf_model, hf_config: dict) -> int:
    """Parameters of transformers' tower (case.hf_tower's class) built on the meta device from
    `hf_config`'s vision_config (a full config.json dict, e.g. a built-in one)."""
    from mmenc.models.base import vision_config_dict

    tower = case.hf_tower(hf_model)
    tower_cls = type(tower)
    vision_config = type(tower.config)(**vision_config_dict(hf_config))
    with torch.device("meta"):
        return sum(p.numel() for p in tower_cls(vision_config).parameters())


_QWEN_PIXELS = (3 * 2 * 14 * 14,)

# the compile and CUDA-graph tests' (mixed, dense) grids of a row without its own compile_grids
DEFAULT_COMPILE_GRIDS = ([[1, 8, 12], [1, 4, 4]], [[1, 12, 8]])

# The CLIP lineage (issue 31): CLIP itself and the LLaVA families over CLIP / SigLIP towers.
CLIP_FAMILIES: dict[str, FamilyCase] = {
    "CLIPModel": FamilyCase(save_clip, hf_clip_outputs, (3 * 8 * 8,), "openai/clip-vit-",
                            aliases=("CLIPVisionModel", "CLIPVisionModelWithProjection"), hf_tower=clip_vision,
                            output_width=lambda config: config["vision_config"]["hidden_size"],
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[1, 6, 6], [1, 6, 6]]),
        hf_vision=HFVision("clip", "CLIPVisionModel", "CLIPVisionConfig",
                           ("CLIPModel", "CLIPVisionModel", "CLIPVisionModelWithProjection"))),
    "LlavaForConditionalGeneration+clip": FamilyCase(
        save_llava, hf_llava_outputs, (3 * 8 * 8,), "llava-hf/llava-1.5-", hf_tower=None,
        architecture="LlavaForConditionalGeneration", vision_model_type="clip_vision_model",
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[1, 6, 6], [1, 6, 6]])),
    # vision_feature_layer as a list (concatenated) and the "full" strategy, under SigLIP
    "LlavaForConditionalGeneration+siglip": FamilyCase(
        functools.partial(save_llava, tower="siglip", feature_layer=[-3, -1], strategy="full"), hf_llava_outputs,
        (3 * 8 * 8,), "llava-hf/llava-interleave-", hf_tower=None, architecture="LlavaForConditionalGeneration",
        vision_model_type="siglip_vision_model",
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[1, 6, 6], [1, 6, 6]])),
    "VipLlavaForConditionalGeneration": FamilyCase(save_vipllava, hf_vipllava_outputs, (3 * 8 * 8,),
                                                   "llava-hf/vip-llava-", hf_tower=None,
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[1, 6, 6], [1, 6, 6]])),
    # anyres: base + canvas tiles per image; canvases 1x2, 2x2, 3x1 (cut rows / columns) in one call
    "LlavaNextForConditionalGeneration": FamilyCase(
        save_llava_anyres, hf_anyres_outputs, (3 * 8 * 8,), "llava-hf/llava-v1.6-", hf_tower=None,
        grid=anyres_grid([(40, 90), (100, 100), (150, 30), (47, 47)], TINY_NEXT_PINPOINTS),
        meta_grid=anyres_grid([(672, 672), (336, 700)], [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
                              336, 24),
        compile_grids=([[3, 6, 6, 40, 90], [5, 6, 6, 100, 100]], [[4, 6, 6, 150, 30]])),
    # OneVision: a 2x2 canvas shrunk bilinearly (anyres_max_1), 1x1 and 1x3 ones kept, SigLIP tower
    "LlavaOnevisionForConditionalGeneration": FamilyCase(
        functools.partial(save_llava_anyres, onevision=True), hf_anyres_outputs, (3 * 8 * 8,),
        "llava-hf/llava-onevision-", hf_tower=None,
        grid=anyres_grid([(90, 100), (30, 40), (40, 130), (100, 50)], TINY_ONEVISION_PINPOINTS),
        meta_grid=anyres_grid([(1000, 700), (384, 768)], [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)],
                              384, 27),
        compile_grids=([[7, 6, 6, 90, 100], [2, 6, 6, 30, 40]], [[4, 6, 6, 40, 130]])),
    # square tiles (its pixel shuffle, as transformers', needs them); a 4x4 tile resamples the 6x6 table
    "AyaVisionForConditionalGeneration": FamilyCase(save_aya_vision, hf_aya_outputs, (3 * 8 * 8,), "CohereLabs/aya-",
                                                    hf_tower=None, grid=((3, 6, 6), (1, 4, 4), (2, 6, 6), (1, 6, 6)),
                                                    meta_grid=((3, 26, 26), (1, 26, 26)),
        compile_grids=([[3, 6, 6], [1, 4, 4]], [[2, 6, 6]])),
    # square tiles (the processor's): several per image, two sizes in one call (packed), bucketed positions
    "Idefics3ForConditionalGeneration": FamilyCase(
        save_idefics3, hf_idefics3_outputs, (3 * 8 * 8,), "HuggingFace", hf_tower=None,
        grid=((3, 6, 6), (1, 4, 4), (5, 6, 6), (1, 6, 6)), meta_grid=((5, 32, 32), (1, 32, 32)),
        compile_grids=([[3, 6, 6], [1, 4, 4]], [[5, 6, 6]])),
    "SmolVLMForConditionalGeneration": FamilyCase(
        functools.partial(save_idefics3, smolvlm=True), hf_idefics3_outputs, (3 * 8 * 8,), "HuggingFaceTB/SmolVLM",
        hf_tower=None, grid=((2, 6, 6), (1, 4, 4), (1, 6, 6), (3, 4, 4)), meta_grid=((5, 32, 32), (1, 32, 32)),
        compile_grids=([[2, 6, 6], [1, 4, 4]], [[3, 6, 6]])),
}
FAMILIES: dict[str, FamilyCase] = {
    "Qwen2VLForConditionalGeneration": FamilyCase(save_qwen2_vl, hf_tower_outputs, _QWEN_PIXELS, "Qwen/Qwen2-VL-",
        hf_vision=HFVision("qwen2_vl", "Qwen2VisionTransformerPretrainedModel", "Qwen2VLVisionConfig")),
    "Qwen2_5_VLForConditionalGeneration": FamilyCase(save_qwen2_5_vl, hf_tower_outputs, _QWEN_PIXELS,
                                                     "Qwen/Qwen2.5-VL-",
        hf_vision=HFVision("qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel", "Qwen2_5_VLVisionConfig")),
    "Qwen3VLForConditionalGeneration": FamilyCase(save_qwen3_vl, hf_tower_outputs, (3 * 2 * 16 * 16,),
                                                  "Qwen/Qwen3-VL-",
        hf_vision=HFVision("qwen3_vl", "Qwen3VLVisionModel", "Qwen3VLVisionConfig")),
    "Qwen3VLMoeForConditionalGeneration": FamilyCase(functools.partial(save_qwen3_vl, moe=True), hf_tower_outputs,
                                                     (3 * 2 * 16 * 16,), "Qwen/Qwen3-VL-",
        hf_vision=HFVision("qwen3_vl_moe", "Qwen3VLMoeVisionModel", "Qwen3VLMoeVisionConfig")),
    "Glm4vForConditionalGeneration": FamilyCase(save_glm4v, hf_glm4v_outputs, _QWEN_PIXELS, "zai-org/GLM-4",
        hf_vision=HFVision("glm4v", "Glm4vVisionModel", "Glm4vVisionConfig")),
    # qkv bias on here, so that path loads and runs too
    "Glm4vMoeForConditionalGeneration": FamilyCase(functools.partial(save_glm4v, moe=True,
                                                                     vision=dict(attention_bias=True)),
                                                   hf_glm4v_outputs, _QWEN_PIXELS, "zai-org/GLM-4",
        hf_vision=HFVision("glm4v_moe", "Glm4vMoeVisionModel", "Glm4vMoeVisionConfig")),
    "GlmOcrForConditionalGeneration": FamilyCase(save_glm_ocr, hf_tower_outputs, _QWEN_PIXELS, "zai-org/GLM-OCR",
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[1, 4, 4], [1, 4, 4]]),
        hf_vision=HFVision("glm_ocr", "GlmOcrVisionModel", "GlmOcrVisionConfig")),
    "PaddleOCRVLForConditionalGeneration": FamilyCase(save_paddleocr_vl, hf_image_features, (3, 14, 14),
                                                      "PaddlePaddle/PaddleOCR-VL", hf_tower=None,
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[1, 4, 4], [1, 4, 4]])),
    "Ernie4_5_VLMoeForConditionalGeneration": FamilyCase(
        save_ernie4_5_vl, hf_ernie_features, (3 * 14 * 14,), "baidu/ERNIE-4.5-VL-",
        aliases=("Ernie4_5_VL_MoeForConditionalGeneration",), hf_tower=None,
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[1, 4, 4], [1, 4, 4]])),
    "HunYuanVLForConditionalGeneration": FamilyCase(save_hunyuan_vl, hf_hunyuan_features, (3 * 16 * 16,),
                                                    "tencent/HunyuanOCR", hf_tower=None,
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[1, 4, 4], [1, 4, 4]])),
    "Qwen3OmniMoeForConditionalGeneration": FamilyCase(save_qwen3_omni, hf_omni_outputs, (3 * 2 * 16 * 16,),
                                                       "Qwen/Qwen3-Omni-", hf_tower=hf_omni_vision,
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[1, 4, 4], [1, 4, 4]]),
        hf_vision=HFVision("qwen3_omni_moe", "Qwen3OmniMoeVisionEncoder", "Qwen3OmniMoeVisionEncoderConfig")),
    "Llama4ForConditionalGeneration": FamilyCase(save_llama4, hf_llama4_outputs, (3, 14, 14), "meta-llama/Llama-4-",
                                                 hf_tower=None, grid=((1, 4, 4), (3, 4, 4), (2, 4, 4), (1, 4, 4)),
                                                 meta_grid=((1, 24, 24), (2, 24, 24)),
        compile_grids=([[3, 4, 4], [1, 4, 4]], [[2, 4, 4], [2, 4, 4]]),
        hf_vision=HFVision("llama4", "Llama4VisionModel", "Llama4VisionConfig")),
    "Ovis2ForConditionalGeneration": FamilyCase(save_ovis2, hf_ovis2_outputs, (3, 14, 14), "thisisiron/Ovis2-",
                                                hf_tower=None,  # ours also holds the visual embedding table
                                                grid=((2, 4, 4), (1, 4, 4), (3, 4, 4), (1, 4, 4)),
                                                meta_grid=((1, 32, 32), (3, 32, 32)),
        compile_grids=([[2, 4, 4], [1, 4, 4]], [[1, 4, 4], [1, 4, 4]]),
        hf_vision=HFVision("ovis2", "Ovis2VisionModel", "Ovis2VisionConfig")),
    "Kimi_K25ForConditionalGeneration": FamilyCase(save_kimi_k25, hf_kimi_outputs, (3, 14, 14), "moonshotai/Kimi-",
                                                   aliases=("KimiK25ForConditionalGeneration",
                                                            "KimiVLForConditionalGeneration"), hf_tower=None),
    "SiglipModel": FamilyCase(save_siglip, hf_siglip_outputs, (3 * 8 * 8,), "google/siglip-",
                              aliases=("SiglipVisionModel",), hf_tower=siglip_vision,
        compile_grids=([[1, 6, 6], [1, 4, 4]], [[1, 6, 6], [1, 6, 6]]),
        hf_vision=HFVision("siglip", "SiglipVisionModel", "SiglipVisionConfig", ("SiglipModel", "SiglipVisionModel"))),
    "Siglip2Model": FamilyCase(functools.partial(save_siglip, version=2), hf_siglip2_outputs, (4 * 4 * 3,),
                               "google/siglip2-", aliases=("Siglip2VisionModel",), hf_tower=siglip_vision,
        compile_grids=([[1, 4, 6], [1, 6, 4], [1, 2, 2]], [[1, 4, 4], [1, 4, 4]]),
        hf_vision=HFVision("siglip2", "Siglip2VisionModel", "Siglip2VisionConfig",
                           ("Siglip2Model", "Siglip2VisionModel"))),
    # PaliGemma: any frame size (the table resampled), a linear per token
    "PaliGemmaForConditionalGeneration": FamilyCase(
        save_gemma_vlm, hf_gemma_vlm_outputs, (3 * 8 * 8,), "google/paligemma", hf_tower=None,
        output_width=lambda config: config.get("projection_dim", 2048),
        compile_grids=([[1, 6, 6], [1, 4, 4]], [[1, 6, 6], [1, 6, 6]])),
    # Gemma 3: frames at the trained 4x4 patches only, pooled 2x2
    "Gemma3ForConditionalGeneration": FamilyCase(
        functools.partial(save_gemma_vlm, gemma3=True), hf_gemma_vlm_outputs, (3 * 8 * 8,), "google/gemma-3-",
        hf_tower=None, grid=((1, 4, 4), (3, 4, 4), (2, 4, 4), (1, 4, 4)), meta_grid=((1, 64, 64), (2, 64, 64)),
        compile_grids=([[3, 4, 4], [1, 4, 4]], [[2, 4, 4]])),
    "Mistral3ForConditionalGeneration": FamilyCase(save_pixtral, hf_pixtral_outputs, (3, 14, 14),
                                                   "mistralai/Mistral-Small-", hf_tower=None),
    "LlavaForConditionalGeneration": FamilyCase(functools.partial(save_pixtral, llava=True,
                                                                  vision=dict(patch_size=16, image_size=16 * 16)),
                                                hf_pixtral_outputs, (3, 16, 16), "mistralai/Pixtral-", hf_tower=None,
                                                vision_model_type="pixtral",
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[1, 4, 4], [1, 4, 4]])),
    "InternVLForConditionalGeneration": FamilyCase(save_internvl, hf_internvl_outputs, (3, 14, 14), "OpenGVLab/InternVL",
                                                   hf_tower=None,
        compile_grids=([[1, 8, 12], [1, 4, 4]], [[3, 4, 4], [1, 4, 4]])),
    **CLIP_FAMILIES,
}
