"""Pieces of `mmenc serve` without HTTP: sizes, settings, the LRU cache, request parsing, the batcher."""
import time

import pytest
import torch

pytest.importorskip("prometheus_client")

from mmenc.models.base import TowerOutput  # noqa: E402
from mmenc.serving.batcher import Batcher, Job  # noqa: E402
from mmenc.serving.cache import EncoderCache  # noqa: E402
from mmenc.serving.formats import EncodedImage  # noqa: E402
from mmenc.serving.inputs import RequestError, parse_form  # noqa: E402
from mmenc.serving.metrics import ServeMetrics  # noqa: E402
from mmenc.serving.settings import ServeSettings, parse_size  # noqa: E402


def test_parse_size():
    assert parse_size("0", "--cache-bytes") == 0
    assert parse_size("512MiB", "x") == 512 << 20 and parse_size("2G", "x") == 2 * 10 ** 9
    assert parse_size("1.5kib", "x") == 1536 and parse_size(77, "x") == 77
    with pytest.raises(ValueError, match=r"--cache-bytes='lots' is not a size.*512MiB"):
        parse_size("lots", "--cache-bytes")


def test_settings_name_the_bad_value():
    with pytest.raises(ValueError, match="max_batch_patches=0 must be a positive integer"):
        ServeSettings(max_batch_patches=0)
    with pytest.raises(ValueError, match="max_queue_images=4 < max_images_per_request=8"):
        ServeSettings(max_queue_images=4, max_images_per_request=8)
    with pytest.raises(ValueError, match="port=70000"):
        ServeSettings(port=70000)
    with pytest.raises(ValueError, match=r"frontends=-1 must be an integer >= 0"):
        ServeSettings(frontends=-1)


def _entry(rows: int) -> EncodedImage:
    return EncodedImage(torch.zeros(rows, 4), 4, (1, 2, 2 * rows))  # 16 bytes per row


def test_cache_evicts_least_recently_used_by_bytes():
    cache = EncoderCache(max_bytes=160)
    for key in "abc":
        cache.put(key, _entry(3))  # 48 bytes each
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", _entry(3))  # 192 > 160: evict b (least recent)
    assert cache.get("b") is None and all(cache.get(k) is not None for k in "acd")
    assert cache.nbytes == 144 and len(cache) == 3
    cache.put("huge", _entry(20))  # larger than the whole cache: not stored, nothing evicted
    assert cache.get("huge") is None and len(cache) == 3
    off = EncoderCache(max_bytes=0)
    off.put("a", _entry(1))
    assert off.get("a") is None


def test_form_fields_checked():
    req = parse_form([b"x", b"y"], {"format": ["json"], "uuids": ["u1", "u2"]}, max_images=4)
    assert req.format == "json" and [i.uuid for i in req.images] == ["u1", "u2"]
    with pytest.raises(RequestError, match="uuids must be a list with one entry per image"):
        parse_form([b"x"], {"uuids": ["u1", "u2"]}, max_images=4)
    with pytest.raises(RequestError, match="format='png' is not supported"):
        parse_form([b"x"], {"format": ["png"]}, max_images=4)
    assert parse_form([b""], {}, max_images=4).images[0].error.kind == "invalid_image"


