"""Hugging Face transformers' own vision towers, for side-by-side benchmarks and parity checks.

`build_hf_tower(loaded, attn_implementation)` builds transformers' tower for a LoadedTower's
config with the same weights: a checkpoint folder's tensors are loaded into it; with dummy weights
it keeps transformers' random init and the mmenc tower is given those same weights.
Calling the result with (pixel_values, grid_thw) returns the merged embeddings [tokens, out_hidden].
Towers whose output includes the projector take mmenc.bench.hf_projected's reference, the LLaVA-style
families (projector and feature choice on the VLM itself) mmenc.bench.hf_vlm's.
"""
import importlib

import torch

from mmenc.bench.hf_projected import HF_PROJECTED, Reference, build_projected
from mmenc.bench.hf_vlm import build_vlm, vlm_family
from mmenc.models.base import vision_config_dict


def vision_model_type(hf_config: dict) -> str | None:
    """config.json's vision_config.model_type, or None."""
    vision = hf_config.get("vision_config")
    return vision.get("model_type") if isinstance(vision, dict) else None


def hf_vision(architecture: str):
    """The family table's transformers tower (mmenc.testing.checkpoints.FAMILIES, HFVision) standing for
    `architecture`, or None."""
    from mmenc.testing.checkpoints import FAMILIES

    for key, case in FAMILIES.items():
        vision = case.hf_vision
        if vision is not None and architecture in (vision.architectures or (case.architecture or key,)):
            return vision
    return None


def _llama4_with_projector(cls, text_hidden: int):
    """transformers' Llama4VisionModel plus the model's multi_modal_projector.linear_1, called on
    mmenc's rows: (pixel_values [T, C, p, p] or [T, C*p*p], grid_thw of (tiles, s, s)) -> [T / 4, text_hidden],
    what Llama 4's language model receives. State names as the checkpoint's tower group, prefixes removed."""
    from mmenc.testing.checkpoints import square_tiles

    class Llama4VisionAndProjector(cls):
        def __init__(self, config):
            super().__init__(config)
            self.linear_1 = torch.nn.Linear(config.vision_output_dim, text_hidden, bias=False)

        def forward(self, pixel_values, grid_thw):
            p, c = self.config.patch_size, self.config.num_channels
            tiles = square_tiles(pixel_values.reshape(-1, c, p, p), grid_thw.cpu())
            features = super().forward(tiles).last_hidden_state
            return self.linear_1(features.reshape(-1, features.shape[-1]))

    return Llama4VisionAndProjector


def _ovis2_with_table(cls, text_hidden: int):
    """transformers' Ovis2VisionModel plus the model's visual_embeddings_table, called on mmenc's rows:
    (pixel_values, grid_thw of (crops, s, s)) -> [T / m^2, text_hidden], what Ovis2Model.get_image_features
    gives. State names as the checkpoint's tower group, prefixes removed."""
    from mmenc.testing.checkpoints import square_tiles

    class Ovis2VisionAndTable(cls):
        def __init__(self, config):
            super().__init__(config)
            self.embeddings_table = torch.nn.Embedding(config.vocab_size, text_hidden)

        def forward(self, pixel_values, grid_thw):
            p, c = self.config.patch_size, self.config.num_channels
            probs = super().forward(square_tiles(pixel_values.reshape(-1, c, p, p), grid_thw.cpu())).pooler_output
            probs = torch.nn.functional.pad(probs, (0, self.config.num_visual_indicator_tokens))
            return (probs @ self.embeddings_table.weight).reshape(-1, self.embeddings_table.weight.shape[-1])

    return Ovis2VisionAndTable


