"""Vision-only checkpoints (issue 28, item 5): transformers' vision model saved alone (config.json is the
vision config itself, the tensors carry no prefix: SiglipVisionModel, Siglip2VisionModel, CLIPVisionModel,
Qwen2_5_VisionTransformerPretrainedModel, Glm4vVisionModel, ...) load as the full checkpoint does.

Every family whose transformers module holds exactly mmenc's tower (FamilyCase.hf_tower) is covered: the
module is saved with its own save_pretrained, and mmenc's embeddings from that folder must equal those from
the full checkpoint, bit for bit."""
import pytest
import torch

from mmenc.engine.tower import build_tower, run_tower
from mmenc.models.registry import supported_architectures
from mmenc.testing import checkpoints as ck

pytest.importorskip("transformers")

CASES = {name: case for name, case in ck.FAMILIES.items() if case.hf_tower is not None}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_vision_only_checkpoint_loads_like_the_full_one(name, tmp_path):
    case = CASES[name]
    full, hf_model = case.save(tmp_path / "full")
    vision = case.hf_tower(hf_model)
    if any(p.is_meta for p in vision.parameters()):  # built at the full model's size (CLIP): its weights, by name
        wanted = set(vision.state_dict())
        vision = vision.to_empty(device="cpu")
        vision.load_state_dict({k: v for k, v in hf_model.state_dict().items() if k in wanted}, strict=True)
    vision.save_pretrained(tmp_path / "vision")
    arch = type(vision).__name__
    assert arch in supported_architectures(), f"{arch} (the vision-only class of {name}) is not served"
    grid = torch.tensor(case.grid) if case.grid is not None else torch.tensor([[1, 2, 2], [1, 6, 10], [1, 10, 4]])
    one, alone = build_tower(str(full), device="cpu"), build_tower(str(tmp_path / "vision"), device="cpu")
    pixels = case.pixels(grid).reshape(int(grid[:, :3].prod(-1).sum()), -1)
    torch.testing.assert_close(run_tower(alone, pixels, grid).embeddings, run_tower(one, pixels, grid).embeddings,
                               rtol=0, atol=0)
