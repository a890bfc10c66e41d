"""`mmenc serve --ray` on a local Ray (loopback only, 2 CPUs): two Ray Serve replicas answer the
service contract tests of test_serve.py (the same test functions, run against the Ray address) with
embeddings equal to Encoder.encode, cache hits included (the shared cache tier); a replica killed under
load loses no request the client was told succeeded; the settings and the CLI flags are checked.
Drain on SIGTERM through Ray is tests/test_ray_cli.py's."""
import concurrent.futures
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray.serve")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is used: bind to loopback

import test_serve  # noqa: E402
from serve_client import data_url, decode_item, free_port, png, post_json, rel_err, request, wait_for  # noqa: E402
from test_serve import (  # noqa: E402, F401  the contract tests, run here against two Ray replicas
    test_auth,
    test_bad_images_fail_alone,
    test_body_over_the_limit_is_413_and_wrong_type_415,
    test_every_format_equals_encoder_encode,
    test_health_models_metrics,
    test_malformed_requests_are_400_naming_the_field,
    test_multipart_gives_the_json_answer,
    test_sixteen_concurrent_clients_get_their_own_answers,
    test_uuids_and_content_keys_hit_the_cache,
)

from mmenc.ray.serve import RayServeSettings, deployment, parse_autoscale  # noqa: E402
from mmenc.serving.settings import ServeSettings  # noqa: E402

KEY = test_serve.KEY
APP = "mmenc-test"
PROXY_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def ray_port():
    """A local Ray (2 CPUs, loopback) with Serve's proxy on a free loopback port; torn down after the module."""
    from mmenc.ray.cluster import start_local

    start_local(num_cpus=2)
    import ray
    from ray import serve

    port = free_port()
    # the proxy bounds every request as `mmenc serve --ray` does (RayServeSettings.request_timeout_s), so
    # a request that a killed replica held answers 408 instead of hanging the client
    serve.start(http_options={"host": "127.0.0.1", "port": port, "request_timeout_s": PROXY_TIMEOUT_S})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def _deploy(port, q25, replicas=2, **settings):
    from ray import serve

    serve_settings = ServeSettings(**{"max_wait_ms": 20, "preprocess_threads": 1, **settings})
    ray_settings = RayServeSettings(replicas=replicas, cpus_per_replica=0.5, name=APP)
    serve.run(deployment(serve_settings, ray_settings, {"model": q25, "device": "cpu"}), name=APP, route_prefix="/")
    wait_for(lambda: request(port, "GET", "/health").status == 200, 120, "the replicas to answer /health")


@pytest.fixture(scope="module")
def server(ray_port, q25):
    """Two replicas with the limits test_serve's main server has (the contract tests' fixture)."""
    _deploy(ray_port, q25, api_key=KEY, max_image_pixels=250 * 250, max_request_bytes=2 << 20,
            max_images_per_request=8)
    yield ray_port


def test_two_replicas_answer_and_each_equals_encoder_encode(server, reference):
    from ray import serve

    status = serve.status().applications[APP].deployments[APP]
    assert status.replica_states.get("RUNNING") == 2, status
    images = [png(56, 56 + 28 * (i % 3), seed=200 + i) for i in range(6)]
    want = reference.encode(images)
    for i, image in enumerate(images):  # one image per request: the router spreads them over the replicas
        reply = post_json(server, {"images": [data_url(image)], "format": "base64"}, key=KEY)
        assert reply.status == 200, reply.body[:300]
        got = decode_item(reply.json()["data"][0], "base64")
        assert rel_err(got, want[i]) < 1e-5, f"image {i}: {rel_err(got, want[i]):.2e}"


def test_a_repeat_hits_the_cache_on_either_replica(server):
    """The same image again and again, routed by Ray's load balancing: one tower run, every repeat a hit,
    some of them on the replica that did not encode it (the shared tier), all counted in /metrics."""
    from serve_client import metric

    doc = {"images": [data_url(png(49, 77, seed=420))], "format": "base64"}
    hits, shared = metric(server, "mmenc_cache_hits_total"), metric(server, "mmenc_cache_shared_hits_total")
    cached = []
    for _ in range(30):
        reply = post_json(server, doc, key=KEY)
        assert reply.status == 200, reply.body[:300]
        cached.append(reply.json()["data"][0]["cached"])
        if len(cached) >= 4 and metric(server, "mmenc_cache_shared_hits_total") > shared:
            break
    assert cached == [False] + [True] * (len(cached) - 1), cached
    assert metric(server, "mmenc_cache_shared_hits_total") > shared, f"{len(cached)} repeats never left one replica"
    assert metric(server, "mmenc_cache_hits_total") == hits + len(cached) - 1


def _replica_names(app: str) -> set[str]:
    import ray

    return {(r["name"], r["namespace"]) for r in ray.util.list_named_actors(all_namespaces=True)
            if "SERVE_REPLICA" in r["name"] and f"#{app}#" in r["name"]}  # not the {app}-cache deployment's