class HFTower:
    """transformers' tower module and how to call it: (pixel_values, grid_thw) -> embeddings."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.module, self.device = module, device

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        out = self.module(pixel_values, grid_thw=grid_thw.to(self.device))
        if isinstance(out, torch.Tensor):
            return out
        return out.pooler_output if getattr(out, "pooler_output", None) is not None else out[0]


class _SiglipInputs(HFTower):
    """A SigLIP(2) tower takes images, not mmenc's (pixel_values, grid_thw): the conversion is made once
    per input (outside the timed call when the same tensor comes back). The pooling head is skipped, as
    mmenc's encode_pixels skips it; embeddings are last_hidden_state on the valid tokens [T, hidden]."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        super().__init__(module, device)
        module.use_head = False
        self._key, self._inputs = None, None

    def inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        key = (pixel_values.data_ptr(), tuple(pixel_values.shape), tuple(map(tuple, grid_thw.tolist())))
        if key != self._key:
            self._key, self._inputs = key, self.convert(pixel_values, grid_thw.cpu())
        return self._inputs


class SiglipHFTower(_SiglipInputs):
    """SiglipVisionModel on [B, C, h*p, w*p] images, one batch per frame size, positions interpolated;
    `from_processor` on its image processor's batch (--e2e)."""

    def convert(self, pixel_values, grid_thw):
        from mmenc.testing.checkpoints import siglip_frames

        p, groups = self.module.config.patch_size, {}
        for patches, h, w in siglip_frames(pixel_values, grid_thw):
            groups.setdefault((h, w), []).append(patches.view(h, w, -1, p, p).permute(2, 0, 3, 1, 4))
        return [torch.stack(frames).flatten(2, 3).flatten(3, 4) for frames in groups.values()]

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        outs = [self.module(pixel_values=images, interpolate_pos_encoding=True).last_hidden_state.flatten(0, 1)
                for images in self.inputs(pixel_values, grid_thw)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.inference_mode()
    def from_processor(self, out) -> torch.Tensor:
        images = out["pixel_values"].to(self.device, next(self.module.parameters()).dtype, non_blocking=True)
        return self.module(pixel_values=images, interpolate_pos_encoding=True).last_hidden_state.flatten(0, 1)


class Siglip2HFTower(_SiglipInputs):
    """Siglip2VisionModel on transformers' padded NaFlex batch (pixel_attention_mask, spatial_shapes)."""

    def convert(self, pixel_values, grid_thw):
        from mmenc.testing.checkpoints import hf_siglip2_batch

        return hf_siglip2_batch(pixel_values, grid_thw)  # on pixel_values' device

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        padded, mask, shapes = self.inputs(pixel_values, grid_thw)
        out = self.module(pixel_values=padded, pixel_attention_mask=mask, spatial_shapes=shapes).last_hidden_state
        return out[mask.bool()]

    @torch.inference_mode()
    def from_processor(self, out) -> torch.Tensor:
        """transformers' NaFlex batch as its processor gives it (--e2e) -> the valid tokens' embeddings."""
        mask = out["pixel_attention_mask"].to(self.device)
        padded = out["pixel_values"].to(self.device, next(self.module.parameters()).dtype, non_blocking=True)
        hidden = self.module(pixel_values=padded, pixel_attention_mask=mask,
                             spatial_shapes=out["spatial_shapes"].to(self.device)).last_hidden_state
        return hidden[mask.bool()]


class ClipHFTower(SiglipHFTower):
    """CLIPVisionModel on SigLIP's image batches (one per frame size): last_hidden_state, every token (the class
    token first), as mmenc's CLIP tower gives them."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        HFTower.__init__(self, module, device)
        self._key, self._inputs = None, None


# architecture -> checkpoint tensor names (tower prefix removed) that transformers' tower above does not hold
HF_SKIP: dict[str, tuple[str, ...]] = {"CLIPModel": ("projection.",), "CLIPVisionModelWithProjection": ("projection.",)}

# transformers tower class -> how to call it, where not HFTower's (pixel_values, grid_thw=...)
HF_CALLS: dict[str, type] = {"SiglipVisionModel": SiglipHFTower, "Siglip2VisionModel": Siglip2HFTower,
                             "CLIPVisionModel": ClipHFTower}


def _missing_class(architecture: str, module: str, cls: str) -> str | None:
    """None if transformers.models.<module>.modeling_<module> has `cls`, else the reason."""
    try:
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except ImportError as e:
        return f"transformers cannot be imported for {architecture}: {e}"
    return None if hasattr(modeling, cls) else f"this transformers version has no {cls}"


def hf_tower_available(architecture: str, vision_model_type: str | None = None) -> str | None:
    """None if transformers can build this architecture's tower here (over this vision tower, config.json's
    vision_config.model_type, where the family has several), else the reason."""
    vlm = vlm_family(architecture, vision_model_type)
    if vlm is not None:  # the whole VLM, its language model cut to one layer (mmenc/bench/hf_vlm.py)
        return _missing_class(architecture, vlm.module, architecture)
    if architecture in HF_PROJECTED:  # towers whose output includes the projector (mmenc/bench/hf_projected.py)
        return _missing_class(architecture, HF_PROJECTED[architecture].module, HF_PROJECTED[architecture].probe)
    vision = hf_vision(architecture)
    if vision is None:
        return (f"no transformers tower registered for {architecture} (Kimi: its embeddings include the "
                f"projector; compare with benchmarks/kimi_vs_transformers.py)")
    return _missing_class(architecture, vision.module, vision.tower)


def build_hf_tower(loaded, attn_implementation: str = "sdpa") -> Reference:
    """transformers' tower for `loaded` (a mmenc LoadedTower), same dtype, device and weights."""
    vision_type = vision_model_type(loaded.hf_config)
    if any(vlm_family(a, vision_type) is not None for a in loaded.hf_config.get("architectures", [])):
        return build_vlm(loaded, attn_implementation)
    if any(a in HF_PROJECTED for a in loaded.hf_config.get("architectures", [])):
        return build_projected(loaded, attn_implementation)
    architecture = next(a for a in loaded.hf_config.get("architectures", []) if hf_vision(a) is not None)
    vision = hf_vision(architecture)
    module, cls_name, cfg_name = vision.module, vision.tower, vision.config
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    configuration = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    vision = vision_config_dict(loaded.hf_config)
    config = getattr(configuration, cfg_name)(**vision)
    config._attn_implementation = attn_implementation
    tower_cls = getattr(modeling, cls_name)
    if architecture == "Llama4ForConditionalGeneration":
        tower_cls = _llama4_with_projector(tower_cls, loaded.config.out_hidden_size)
    elif architecture == "Ovis2ForConditionalGeneration":
        tower_cls = _ovis2_with_table(tower_cls, loaded.config.out_hidden_size)
    with torch.device(loaded.device):  # random init on the device (seconds for a 6B tower on a GPU, not minutes on CPU)
        tower = tower_cls._from_config(config, attn_implementation=attn_implementation, dtype=loaded.dtype)
    tower = tower.to(loaded.device).eval()
    if loaded.load_format == "dummy":  # share transformers' random weights with the mmenc tower
        with torch.no_grad():
            loaded.tower.load_weights((name, t) for name, t in tower.state_dict().items() if "inv_freq" not in name)
    else:
        from mmenc.loader import iter_tower_tensors

        skip = HF_SKIP.get(architecture, ())  # tensors mmenc's tower holds beyond transformers' tower
        tensors = {n: t for n, t in iter_tower_tensors(loaded.model, loaded.spec.weight_prefixes) if not n.startswith(skip)}
        missing, unexpected = tower.load_state_dict(tensors, strict=False)
        missing = [m for m in missing if "inv_freq" not in m]
        if missing or unexpected:
            raise ValueError(f"checkpoint tensors do not fit transformers' {cls_name}: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    return HF_CALLS.get(cls_name, HFTower)(tower, loaded.device)

