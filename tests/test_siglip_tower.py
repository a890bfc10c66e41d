"""SigLIP / SigLIP2 specifics beyond the generic tower tests: the attention-pooling head (pooled image
embeddings through Encoder and `mmenc encode --pooled`), the dense [B, S] path, NaFlex position
resampling, and the processors against transformers' (PaliGemma / Gemma 3 with their projectors:
tests/test_gemma_towers.py and the generic tests)."""
import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from mmenc.engine.encoder import Encoder
from mmenc.engine.tower import build_tower, run_tower
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.preprocess.siglip import naflex_size, siglip2_from_hf, siglip_from_hf
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close

transformers = pytest.importorskip("transformers")

TOL = 1e-5
GRID = torch.tensor([[1, 2, 2], [1, 6, 10], [1, 8, 6], [1, 10, 4]])  # different sizes: one packed call


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    return ck.save_siglip(tmp_path_factory.mktemp("siglip"))


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory):
    return ck.save_siglip(tmp_path_factory.mktemp("siglip2"), version=2)


def _hf_pooled_siglip(model, pixels, grid):
    p = model.config.vision_config.patch_size
    rows = []
    with torch.no_grad():
        for patches, h, w in ck.siglip_frames(pixels, grid):
            image = patches.view(h, w, -1, p, p).permute(2, 0, 3, 1, 4).reshape(1, -1, h * p, w * p)
            rows.append(model.vision_model(pixel_values=image, interpolate_pos_encoding=True).pooler_output)
    return torch.cat(rows)


def _hf_pooled_siglip2(model, pixels, grid):
    padded, mask, shapes = ck.hf_siglip2_batch(pixels, grid)
    with torch.no_grad():
        return model.vision_model(pixel_values=padded, pixel_attention_mask=mask, spatial_shapes=shapes).pooler_output


@pytest.mark.parametrize("version", [1, 2])
def test_pooled_matches_transformers(version, siglip, siglip2):
    folder, hf_model = siglip if version == 1 else siglip2
    case = ck.FAMILIES["SiglipModel" if version == 1 else "Siglip2Model"]
    pixels = case.pixels(GRID, seed=5)
    want = (_hf_pooled_siglip if version == 1 else _hf_pooled_siglip2)(hf_model, pixels, GRID)
    with Encoder(str(folder), device="cpu") as enc:
        got = enc.encode_pixels(pixels, GRID, pooled=True)
        out = enc.encode_pixels(pixels, GRID, return_extras=True, pooled=True)
    assert got.shape == (len(GRID), hf_model.config.vision_config.hidden_size)
    err = assert_close(got, want, f"SigLIP{version} pooled", TOL)
    print(f"SigLIP{version} pooled: relative error {err:.2e} (tolerance {TOL:.0e})")
    assert torch.equal(out.extras["pooled"], got) and out.embeddings.shape[0] == int(GRID.prod(-1).sum())
    with Encoder(str(folder), device="cpu") as enc:  # zero images: an empty [0, hidden]
        empty = enc.encode_pixels(pixels[:0], GRID[:0], pooled=True)
    assert empty.shape == (0, got.shape[1])


def test_same_size_frames_run_dense_and_match_transformers(siglip):
    """Images at the position table's size (6x6) run as one [B, S] batch, as transformers does."""
    folder, hf_model = siglip
    loaded = build_tower(str(folder), device="cpu")
    grid = torch.tensor([[1, 6, 6]] * 3)
    assert loaded.tower.plan(grid, "cpu").dense and not loaded.tower.plan(GRID, "cpu").dense
    pixels = ck.FAMILIES["SiglipModel"].pixels(grid, seed=1)
    images = pixels.view(3, 6, 6, 3, 8, 8).permute(0, 3, 1, 4, 2, 5).reshape(3, 3, 48, 48)
    with torch.no_grad():
        want = hf_model.vision_model(pixel_values=images).last_hidden_state.reshape(-1, 32)
    assert_close(run_tower(loaded, pixels, grid).embeddings, want, "SigLIP dense batch", TOL)


@pytest.mark.parametrize("h,w", [(6, 6), (2, 17), (9, 3), (1, 1), (16, 16)])
def test_naflex_position_taps_equal_interpolate(h, w):
    """SigLIP2 resizes its table with F.interpolate(bilinear, antialias=True); the taps reproduce it."""
    pos = InterpolatedPosEmbed(36, 8, mode="bilinear_antialias")
    torch.nn.init.normal_(pos.weight)
    index, weight = pos.taps(((1, h, w),))
    want = F.interpolate(pos.weight.reshape(6, 6, 8).permute(2, 0, 1)[None], size=(h, w), mode="bilinear",
                         align_corners=False, antialias=True)[0].reshape(8, -1).T
    assert_close(pos(index, weight), want, f"antialiased taps {h}x{w}", TOL)


def test_pooled_needs_a_head(tmp_path):
    folder, _ = ck.save_qwen2_vl(tmp_path)
    with Encoder(str(folder), device="cpu") as enc:
        with pytest.raises(ValueError, match="has no pooled image embedding"):
            enc.encode_pixels(*enc.preprocess([np.zeros((28, 28, 3), np.uint8)]), pooled=True)


def _images(rgb_only=False):
    rng = np.random.default_rng(0)
    sizes = [(33, 97), (97, 33), (224, 224), (500, 301), (1, 1), (28, 28), (12, 700)]
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    if not rgb_only:
        ims.append(Image.fromarray(rng.integers(0, 256, (40, 60), dtype=np.uint8)))  # grayscale
    return ims


