"""Idefics3 / SmolVLM specifics beyond the generic tower tests (their FAMILIES rows check get_image_features
parity on several tiles of two sizes per call, TP=2, data mode, built-ins): the bucketed positions against
transformers' embedding, and the processor against transformers' PIL class (Lanczos) and torchvision class
(bicubic below torchvision 0.27) where torchvision imports."""
import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc.layers.vit import bucket_positions
from mmenc.preprocess.idefics3 import idefics3_from_hf

transformers = pytest.importorskip("transformers")
HAS_TV = importlib.util.find_spec("torchvision") is not None


@pytest.mark.parametrize("side,patch", [(26, 14), (32, 16), (27, 14)])
def test_bucket_positions_equal_transformers(side, patch):
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    embeddings = Idefics3VisionEmbeddings(transformers.Idefics3VisionConfig(hidden_size=8, image_size=side * patch,
                                                                            patch_size=patch))
    seen = []
    embeddings.position_embedding.register_forward_hook(lambda module, args, out: seen.append(args[0][0]))
    for h, w in [(side, side), (side - 1, side), (5, 9), (1, 1), (side + 3, 2)]:
        embeddings(torch.zeros(1, 3, h * patch, w * patch), torch.ones(1, h, w, dtype=torch.bool))
        assert torch.equal(seen[-1], bucket_positions(h, w, side)), (h, w)


CONFIGS = [({}, 14), ({"size": {"longest_edge": 1024}, "max_image_size": {"longest_edge": 512}}, 16),
           ({"do_image_splitting": False}, 14), ({"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 48},
                                                 "resample": 3}, 8)]


def _compare(hf, cfg, patch, backend):
    rng = np.random.default_rng(0)
    proc = idefics3_from_hf({**cfg, "patch_size": patch}, backend=backend)
    for h, w in [(33, 97), (97, 33), (1, 1), (12, 700), (1000, 700)]:  # every one is resized to the longest edge
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        ref = torch.as_tensor(np.asarray(hf(images=[[im]], return_tensors="pt")["pixel_values"][0]))
        pv, grid = proc([im])
        tiles, s, _ = grid[0].tolist()
        assert ref.shape[0] == tiles, f"{h}x{w}: {tiles} tiles, transformers {ref.shape[0]}"
        edge = s * patch
        got = pv.view(tiles, s, s, 3, patch, patch).permute(0, 3, 1, 4, 2, 5).reshape(tiles, 3, edge, edge)
        err = (got - ref[:, :, :edge, :edge]).abs().max().item()
        assert err == 0.0, f"{type(hf).__name__} {cfg} on {h}x{w}: max abs diff {err}"


@pytest.mark.parametrize("cfg,patch", CONFIGS)
def test_processor_matches_transformers_pil(cfg, patch):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    _compare(Idefics3ImageProcessorPil(**cfg), cfg, patch, "pil")


@pytest.mark.skipif(not HAS_TV, reason="transformers' default (torchvision) processors need torchvision")
@pytest.mark.parametrize("cfg,patch", CONFIGS)
def test_processor_matches_transformers_torchvision(cfg, patch):
    import torchvision
    from transformers.models.idefics3.image_processing_idefics3 import Idefics3ImageProcessor

    from mmenc.testing import version_before

    if cfg.get("resample", 1) == 1 and not version_before(torchvision.__version__, "0.27"):
        pytest.skip("torchvision >= 0.27 resizes Lanczos on the CPU, which mmenc's torchvision backend does not")
    _compare(Idefics3ImageProcessor(**cfg), cfg, patch, "torchvision")


def test_processor_errors_name_the_value():
    with pytest.raises(ValueError, match=r"resample=4 is not supported"):
        idefics3_from_hf({"resample": 4})
    with pytest.raises(ValueError, match=r"takes size=\{'longest_edge': N\}"):
        idefics3_from_hf({"size": {"height": 10, "width": 10}})
