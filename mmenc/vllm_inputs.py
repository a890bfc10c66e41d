"""What vLLM takes from mmenc's embeddings: the image-embedding layout, and the `multi_modal_data` of
`LLM.generate` (offline; the service's `vllm` format and EC files carry the same tensors).

vLLM's Qwen2-VL lineage takes an image as {"image_embeds": [tokens, width], "image_grid_thw": (t, h, w)}:
width is the text model's hidden size, times (1 + deepstack levels) for Qwen3-VL, whose levels follow the
main embeddings on dim 1 (the layout vLLM's Qwen3-VL keeps in its encoder cache and splits again). The
grid sizes the prompt's placeholder run and the language model's M-RoPE positions. The same tensor is what
vLLM's EC consumer reads from an --ec-storage file. Which families take which, checked by running vLLM
0.32 itself (interop/vllm/): EMBEDS_ARCHITECTURES take both; EC_ONLY_ARCHITECTURES only the EC files
(GLM-4.1V: vLLM's data parser for it has no embedding fields, so an embeddings dict is read as a list of
images and refused). LLaVA-1.5, LLaVA-NeXT and LLaVA-OneVision take a bare [tokens, hidden] tensor per image
instead (BARE_EMBEDS_ARCHITECTURES, `takes_grid`): offline a list of them, in the chat API one base64 tensor per
part; for NeXT and OneVision that is mmenc's packed sequence (base tile, unpadded canvas, image_newline), which
vLLM returns as it is, and the images of one encoder batch must have one length (SAME_LENGTH_EMBEDS_ARCHITECTURES:
vLLM 0.32's schema refuses mixed lengths). docs/serving.md, "Feeding vLLM", has the per-family table and vLLM's
reasons.

    pixel_values, grid = enc.preprocess(images)
    out = enc.encode_pixels(pixel_values, grid, return_extras=True)
    llm.generate({"prompt": prompt, "multi_modal_data": {"image": multi_modal_data(out, grid)}})

Videos (VIDEO_EMBEDS_ARCHITECTURES): {"video_embeds", "video_grid_thw"}, plus Qwen2.5-VL's
"second_per_grid_ts" (its M-RoPE time step: without it vLLM takes 1.0 and its answer changes) and Qwen3-VL's
"timestamps" (required: they size the prompt's per-unit "<t seconds>" text):

    (video,) = enc.encode(["clip.mp4"], return_extras=True)
    llm.generate({"prompt": prompt, "multi_modal_data": {"video": video_multi_modal_data([video])}})
"""
from collections.abc import Sequence
from typing import Any

import torch

# run by interop/vllm/ (vLLM 0.32.0): image_embeds inputs (offline and content parts) and EC files.
# The Qwen2-VL lineage takes an image as {"image_embeds", "image_grid_thw"} (the grid layout);
GRID_EMBEDS_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                             "Qwen3VLForConditionalGeneration")
# LLaVA-1.5, NeXT and OneVision a bare [tokens, hidden] tensor per image (the bare layout: vLLM's default data
# parser, no grid; NeXT / OneVision: the packed anyres sequence)
BARE_EMBEDS_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                             "LlavaOnevisionForConditionalGeneration")
EMBEDS_ARCHITECTURES = GRID_EMBEDS_ARCHITECTURES + BARE_EMBEDS_ARCHITECTURES
# one token count per encoder batch: vLLM 0.32's embedding schema of LLaVA-NeXT / OneVision is [bn, ifs, hs] with
# ifs not dynamic, so images whose embeddings differ in length, in one prompt or in requests the scheduler batches
# together, are refused ("data contains inconsistent shapes: torch.Size([70, 64]) (index 0) vs torch.Size([44, 64])
# (index 1)", raised inside the engine step: offline a ValueError, a server answers 500 and exits). LLaVA-1.5's
# images all have one length.
SAME_LENGTH_EMBEDS_ARCHITECTURES = ("LlavaNextForConditionalGeneration", "LlavaOnevisionForConditionalGeneration")
# the bare layout read from vLLM's source and not run (interns1.py takes InternVL's embeddings without a grid)
_BARE_UNRUN = ("InternVLForConditionalGeneration",)
# videos as {"video_embeds", "video_grid_thw", ...} inputs (offline and video_embeds content parts)
VIDEO_EMBEDS_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                              "Qwen3VLForConditionalGeneration")
# EC files only: vLLM refuses image_embeds inputs for these (see above), its EC consumer reads mmenc's files
EC_ONLY_ARCHITECTURES = ("Glm4vForConditionalGeneration",)


