"""Videos through `mmenc encode` (progress in frames, metadata in the file) and `mmenc serve` (JSON data
URLs, multipart, the `vllm` video form, the EC storage, the cache), on clips these tests encode."""
import base64
import json

import pytest
import torch

pytest.importorskip("av")

from mmenc.preprocess.video import Video  # noqa: E402
from mmenc.testing.clips import write_clip  # noqa: E402


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_clip(tmp_path_factory.mktemp("vclip") / "clip.mp4", frames=24, size=(32, 48), fps=8, gop=5)


@pytest.fixture(scope="module")
def reference(q25, clip):
    from mmenc.engine.encoder import Encoder

    with Encoder(q25, device="cpu", dtype="float32", preprocess_workers=1) as enc:
        (out,) = enc.encode([Video(clip, fps=2)])
    return out


def test_cli_encodes_videos_with_metadata_and_frame_progress(q25, clip, tmp_path, capsys, reference):
    from safetensors import safe_open

    from mmenc.cli.main import main

    bad = tmp_path / "bad.webm"
    bad.write_bytes(b"\x1a\x45\xdf\xa3" + bytes(50))
    out = tmp_path / "out.safetensors"
    code = main(["encode", str(clip), str(bad), "--model", q25, "--device", "cpu", "--fps", "2", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "bad.webm" in err and f"/{len(reference.video.frames_indices)} frames" in err
    with safe_open(str(out), "pt") as f:
        assert torch.allclose(f.get_tensor(str(clip)), reference.embeddings.float(), rtol=1e-5, atol=1e-6)
        assert f.get_tensor(f"{clip}.grid_thw").tolist() == [list(r) for r in reference.video.grid_thw]
        assert f.get_tensor(f"{clip}.frames_indices").tolist() == list(reference.video.frames_indices)
        meta = json.loads(f.metadata()[f"video:{clip}"])
    assert meta["second_per_grid_ts"] == pytest.approx(reference.video.second_per_grid_ts)


def test_serve_takes_videos_in_json_and_multipart(q25, clip, tmp_path, reference):
    pytest.importorskip("fastapi")
    from serve_client import free_port, load_b64_tensor, multipart, post_json, rel_err, request, served

    from mmenc.serving.settings import ServeSettings

    data = clip.read_bytes()
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    ec = tmp_path / "ec"
    settings = ServeSettings(port=free_port(), max_wait_ms=5, preprocess_threads=2, max_batch_patches=2048,
                             ec_storage=str(ec))
    with served(settings, q25, tmp_path / "serve.log") as port:
        reply = post_json(port, {"images": [url], "fps": 2, "format": "vllm", "uuids": ["clip-1"]})
        assert reply.status == 200, reply.body[:500]
        item = reply.json()["data"][0]
        part = item["video_embeds"]["video_embeds"]
        grid = [list(r) for r in reference.video.grid_thw]
        assert item["video_embeds"]["type"] == "video_embeds" and item["video"]["grid_thw"] == grid
        assert rel_err(load_b64_tensor(part["video_embeds"]), reference.embeddings) < 1e-5
        assert [load_b64_tensor(part["video_grid_thw"]).tolist()] == grid  # [3]: one part's row, as vLLM stacks
        assert load_b64_tensor(part["second_per_grid_ts"]).tolist() == reference.video.second_per_grid_ts  # a scalar
        assert list(ec.rglob("*")), "the video's embeddings were written to the EC storage"
        body, ctype = multipart([data], {"fps": "2", "format": "json", "uuids": "clip-1"})
        again = request(port, "POST", "/v1/encode", body, {"content-type": ctype})
        assert again.status == 200, again.body[:500]
        item = again.json()["data"][0]
        assert item["cached"] and rel_err(torch.tensor(item["embedding"]), reference.embeddings) < 1e-5
        bad = post_json(port, {"images": ["data:video/mp4;base64," + base64.b64encode(data[:300]).decode()]})
        assert bad.status == 200 and bad.json()["data"][0]["error"]["type"] == "invalid_video"
        assert post_json(port, {"images": [url], "fps": 0}).status == 400


def test_ray_job_encodes_video_pieces_and_joins_them(q25, clip, tmp_path, reference):
    """`mmenc encode --ray` over a folder of videos and an image: one row per video piece, joined per key."""
    pytest.importorskip("ray.data")
    import os

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from mmenc.ray.cluster import start_local
    from mmenc.ray.data import OfflineSettings, read_shards, run_job
    from serve_client import png

    image = tmp_path / "img.png"
    image.write_bytes(png(56, 56))
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypisom" + bytes(40))
    keys = [str(clip), str(image), str(bad)]
    start_local(num_cpus=2)
    try:
        settings = OfflineSettings(output=str(tmp_path / "shards"), shard_size=2, encoders=1, batch_size=4,
                                   video={"fps": 2}, video_piece_patches=1)
        report = run_job(keys, {"model": q25, "device": "cpu", "dtype": "float32"}, settings)
    finally:
        ray.shutdown()
    tensors, failed = read_shards(tmp_path / "shards")
    assert report.images == 2 and list(failed) == [str(bad)]
    assert torch.allclose(tensors[str(clip)], reference.embeddings, rtol=1e-5, atol=1e-6)
    assert tensors[f"{clip}.grid_thw"].tolist() == [list(r) for r in reference.video.grid_thw]
    assert tensors[f"{clip}.frames_indices"].tolist() == list(reference.video.frames_indices)
