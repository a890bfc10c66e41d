"""`mmenc backends`: the table of every backend and the platform's pick, as text and as JSON."""
import json

import pytest
import torch

from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import DeviceInfo, registered_backends
from mmenc.cli.main import main
from mmenc.platforms.cpu import CpuPlatform
from mmenc.platforms.cuda import CudaPlatform


def run(capsys, *argv):
    rc = main(["backends", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def table_rows(out: str) -> dict[str, str]:
    """backend name -> its table line."""
    rows = {}
    for line in out.splitlines():
        words = line.replace("*", " ").replace("+", " ").split()
        if words and words[0] in B.__members__:
            rows[words[0]] = line
    return rows


def test_cpu_defaults(capsys, use_platform):
    use_platform(CpuPlatform())
    rc, out, _ = run(capsys)
    assert rc == 0
    assert "platform: cpu" in out and "device: " in out
    assert "head_size: 80" in out and "float32 (default on CPU)" in out
    rows = table_rows(out)
    assert set(rows) == {b.name for b in registered_backends()}, "every registered backend has a row"
    assert rows["TORCH_SDPA"].lstrip().startswith("*")
    assert sum(line.lstrip().startswith("*") for line in rows.values()) == 1
    assert "selected (*): TORCH_SDPA: first usable in the cpu priority list for float32" in out
    assert "not offered by the cpu platform" in rows["FLASH_ATTN"]
    assert f"yes ({torch.__version__})" in rows["NAIVE"]


def test_gpu_default_dtype_is_bfloat16(capsys, use_platform):
    use_platform(CudaPlatform(DeviceInfo(type="cuda", vendor="nvidia", capability=(9, 0))))
    rc, out, _ = run(capsys, "--head-size", "128")
    assert rc == 0
    assert "platform: cuda" in out and "compute capability 9.0" in out
    assert "head_size: 128" in out and "bfloat16 (default on cuda)" in out
    assert "priority for bfloat16: FLASH_ATTN > TORCH_SDPA" in out


def test_fallback_explains_what_was_passed_over(capsys, use_platform):
    use_platform(CudaPlatform(DeviceInfo(type="cuda", vendor="nvidia", capability=(9, 0))))
    rc, out, _ = run(capsys, "--dtype", "fp32")
    assert rc == 0 and "float32 (requested)" in out
    assert "selected (*): TORCH_SDPA" in out and "passed over: FLASH_ATTN" in out
    assert "float32 is not supported" in table_rows(out)["FLASH_ATTN"]


@pytest.mark.parametrize("spelling, name", [("bf16", "bfloat16"), ("FLOAT16", "float16"), ("half", "float16"),
                                            ("float32", "float32")])
def test_dtype_spellings(capsys, use_platform, spelling, name):
    use_platform(CpuPlatform())
    rc, out, _ = run(capsys, "--dtype", spelling)
    assert rc == 0 and f"dtype: {name} (requested)" in out


def test_bad_dtype_names_value_and_choices(capsys, use_platform):
    use_platform(CpuPlatform())
    rc, out, err = run(capsys, "--dtype", "float8")
    assert rc == 2 and out == ""
    assert "'float8'" in err and "float32" in err and "float16" in err and "bfloat16" in err


def test_bad_head_size(capsys, use_platform):
    use_platform(CpuPlatform())
    rc, _, err = run(capsys, "--head-size", "0")
    assert rc == 2 and "--head-size 0" in err


def test_json(capsys, use_platform):
    use_platform(CpuPlatform())
    rc, out, _ = run(capsys, "--json", "--head-size", "72", "--dtype", "bfloat16")
    assert rc == 0
    data = json.loads(out)
    assert data["platform"] == "cpu" and data["head_size"] == 72 and data["dtype"] == "bfloat16"
    assert data["dtype_source"] == "requested"
    assert data["selected"] == "TORCH_SDPA" and "priority list" in data["why"]
    assert data["priority"] == [b.name for b in CpuPlatform().vit_attn_priority(torch.bfloat16)]
    rows = {r["name"]: r for r in data["backends"]}
    assert set(rows) == {b.name for b in registered_backends()}
    assert [name for name, r in rows.items() if r["selected"]] == ["TORCH_SDPA"]
    for row in rows.values():
        assert row["usable"] == (not row["reasons"])
        assert (row["priority"] is not None) == (row["name"] in data["priority"])
    assert rows["TORCH_SDPA"]["priority"] == 1 and rows["TORCH_SDPA"]["installed"] is True
    assert rows["FLASH_ATTN"]["offered"] is False and not rows["FLASH_ATTN"]["usable"]


def test_nothing_usable_says_why(capsys, use_platform, fake_platform_cls, monkeypatch):
    platform = fake_platform_cls("cpu", priority=(B.FLASH_ATTN,), name="bare")()
    use_platform(platform)
    rc, out, _ = run(capsys)
    assert rc == 1
    assert "selected: none" in out and "no encoder-attention backend can run" in out and "FLASH_ATTN" in out
    assert not any(line.lstrip().startswith("*") for line in table_rows(out).values())


def test_listed_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "backends" in capsys.readouterr().out


def test_short_segment_choice_shown(capsys, use_platform, fake_platform_cls):
    cls = fake_platform_cls("cpu", priority=(B.TORCH_SDPA, B.NAIVE), name="windows")
    cls.vit_attn_short_priority = lambda self, dtype: [B.FLASH_ATTN, B.NAIVE]
    cls.short_seqlen_max = 64
    use_platform(cls())
    rc, out, _ = run(capsys)
    assert rc == 0
    assert table_rows(out)["NAIVE"].lstrip().startswith("+")
    assert "longest segment is <= 64 tokens (+): NAIVE" in out
    rc, out, _ = run(capsys, "--json")
    data = json.loads(out)
    assert data["selected"] == "TORCH_SDPA" and data["short_selected"] == "NAIVE"
    assert data["short_priority"] == ["FLASH_ATTN", "NAIVE"] and data["short_seqlen_max"] == 64


def test_no_short_choice_by_default(capsys, use_platform):
    use_platform(CpuPlatform())
    rc, out, _ = run(capsys, "--json")
    assert json.loads(out)["short_selected"] is None


def _words(text: str) -> list[str]:
    return text.replace("*", " ").split()


@pytest.mark.parametrize("width", [100, 80])  # reasons under their column; under the row
def test_width_wraps_the_reasons(capsys, use_platform, width):
    use_platform(CpuPlatform())
    _, full, _ = run(capsys, "--width", "0")
    rc, out, _ = run(capsys, "--width", str(width))
    assert rc == 0
    table = out.split("\n\n")[1]
    assert max(len(line) for line in table.splitlines()) <= width, table
    assert _words(out) == _words(full), "wrapping must keep every word, in order"
    assert "--pre flash-attn-4" in " ".join(out.split()), "a package name is not cut at its hyphens"
    assert max(len(line) for line in full.splitlines()) > 100, "the unwrapped table is wider than tested"


def test_terminal_width_is_the_default_on_a_terminal(capsys, use_platform, monkeypatch):
    import os
    import sys

    use_platform(CpuPlatform())
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr("shutil.get_terminal_size", lambda *a: os.terminal_size((90, 24)))
    rc, out, _ = run(capsys)
    assert rc == 0 and max(len(line) for line in out.split("\n\n")[1].splitlines()) <= 90
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    rc, out, _ = run(capsys)
    assert max(len(line) for line in out.splitlines()) > 90, "piped output keeps one line per backend"


def test_bad_width(capsys, use_platform):
    use_platform(CpuPlatform())
    rc, _, err = run(capsys, "--width", "-3")
    assert rc == 2 and "--width -3" in err


def test_linear_backends_table(capsys, use_platform):
    use_platform(CpuPlatform(DeviceInfo(type="cpu", vendor="cpu", features=frozenset({"avx2", "avx512"}))))
    rc, out, _ = run(capsys)
    assert rc == 0
    assert "linears (float32): priority ONEDNN > NATIVE" in out and "cpu features: avx2, avx512" in out
    assert "selected (*): ONEDNN: first usable in the cpu priority list for float32" in out
    rc, out, _ = run(capsys, "--json", "--quantization", "fp8")
    linear = json.loads(out)["linear"]
    assert rc == 1 and linear["selected"] is None and "no linear backend can run" in linear["why"]
    rows = {r["name"]: " ".join(r["reasons"]) for r in linear["backends"]}
    assert all("runs unquantized weights only" in why for name, why in rows.items() if name != "FP8")
    assert "needs a CUDA GPU" in rows["FP8"] and "not offered by the cpu platform" in rows["FP8"]
