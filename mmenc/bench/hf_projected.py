"""transformers' reference for towers whose mmenc output includes the model's projector, for `mmenc bench`.

One table, HF_PROJECTED (architecture -> ProjectedFamily), two ways to build the reference, both
returning a callable (pixel_values, grid_thw) -> the embeddings the language model consumes
[tokens, width], as mmenc's tower returns them:

- from the VLM's config (Pixtral as Llava / Mistral3, InternVL, PaliGemma, Gemma 3): transformers' vision
  tower module plus its projector module, called as get_image_features calls them, on transformers' input
  layout: Pixtral takes one zero-padded batch of images with their image_sizes (block-diagonal attention
  mask), InternVL a batch of 448 px tiles, PaliGemma / Gemma 3 a batch of equal images; mmenc's patch rows are laid back out as those images inside
  the call (one copy of the pixels). A checkpoint folder's tower tensors are loaded into both modules.
- from the full model's modules (PaddleOCR-VL, ERNIE-4.5-VL, HunyuanOCR): the tower and projector
  modules of transformers' model, called as its get_image_features does. Built from the config.json
  dict's vision/text configs (no language model); with a checkpoint folder the full transformers
  model is loaded (`from_pretrained`, its weight renames applied) and its modules kept.

With load_format="dummy" transformers' random weights (made on the target device) are given to the
mmenc tower.

    hf = build_projected(loaded, "sdpa")   # loaded: a mmenc LoadedTower
    embeddings = hf(pixel_values, grid_thw)
"""
import dataclasses
import functools
import importlib
from collections.abc import Callable

import torch
import torch.nn as nn

from mmenc.testing.checkpoints import pixtral_images

Reference = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ProjectedFamily:
    """module: transformers.models.<module>; probe: a class of its modeling file the reference needs
    (absent: this transformers is too old); build: (loaded, attn_implementation) -> Reference."""

    module: str
    probe: str
    build: Callable[..., Reference]


# ---- from the VLM's config: vision tower + projector (Pixtral, InternVL) ----