class _FakeTower:
    """encode_pixels that records the images per call; rows = patches / 4 (merge 2x2), width 3."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def encode_pixels(self, pixel_values, grid_thw, return_extras=True):
        self.calls.append(grid_thw.shape[0])
        if self.fail:
            raise RuntimeError("device lost")
        rows = int(grid_thw.prod(-1).sum()) // 4
        return TowerOutput(torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3),
                           {"deepstack": [torch.ones(rows, 3)]})

    @staticmethod
    def output_tokens(grid_thw):
        return (grid_thw.prod(-1) // 4).tolist()


def _job(side: int) -> Job:
    grid = torch.tensor([[1, side, side]])
    return Job(torch.zeros(side * side, 8), grid)


def test_batcher_fills_calls_up_to_max_patches_and_drops_cancelled_jobs():
    tower = _FakeTower()
    batcher = Batcher(tower.encode_pixels, tower.output_tokens, max_batch_patches=48, max_wait_ms=300,
                      metrics=ServeMetrics())
    jobs = [_job(4), _job(4), _job(4), _job(4)]  # 16 patches each: three fit in 48
    jobs[1].future.cancel()
    futures = [batcher.submit(j) for j in jobs]
    done = [f.result(timeout=10) for i, f in enumerate(futures) if i != 1]
    batcher.close(timeout=10)
    assert tower.calls == [3], f"images per tower call: {tower.calls}"
    assert [d.num_tokens for d in done] == [4, 4, 4] and done[0].full.shape == (4, 6)  # deepstack on dim 1
    assert done[0].hidden == 3 and done[0].embeddings.shape == (4, 3)
    assert done[1].full.untyped_storage().nbytes() == 4 * 6 * 4, "each image must own just its rows"


def test_batcher_carries_the_image_that_does_not_fit_and_reports_tower_failures():
    tower = _FakeTower()
    batcher = Batcher(tower.encode_pixels, tower.output_tokens, max_batch_patches=20, max_wait_ms=200,
                      metrics=ServeMetrics())
    futures = [batcher.submit(_job(4)) for _ in range(3)]  # 16 + 16 > 20: one image per call
    assert all(f.result(timeout=10).num_tokens == 4 for f in futures)
    batcher.close(timeout=10)
    assert tower.calls == [1, 1, 1]
    failing = _FakeTower(fail=True)
    batcher = Batcher(failing.encode_pixels, failing.output_tokens, 64, 1, ServeMetrics())
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="device lost"):
        batcher.submit(_job(2)).result(timeout=10)
    batcher.close(timeout=10)
    assert time.perf_counter() - start < 5


@pytest.mark.gpu
def test_batcher_gathers_into_a_pinned_buffer_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (pinned host memory)")
    seen = []

    def encode_pixels(pixel_values, grid_thw, return_extras=True):
        seen.append(pixel_values.is_pinned())
        rows = int(grid_thw.prod(-1).sum())
        return TowerOutput(pixel_values.to("cuda")[:, :3].reshape(rows, 3))

    batcher = Batcher(encode_pixels, lambda g: g.prod(-1).tolist(), 64, 50, ServeMetrics(), pin_memory=True)
    jobs = [Job(torch.full((16, 8), float(i)), torch.tensor([[1, 4, 4]])) for i in range(6)]
    results = [f.result(timeout=30) for f in [batcher.submit(j) for j in jobs]]
    batcher.close(timeout=10)
    assert all(seen) and len(seen) >= 2, seen
    for i, r in enumerate(results):  # each image got its own rows back, even though the buffer was reused
        assert torch.equal(r.full, torch.full((16, 3), float(i))), i


def test_cli_flags_reach_the_settings():
    from mmenc.cli.main import build_parser
    from mmenc.cli.serve import settings_from_args

    defaults = settings_from_args(build_parser().parse_args(["serve"]))
    assert (defaults.max_in_flight, defaults.bucket_batches) == (ServeSettings().max_in_flight, "auto")
    args = build_parser().parse_args(["serve", "--max-in-flight", "3", "--bucket-batches", "off"])
    assert (settings_from_args(args).max_in_flight, settings_from_args(args).bucket_batches) == (3, "off")
    with pytest.raises(ValueError, match="max_in_flight=0"):
        settings_from_args(build_parser().parse_args(["serve", "--max-in-flight", "0"]))
    assert defaults.frontends == 0
    assert settings_from_args(build_parser().parse_args(["serve", "--frontends", "4"])).frontends == 4


def test_frontends_refuse_a_port_in_use_once_and_clearly():
    import socket

    from mmenc.serving.uvicorn_run import bind

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"cannot listen on 127.0.0.1:{port} .*pass another --port"):
            bind("127.0.0.1", port)
    from mmenc.cli.main import build_parser
    from mmenc.cli.serve import run

    with pytest.raises(ValueError, match="--frontends 2 does not combine with --ray"):
        run(build_parser().parse_args(["serve", "--ray", "--frontends", "2"]))


def test_connections_get_a_small_send_buffer_under_uvloop():
    pytest.importorskip("uvicorn")
    import socket

    from mmenc.serving.server import SEND_BUFFER_BYTES, _http_protocol

    protocol = _http_protocol()
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert protocol == "auto"
        return

    class Transport:  # what connection_made reads before uvicorn's own setup
        def __init__(self, sock):
            self.sock = sock

        def get_extra_info(self, name, default=None):
            return self.sock if name == "socket" else default

    with socket.socket() as sock:
        handler = protocol.__new__(protocol)
        base = protocol.__mro__[1]
        original, base.connection_made = base.connection_made, lambda self, transport: None
        try:
            handler.connection_made(Transport(sock))
        finally:
            base.connection_made = original
        # Linux doubles the value it is given; other kernels keep it
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) in (SEND_BUFFER_BYTES, 2 * SEND_BUFFER_BYTES)
