"""Load test of `mmenc serve` against offline `Encoder.encode`, in one run, on loopback only.

    python benchmarks/serve_load.py --model /models/Qwen2.5-VL-7B-Instruct --compile --cuda-graphs \
        --clients 64 --sizes 448 --requests 4096 --duration 120 --json serve_load.json

1. Builds a pool of distinct images (JPEG, --sizes, e.g. "448" or "224,448,640x480,1036").
2. Offline: Encoder.encode over the same images in batches of --offline-batch (after warm-up calls);
   its outputs are the reference every response is compared with; images/s from the timed calls.
3. Starts `mmenc serve` (a subprocess on 127.0.0.1, the same Encoder flags; with --ray-replicas N,
   `mmenc serve --ray --replicas N`), waits for /health.
4. --clients closed-loop clients (threads spread over --processes processes) send --warmup
   requests each, then the measured ones: --requests in total, or until --duration seconds.
   Every image carries a fresh uuid, so the tower runs for each (no cache hits) unless
   --repeat-fraction > 0 re-sends earlier uuids. Each answer is decoded as vLLM would
   (torch.load(weights_only=True) of the base64) and compared with the offline reference.
5. Prints one table: images/s served and offline, their ratio, p50/p90/p99 latency, errors,
   lost and mismatched answers, cache hit rate and batch sizes from /metrics; --json writes it.
Bounded: --requests and --duration cap the measured phase; the server is stopped with SIGTERM.

Host ceiling (bench only): --stand-in-tower HIDDEN replaces the tower, offline and in the server, by
benchmarks/serve_stand_in.py's near-free stand-in answering [tokens, HIDDEN] bf16 (CPU, a tiny
Qwen2.5-VL checkpoint when --model is not given), so images/s measures the HTTP + preprocessing +
batching + rendering side alone. With few cores, --check-every N decodes only every Nth answer of
each client (the others are checked for status and item count), so the clients leave the server
its CPU; server_cpu_ms_per_image is the server process's CPU time (user + system) per image served
(with --serve-arg=--frontends --serve-arg=N: the engine process's), frontends_cpu_ms_per_image that of
its child processes (the front ends) together.
"""
import argparse
import base64
import io
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np
import torch

from mmenc.cli.common import add_encoder_args, encoder_kwargs
from mmenc.engine.encoder import DEFAULT_MODEL
from mmenc.serving.b64 import b64decode  # pybase64 when installed: the checker is not the limit
from mmenc.testing.processes import child_pids, cpu_seconds, free_port

HOST = "127.0.0.1"


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """'448,640x480' -> [(448, 448), (480, 640)] as (height, width)."""
    sizes = []
    for part in text.split(","):
        w, _, h = part.strip().lower().partition("x")
        sizes.append((int(h or w), int(w)))
    return sizes