class VLMTowerAndProjector:
    """(pixel_values [T, C*p*p] or [T, C, p, p], grid_thw [N, 3]) -> transformers' embeddings [tokens, out]."""

    def __init__(self, architecture: str, config, vision: nn.Module, projector: nn.Module, device):
        self.architecture, self.config, self.device = architecture, config, device
        self.vision, self.projector = vision, projector
        patch = config.vision_config.patch_size
        self.patch = patch[0] if isinstance(patch, (list, tuple)) else patch

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if self.architecture == "InternVLForConditionalGeneration":
            return self._internvl(*self._equal_frames(pixel_values, grid_thw, "InternVL"))
        if self.architecture in SIGLIP_VLMS:
            return self._siglip(*self._equal_frames(pixel_values, grid_thw, "PaliGemma / Gemma 3"))
        images, sizes = pixtral_images(pixel_values, grid_thw, self.patch)
        return self._pixtral(images, torch.tensor(sizes))  # sizes on the host, as the processor returns them

    @torch.inference_mode()
    def from_processor(self, out) -> torch.Tensor:
        """transformers' image processor output (--e2e): InternVL's tiles, PaliGemma / Gemma 3's images, or
        Pixtral's zero-padded batch with image_sizes -> the embeddings of every image, concatenated."""
        images = out["pixel_values"].to(self.device, next(self.vision.parameters()).dtype, non_blocking=True)
        h, w = images.shape[-2] // self.patch, images.shape[-1] // self.patch
        if self.architecture == "InternVLForConditionalGeneration":
            return self._internvl(images, h, w)
        if self.architecture in SIGLIP_VLMS:
            return self._siglip(images, h, w)
        return self._pixtral(images, torch.as_tensor(out["image_sizes"]))

    def _pixtral(self, images: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """Pixtral's zero-padded images [N, C, H, W] with their (height, width) through tower and projector."""
        feats = self.vision(images, image_sizes=sizes).last_hidden_state.squeeze(0)  # [T, D]
        if self.architecture == "Mistral3ForConditionalGeneration":
            return self.projector(feats, sizes)
        return self.projector(feats)

    def _equal_frames(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, what: str
                      ) -> tuple[torch.Tensor, int, int]:
        """mmenc's (C, p, p) rows of frames of one size -> (images [F, C, h*p, w*p], h, w)."""
        p = self.patch
        sizes = {(h, w) for _, h, w in grid_thw.tolist()}
        if len(sizes) != 1:
            raise ValueError(f"grid_thw has frames of sizes {sorted(sizes)}; transformers' {what} takes one batch of "
                             f"equal images (its processor's size), expected one (h, w)")
        (h, w), = sizes
        return pixel_values.reshape(-1, h, w, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(-1, 3, h * p, w * p), h, w

    def _siglip(self, images: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """PaliGemma / Gemma 3: SiglipVisionModel's last_hidden_state through the projector, as get_image_features."""
        side = self.config.vision_config.image_size // self.patch
        feats = self.vision(pixel_values=images, interpolate_pos_encoding=(h, w) != (side, side)).last_hidden_state
        out = self.projector(feats)
        return out.reshape(-1, out.shape[-1])

    def _internvl(self, tiles: torch.Tensor, h: int, w: int) -> torch.Tensor:
        from transformers.models.internvl.modeling_internvl import InternVLModel

        ratio = self.config.downsample_ratio
        feats = self.vision(pixel_values=tiles).last_hidden_state[:, 1:]  # CLS dropped
        feats = InternVLModel.pixel_shuffle(None, feats.reshape(feats.shape[0], h, w, -1), scale_factor=ratio)
        return self.projector(feats.reshape(-1, feats.shape[-1]))


def _from_vlm_config(loaded, attn_implementation: str, *, module: str, config_name: str, vision_name: str,
                     projector_name: str) -> VLMTowerAndProjector:
    import transformers

    architecture = next(a for a in loaded.hf_config.get("architectures", []) if a in HF_PROJECTED)
    top = {k: v for k, v in loaded.hf_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    if architecture == "InternVLForConditionalGeneration":
        top["text_config"] = {"model_type": "qwen2", **top.get("text_config", {})}
    config = getattr(transformers, config_name)(**top)
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    with torch.device(loaded.device):  # random init on the device (InternViT-6B: 5.7 B parameters)
        vision = getattr(transformers, vision_name)._from_config(config.vision_config,
                                                                 attn_implementation=attn_implementation,
                                                                 dtype=loaded.dtype)
        projector = getattr(modeling, projector_name)(config).to(loaded.dtype)
    vision, projector = vision.to(loaded.device).eval(), projector.to(loaded.device).eval()
    if loaded.load_format == "dummy":
        with torch.no_grad():
            loaded.tower.load_weights((n, t) for mod in (vision, projector) for n, t in mod.state_dict().items()
                                      if "inv_freq" not in n)
    else:
        from mmenc.loader import iter_tower_tensors

        tensors = dict(iter_tower_tensors(loaded.model, loaded.spec.weight_prefixes))
        for mod in (vision, projector):
            # SiglipVisionModel's names start "vision_model."; transformers 5 writes the tower without it
            state = {k: tensors.get(k, tensors.get(k.removeprefix("vision_model."))) for k in mod.state_dict()}
            missing, _ = mod.load_state_dict({k: v for k, v in state.items() if v is not None}, strict=False)
            missing = [m for m in missing if "inv_freq" not in m]
            if missing:
                raise ValueError(f"checkpoint {loaded.model!r} lacks transformers' {type(mod).__name__} tensors "
                                 f"{missing[:5]}")
    return VLMTowerAndProjector(architecture, config, vision, projector, loaded.device)


# ---- from the full model's modules (PaddleOCR-VL, ERNIE-4.5-VL, HunyuanOCR) ----

def _paddleocr(m: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    p = m.visual.config.patch_size
    pixel_values = pixel_values.reshape(1, pixel_values.shape[0], -1, p, p)  # get_image_features' layout
    return m.projector(m.visual(pixel_values=pixel_values, grid_thw=grid_thw).last_hidden_state, grid_thw)


def _ernie(m: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    return m.resampler_model(m.vision_tower(pixel_values, grid_thw).last_hidden_state, grid_thw)


def _hunyuan(m: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    return m.vision_tower(pixel_values, grid_thw=grid_thw).pooler_output[0]


class ModelParts(nn.Module):
    """The transformers modules as attributes (their in-model names) and the call of get_image_features;
    calling it runs under inference_mode with grid_thw on the modules' device."""

    def __init__(self, modules: dict[str, nn.Module], call: Callable, device):
        super().__init__()
        for name, module in modules.items():
            setattr(self, name, module)
        self._call, self._device = call, device

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self._call(self, pixel_values, grid_thw)

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return super().__call__(pixel_values, grid_thw.to(self._device))


def _from_model_parts(loaded, attn_implementation: str, *, module: str, model_cls: str,
                      parts: tuple[tuple[str, str, str], ...], call: Callable) -> ModelParts:
    """parts: (attribute in the model, class, built from the "vision" or the "full" config)."""
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    if loaded.load_format != "dummy":
        full = getattr(modeling, model_cls).from_pretrained(str(loaded.model), dtype=loaded.dtype,
                                                           attn_implementation=attn_implementation)
        modules = {name: getattr(full.model, name) for name, _, _ in parts}
        return ModelParts(modules, call, loaded.device).to(loaded.device).eval()
    configuration = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    config_cls = next(getattr(configuration, n) for n in dir(configuration)
                      if n.endswith("Config") and getattr(getattr(configuration, n), "model_type", None) == module)
    config = config_cls(vision_config=dict(loaded.hf_config["vision_config"]),
                        text_config=dict(loaded.hf_config.get("text_config") or {}))
    config.vision_config._attn_implementation = attn_implementation
    modules = {}
    with torch.device(loaded.device):  # random init on the device
        for name, cls_name, which in parts:
            cls = getattr(modeling, cls_name)
            if which == "vision":
                modules[name] = cls._from_config(config.vision_config, attn_implementation=attn_implementation,
                                                 dtype=loaded.dtype)
            else:
                modules[name] = cls(config).to(loaded.dtype)
    tower = ModelParts(modules, call, loaded.device).to(loaded.device).eval()
    prefixes = tuple(f"{name}." for name, _, _ in parts)
    with torch.no_grad():  # share transformers' random weights with the mmenc tower (names without the prefix)
        loaded.tower.load_weights((n.split(".", 1)[1] if n.startswith(prefixes) and len(parts) > 1 else
                                   n.removeprefix("vision_tower."), t)
                                  for n, t in tower.state_dict().items() if "inv_freq" not in n)
    return tower


def _vlm(module: str, config_name: str, vision_name: str, projector_name: str) -> ProjectedFamily:
    return ProjectedFamily(module, projector_name, functools.partial(
        _from_vlm_config, module=module, config_name=config_name, vision_name=vision_name,
        projector_name=projector_name))


def _parts(module: str, model_cls: str, parts: tuple[tuple[str, str, str], ...], call: Callable) -> ProjectedFamily:
    return ProjectedFamily(module, parts[0][1], functools.partial(
        _from_model_parts, module=module, model_cls=model_cls, parts=parts, call=call))


SIGLIP_VLMS = ("PaliGemmaForConditionalGeneration", "Gemma3ForConditionalGeneration")

HF_PROJECTED: dict[str, ProjectedFamily] = {
    "PaliGemmaForConditionalGeneration": _vlm("paligemma", "PaliGemmaConfig", "SiglipVisionModel",
                                              "PaliGemmaMultiModalProjector"),
    "Gemma3ForConditionalGeneration": _vlm("gemma3", "Gemma3Config", "SiglipVisionModel", "Gemma3MultiModalProjector"),
    "Mistral3ForConditionalGeneration": _vlm("mistral3", "Mistral3Config", "PixtralVisionModel",
                                             "Mistral3MultiModalProjector"),
    "LlavaForConditionalGeneration": _vlm("llava", "LlavaConfig", "PixtralVisionModel", "LlavaMultiModalProjector"),
    "InternVLForConditionalGeneration": _vlm("internvl", "InternVLConfig", "InternVLVisionModel",
                                             "InternVLMultiModalProjector"),
    "PaddleOCRVLForConditionalGeneration": _parts("paddleocr_vl", "PaddleOCRVLForConditionalGeneration", (
        ("visual", "PaddleOCRVisionModel", "vision"), ("projector", "PaddleOCRProjector", "full")), _paddleocr),
    "Ernie4_5_VLMoeForConditionalGeneration": _parts("ernie4_5_vl_moe", "Ernie4_5_VLMoeForConditionalGeneration", (
        ("vision_tower", "Ernie4_5_VLMoeVisionTransformerPretrainedModel", "vision"),
        ("resampler_model", "Ernie4_5_VLMoeVariableResolutionResamplerModel", "full")), _ernie),
    "HunYuanVLForConditionalGeneration": _parts("hunyuan_vl", "HunYuanVLForConditionalGeneration", (
        ("vision_tower", "HunYuanVLVisionTransformer", "vision"),), _hunyuan),
}


def build_projected(loaded, attn_implementation: str = "sdpa") -> Reference:
    """transformers' tower + projector for `loaded` (a mmenc LoadedTower), same dtype, device and weights."""
    architecture = next(a for a in loaded.hf_config.get("architectures", []) if a in HF_PROJECTED)
    return HF_PROJECTED[architecture].build(loaded, attn_implementation)
