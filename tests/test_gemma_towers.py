"""PaliGemma / Gemma 3 specifics beyond the generic tower tests (tests/test_towers_generic.py): Gemma 3's
processor against transformers', pan-and-scan and off-size frames refused, a pool that drops a partial
block, and the published checkpoints' tensor names (vision_tower.vision_model.*)."""
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from mmenc.engine.tower import build_tower, run_tower
from mmenc.preprocess import gemma3_from_hf, get_processor
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close

transformers = pytest.importorskip("transformers")

TOL = 1e-5


def _images():
    rng = np.random.default_rng(1)
    sizes = [(33, 97), (97, 33), (896, 896), (500, 301), (1, 1), (12, 700)]
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    return ims + [Image.fromarray(rng.integers(0, 256, (40, 60), dtype=np.uint8))]  # grayscale


@pytest.mark.parametrize("cfg", [{}, {"size": {"height": 896, "width": 896}, "resample": 2},
                                 {"size": {"height": 56, "width": 56}, "resample": 3}])
def test_gemma3_processor_matches_transformers(cfg):
    """Bitwise equal to Gemma3ImageProcessorPil (pan-and-scan off); grid (1, S/p, S/p)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    ref = Gemma3ImageProcessorPil(**cfg)(images=_images(), return_tensors="pt")["pixel_values"]
    pv, grid = gemma3_from_hf({**cfg, "patch_size": 14}, backend="pil")(_images())
    n = ref.shape[-1] // 14
    assert grid.tolist() == [[1, n, n]] * len(_images())
    rows = ref[:, :, :n * 14, :n * 14].reshape(len(_images()), 3, n, 14, n, 14).permute(0, 2, 4, 1, 3, 5)
    err = (pv - rows.reshape(-1, 3 * 14 * 14)).abs().max().item()
    print(f"Gemma 3 processor {cfg}: max abs diff {err}")
    assert err == 0.0, f"Gemma 3 processor {cfg}: max abs diff {err}, expected bitwise equal"


def test_gemma3_processor_kind_and_pan_and_scan():
    assert get_processor("gemma3", {}).config.resample == "bilinear"  # SigLIP's default is bicubic
    assert get_processor("siglip", {}).config.resample == "bicubic"
    with pytest.raises(ValueError, match="do_pan_and_scan=True"):
        gemma3_from_hf({"do_pan_and_scan": True})


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return ck.save_gemma_vlm(tmp_path_factory.mktemp("gemma3"), gemma3=True)


def test_gemma3_refuses_other_frame_sizes(gemma3):
    loaded = build_tower(str(gemma3[0]), device="cpu")
    grid = torch.tensor([[1, 4, 4], [1, 6, 6]])
    with pytest.raises(ValueError, match=r"grid_thw\[1\] = \(1, 6, 6\).*expected \(t, 4, 4\)"):
        run_tower(loaded, ck.FAMILIES["Gemma3ForConditionalGeneration"].pixels(grid), grid)


def test_gemma3_pool_drops_a_partial_block(tmp_path):
    """5x5 patches pooled to 2x2 tokens (kernel 2): nn.AvgPool2d drops the last row and column."""
    _, hf_model = ck.save_gemma_vlm(tmp_path, vision=dict(image_size=40), gemma3=True)
    loaded = build_tower(str(tmp_path), device="cpu")
    grid = torch.tensor([[2, 5, 5]])
    pixels = ck.FAMILIES["Gemma3ForConditionalGeneration"].pixels(grid, seed=4)
    want, _ = ck.hf_gemma_vlm_outputs(hf_model, pixels, grid)
    got = run_tower(loaded, pixels, grid).embeddings
    assert got.shape == (8, 24) and loaded.output_tokens(grid) == [8]
    assert_close(got, want, "Gemma 3, 5x5 patches pooled 2x2", TOL)


@pytest.mark.parametrize("gemma", [False, True])
def test_published_tensor_names(gemma, tmp_path):
    """Published checkpoints name the tower vision_tower.vision_model.* (transformers 5 writes vision_tower.*)."""
    folder, hf_model = ck.save_gemma_vlm(tmp_path, gemma3=gemma)
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    assert any(k.startswith("vision_tower.vision_model.") for k in renamed)
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    loaded = build_tower(str(folder), device="cpu")
    grid = torch.tensor([[1, 4, 4], [2, 4, 4]])
    pixels = ck.FAMILIES["Gemma3ForConditionalGeneration"].pixels(grid, seed=5)
    want, _ = ck.hf_gemma_vlm_outputs(hf_model, pixels, grid)
    assert_close(run_tower(loaded, pixels, grid).embeddings, want, f"gemma3={gemma}, published names", TOL)


@pytest.mark.parametrize("gemma,resample", [(False, "bicubic"), (True, "bilinear")])
def test_checkpoint_routes_its_processor(gemma, resample, tmp_path):
    """No preprocessor_config.json: PaliGemma gets SiglipImageProcessor's defaults (bicubic), Gemma 3
    Gemma3ImageProcessor's (bilinear), both at the tower's trained size and patch."""
    folder, hf_model = ck.save_gemma_vlm(tmp_path, gemma3=gemma)
    config = build_tower(str(folder), device="cpu").processor.config
    size = hf_model.config.vision_config.image_size
    assert (config.resample, config.height, config.width, config.patch_size) == (resample, size, size, 8)


@pytest.mark.parametrize("gemma", [False, True])
def test_bench_reference_matches_mmenc(gemma, tmp_path):
    """`mmenc bench`'s transformers side (mmenc/bench/hf_projected.py) gives mmenc's embeddings: on a checkpoint
    folder (its tensors loaded into transformers' modules) and with load_format="dummy" (their random weights
    given to mmenc's tower)."""
    from mmenc.bench.hf_reference import build_hf_tower

    folder, _ = ck.save_gemma_vlm(tmp_path, gemma3=gemma)
    grid = torch.tensor([[1, 4, 4], [2, 4, 4]])
    pixels = ck.FAMILIES["Gemma3ForConditionalGeneration"].pixels(grid, seed=6)
    for load_format in ("auto", "dummy"):
        loaded = build_tower(str(folder), device="cpu", load_format=load_format)
        reference = build_hf_tower(loaded)
        assert_close(run_tower(loaded, pixels, grid).embeddings, reference(pixels, grid),
                     f"gemma3={gemma}, load_format={load_format}: mmenc vs bench reference", TOL)
