"""The layouts mmenc hands vLLM (mmenc.vllm_inputs, the `vllm` response format): shapes, dtypes and key
names as vLLM 0.32 takes them (interop/vllm/ runs vLLM itself on them; these check the layout alone)."""
import base64
import io
import json

import pytest
import torch

from mmenc.engine.outputs import ImageEmbedding
from mmenc.engine.videos import VideoEmbedding
from mmenc.preprocess.video import VideoInfo
from mmenc.serving.formats import EncodedImage, render_item
from mmenc.serving.tensor_bytes import TensorSaver
from mmenc.vllm_inputs import (BARE_EMBEDS_ARCHITECTURES, EMBEDS_ARCHITECTURES, multi_modal_data, takes_grid,
                               video_multi_modal_data)


def _info(grid, timestamps=None, second=None) -> VideoInfo:
    t = grid[0][0] * 2
    return VideoInfo(grid_thw=tuple(grid), frames_indices=tuple(range(t)), frame_times=tuple(i / 4 for i in range(t)),
                     timestamps=timestamps, second_per_grid_ts=second, fps=4.0, sampled_fps=4.0, total_num_frames=t,
                     duration=t / 4, size=(112, 112), resized=(112, 112))


def _load(text: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)


def test_image_layouts():
    a, b = ImageEmbedding(torch.randn(4, 8), {}), ImageEmbedding(torch.randn(6, 8), {})
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]], dtype=torch.int32)
    data = multi_modal_data([a, b], grid)
    assert data["image_embeds"].shape == (10, 8) and data["image_grid_thw"].dtype == torch.int64
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        multi_modal_data([a, b], grid[:, :2])
    bare = multi_modal_data([a, b])  # the "tensors" layout: one [tokens, hidden] per image
    assert [t.shape for t in bare] == [(4, 8), (6, 8)] and torch.equal(bare[0], a.embeddings)


def test_video_multi_modal_data_carries_the_time_fields():
    q25 = VideoEmbedding(torch.randn(16, 8), {}, _info([(2, 4, 8)], second=0.5))
    data = video_multi_modal_data([q25])
    assert data["video_grid_thw"].tolist() == [[2, 4, 8]] and data["video_embeds"].shape == (16, 8)
    assert data["second_per_grid_ts"].tolist() == [0.5] and "timestamps" not in data
    q3 = VideoEmbedding(torch.randn(16, 8), {"deepstack": [torch.zeros(16, 8)]}, _info([(2, 4, 8)], (0.25, 1.5)))
    data = video_multi_modal_data(q3)
    assert data["video_embeds"].shape == (16, 16) and data["timestamps"].tolist() == [[0.25, 1.5]]
    assert "second_per_grid_ts" not in data
    with pytest.raises(ValueError, match="one"):
        video_multi_modal_data([VideoEmbedding(torch.randn(8, 8), {}, _info([(1, 4, 8), (1, 4, 8)]))])


@pytest.mark.parametrize("saver", [None, TensorSaver()], ids=["torch.save", "saver"])
def test_vllm_video_part_is_one_chat_part(saver):
    """What vLLM's chat API stacks per video_embeds part: grid [3] (a [1, 3] one is refused, "size_per_item
    should be a 1-D tensor"), second_per_grid_ts a scalar ([1] stacks to [1, 1], which kills vLLM's engine),
    timestamps [t]."""
    info = _info([(2, 4, 8)], timestamps=(0.25, 1.5), second=0.5).as_dict()
    image = EncodedImage(torch.randn(16, 8), 8, (2, 4, 8), video=info)
    item = json.loads(b"".join(render_item(image, "vllm", {"index": 0, "uuid": "k"}, saver)))
    part = item["video_embeds"]
    assert part["type"] == "video_embeds" and part["uuid"] == "k"
    fields = {k: _load(v) for k, v in part["video_embeds"].items()}
    assert torch.equal(fields["video_embeds"], image.full)
    assert fields["video_grid_thw"].tolist() == [2, 4, 8] and fields["video_grid_thw"].dtype == torch.int64
    assert fields["second_per_grid_ts"].shape == () and fields["second_per_grid_ts"].item() == 0.5
    assert fields["timestamps"].tolist() == [0.25, 1.5] and fields["timestamps"].dtype == torch.float64
    plain = EncodedImage(torch.randn(16, 8), 8, (2, 4, 8), video=_info([(2, 4, 8)]).as_dict())
    fields = json.loads(b"".join(render_item(plain, "vllm", {"index": 0, "uuid": None}, saver)))["video_embeds"]
    assert set(fields["video_embeds"]) == {"video_embeds", "video_grid_thw"}


@pytest.mark.parametrize("saver", [None, TensorSaver()], ids=["torch.save", "saver"])
def test_vllm_image_part_in_each_layout(saver):
    """The grid layout's part is {"image_embeds", "image_grid_thw" int64 [3]}; the bare one (LLaVA-1.5, what
    vLLM's chat API takes for it: a dict is read as a list of images and refused) the tensor's base64 alone."""
    image = EncodedImage(torch.randn(6, 8), 8, (1, 4, 6))
    part = json.loads(b"".join(render_item(image, "vllm", {"index": 0, "uuid": "k"}, saver)))["image_embeds"]
    fields = {k: _load(v) for k, v in part["image_embeds"].items()}
    assert torch.equal(fields["image_embeds"], image.full) and fields["image_grid_thw"].tolist() == [1, 4, 6]
    bare = json.loads(b"".join(render_item(image, "vllm", {"index": 0, "uuid": "k"}, saver, grid=False)))
    part = bare["image_embeds"]
    assert part["type"] == "image_embeds" and part["uuid"] == "k" and isinstance(part["image_embeds"], str)
    assert torch.equal(_load(part["image_embeds"]), image.full)


def test_layout_per_architecture():
    assert takes_grid("Qwen2_5_VLForConditionalGeneration") and takes_grid("Glm4vForConditionalGeneration")
    for bare in ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                 "LlavaOnevisionForConditionalGeneration"):
        assert not takes_grid(bare), bare
    assert set(BARE_EMBEDS_ARCHITECTURES) <= set(EMBEDS_ARCHITECTURES)