def takes_grid(architecture: str) -> bool:
    """Whether vLLM takes this family's image embeddings with their grid (the {"image_embeds",
    "image_grid_thw"} dict) rather than bare; families vLLM takes no embeddings of answer True (the dict is
    what their EC-file twins and any future parser would read)."""
    return architecture not in BARE_EMBEDS_ARCHITECTURES + _BARE_UNRUN


def image_embeds(output: Any) -> torch.Tensor:
    """[tokens, hidden * (1 + deepstack levels)]: `output.embeddings` then each of
    `output.extras["deepstack"]` on dim 1 (a TowerOutput, or one image's ImageEmbedding)."""
    parts = [output.embeddings, *(output.extras.get("deepstack") or [])]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def multi_modal_data(outputs: Any | Sequence[Any], grid_thw: torch.Tensor | None = None) -> Any:
    """vLLM's `multi_modal_data["image"]` for N images. With grid_thw (the Qwen2-VL lineage,
    GRID_EMBEDS_ARCHITECTURES): {"image_embeds": [sum tokens_i, width] on the CPU, "image_grid_thw": int64
    [N, 3]}. Without (LLaVA-1.5, NeXT, OneVision and the families whose vLLM model takes a bare [bn, tokens,
    hidden] input): a list of N [tokens_i, hidden] tensors on the CPU, what vLLM's default data parser reads as
    image embeddings (SAME_LENGTH_EMBEDS_ARCHITECTURES: vLLM takes them only when every tokens_i is equal).
    outputs: one TowerOutput of all N images (encode_pixels with return_extras=True; grid layout only) or
    N ImageEmbedding (encode with return_extras=True), in grid_thw's order."""
    pieces = [outputs] if hasattr(outputs, "embeddings") else list(outputs)
    if not pieces:
        raise ValueError("no outputs: pass the TowerOutput of encode_pixels or one ImageEmbedding per image")
    if grid_thw is None:
        return [image_embeds(piece).cpu() for piece in pieces]
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw of shape {tuple(grid_thw.shape)}: expected [N, 3] (t, h, w) rows, "
                         "as Encoder.preprocess returns")
    embeds = torch.cat([image_embeds(piece) for piece in pieces]).cpu()
    return {"image_embeds": embeds, "image_grid_thw": grid_thw.to(torch.int64).cpu()}


def video_multi_modal_data(videos: Any | Sequence[Any]) -> dict[str, torch.Tensor]:
    """vLLM's `multi_modal_data["video"]` for N videos (VideoEmbedding of Encoder.encode, return_extras=True
    for Qwen3-VL's deepstack): {"video_embeds": [sum tokens_i, width], "video_grid_thw": int64 [N, 3]}, plus
    "second_per_grid_ts" float64 [N] (Qwen2.5-VL: its M-RoPE time step) and "timestamps" float64 [N, t]
    (Qwen3-VL: the "<t seconds>" text before each temporal unit) where the videos' VideoInfo has them."""
    videos = [videos] if hasattr(videos, "embeddings") else list(videos)
    if not videos:
        raise ValueError("no videos: pass one VideoEmbedding per video")
    rows = [row for v in videos for row in v.video.grid_thw]
    if len(rows) != len(videos):
        raise ValueError(f"{len(rows)} grid rows for {len(videos)} videos: vLLM takes one (t, h, w) row per video")
    data = {"video_embeds": torch.cat([image_embeds(v) for v in videos]).cpu(),
            "video_grid_thw": torch.tensor(rows, dtype=torch.int64)}
    seconds = [v.video.second_per_grid_ts for v in videos]
    if all(s is not None for s in seconds):
        data["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float64)
    stamps = [v.video.timestamps for v in videos]
    if all(t is not None for t in stamps):
        if len({len(t) for t in stamps}) == 1:
            data["timestamps"] = torch.tensor(stamps, dtype=torch.float64)
        else:  # one row per video, of its own length
            data["timestamps"] = [torch.tensor(t, dtype=torch.float64) for t in stamps]
    return data
