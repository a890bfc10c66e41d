"""`mmenc bench` on a CPU: a small default workload, a warning before long ones, progress, arguments
checked before any work, and the JSON written atomically."""
import json

import pytest

import mmenc.cli.bench as bench_cli
from mmenc.cli.main import main
from mmenc.bench.measure import WORKLOADS


def _bench(capsys, *argv):
    rc = main(["bench", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cpu_default_is_a_quick_run_that_prints_the_longer_one(folder, tmp_path, capsys):
    out = tmp_path / "b.json"
    rc, stdout, err = _bench(capsys, "--model", folder, "--device", "cpu", "--json", str(out))
    assert rc == 0
    assert "the device is a CPU: a quick run of the small CPU workload cpu-1x112px" in err
    assert "cpu-1x112px" in stdout and "8x1036px" not in stdout and "cpu-2x224px" not in stdout
    data = json.loads(out.read_text())
    assert [w["workload"] for w in data["workloads"]] == ["cpu-1x112px"]
    assert data["workloads"][0]["rel_err_vs_transformers"] < 1e-5
    calls = 2 + 1 + 3 + 1 + 1 + 3  # flop count, first call, warm-up, timed; transformers: reference, warm-up, timed
    assert f"mmenc bench cpu-1x112px: {calls}/{calls} tower calls (100%)" in err
    longer = next(line for line in err.splitlines() if "a longer one:" in line).split("a longer one: ", 1)[1]
    assert longer == (f"mmenc bench --model {folder} --device cpu --workload cpu-2x224px --warmup 3 --iters 10")
    rc, _, err = _bench(capsys, *longer.split()[2:], "--no-hf", "--iters", "1", "--warmup", "0")  # it runs
    assert rc == 0 and "a longer one" not in err and "mmenc bench cpu-2x224px: 3/3 tower calls" in err


def test_the_quick_cpu_run_of_the_default_tower_fits_in_about_a_minute():
    """The default tower (Qwen2.5-VL-7B's, 670 M parameters) in the quick run: its FLOPs (2 x parameters x
    patches per call, every call) at 0.1 TFLOP/s, a modest 2-core rate, take well under a minute."""
    grids = bench_cli.CPU_WORKLOADS[next(iter(bench_cli.CPU_WORKLOADS))]
    warmup, iters = bench_cli.CPU_QUICK
    calls = 2 + warmup + iters + 1 + warmup + iters
    seconds = calls * 2 * 670e6 * sum(t * h * w for t, h, w in grids) / 0.1e12
    assert seconds < 20, seconds


def test_long_cpu_workload_is_announced(folder, capsys, monkeypatch):
    monkeypatch.setattr(bench_cli, "matmul_tflops", lambda device, dtype: 1e-9)  # a very slow CPU
    rc, _, err = _bench(capsys, "--model", folder, "--grid", "1x8x8*2", "--warmup", "0", "--iters", "1", "--no-hf")
    assert rc == 0
    warning = next(line for line in err.splitlines() if "warning: workload 1x8x8*2" in line)
    assert "is long on a CPU" in warning and "3 tower calls would take about" in warning
    assert "--workload cpu-1x112px" in warning
    rc, _, err = _bench(capsys, "--model", folder, "--grid", "1x8x8*2", "--warmup", "0", "--iters", "1", "--no-hf",
                        "--quiet")
    assert "warning: workload" in err and "tower calls (100%)" not in err, "--quiet keeps warnings, drops progress"


def test_cpu_warning_estimate():
    grids = WORKLOADS["8x1036px"]
    warning = bench_cli.cpu_warning("8x1036px", grids, params=670_000_000, tflops=0.2, calls=29)
    patches = 8 * 74 * 74
    hours = 29 * 2 * 670e6 * patches / 0.2e12 / 3600
    assert f"is sized for a GPU: its 29 tower calls would take about {hours:.1f} h" in warning
    assert f"{patches} patches" in warning
    assert bench_cli.cpu_warning("cpu-2x224px", bench_cli.CPU_WORKLOADS["cpu-2x224px"], params=1000, tflops=1.0,
                                 calls=29) is None


@pytest.mark.parametrize("argv, needle", [
    (["--iters", "0"], "--iters=0 must be >= 1"),
    (["--warmup", "-1"], "--warmup=-1 must be >= 0"),
    (["--device", "bogus"], "--device 'bogus' is not a torch device"),
    (["--max-intermediate-bytes", "-1"], "max_intermediate_bytes=-1"),
])
def test_bad_arguments_are_one_line(folder, capsys, argv, needle):
    rc, out, err = _bench(capsys, "--model", folder, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_row_block_budget_flag(folder, tmp_path, capsys):
    """--max-intermediate-bytes 64 splits every block's MLP into row blocks: still transformers' answer."""
    out = tmp_path / "b.json"
    rc, _, _ = _bench(capsys, "--model", folder, "--device", "cpu", "--warmup", "0", "--iters", "1",
                      "--max-intermediate-bytes", "64", "--json", str(out))
    assert rc == 0
    assert json.loads(out.read_text())["workloads"][0]["rel_err_vs_transformers"] < 1e-5


def test_bad_json_path_fails_before_work(folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_cli, "encoder_kwargs", lambda *a: pytest.fail("the model was built first"))
    rc, _, err = _bench(capsys, "--model", folder, "--json", str(tmp_path / "nowhere" / "b.json"))
    assert rc == 2 and "--json" in err and "does not exist; create it first" in err
    rc, _, err = _bench(capsys, "--model", folder, "--json", str(tmp_path))
    assert rc == 2 and "is a folder" in err


def test_help_lists_workloads_without_design_md(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "DESIGN.md" not in text
    assert "8x1036px: 8 images of 1x74x74 patches" in text and "cpu-2x224px: 2 images of 1x16x16 patches" in text
    assert "--quiet" in text
