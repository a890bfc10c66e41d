"""A Hub id resolves through huggingface_hub (issue 28, item 4): the cache layout is built on disk here
(mmenc.testing.hub_cache) and every test runs with HF_HUB_OFFLINE=1, so nothing touches the network;
random weights only when asked (load_format="dummy"), and every output made from them says so."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from mmenc.engine.encoder import Encoder
from mmenc.testing.checkpoints import save_qwen2_5_vl
from mmenc.testing.hub_cache import REVISION, put_in_hub_cache

IMAGES = [os.path.join(os.path.dirname(__file__), "..", "examples", "images", name)
          for name in ("square_224.jpg", "tall_200x400.jpg")]
REPO = "Qwen/Qwen2.5-VL-7B-Instruct"  # also a built-in name: today it silently meant random weights


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache folder, offline: huggingface_hub's settings and the environment."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_cached_hub_id_loads_the_checkpoints_weights(q25, hub_cache):
    snapshot = put_in_hub_cache(hub_cache, REPO, q25)
    with Encoder(REPO, device="cpu") as hub, Encoder(q25, device="cpu") as local:
        assert not hub.random_weights and hub.weights == "checkpoint"
        assert hub.checkpoint_folder == snapshot and snapshot.parent.name == "snapshots"
        assert hub.model_name == REPO
        for got, want in zip(hub.encode(IMAGES), local.encode(IMAGES)):
            assert torch.equal(got, want)


def test_only_the_towers_shards_are_needed(tmp_path, hub_cache):
    """A sharded checkpoint cached without the shards that hold no tower tensor (what a download of
    mmenc's files leaves): it loads, and the missing shards are never asked for."""
    folder, _ = save_qwen2_5_vl(tmp_path / "sharded", seed=3, max_shard_size="20KB")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tower = {f for name, f in weight_map.items() if name.startswith(("model.visual.", "visual."))}
    others = set(weight_map.values()) - tower
    assert others, "the checkpoint should have shards without tower tensors"
    put_in_hub_cache(hub_cache, "org/sharded-vl", folder,
                     files=["config.json", "model.safetensors.index.json", *sorted(tower)],
                     absent=["preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"])
    with Encoder("org/sharded-vl", device="cpu") as hub, Encoder(str(folder), device="cpu") as local:
        assert torch.equal(hub.encode(IMAGES[:1])[0], local.encode(IMAGES[:1])[0])


def test_a_hub_id_not_in_the_cache_is_refused_offline_with_the_fix(hub_cache):
    with pytest.raises(ValueError) as e:
        Encoder("Qwen/Qwen2-VL-2B-Instruct", device="cpu")
    message = str(e.value)
    assert "'Qwen/Qwen2-VL-2B-Instruct'" in message and "HF_HUB_OFFLINE" in message
    assert str(hub_cache) in message and "--load-format dummy" in message


def test_random_weights_only_when_asked(hub_cache):
    with Encoder("Qwen/Qwen2-VL-2B-Instruct", device="meta", load_format="dummy") as enc:
        assert enc.random_weights and enc.weights == "random" and enc.checkpoint_folder is None
    with Encoder(device="meta") as default:  # no model: the built-in default, random, offline
        assert default.random_weights and default.model_name == "Qwen/Qwen2.5-VL-7B-Instruct"


def test_dummy_weights_for_a_cached_hub_id_read_its_config_only(q25, hub_cache):
    """load_format="dummy" with a Hub id that is no built-in name: its config.json, no weight file."""
    put_in_hub_cache(hub_cache, "org/config-only", q25, files=["config.json"])
    with Encoder("org/config-only", device="cpu", load_format="dummy") as enc:
        assert enc.random_weights and enc.loaded.config.out_hidden_size == 24


def test_encode_outputs_say_where_the_weights_came_from(q25, hub_cache, tmp_path, capsys):
    from mmenc.cli.main import main

    put_in_hub_cache(hub_cache, "org/tiny", q25)
    for flags, weights in (["--load-format", "dummy"], "random"), ([], "checkpoint"):
        out = tmp_path / f"{weights}.safetensors"
        assert main(["encode", IMAGES[0], "-o", str(out), "--device", "cpu", "-q", "--model", "org/tiny", *flags]) == 0
        with safe_open(str(out), framework="pt") as f:
            assert f.metadata()["weights"] == weights and f.metadata()["model"] == "org/tiny"
        assert f" weights={weights} " in capsys.readouterr().out


@pytest.mark.slow
def test_readme_command_one_runs_offline_and_says_it_is_random(tmp_path):
    """`mmenc encode examples/images --output ...` (README command 1) in a fresh process, offline, with an
    empty cache: it works, and both the summary line and the file say the weights are random (the 7B tower
    at random on the CPU: tens of seconds)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache"),
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    out = tmp_path / "embeddings.safetensors"
    images = os.path.join(os.path.dirname(__file__), "..", "examples", "images")
    run = subprocess.run([sys.executable, "-m", "mmenc", "encode", images, "--output", str(out), "--device", "cpu",
                          "--dtype", "bfloat16", "-q"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "RANDOM" in run.stderr and " weights=random " in run.stdout
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["weights"] == "random"


def test_revision_pins_one_snapshot(q25, hub_cache):
    """Every file comes from the snapshot refs/main names, not from an older one left in the cache."""
    put_in_hub_cache(hub_cache, "org/two-revisions", q25, files=["config.json"], revision="f" * 40)
    snapshot = put_in_hub_cache(hub_cache, "org/two-revisions", q25)  # refs/main now points here
    assert snapshot.name == REVISION
    with Encoder("org/two-revisions", device="cpu") as enc:
        assert enc.checkpoint_folder == snapshot


class _FakeHub:
    """A Hub stand-in on 127.0.0.1 serving one folder as `org/name` at REVISION through the routes
    huggingface_hub downloads from (HEAD then GET /{repo}/resolve/{revision}/{file}); it records the
    files fetched. Loopback only: the suite still never reaches the network."""

    def __init__(self, repo: str, folder):
        import hashlib
        import http.server
        import threading

        files, fetched = {p.name: p for p in folder.iterdir() if p.is_file()}, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, body: bool):
                prefix = f"/{repo}/resolve/"
                name = self.path.split("?")[0][len(prefix):].split("/", 1)[-1] if self.path.startswith(prefix) else None
                if name not in files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound" if name is not None else "RepoNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = files[name].read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", REVISION)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    fetched.append(name)
                    self.wfile.write(data)

            def do_HEAD(self):
                self._answer(False)

            def do_GET(self):
                self._answer(True)

            def log_message(self, *args):
                pass

        self.fetched = fetched
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _resolve_in_child(model: str, env: dict) -> subprocess.CompletedProcess:
    code = "import sys; from mmenc.engine.tower import resolve_checkpoint; print(resolve_checkpoint(sys.argv[1]))"
    return subprocess.run([sys.executable, "-c", code, model], env=env, capture_output=True, text=True, timeout=300)


def test_a_download_fetches_only_the_towers_files(tmp_path):
    """Online (a Hub stand-in on loopback, HF_ENDPOINT): config.json, the processor configs that exist, the
    index and the shards holding tower tensors are downloaded, the language model's shards are not; a second
    resolution offline finds them in the cache."""
    folder, _ = save_qwen2_5_vl(tmp_path / "sharded", seed=4, max_shard_size="20KB")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tower = {f for name, f in weight_map.items() if name.startswith(("model.visual.", "visual."))}
    (folder / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    hub = _FakeHub("org/sharded", folder)
    cache = tmp_path / "cache"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(cache),
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "30", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    try:
        run = _resolve_in_child("org/sharded", env)
        assert run.returncode == 0, run.stderr[-2000:]
        assert set(hub.fetched) == {"config.json", "preprocessor_config.json", "model.safetensors.index.json", *tower}
        assert set(weight_map.values()) - tower, "the language model's shards exist and were not fetched"
    finally:
        hub.close()
    offline = _resolve_in_child("org/sharded", {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert offline.returncode == 0 and offline.stdout.strip() == run.stdout.strip(), offline.stderr[-2000:]


def test_an_unreachable_hub_is_named_with_the_fix(tmp_path):
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path),
           "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    run = _resolve_in_child("org/unreachable", env)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "'org/unreachable'" in last and "downloading it failed" in last and "--load-format dummy" in last, last
