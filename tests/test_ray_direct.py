"""`mmenc serve --ray --ray-ingress direct` on a local Ray (loopback only, 2 CPUs): two Ray Serve
replicas that each listen on the service port themselves (SO_REUSEPORT, no Serve proxy) answer the
service contract tests of test_serve.py with embeddings equal to Encoder.encode; a replica killed
under load never yields a wrong answer, the other keeps serving and Ray starts a new one; the
settings refuse what direct ingress cannot do."""
import concurrent.futures
import http.client
import os
import socket

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray.serve")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is used: bind to loopback

import test_serve  # noqa: E402
from serve_client import data_url, decode_item, free_port, png, post_json, rel_err, request, wait_for  # noqa: E402
from test_serve import (  # noqa: E402, F401  the contract tests, run here against two direct-ingress replicas
    test_auth,
    test_every_format_equals_encoder_encode,
    test_health_models_metrics,
    test_malformed_requests_are_400_naming_the_field,
    test_sixteen_concurrent_clients_get_their_own_answers,
)

from mmenc.ray.serve import RayServeSettings, deployment  # noqa: E402
from mmenc.serving.settings import ServeSettings  # noqa: E402

KEY = test_serve.KEY
APP = "mmenc-direct-test"


@pytest.fixture(scope="module")
def server(q25):
    """Two direct-ingress replicas on one free loopback port, with test_serve's main server's limits."""
    from mmenc.ray.cluster import start_local

    start_local(num_cpus=2)
    import ray
    from ray import serve

    port = free_port()
    settings = ServeSettings(host="127.0.0.1", port=port, max_wait_ms=20, preprocess_threads=1, api_key=KEY,
                             max_image_pixels=250 * 250, max_request_bytes=2 << 20, max_images_per_request=8,
                             shutdown_timeout_s=5)
    serve.start(proxy_location="Disabled")
    try:
        serve.run(deployment(settings, RayServeSettings(replicas=2, cpus_per_replica=0.5, name=APP, ingress="direct"),
                             {"model": q25, "device": "cpu"}), name=APP, route_prefix=None)
        wait_for(lambda: _health(port) == 200, 120, "the replicas to answer /health")
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def _health(port) -> int | None:
    try:
        return request(port, "GET", "/health", timeout=5).status
    except OSError:
        return None


def _replica_names() -> set[tuple[str, str]]:
    import ray

    return {(r["name"], r["namespace"]) for r in ray.util.list_named_actors(all_namespaces=True)
            if "SERVE_REPLICA" in r["name"] and f"#{APP}#" in r["name"]}  # not the {APP}-cache deployment's


def test_both_replicas_listen_on_the_one_port(server):
    from ray import serve

    status = serve.status().applications[APP].deployments[APP]
    assert status.replica_states.get("RUNNING") == 2, status
    with socket.socket() as s:  # the port is taken for anyone not asking for SO_REUSEPORT
        with pytest.raises(OSError):
            s.bind(("127.0.0.1", server))


def test_replica_killed_under_load_never_answers_wrong(server, reference):
    """Kill one replica's process while 8 clients send single-image requests (48 in all, one
    connection each): every 200 carries the right embedding; the others are a 5xx or a dropped
    connection (the killed replica's); the surviving replica keeps answering, and Ray starts a new
    replica that binds the same port."""
    import ray

    images = [png(56, 84, seed=400 + i) for i in range(48)]
    want = reference.encode(images)
    before = _replica_names()
    assert len(before) == 2, before
    victim = sorted(before)[0]
    done = []

    def client(i):
        try:
            reply = post_json(server, {"images": [data_url(images[i])], "format": "base64"}, key=KEY, timeout=120)
        except (ConnectionError, http.client.HTTPException) as e:  # reset by the dying replica
            reply = e
        done.append(i)
        return i, reply

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, i) for i in range(48)]
        wait_for(lambda: len(done) >= 8, 60, "8 requests answered before the kill")
        ray.kill(ray.get_actor(victim[0], namespace=victim[1]), no_restart=True)
        killed_at = len(done)
        results = [f.result(timeout=180) for f in futures]
    assert killed_at < 48, "the load ended before the replica was killed; the test proved nothing"
    ok = dropped = 0
    for i, reply in results:
        if isinstance(reply, Exception):
            dropped += 1
            continue
        if reply.status == 200:
            got = decode_item(reply.json()["data"][0], "base64")
            assert rel_err(got, want[i]) < 1e-5, f"request {i} answered 200 with a wrong embedding"
            ok += 1
        else:
            assert 500 <= reply.status < 600, (reply.status, reply.body[:200])
    assert ok >= 24, f"only {ok} of 48 requests succeeded with one of two replicas alive ({dropped} dropped)"
    wait_for(lambda: len(_replica_names() - {victim}) == 2, 120, "Ray to start a replica in place of the killed one")
    wait_for(lambda: all(_health(server) == 200 for _ in range(8)), 120, "every connection to answer /health again")
    reply = post_json(server, {"images": [data_url(images[0])], "format": "base64"}, key=KEY)
    assert reply.status == 200 and rel_err(decode_item(reply.json()["data"][0], "base64"), want[0]) < 1e-5
    print(f"replica killed after {killed_at} answers: {ok} answered 200, {dropped} connections dropped")


def test_direct_ingress_settings():
    with pytest.raises(ValueError, match="--autoscale needs --ray-ingress proxy"):
        RayServeSettings(autoscale=(1, 2), ingress="direct")
    with pytest.raises(ValueError, match="must be one of proxy, direct"):
        RayServeSettings(ingress="haproxy")
    from mmenc.cli.main import build_parser
    from mmenc.cli.serve import ray_settings_from_args

    args = build_parser().parse_args(["serve", "--ray", "--ray-ingress", "direct", "--replicas", "2"])
    assert ray_settings_from_args(args, cluster_gpus=0).ingress == "direct"
    from mmenc.ray.serve import app_builder

    app_builder({"model": "m", "ingress": "direct", "port": "9001", "replicas": "2"})  # host/port accepted here
