"""transformers' reference for the LLaVA-style families, for `mmenc bench`: the whole transformers VLM with its
language model cut to one layer, called through its own `get_image_features`.

These families (LLaVA-1.5 over CLIP or SigLIP, VipLLaVA, LLaVA-NeXT, LLaVA-OneVision, Aya Vision, Idefics3,
SmolVLM) have no vision module in transformers that holds the projector, the feature-layer choice and the
newline/unpadding logic: all of it lives on the VLM's model. So the reference builds the VLM class named by
config.json from its config, with `text_config.num_hidden_layers = 1` (the language model's weights are never
used; one layer, and with random weights a 1,024-word vocabulary, keep the memory small), and calls
`model.model.get_image_features` batched as transformers' processor output would be:

- frames (LLaVA, VipLLaVA, Aya Vision): one call per frame size, the frames of that size stacked;
- anyres (LLaVA-NeXT, OneVision): one call, every image's tiles zero-padded to the most tiles, with image_sizes;
- tiles (Idefics3, SmolVLM): one call per tile layout, the images of that layout stacked.

Results are put back in image order, concatenated: [tokens, text hidden] as mmenc's tower returns them. With a
checkpoint folder `from_pretrained` reads it (the language model's other layers are skipped); with
load_format="dummy" transformers' random weights are given to the mmenc tower.

    hf = build_vlm(loaded, "sdpa")   # loaded: a mmenc LoadedTower
    embeddings = hf(pixel_values, grid_thw)
"""
import copy
import dataclasses
from collections.abc import Callable

import torch

from mmenc.testing.checkpoints.clip import frame_images

# one get_image_features call: (the indices of its images or frames in the input, its tensor keywords)
Calls = list[tuple[list[int], dict[str, torch.Tensor]]]


@dataclasses.dataclass(frozen=True)
class VLMFamily:
    """module: transformers.models.<module> (its modeling file must exist); calls: (model, pixel_values,
    grid_thw) -> the get_image_features calls for mmenc's rows; options: (config) -> that call's other keywords;
    vision_model_types: the vision towers the row covers (empty: any)."""

    module: str
    calls: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], Calls]
    options: Callable[..., dict]
    vision_model_types: tuple[str, ...] = ()


def _groups(items: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """Input indices by tensor shape (the items one stacked call can take)."""
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(tuple(item.shape), []).append(i)
    return groups


def _tiles(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    """Each grid row's (t, h, w) patch rows as t tiles [t, C, h*p, w*p]."""
    p = model.config.vision_config.patch_size
    rows, out = pixel_values.reshape(pixel_values.shape[0], -1, p, p), []
    for image, (t, h, w) in zip(rows.split(grid_thw[:, :3].prod(-1).tolist()), grid_thw[:, :3].tolist()):
        out.append(image.view(t, h, w, -1, p, p).permute(0, 3, 1, 4, 2, 5).reshape(t, -1, h * p, w * p))
    return out


def _frame_calls(model, pixel_values, grid_thw) -> Calls:
    """LLaVA, VipLLaVA, Aya Vision: the frames of one size stacked into [B, C, H, W] per call."""
    frames = frame_images(pixel_values, grid_thw, model.config.vision_config.patch_size)
    return [(idx, {"pixel_values": torch.cat([frames[i] for i in idx])}) for idx in _groups(frames).values()]


def _anyres_calls(model, pixel_values, grid_thw) -> Calls:
    """LLaVA-NeXT, OneVision: one call, every image's tiles zero-padded to the most tiles, image_sizes beside."""
    tiles = _tiles(model, pixel_values, grid_thw)
    most = max(t.shape[0] for t in tiles)
    batch = torch.stack([torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 0, 0, most - t.shape[0])) for t in tiles])
    return [(list(range(len(tiles))), {"pixel_values": batch, "image_sizes": grid_thw[:, 3:5]})]


def _tile_calls(model, pixel_values, grid_thw) -> Calls:
    """Idefics3, SmolVLM: the images of one tile layout stacked into [B, tiles, C, h*p, w*p] per call."""
    tiles = _tiles(model, pixel_values, grid_thw)
    return [(idx, {"pixel_values": torch.stack([tiles[i] for i in idx])}) for idx in _groups(tiles).values()]


def _llava(config) -> dict:
    return {"vision_feature_layer": config.vision_feature_layer, "interpolate_pos_encoding": True,
            "vision_feature_select_strategy": config.vision_feature_select_strategy}


def _aya(config) -> dict:  # Aya's tiles keep every token
    return {"vision_feature_layer": config.vision_feature_layer, "interpolate_pos_encoding": True,
            "vision_feature_select_strategy": "full"}


def _anyres(config) -> dict:
    extra = {"vision_aspect_ratio": config.vision_aspect_ratio} if hasattr(config, "vision_aspect_ratio") else {}
    return {"vision_feature_layer": config.vision_feature_layer,
            "vision_feature_select_strategy": config.vision_feature_select_strategy, **extra}


LLAVA_TOWERS = ("clip_vision_model", "siglip_vision_model")  # LLaVA over Pixtral: hf_projected.py

HF_VLMS: dict[str, VLMFamily] = {
    "LlavaForConditionalGeneration": VLMFamily("llava", _frame_calls, _llava, LLAVA_TOWERS),
    "VipLlavaForConditionalGeneration": VLMFamily("vipllava", _frame_calls,
                                                  lambda c: {"interpolate_pos_encoding": True}),
    "LlavaNextForConditionalGeneration": VLMFamily("llava_next", _anyres_calls, _anyres),
    "LlavaOnevisionForConditionalGeneration": VLMFamily("llava_onevision", _anyres_calls, _anyres),
    "AyaVisionForConditionalGeneration": VLMFamily("aya_vision", _frame_calls, _aya),
    "Idefics3ForConditionalGeneration": VLMFamily("idefics3", _tile_calls, lambda c: {}),
    "SmolVLMForConditionalGeneration": VLMFamily("smolvlm", _tile_calls, lambda c: {}),
}

