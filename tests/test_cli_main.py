"""`mmenc --version`, and `python -m mmenc` behaving like the `mmenc` command."""
import os
import subprocess
import sys

import mmenc
from mmenc.cli.main import main


def _python_m(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmenc", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.strip() == f"mmenc {mmenc.__version__}"


def test_python_m_mmenc_is_the_mmenc_command(capsys):
    done = _python_m("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"mmenc {mmenc.__version__}", done.stderr
    done = _python_m("backends", "--head-size", "80", "--dtype", "float32")
    assert main(["backends", "--head-size", "80", "--dtype", "float32"]) == 0
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == capsys.readouterr().out
    done = _python_m("encode")  # a usage error (no images and no --text), as from `mmenc encode`
    assert done.returncode == 2
    assert "give images or videos (IMAGE_VIDEO_OR_DIR ...), --text FILE, or both" in done.stderr
