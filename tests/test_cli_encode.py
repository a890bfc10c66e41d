"""`mmenc encode` and `mmenc bench` end to end on a tiny checkpoint and a few generated images."""
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from mmenc.cli.main import main
from mmenc.engine.encoder import Encoder


@pytest.fixture
def images(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "imgs"
    (root / "sub").mkdir(parents=True)
    paths = [root / "a.png", root / "sub" / "b.jpg", root / "c.webp"]
    for p, (h, w) in zip(paths, [(56, 84), (100, 60), (64, 64)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(p)
    (root / "notes.txt").write_text("not an image, not picked up from a folder")
    return root, paths


def test_encode_folder_writes_every_image(folder, images, tmp_path, capsys):
    root, paths = images
    out = tmp_path / "emb.safetensors"
    assert main(["encode", str(root), "--model", folder, "--output", str(out), "--batch-size", "2"]) == 0
    captured = capsys.readouterr()
    assert "images=3" in captured.out and "backend=TORCH_SDPA" in captured.out and "images/s=" in captured.out
    assert "3/3 images" in captured.err  # progress
    tensors = load_file(str(out))
    enc = Encoder(folder, device="cpu")
    for p in paths:
        want = enc.encode([str(p)])[0]
        assert torch.allclose(tensors[str(p)], want, rtol=1e-5, atol=1e-6), f"{p}: embeddings differ"
        assert tensors[f"{p}.grid_thw"].tolist() == enc.preprocess([str(p)])[1][0].tolist()


def test_encode_keeps_good_images_when_one_fails(folder, images, tmp_path, capsys):
    root, paths = images
    bad = root / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    out = tmp_path / "emb.safetensors"
    assert main(["encode", str(paths[0]), str(bad), "--model", folder, "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "broken.png" in err and "failed" in err
    assert set(load_file(str(out))) == {str(paths[0]), f"{paths[0]}.grid_thw"}


def test_encode_bad_arguments(folder, images, tmp_path, capsys):
    assert main(["encode", str(tmp_path / "missing.png"), "--model", folder]) == 2
    assert "missing.png' does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["encode", str(tmp_path / "empty"), "--model", folder]) == 2
    assert "holds no image files" in capsys.readouterr().err
    assert main(["encode", str(images[1][0]), "--model", str(tmp_path / "nowhere")]) == 2
    assert "nowhere' is neither an existing checkpoint folder nor a Hugging Face Hub id" in capsys.readouterr().err
    assert main(["encode", str(images[1][0]), "--model", folder, "--batch-size", "0"]) == 2
    assert "--batch-size=0 must be >= 1" in capsys.readouterr().err


def test_bench_runs_side_by_side_with_transformers(folder, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", folder, "--grid", "1x8x8*2", "--warmup", "0", "--iters", "1",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mmenc (TORCH_SDPA)" in text and "transformers (sdpa)" in text
    import json
    data = json.loads(out.read_text())
    assert data["workloads"][0]["rel_err_vs_transformers"] < 1e-5
    assert {r["impl"].split()[0] for r in data["rows"]} == {"mmenc", "transformers"}