DUMMY_VOCAB = 1024  # the language model's vocabulary with random weights (get_image_features never reads it)

# what transformers' image processors of these families answer that get_image_features takes
PROCESSOR_KEYS = ("pixel_values", "image_sizes", "pixel_attention_mask")


def vlm_family(architecture: str, vision_model_type: str | None) -> VLMFamily | None:
    """HF_VLMS' row for this architecture and vision tower, or None."""
    family = HF_VLMS.get(architecture)
    if family is None or (family.vision_model_types and vision_model_type not in family.vision_model_types):
        return None
    return family


def _per_image(pooled, images: int) -> list[torch.Tensor]:
    """get_image_features' pooler_output as `images` tensors [tokens, hidden]: a list or tuple of them, a
    [images, tokens, hidden] tensor, or (Idefics3 on older transformers) [images * tiles, tokens, hidden]."""
    if isinstance(pooled, (list, tuple)):
        return [f.reshape(-1, f.shape[-1]) for f in pooled]
    return list(pooled.reshape(images, -1, pooled.shape[-1]).unbind(0))


class VLMReference:
    """Called as (pixel_values, grid_thw) -> transformers' embeddings [tokens, text hidden], image order;
    `from_processor(out)` runs get_image_features on what transformers' image processor answered (--e2e)."""

    needs_image_sizes: bool  # anyres: rows without the image size (a TxHxW workload) cannot be laid out

    def __init__(self, model: torch.nn.Module, family: VLMFamily, device: torch.device):
        self.module, self.family, self.device = model, family, device
        self.options = family.options(model.config)
        self.needs_image_sizes = family.calls is _anyres_calls
        self._image_features = model.model.get_image_features

    def compiled(self) -> "VLMReference":
        """The same model and weights, get_image_features under torch.compile (`mmenc bench --hf-compile`)."""
        peer = copy.copy(self)
        peer._image_features = torch.compile(self.module.model.get_image_features)
        return peer

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid_thw = grid_thw.cpu()
        if self.needs_image_sizes and grid_thw.shape[-1] != 5:
            raise ValueError(f"transformers' {type(self.module).__name__} needs each image's size: grid_thw rows "
                             f"(tiles, s, s, H, W), not {tuple(grid_thw.shape)}; run `mmenc bench --e2e` (files "
                             f"through the processor) for this family")
        calls = self.family.calls(self.module, pixel_values, grid_thw)
        out: list = [None] * sum(len(indices) for indices, _ in calls)  # frames, or images
        for indices, inputs in calls:
            features = self._image_features(**inputs, **self.options).pooler_output
            for i, feature in zip(indices, _per_image(features, len(indices))):
                out[i] = feature
        return torch.cat(out)

    @torch.inference_mode()
    def from_processor(self, out) -> torch.Tensor:
        """transformers' image processor output (a BatchFeature) -> the embeddings of every image, concatenated."""
        dtype = next(self.module.parameters()).dtype
        inputs = {key: out[key].to(self.device, non_blocking=True) for key in PROCESSOR_KEYS if key in out}
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        pooled = self._image_features(**inputs, **self.options).pooler_output
        return torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled.reshape(-1, pooled.shape[-1])


def _one_layer(config, vocab: int | None = None):
    """The VLM config with its language model cut to one layer (and per-layer lists cut with it), and with
    `vocab` its vocabulary cut too (random weights only: a checkpoint's embedding table has its own size)."""
    text = config.text_config
    text.num_hidden_layers = 1
    if vocab is not None:  # a 72B OneVision's 152,064 x 8192 table and head would be 5 GB in bf16
        text.vocab_size = min(text.vocab_size, vocab)
    for name in ("layer_types", "sliding_window_pattern_list"):
        if isinstance(getattr(text, name, None), list):
            setattr(text, name, getattr(text, name)[:1])
    return config


def build_vlm(loaded, attn_implementation: str = "sdpa") -> VLMReference:
    """The reference for `loaded` (a mmenc LoadedTower), same dtype, device and weights."""
    import transformers

    from mmenc.engine.tower import tower_weight_prefixes
    from mmenc.loader.checkpoint import strip_tower_prefix

    architecture = next(a for a in loaded.hf_config.get("architectures", []) if a in HF_VLMS)
    cls = getattr(transformers, architecture)
    dummy = loaded.load_format == "dummy"
    config = _one_layer(cls.config_class.from_dict(dict(loaded.hf_config)), vocab=DUMMY_VOCAB if dummy else None)
    if not dummy:
        model = cls.from_pretrained(str(loaded.folder or loaded.model), config=config, dtype=loaded.dtype,
                                    attn_implementation=attn_implementation)
        return VLMReference(model.to(loaded.device).eval(), HF_VLMS[architecture], loaded.device)
    with torch.device(loaded.device):  # random init on the device
        model = cls._from_config(config, attn_implementation=attn_implementation, dtype=loaded.dtype)
    model = model.to(loaded.device).eval()
    prefixes = tower_weight_prefixes(loaded.spec, loaded.hf_config)
    with torch.no_grad():  # share transformers' random weights with the mmenc tower
        tensors = strip_tower_prefix(model.state_dict().items(), prefixes, f"transformers' {architecture}")
        loaded.tower.load_weights(tensors)
    return VLMReference(model, HF_VLMS[architecture], loaded.device)

