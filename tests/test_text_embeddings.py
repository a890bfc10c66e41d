"""Texts and images in one space (issue 31, item 3): `Encoder.embed_text` against transformers'
get_text_features on the checkpoint's own tokenizer (tiny tokenizers written beside tiny checkpoints,
nothing downloaded), for CLIP (causal, end-of-text pooling, both eos rules), SigLIP and SigLIP2
(max_length padding, last-token head); the scores image x text equal transformers' logits; errors;
`mmenc encode --text FILE`."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from mmenc.engine.encoder import Encoder
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close

transformers = pytest.importorskip("transformers")

TOL = 1e-5
TEXTS = ["a photo of a cat", "dog", "two dogs on the grass in the sun at noon", "a", "the red car"]


def _reference(model, folder, texts, padding):
    """get_text_features on the tokenizer transformers loads from the folder (AutoTokenizer picks the class:
    a Siglip2 checkpoint's is Siglip2Tokenizer over the saved tokenizer.json)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    inputs = tokenizer(texts, padding=padding, truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        out = model.get_text_features(**inputs)
    return out.pooler_output if hasattr(out, "pooler_output") else out


@pytest.mark.parametrize("eos_last", [False, True], ids=["eos-id", "eos-argmax"])
def test_clip_text_matches_get_text_features(tmp_path, eos_last):
    text = {"eos_token_id": 2, "vocab_size": 64} if eos_last else {}  # eos 2: transformers pools at argmax(ids)
    folder, model = ck.save_clip(tmp_path, text=text)
    ck.save_tiny_tokenizer(folder, "clip", eos_last=eos_last)
    want = _reference(model, folder, TEXTS, padding=True)
    with Encoder(str(folder), device="cpu") as enc:
        assert enc.supports_text and enc.pooled_dim == 24
        got = enc.embed_text(TEXTS)
        assert enc.embed_text([]).shape == (0, 24)
    assert got.shape == (len(TEXTS), 24)
    err = assert_close(got, want, "CLIP get_text_features", TOL)
    print(f"CLIP text ({'argmax' if eos_last else 'eos id'}): relative error {err:.2e} (tolerance {TOL:.0e})")


@pytest.mark.parametrize("version", [1, 2])
def test_siglip_text_matches_get_text_features(tmp_path, version):
    folder, model = ck.save_siglip(tmp_path, version=version)
    ck.save_tiny_tokenizer(folder, "siglip")
    want = _reference(model, folder, TEXTS, padding="max_length")
    with Encoder(str(folder), device="cpu") as enc:
        assert enc.pooled_dim == 32
        got = enc.embed_text(TEXTS)
    err = assert_close(got, want, f"SigLIP{version} get_text_features", TOL)
    print(f"SigLIP{version} text: relative error {err:.2e} (tolerance {TOL:.0e})")


def test_image_text_scores_equal_transformers_logits(tmp_path):
    """cos(image, text) * exp(logit_scale) from mmenc's two embeddings = CLIPModel's logits_per_image."""
    folder, model = ck.save_clip(tmp_path)
    tokenizer = ck.save_tiny_tokenizer(folder, "clip")
    grid = torch.tensor([[1, 6, 6], [1, 6, 6]])
    pixels = ck.FAMILIES["CLIPModel"].pixels(grid, seed=3)
    with Encoder(str(folder), device="cpu") as enc:
        images = torch.nn.functional.normalize(enc.encode_pixels(pixels, grid, pooled=True), dim=-1)
        texts = torch.nn.functional.normalize(enc.embed_text(TEXTS[:3]), dim=-1)
    inputs = tokenizer(TEXTS[:3], padding=True, truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        want = model(**inputs, pixel_values=torch.cat(ck.frame_images(pixels, grid, 8))).logits_per_image
    assert_close(images @ texts.T * model.logit_scale.exp().detach(), want, "CLIP logits_per_image", TOL)


def test_text_errors_name_the_model(tmp_path):
    folder, _ = ck.save_llava(tmp_path / "llava")
    with Encoder(str(folder), device="cpu") as enc:
        assert not enc.supports_text and enc.pooled_dim is None
        with pytest.raises(ValueError, match=r"LlavaForConditionalGeneration has no text tower mmenc runs"):
            enc.embed_text(["a"])
    clip, _ = ck.save_clip(tmp_path / "clip")  # no tokenizer files
    with Encoder(str(clip), device="cpu") as enc:
        with pytest.raises(ValueError, match="has no tokenizer files"):
            enc.embed_text(["a"])
    ck.save_tiny_tokenizer(clip, "clip")
    with Encoder(str(clip), device="cpu") as enc:
        with pytest.raises(ValueError, match="texts must be a list of strings"):
            enc.embed_text("a photo")
    with Encoder("openai/clip-vit-base-patch16", device="meta", load_format="dummy") as enc:
        assert not enc.supports_text
        with pytest.raises(ValueError, match="random weights and no tokenizer files"):
            enc.embed_text(["a"])


def test_cli_encode_text(tmp_path):
    folder, model = ck.save_clip(tmp_path / "clip")
    ck.save_tiny_tokenizer(folder, "clip")
    texts = tmp_path / "texts.txt"
    texts.write_text("a photo of a cat\n\ndog\n")  # blank lines are skipped
    image = tmp_path / "im.png"
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 50, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "out.safetensors"
    subprocess.run([sys.executable, "-m", "mmenc", "encode", str(image), "--text", str(texts), "--pooled",
                    "--model", str(folder), "--device", "cpu", "-o", str(out), "--quiet"], check=True)
    with safe_open(str(out), "pt") as f:
        assert sorted(f.keys()) == sorted([str(image), f"{image}.grid_thw", "text:1", "text:3"])
        got = torch.stack([f.get_tensor("text:1"), f.get_tensor("text:3")])
        assert json.loads(f.metadata()["texts"]) == {"text:1": "a photo of a cat", "text:3": "dog"}
        assert f.get_tensor(str(image)).shape == (24,)
    assert_close(got, _reference(model, folder, ["a photo of a cat", "dog"], padding=True), "CLI text", TOL)