def make_pool(sizes, distinct: int, seed: int = 0) -> list[bytes]:
    """`distinct` JPEGs per size (smooth random content, like photos), interleaved across sizes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pool = []
    for i in range(distinct):
        for h, w in sizes:
            small = Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
            noisy = np.clip(np.asarray(small, np.int16) + rng.integers(-12, 12, (h, w, 3)), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(noisy).save(buf, format="JPEG", quality=90)
            pool.append(buf.getvalue())
    return pool


def reference_tensor(piece, fmt: str) -> torch.Tensor:
    """What the server should answer for one image: vllm -> embeddings and deepstack on dim 1."""
    if fmt == "vllm":
        return torch.cat([piece.embeddings, *piece.extras.get("deepstack", [])], dim=1).cpu()
    return piece.embeddings.cpu()


def make_encoder(args):
    if args.stand_in_tower:
        from serve_stand_in import stand_in_encoder  # this script's folder (Python's sys.path[0] for a script)

        return stand_in_encoder(args.stand_in_tower, **encoder_kwargs(args, DEFAULT_MODEL))
    from mmenc.engine.encoder import Encoder

    return Encoder(**encoder_kwargs(args, DEFAULT_MODEL))


def offline(args, pool: list[bytes]) -> tuple[dict, float, int]:
    """(references by pool index, offline images/s, images timed)."""
    enc = make_encoder(args)
    sync = torch.cuda.synchronize if enc.device.type == "cuda" else (lambda: None)
    refs = {}
    for first in range(0, len(pool), args.offline_batch):
        for i, piece in enumerate(enc.encode(pool[first:first + args.offline_batch], return_extras=True)):
            refs[first + i] = reference_tensor(piece, args.format)
    batches = max(1, args.offline_images // args.offline_batch)
    order = [[pool[(b * args.offline_batch + i) % len(pool)] for i in range(args.offline_batch)]
             for b in range(batches)]
    for batch in order[:2]:  # warm-up: compile / capture for this batch shape
        enc.encode(batch)
    sync()
    start = time.perf_counter()
    for batch in order:
        enc.encode(batch)
    sync()
    seconds = time.perf_counter() - start
    enc.close()
    del enc
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return refs, batches * args.offline_batch / seconds, batches * args.offline_batch


def start_server(args, port: int, log_path: str) -> subprocess.Popen:
    here = os.path.dirname(os.path.abspath(__file__))
    entry = (["-m", "mmenc.cli.main"] if not args.stand_in_tower else
             [os.path.join(here, "serve_stand_in.py"), "--stand-in-hidden", str(args.stand_in_tower)])
    cmd = [sys.executable, *entry, "serve", "--host", HOST, "--port", str(port),
           "--max-batch-patches", str(args.max_batch_patches), "--max-wait-ms", str(args.max_wait_ms),
           "--cache-bytes", args.cache_bytes, "--max-queue-images", str(max(1024, 2 * args.clients * args.images_per_request)),
           "--max-images-per-request", str(max(64, args.images_per_request))]
    if args.preprocess_threads:
        cmd += ["--preprocess-threads", str(args.preprocess_threads)]
    cmd += list(args.serve_arg or [])
    if args.ray_replicas:
        cmd += ["--ray", "--replicas", str(args.ray_replicas)]
    kw = encoder_kwargs(args, DEFAULT_MODEL)
    cmd += ["--model", kw["model"], "--dtype", str(kw["dtype"]), "--load-format", kw["load_format"],
            "--tensor-parallel-size", str(kw["tensor_parallel_size"]), "--mm-encoder-tp-mode", kw["mm_encoder_tp_mode"]]
    cmd += ["--device", kw["device"]] if kw["device"] else []
    cmd += ["--mm-encoder-attn-backend", kw["mm_encoder_attn_backend"]] if kw["mm_encoder_attn_backend"] else []
    cmd += ["--compile"] if kw["compile"] else []
    cmd += ["--cuda-graphs"] if kw["cuda_graphs"] else []
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)


def get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_py_spy(cfg: dict) -> subprocess.Popen:
    """py-spy sampling the server's threads during the measured phase (collapsed stacks to cfg["py_spy"])."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")  # a venv's, else PATH's
    cmd = [beside if os.path.exists(beside) else "py-spy", "record", "--pid", str(cfg["server_pid"]), "--duration", str(int(cfg["duration"])),
           "--rate", "250", "--format", "raw", "--output", cfg["py_spy"], "--nonblocking", "--threads"]
    return subprocess.Popen(cmd + (["--gil"] if cfg["py_spy_gil"] else []), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def py_spy_top(path: str, n: int = 15) -> str:
    """The `n` frames with the most samples at the top of the stack (self time), and per thread."""
    leaf, threads, total = {}, {}, 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            leaf[frames[-1]] = leaf.get(frames[-1], 0) + int(count)
            threads[frames[0]] = threads.get(frames[0], 0) + int(count)
            total += int(count)
    rows = [f"py-spy: {total} samples"] + [f"  thread {100 * c / total:5.1f}%  {k}" for k, c in
                                           sorted(threads.items(), key=lambda kv: -kv[1])[:6]]
    rows += [f"  self {100 * c / total:5.1f}%  {k}" for k, c in sorted(leaf.items(), key=lambda kv: -kv[1])[:n]]
    return "\n".join(rows)


def metrics(port: int) -> dict[str, float]:
    text = get(port, "/metrics")[1].decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(mmenc_[a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


# -- clients (run in spawned processes) ------------------------------------------------------------
def decode(item: dict, fmt: str) -> torch.Tensor:
    if fmt == "vllm":
        raw = b64decode(item["image_embeds"]["image_embeds"]["image_embeds"])
        return torch.load(io.BytesIO(raw), weights_only=True)
    if fmt == "base64":
        return torch.frombuffer(bytearray(b64decode(item["embedding"])),
                                dtype=getattr(torch, item["dtype"])).reshape(item["shape"])
    return torch.tensor(item["embedding"])


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error of an answer; 0.0 at once when it is bitwise the reference (the usual case),
    so checking every answer costs the client little (run 11b: 6 client processes checking every
    2.4 MB answer held 64 clients to ~240 answers/s)."""
    if got.shape != want.shape:
        return float("inf")
    if got.dtype == want.dtype and torch.equal(got, want):
        return 0.0
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm())


def client_loop(cfg: dict, client: int, pool_urls: list[str], refs: dict, deadline_box: list, quota: int,
                warmup: int, barrier, out: list) -> None:
    import http.client

    conn = http.client.HTTPConnection(HOST, cfg["port"], timeout=cfg["timeout"])
    rng = np.random.default_rng(client)
    n_pool, C, k = len(pool_urls), cfg["clients"], cfg["images_per_request"]
    seq = 0

    def one(measured: bool) -> None:
        nonlocal seq, conn
        idx = [((client + (seq * k + j) * C) % n_pool) for j in range(k)]
        uuids = [f"{cfg['run']}-{idx[j]}" if rng.random() < cfg["repeat_fraction"] else
                 f"{cfg['run']}-{client}-{seq}-{j}" for j in range(k)]
        seq += 1
        body = ('{"format":"%s","uuids":%s,"images":["%s"]}' % (cfg["format"], json.dumps(uuids),
                                                               '","'.join(pool_urls[i] for i in idx))).encode()
        rec = {"measured": measured, "images": k, "t0": time.time()}
        try:
            conn.request("POST", "/v1/encode", body, {"content-type": "application/json"})
            resp = conn.getresponse()
            payload = resp.read()
            rec["t1"], rec["status"] = time.time(), resp.status
        except (OSError, http.client.HTTPException) as e:
            rec["t1"], rec["status"], rec["error"] = time.time(), 0, repr(e)
            conn.close()
            conn = http.client.HTTPConnection(HOST, cfg["port"], timeout=cfg["timeout"])
            out.append(rec)
            return
        rec["ok"] = rec["mismatch"] = rec["item_errors"] = 0
        rec["max_err"] = 0.0
        if resp.status == 200 and seq % cfg["check_every"]:  # not decoded: status and item count only
            rec["unchecked"] = payload.count(b'"index":')
            rec["lost"] = k - rec["unchecked"]
            rec["item_errors"] = payload.count(b'"error":{"type"')
        elif resp.status == 200:
            data = json.loads(payload)["data"]
            rec["lost"] = k - len(data)
            for j, item in enumerate(data):
                if item.get("index") != j or item.get("uuid") != uuids[j]:
                    rec["mismatch"] += 1
                elif "error" in item:
                    rec["item_errors"] += 1
                else:
                    got, want = decode(item, cfg["format"]), refs[idx[j]]
                    err = _rel_err(got, want)
                    rec["max_err"] = max(rec["max_err"], err)
                    rec["ok" if err <= cfg["tolerance"] else "mismatch"] += 1
        out.append(rec)

    for _ in range(warmup):
        one(False)
    barrier.wait()  # this process's warm-up is done
    barrier.wait()  # the measured phase starts
    for _ in range(quota):
        if time.time() > deadline_box[0]:
            break
        one(True)
    conn.close()


def process_main(cfg: dict, clients: list[int], quotas: list[int], warm, go, start_box, queue) -> None:
    refs = torch.load(cfg["refs_path"], weights_only=True)
    with open(cfg["pool_path"]) as f:
        pool_urls = json.load(f)
    local = threading.Barrier(len(clients) + 1)
    deadline_box, outs, threads = [float("inf")], [[] for _ in clients], []
    for c, q, out in zip(clients, quotas, outs):
        threads.append(threading.Thread(target=client_loop, args=(cfg, c, pool_urls, refs, deadline_box, q,
                                                                 cfg["warmup"], local, out)))
        threads[-1].start()
    local.wait()  # every thread of this process finished its warm-up
    warm.wait()  # ... and every process; the parent reads /metrics
    go.wait()
    deadline_box[0] = start_box.value + cfg["duration"]
    local.wait()  # release this process's threads
    for t in threads:
        t.join()
    queue.put([r for out in outs for r in out])


def run_clients(cfg: dict, processes: int) -> tuple[list[dict], dict]:
    """Records of every request, and /metrics between the warm-up and the measured phase."""
    ctx = mp.get_context("spawn")
    C = cfg["clients"]
    groups = [list(range(p, C, processes)) for p in range(processes)]
    quotas = [cfg["requests"] // C + (1 if c < cfg["requests"] % C else 0) for c in range(C)]
    warm, go = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1)
    start_box, queue = ctx.Value("d", 0.0), ctx.Queue()
    procs = [ctx.Process(target=process_main, args=(cfg, g, [quotas[c] for c in g], warm, go, start_box, queue))
             for g in groups]
    for p in procs:
        p.start()
    warm.wait(timeout=cfg["timeout"] + 600)
    before = metrics(cfg["port"])
    spy = start_py_spy(cfg) if cfg["py_spy"] else None
    start_box.value = time.time()
    go.wait(timeout=60)
    cpu_before = cpu_seconds(cfg["server_pid"])
    children = {pid: cpu_seconds(pid) for pid in child_pids(cfg["server_pid"])}
    records = [r for _ in procs for r in queue.get(timeout=cfg["duration"] + cfg["timeout"] + 120)]
    before["server_cpu_s"] = cpu_seconds(cfg["server_pid"]) - cpu_before
    before["children_cpu_s"] = sum(cpu_seconds(pid) - cpu for pid, cpu in children.items())
    if spy is not None:
        spy.wait(timeout=cfg["duration"] + 60)
    for p in procs:
        p.join()
    return records, before


def summarize(records: list[dict], offline_ips: float, before: dict, after: dict) -> dict:
    measured = [r for r in records if r["measured"]]
    ok = [r for r in measured if r["status"] == 200]
    images_ok = sum(r["ok"] + r.get("unchecked", 0) - (r["item_errors"] if "unchecked" in r else 0) for r in ok)
    span = (max(r["t1"] for r in measured) - min(r["t0"] for r in measured)) if measured else float("nan")
    lat = np.array([r["t1"] - r["t0"] for r in ok]) * 1000 if ok else np.array([float("nan")])
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    hits, misses = delta.get("mmenc_cache_hits_total", 0.0), delta.get("mmenc_cache_misses_total", 0.0)
    batches = delta.get("mmenc_batch_images_count", 0.0)
    served = images_ok / span
    return {
        "requests": len(measured), "images_ok": images_ok, "seconds": round(span, 3),
        "served_images_per_s": round(served, 2), "offline_images_per_s": round(offline_ips, 2),
        "served_over_offline": round(served / offline_ips, 3),
        "server_cpu_ms_per_image": round(1000 * before["server_cpu_s"] / max(images_ok, 1), 2),
        "frontends_cpu_ms_per_image": round(1000 * before["children_cpu_s"] / max(images_ok, 1), 2),
        "checked": sum(r["ok"] + r.get("mismatch", 0) for r in ok if "unchecked" not in r),
        "p50_ms": round(float(np.percentile(lat, 50)), 1), "p90_ms": round(float(np.percentile(lat, 90)), 1),
        "p99_ms": round(float(np.percentile(lat, 99)), 1),
        "http_errors": sum(r["status"] != 200 for r in measured),
        "item_errors": sum(r.get("item_errors", 0) for r in measured),
        "lost": sum(r.get("lost", 0) for r in ok) + sum(r["images"] for r in measured if r["status"] != 200),
        "mismatched": sum(r.get("mismatch", 0) for r in measured),
        "max_rel_err": max((r.get("max_err", 0.0) for r in ok), default=0.0),
        "cache_hit_rate": round(hits / (hits + misses), 3) if hits + misses else 0.0,
        "mean_batch_images": round(delta.get("mmenc_batch_images_sum", 0.0) / batches, 2) if batches else 0.0,
        "mean_tower_ms": round(1000 * delta.get("mmenc_tower_seconds_sum", 0.0) / batches, 2) if batches else 0.0,
        "mean_queue_ms": round(1000 * delta.get("mmenc_queue_seconds_sum", 0.0)
                               / max(delta.get("mmenc_queue_seconds_count", 0.0), 1), 2),
        "mean_preprocess_ms": round(1000 * delta.get("mmenc_preprocess_seconds_sum", 0.0)
                                    / max(delta.get("mmenc_preprocess_seconds_count", 0.0), 1), 2),
        "tower_calls": int(batches), "packings": int(after.get("mmenc_tower_packings", 0.0)),
        "graph_replays": int(delta.get('mmenc_cuda_graph_calls{kind="replays"}', 0.0)),
        "graph_eager": int(delta.get('mmenc_cuda_graph_calls{kind="eager"}', 0.0)),
        "probe_ms": round(1000 * delta.get("mmenc_standin_probe_seconds_sum", 0.0)
                          / max(delta.get("mmenc_standin_probe_seconds_count", 0.0), 1), 2),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_encoder_args(p, f"default: {DEFAULT_MODEL} with random weights")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--processes", type=int, default=None, help="client processes (default: min(8, CPUs/2, clients))")
    p.add_argument("--sizes", default="448", help="image sizes: N (square) or WxH, comma-separated (default: 448)")
    p.add_argument("--distinct", type=int, default=16, help="distinct images per size (default: %(default)s)")
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument("--requests", type=int, default=2048, help="measured requests in total (default: %(default)s)")
    p.add_argument("--duration", type=float, default=120.0, help="measured phase stops after S seconds")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests per client first (default: %(default)s)")
    p.add_argument("--repeat-fraction", type=float, default=0.0, help="share of images re-sent under a shared uuid")
    p.add_argument("--format", choices=["vllm", "base64", "json"], default="vllm")
    p.add_argument("--tolerance", type=float, default=1e-2, help="relative error counted as a match")
    p.add_argument("--offline-batch", type=int, default=64, help="images per offline Encoder.encode call")
    p.add_argument("--offline-images", type=int, default=1024, help="images timed offline (whole batches)")
    p.add_argument("--max-batch-patches", type=int, default=65536)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--cache-bytes", default="1GiB")
    p.add_argument("--preprocess-threads", type=int, default=None)
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch CPU threads, offline and in the server (OMP_NUM_THREADS); default: torch's own")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, and for the server to start")
    p.add_argument("--ray-replicas", type=int, default=None, metavar="N",
                   help="serve with `mmenc serve --ray --replicas N` (a local Ray, one GPU per replica); "
                        "served_over_offline is then N replicas over one offline Encoder")
    p.add_argument("--stand-in-tower", type=int, default=None, metavar="HIDDEN",
                   help="bench only: replace the tower by a near-free stand-in answering [tokens, HIDDEN] bf16 "
                        "(benchmarks/serve_stand_in.py), to measure the host side alone; CPU only")
    p.add_argument("--check-every", type=int, default=1, metavar="N",
                   help="decode and compare every Nth answer of each client; the others: status and item count "
                        "(default: %(default)s, all)")
    p.add_argument("--serve-arg", action="append", metavar="ARG",
                   help="extra argument for `mmenc serve` (repeat; e.g. --serve-arg=--max-in-flight --serve-arg=3)")
    p.add_argument("--py-spy", default=None, metavar="OUT",
                   help="record the server with py-spy during the measured phase (collapsed stacks to OUT) and print "
                        "the top frames (needs `pip install py-spy` and ptrace rights)")
    p.add_argument("--py-spy-gil", action="store_true", help="with --py-spy: only samples holding the GIL")
    p.add_argument("--json", default=None, help="write the summary (and settings) here")
    args = p.parse_args(argv)
    if args.stand_in_tower:
        args.device = args.device or "cpu"
        if args.model is None:
            from mmenc.testing.checkpoints import save_qwen2_5_vl

            args.model = str(save_qwen2_5_vl(tempfile.mkdtemp(prefix="serve_load_tiny_"))[0])
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # inherited by the server process
    processes = args.processes or max(1, min(8, (os.cpu_count() or 2) // 2, args.clients))

    sizes = parse_sizes(args.sizes)
    pool = make_pool(sizes, args.distinct)
    t = time.perf_counter()
    refs, offline_ips, offline_n = offline(args, pool)
    print(f"offline: Encoder.encode {offline_n} images in batches of {args.offline_batch}: {offline_ips:.1f} images/s "
          f"(set-up and references {time.perf_counter() - t:.1f} s)", flush=True)

    tmp = tempfile.mkdtemp(prefix="serve_load_")
    cfg = {"port": free_port(), "clients": args.clients, "images_per_request": args.images_per_request,
           "format": args.format, "tolerance": args.tolerance, "repeat_fraction": args.repeat_fraction,
           "requests": args.requests, "duration": args.duration, "warmup": args.warmup, "timeout": args.timeout,
           "run": f"r{os.getpid()}", "check_every": max(1, args.check_every), "py_spy": args.py_spy,
           "py_spy_gil": args.py_spy_gil, "refs_path": os.path.join(tmp, "refs.pt"), "pool_path": os.path.join(tmp, "pool.json")}
    torch.save(refs, cfg["refs_path"])
    with open(cfg["pool_path"], "w") as f:
        json.dump(["data:image/jpeg;base64," + base64.b64encode(d).decode() for d in pool], f)
    log_path = os.path.join(tmp, "server.log")
    server = start_server(args, cfg["port"], log_path)
    cfg["server_pid"] = server.pid
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"mmenc serve exited ({server.returncode}); log:\n{open(log_path).read()[-3000:]}")
            try:
                if get(cfg["port"], "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"mmenc serve not healthy after {args.timeout} s; log: {log_path}")
            time.sleep(0.5)
        print(f"server up on {HOST}:{cfg['port']}; {args.clients} clients in {processes} processes", flush=True)
        records, before = run_clients(cfg, processes)
        after = metrics(cfg["port"])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    summary = summarize(records, offline_ips, before, after)
    setting = {"clients": args.clients, "torch_threads": args.torch_threads, "sizes": args.sizes, "format": args.format,
               "images_per_request": args.images_per_request, "model": args.model or DEFAULT_MODEL,
               "compile": args.compile, "cuda_graphs": args.cuda_graphs, "device": args.device,
               "max_batch_patches": args.max_batch_patches, "max_wait_ms": args.max_wait_ms,
               "ray_replicas": args.ray_replicas, "stand_in_tower": args.stand_in_tower,
               "check_every": args.check_every, "processes": processes, "serve_args": args.serve_arg,
               "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    print("| " + " | ".join(summary) + " |")
    print("|" + "---|" * len(summary))
    print("| " + " | ".join(str(v) for v in summary.values()) + " |")
    print(json.dumps(setting))
    if args.py_spy and os.path.exists(args.py_spy):
        print(py_spy_top(args.py_spy))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": setting, "summary": summary}, f, indent=2)
    return 0 if summary["mismatched"] == 0 and summary["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