def _siglip_reference(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """transformers' [B, C, S, S] images -> mmenc rows [B * n * n, C*p*p] (a partial last patch dropped)."""
    n = pixel_values.shape[-1] // patch
    x = pixel_values[:, :, :n * patch, :n * patch].reshape(pixel_values.shape[0], 3, n, patch, n, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(-1, 3 * patch * patch)


HAS_TV = importlib.util.find_spec("torchvision") is not None


# backend="pil" against transformers' *Pil classes (always there), the default backend="torchvision"
# against its default classes (they need torchvision). Exact in both cases; one uint8 level allowed.
BACKENDS = ["pil", pytest.param("torchvision", marks=pytest.mark.skipif(not HAS_TV, reason="needs torchvision"))]
LEVEL = 2 / 255  # one uint8 level after (x / 255 - 0.5) / 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size,patch", [(224, 16), (384, 14)])
def test_siglip_processor_matches_transformers(backend, size, patch):
    cls = "SiglipImageProcessor" if backend == "torchvision" else "SiglipImageProcessorPil"
    cfg = {"size": {"height": size, "width": size}}
    ref = getattr(transformers.models.siglip, cls)(**cfg)(images=_images(), return_tensors="pt")["pixel_values"]
    pv, grid = siglip_from_hf({**cfg, "patch_size": patch}, backend=backend)(_images())
    n = size // patch
    assert grid.tolist() == [[1, n, n]] * len(_images())
    err = (pv - _siglip_reference(ref, patch)).abs().max().item()
    print(f"SigLIP {backend} vs transformers {cls}: max abs diff {err}")
    assert err <= LEVEL, f"SigLIP {backend} vs transformers {cls}: max abs diff {err} > {LEVEL}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_num_patches", [256, 64])
def test_siglip2_processor_matches_transformers(backend, max_num_patches):
    cls = "Siglip2ImageProcessor" if backend == "torchvision" else "Siglip2ImageProcessorPil"
    ims = _images(rgb_only=True)
    ref = getattr(transformers.models.siglip2, cls)(max_num_patches=max_num_patches)(images=ims, return_tensors="pt")
    pv, grid = siglip2_from_hf({"max_num_patches": max_num_patches}, backend=backend)(ims)
    assert torch.equal(grid[:, 1:], ref["spatial_shapes"].to(torch.int64)) and (grid[:, 0] == 1).all()
    assert (grid[:, 1] * grid[:, 2] <= max_num_patches).all()
    err = (pv - ref["pixel_values"][ref["pixel_attention_mask"].bool()]).abs().max().item()
    print(f"SigLIP2 {backend} vs transformers {cls}: max abs diff {err}")
    assert err <= LEVEL, f"SigLIP2 {backend} vs transformers {cls}: max abs diff {err} > {LEVEL}"


def test_default_backend_close_to_pil():
    """The two transformers backends differ after a resize (bicubic more than bilinear); grids never."""
    for make, bound in ((siglip_from_hf, 0.5), (siglip2_from_hf, 2 * LEVEL)):
        pv_tv, g_tv = make({})(_images(rgb_only=True))
        pv_pil, g_pil = make({}, backend="pil")(_images(rgb_only=True))
        err = (pv_tv - pv_pil).abs().max().item()
        assert torch.equal(g_tv, g_pil) and err < bound, f"{make.__name__}: torchvision vs pil {err} >= {bound}"


@pytest.mark.parametrize("make", [siglip_from_hf, siglip2_from_hf])
def test_parallel_preprocessor_gives_the_same_pixels(make):
    """mmenc.preprocess.Preprocessor (per image, worker threads) equals the processor's own call."""
    from mmenc.preprocess import Preprocessor

    proc = make({})
    pixel_values, grid = proc(_images(rgb_only=True))
    out = Preprocessor(proc).run(_images(rgb_only=True))
    assert torch.equal(out[1], grid) and torch.equal(out[0], pixel_values)


def test_naflex_size_rule():
    assert naflex_size(224, 224, 16, 256) == (256, 256)  # upscaled to fill the budget
    h, w = naflex_size(1, 1000, 16, 256)
    assert h == 16 and w % 16 == 0 and w // 16 <= 256  # at least one patch per side
    h, w = naflex_size(500, 301, 16, 64)
    assert h % 16 == 0 and w % 16 == 0 and (h // 16) * (w // 16) <= 64


def test_encoder_encode_pooled_and_cli(siglip2, tmp_path):
    from safetensors.torch import load_file

    from mmenc.cli.main import main

    folder, _ = siglip2
    ims = _images(rgb_only=True)[:3]
    with Encoder(str(folder), device="cpu") as enc:
        vectors = enc.encode(ims, pooled=True)
        pixel_values, grid = enc.preprocess(ims)
        want = enc.encode_pixels(pixel_values, grid, pooled=True)
        full = enc.encode(ims, return_extras=True, pooled=True)
    assert [tuple(v.shape) for v in vectors] == [(32,)] * 3
    assert_close(torch.stack(vectors), want, "encode(pooled=True)", TOL)
    assert torch.equal(full[1].extras["pooled"], vectors[1]) and full[1].embeddings.shape[0] == int(grid[1].prod())
    paths = []
    for i, im in enumerate(ims):
        paths.append(str(tmp_path / f"im{i}.png"))
        im.save(paths[-1])
    out = tmp_path / "pooled.safetensors"
    assert main(["encode", *paths, "--model", str(folder), "--device", "cpu", "--pooled", "-o", str(out), "-q"]) == 0
    saved = load_file(str(out))
    assert_close(torch.stack([saved[p] for p in paths]), want, "mmenc encode --pooled", TOL)
