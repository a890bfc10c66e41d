"""`mmenc bench --video` (mmenc/bench/video.py) on the CPU with a tiny tower: every row is measured, the
JSON is written as the rows come, and the summary line says how encode compares with the tower alone."""
import json

import pytest

pytest.importorskip("av")
pytest.importorskip("transformers")


def test_video_bench_rows_and_json(tmp_path, capsys):
    from mmenc.bench.video import format_video, run_video
    from mmenc.engine.encoder import Encoder
    from mmenc.testing import checkpoints as ck

    folder, _ = ck.save_qwen2_5_vl(tmp_path / "ckpt")
    out = tmp_path / "video.json"
    with Encoder(str(folder), device="cpu", dtype="float32", preprocess_workers=1) as enc:
        rows = run_video(enc, None, seconds=1.0, size=(56, 84), fps=4.0, batch=2, lengths=[1.0],
                         folder=tmp_path, warmup=0, iters=1, json_path=str(out))
    impls = ["mmenc encode(files)", "mmenc preprocess only", "mmenc tower alone"]
    assert [(r.name.split("x")[0], r.impl) for r in rows] == [(n, i) for n in ("1", "2") for i in impls]
    assert all(r.ms > 0 and r.frames == int(r.name.split("x")[0]) * 4 for r in rows)
    saved = json.loads(out.read_text())
    assert [r["impl"] for r in saved["rows"]] == [r.impl for r in rows] and saved["peak_gib_by_seconds"] == {}
    err = capsys.readouterr().err
    assert "transformers skipped" in err and err.count(" frames/s") == len(rows)
    assert err.count("waiting for preprocessing") == 2 and "peak" not in err  # encode rows; the CPU has no peak
    assert all((0 <= r.wait_share <= 1) if r.impl == "mmenc encode(files)" else r.wait_share is None for r in rows)
    assert all(r.peak_gib is None for r in rows) and "wait_share" in saved["rows"][0]
    assert "of the tower alone (target >= 90%)" in format_video(rows, {})