def test_replica_killed_under_load_loses_no_answered_request(server, reference):
    """Kill one replica's process while 8 clients keep sending single-image requests (48 in all):
    every 200 carries the right embedding, anything else is a clear error (a 5xx, or the proxy's 408
    for a request the dead replica held), never a wrong or missing embedding, and a client that
    retries its failed requests gets every answer right; Ray starts a new replica in place of the
    killed one and the service answers again."""
    import ray

    images = [png(56, 84, seed=300 + i) for i in range(48)]
    want = reference.encode(images)
    before = _replica_names(APP)
    assert len(before) == 2, before
    victim_name, namespace = sorted(before)[0]
    done = []

    def client(i):
        reply = post_json(server, {"images": [data_url(images[i])], "format": "base64"}, key=KEY,
                          timeout=PROXY_TIMEOUT_S + 60)
        done.append(i)
        return i, reply

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, i) for i in range(48)]
        wait_for(lambda: len(done) >= 8, 60, "8 requests answered before the kill")
        ray.kill(ray.get_actor(victim_name, namespace=namespace), no_restart=True)
        killed_at = len(done)
        results = [f.result(timeout=PROXY_TIMEOUT_S + 120) for f in futures]
    assert killed_at < 48, "the load ended before the replica was killed; the test proved nothing"
    failed = []
    for i, reply in results:
        if reply.status == 200:
            data = reply.json()["data"][0]
            assert "error" not in data, data
            got = decode_item(data, "base64")
            assert rel_err(got, want[i]) < 1e-5, f"request {i} answered 200 with a wrong embedding"
        else:
            assert reply.status == 408 or 500 <= reply.status < 600, (reply.status, reply.body[:200])
            failed.append(i)
    assert len(failed) <= 24, f"{len(failed)} of 48 requests failed with one of two replicas alive"
    for i in failed:  # what a retrying client sees: every request answered, and answered right
        reply = post_json(server, {"images": [data_url(images[i])], "format": "base64"}, key=KEY,
                          timeout=PROXY_TIMEOUT_S + 60)
        assert reply.status == 200, (i, reply.status, reply.body[:200])
        assert rel_err(decode_item(reply.json()["data"][0], "base64"), want[i]) < 1e-5
    wait_for(lambda: len(_replica_names(APP) - {(victim_name, namespace)}) == 2, 120,
             "Ray to start a replica in place of the killed one")
    reply = post_json(server, {"images": [data_url(images[0])], "format": "base64"}, key=KEY)
    assert reply.status == 200 and rel_err(decode_item(reply.json()["data"][0], "base64"), want[0]) < 1e-5
    print(f"replica killed after {killed_at} answers; statuses: {sorted(r.status for _, r in results)}")


def test_settings_and_autoscale_flag():
    assert parse_autoscale("1:4") == (1, 4)
    for bad in ("4:1", "0:2", "x", "2"):
        with pytest.raises(ValueError, match="MIN:MAX"):
            parse_autoscale(bad)
    options = RayServeSettings(autoscale=(1, 3), gpus_per_replica=2).deployment_options()
    assert options["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in options
    assert options["ray_actor_options"]["num_gpus"] == 2
    assert RayServeSettings(replicas=2).deployment_options()["num_replicas"] == 2
    assert RayServeSettings(request_timeout_s=5).proxy_options(ServeSettings(port=9))["request_timeout_s"] == 5
    with pytest.raises(ValueError, match="request_timeout_s"):
        RayServeSettings(request_timeout_s=0)
    with pytest.raises(ValueError, match="replicas=0"):
        RayServeSettings(replicas=0)


def test_app_builder_for_serve_run_and_config_files():
    from ray.serve import Application

    from mmenc.ray.serve import app_builder

    app = app_builder({"model": "m", "replicas": "2", "api_key": "k", "cache_bytes": "2GiB", "max_wait_ms": "3.5"})
    assert isinstance(app, Application)
    assert isinstance(app_builder({"model": "m", "autoscale": "1:3", "gpus_per_replica": "1"}), Application)
    with pytest.raises(ValueError, match="cache_bytes"):
        app_builder({"model": "m", "cache_bytes": "lots"})
    with pytest.raises(ValueError, match="MIN:MAX"):
        app_builder({"model": "m", "autoscale": "3"})


def test_cli_ray_flags_parse():
    from mmenc.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--ray", "--autoscale", "1:3", "--port", "9000"])
    assert args.ray and args.autoscale == "1:3" and args.port == 9000
    from mmenc.cli.serve import ray_settings_from_args

    assert ray_settings_from_args(args, cluster_gpus=0).autoscale == (1, 3)
    args = build_parser().parse_args(["serve", "--ray", "--replicas", "2", "--tensor-parallel-size", "2"])
    assert ray_settings_from_args(args, cluster_gpus=8).gpus_per_replica == 2
    assert ray_settings_from_args(args, cluster_gpus=0).gpus_per_replica == 0
    args = build_parser().parse_args(["serve", "--ray", "--ray-request-timeout", "7.5"])
    assert ray_settings_from_args(args, cluster_gpus=0).request_timeout_s == 7.5
    assert ray_settings_from_args(args, cluster_gpus=0).cache_tier == "shared"
    args = build_parser().parse_args(["serve", "--ray", "--ray-cache", "replica"])
    assert ray_settings_from_args(args, cluster_gpus=0).cache_tier == "replica"
    with pytest.raises(ValueError, match="--ray-cache='nowhere' must be one of shared, replica"):
        RayServeSettings(cache_tier="nowhere")
