"""transformers' Pixtral (Mistral3 / Llava) and InternVL towers with their projectors, for `mmenc bench`.

Their embeddings include the projector (as mmenc's towers do), so the reference is transformers'
vision tower module plus its projector module, called as transformers' get_image_features calls
them, on transformers' input layout: Pixtral takes one zero-padded batch of images with their
image_sizes (block-diagonal attention mask), InternVL a batch of 448 px tiles. The patch rows mmenc
takes are laid back out as those images inside the call (one copy of the pixels).

    hf = build_projected_tower(loaded, "sdpa")   # loaded: a mmenc LoadedTower
    embeddings = hf(pixel_values, grid_thw)      # [tokens, out_hidden], as mmenc's tower
"""
import importlib

import torch

from mmenc.testing.checkpoints import pixtral_images

# architecture -> (transformers.models.<module>, config class, projector class)
HF_PROJECTED_TOWERS: dict[str, tuple[str, str, str]] = {
    "Mistral3ForConditionalGeneration": ("mistral3", "Mistral3Config", "Mistral3MultiModalProjector"),
    "LlavaForConditionalGeneration": ("llava", "LlavaConfig", "LlavaMultiModalProjector"),
    "InternVLForConditionalGeneration": ("internvl", "InternVLConfig", "InternVLMultiModalProjector"),
}


class ProjectedTower:
    """(pixel_values [T, C*p*p] or [T, C, p, p], grid_thw [N, 3]) -> transformers' embeddings [tokens, out]."""

    def __init__(self, architecture: str, config, vision: torch.nn.Module, projector: torch.nn.Module, device):
        self.architecture, self.config, self.device = architecture, config, device
        self.vision, self.projector = vision, projector
        patch = config.vision_config.patch_size
        self.patch = patch[0] if isinstance(patch, (list, tuple)) else patch

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if self.architecture == "InternVLForConditionalGeneration":
            return self._internvl(pixel_values, grid_thw)
        images, sizes = pixtral_images(pixel_values, grid_thw, self.patch)
        sizes = torch.tensor(sizes)  # on the host, as the processor returns them (no device syncs when sliced)
        feats = self.vision(images, image_sizes=sizes).last_hidden_state.squeeze(0)  # [T, D]
        if self.architecture == "Mistral3ForConditionalGeneration":
            return self.projector(feats, sizes)
        return self.projector(feats)

    def _internvl(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        from transformers.models.internvl.modeling_internvl import InternVLModel

        p, ratio = self.patch, self.config.downsample_ratio
        sizes = {(h, w) for _, h, w in grid_thw.tolist()}
        if len(sizes) != 1:
            raise ValueError(f"grid_thw has tiles of sizes {sorted(sizes)}; transformers' InternVL takes one batch of "
                             f"equal tiles (its processor's 448 px), expected one (h, w)")
        (h, w), = sizes
        tiles = pixel_values.reshape(-1, h, w, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(-1, 3, h * p, w * p)
        feats = self.vision(pixel_values=tiles).last_hidden_state[:, 1:]  # CLS dropped
        feats = InternVLModel.pixel_shuffle(None, feats.reshape(feats.shape[0], h, w, -1), scale_factor=ratio)
        return self.projector(feats.reshape(-1, feats.shape[-1]))


def build_projected_tower(loaded, attn_implementation: str = "sdpa") -> ProjectedTower:
    """transformers' tower + projector for `loaded` (a mmenc LoadedTower), same dtype, device and
    weights (dummy: the mmenc tower takes transformers' random weights)."""
    import transformers

    architecture = next(a for a in loaded.hf_config.get("architectures", []) if a in HF_PROJECTED_TOWERS)
    module, config_name, projector_name = HF_PROJECTED_TOWERS[architecture]
    top = {k: v for k, v in loaded.hf_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    if architecture == "InternVLForConditionalGeneration":
        top["text_config"] = {"model_type": "qwen2", **top.get("text_config", {})}
    config = getattr(transformers, config_name)(**top)
    vision_cls = (transformers.InternVLVisionModel if architecture == "InternVLForConditionalGeneration"
                  else transformers.PixtralVisionModel)
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    with torch.device(loaded.device):  # random init on the device (InternViT-6B: 5.7 B parameters)
        vision = vision_cls._from_config(config.vision_config, attn_implementation=attn_implementation,
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
            names = set(mod.state_dict())
            missing, _ = mod.load_state_dict({k: v for k, v in tensors.items() if k in names}, strict=False)
            missing = [m for m in missing if "inv_freq" not in m]
            if missing:
                raise ValueError(f"checkpoint {loaded.model!r} lacks transformers' {type(mod).__name__} tensors "
                                 f"{missing[:5]}")
    return ProjectedTower(architecture, config, vision, projector, loaded.device)
