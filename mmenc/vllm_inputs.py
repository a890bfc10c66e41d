"""What vLLM takes from mmenc's embeddings: the image-embedding layout, and the `multi_modal_data` of
`LLM.generate` (offline; the service's `vllm` format and EC files carry the same tensors).

vLLM's Qwen2-VL lineage takes an image as {"image_embeds": [tokens, width], "image_grid_thw": (t, h, w)}:
width is the text model's hidden size, times (1 + deepstack levels) for Qwen3-VL, whose levels follow the
main embeddings on dim 1 (the layout vLLM's Qwen3-VL keeps in its encoder cache and splits again). The
grid sizes the prompt's placeholder run and the language model's M-RoPE positions. The same tensor is what
vLLM's EC consumer reads from an --ec-storage file. Which families take which, checked by running vLLM
0.32 itself (interop/vllm/): EMBEDS_ARCHITECTURES take both; EC_ONLY_ARCHITECTURES only the EC files
(GLM-4.1V: vLLM's data parser for it has no embedding fields, so an embeddings dict is read as a list of
images and refused). docs/serving.md, "Feeding vLLM", has the per-family table and vLLM's reasons.

    pixel_values, grid = enc.preprocess(images)
    out = enc.encode_pixels(pixel_values, grid, return_extras=True)
    llm.generate({"prompt": prompt, "multi_modal_data": {"image": multi_modal_data(out, grid)}})
"""
from collections.abc import Sequence
from typing import Any

import torch

# run by interop/vllm/ (vLLM 0.32.0): image_embeds inputs (offline and content parts) and EC files
EMBEDS_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                        "Qwen3VLForConditionalGeneration")
# EC files only: vLLM refuses image_embeds inputs for these (see above), its EC consumer reads mmenc's files
EC_ONLY_ARCHITECTURES = ("Glm4vForConditionalGeneration",)


def image_embeds(output: Any) -> torch.Tensor:
    """[tokens, hidden * (1 + deepstack levels)]: `output.embeddings` then each of
    `output.extras["deepstack"]` on dim 1 (a TowerOutput, or one image's ImageEmbedding)."""
    parts = [output.embeddings, *(output.extras.get("deepstack") or [])]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def multi_modal_data(outputs: Any | Sequence[Any], grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's `multi_modal_data["image"]` for N images: {"image_embeds": [sum tokens_i, width] on the CPU,
    "image_grid_thw": int64 [N, 3]}. outputs: one TowerOutput of all N images (encode_pixels with
    return_extras=True) or N ImageEmbedding (encode with return_extras=True), in grid_thw's order."""
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw of shape {tuple(grid_thw.shape)}: expected [N, 3] (t, h, w) rows, "
                         "as Encoder.preprocess returns")
    pieces = [outputs] if hasattr(outputs, "embeddings") else list(outputs)
    if not pieces:
        raise ValueError("no outputs: pass the TowerOutput of encode_pixels or one ImageEmbedding per image")
    embeds = torch.cat([image_embeds(piece) for piece in pieces]).cpu()
    return {"image_embeds": embeds, "image_grid_thw": grid_thw.to(torch.int64).cpu()}
