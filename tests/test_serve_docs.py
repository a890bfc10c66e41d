"""docs/serving.md's curl commands for real photos (issue 28, item 6), run as written with bash and curl
against a real server on loopback, with a photo past the ~96 KB at which an image inlined into the command
line fails (`Argument list too long`): both answers equal Encoder.encode."""
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi")
from serve_client import decode_item, free_port, request, running_server, wait_for  # noqa: E402

from mmenc.engine.encoder import Encoder  # noqa: E402
from mmenc.serving.settings import ServeSettings  # noqa: E402

DOC = pathlib.Path(__file__).parent.parent / "docs" / "serving.md"


def documented_block() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- real-photo-example[^>]*-->\s*```bash\n(.*?)```", text, re.S)
    assert match, "docs/serving.md has no real-photo-example block"
    return match.group(1)


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("base64") is None, reason="needs curl and base64")
def test_the_documented_curl_commands_send_a_real_photo(q25, tmp_path):
    rng = np.random.default_rng(0)
    photo = tmp_path / "photo.jpg"
    Image.fromarray(rng.integers(0, 255, (400, 500, 3), dtype=np.uint8)).save(photo, quality=95)
    assert photo.stat().st_size > 200_000  # well past the size an inlined base64 argument fails at
    settings = ServeSettings(port=free_port(), preprocess_threads=1)
    with running_server(settings, lambda: Encoder(q25, device="cpu")) as (port, _):
        wait_for(lambda: request(port, "GET", "/health").status == 200, 60, "the encoder to load")
        script = documented_block().replace("localhost:8000", f"127.0.0.1:{port}")
        run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        inline = (f'curl -s 127.0.0.1:{port}/v1/encode -H "content-type: application/json" '
                  f'-d "{{\\"images\\": [\\"data:image/jpeg;base64,$(base64 -w0 photo.jpg)\\"]}}"')
        control = subprocess.run(["bash", "-c", inline], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert control.returncode != 0 and "Argument list too long" in control.stderr  # the one-liner of old
    import json

    want = Encoder(q25, device="cpu").encode([str(photo)])[0]
    for name in ("answer-multipart.json", "answer-json.json"):
        answer = json.loads((tmp_path / name).read_text())
        assert "error" not in answer and "error" not in answer["data"][0], answer
        assert torch.equal(decode_item(answer["data"][0], "base64"), want), name
