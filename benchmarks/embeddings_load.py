"""Load test of POST /v1/embeddings (the OpenAI embeddings API): `mmenc serve` against Infinity
(`infinity-emb`) on the same SigLIP checkpoint, the same JPEGs and the same client load, on loopback.

    # a random-weight SigLIP (transformers' SiglipModel layout, its image processor and a tiny tokenizer)
    python benchmarks/embeddings_load.py --write-checkpoint /tmp/siglip-small --preset small --only-write
    # A/B/A/B on this machine (each target started, loaded, measured and stopped in turn)
    python benchmarks/embeddings_load.py --checkpoint /tmp/siglip-small --targets mmenc,infinity,mmenc,infinity \
        --clients 16 --per-request 4 --images 256 --infinity-bin /work/venvs/infinity/bin/infinity_emb

Every request is the same JSON to both servers: {"model": CHECKPOINT, "input": [4 JPEG data URLs],
"encoding_format": "float", "modality": "image"} (`modality` is Infinity's field; mmenc accepts it).
Each measured image is sent once (--images distinct JPEGs, a pool of --warmup-requests more for the
warm-up), so no cache answers: mmenc runs with --cache-bytes 0 anyway. Clients are threads of this
process, each on its own keep-alive connection, closed-loop: a client sends its next request when its
answer is back. Per target: images/s over the measured phase, request latency p50/p90, errors, the
server's CPU seconds over the phase (every process of its session: on a shared machine images per
CPU second moves much less with the other load than images/s does); then
the cosine between the targets' vectors of the same images (random weights: both must agree).
--offline also times mmenc's Encoder.encode(pooled=True) in this process on the same JPEGs (before any
server starts). Bounded: --images caps the measured requests, --duration the wall time; each server is
stopped (SIGTERM, then SIGKILL) before the next starts. Servers listen on 127.0.0.1 only; Infinity runs
with DO_NOT_TRACK=1 and INFINITY_ANONYMOUS_USAGE_STATS=0 (no telemetry) and HF_HUB_OFFLINE=1.
The last lines printed are one table, one row per run.
"""
import argparse
import base64
import concurrent.futures
import http.client
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from mmenc.testing.processes import free_port, processes, session_cpu_s

HOST = "127.0.0.1"
PRESETS = {  # vision towers; the text tower is one small layer (its width must match for SiglipModel)
    "small": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6, patch_size=16,
                  image_size=224),
    "base-224": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     patch_size=16, image_size=224),
    "so400m-384": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                       patch_size=14, image_size=384),
}


def write_checkpoint(folder: str, preset: str, dtype: str) -> None:
    """A random-weight SiglipModel with its SiglipImageProcessor and a word-level tokenizer (no download)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vision = PRESETS[preset]
    text = dict(hidden_size=vision["hidden_size"], intermediate_size=vision["hidden_size"] * 2, num_hidden_layers=1,
                num_attention_heads=vision["num_attention_heads"], vocab_size=64, max_position_embeddings=256)
    config = transformers.SiglipConfig(vision_config=vision, text_config=text)
    torch.manual_seed(0)
    model = transformers.SiglipModel(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    side = vision["image_size"]
    transformers.SiglipImageProcessor(size={"height": side, "width": side}).save_pretrained(folder)
    words = "a photo of the cat dog two on grass red blue car house tree".split()
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                         eos_token="</s>", model_max_length=256).save_pretrained(folder)
    path = os.path.join(folder, "tokenizer_config.json")  # a class name transformers 4 (Infinity's) knows too
    with open(path) as f:
        tokenizer_config = json.load(f)
    with open(path, "w") as f:
        json.dump({**tokenizer_config, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
    print(f"wrote a random-weight SiglipModel ({preset}, {dtype}) to {folder}", file=sys.stderr)


def make_jpegs(count: int, size: tuple[int, int], seed: int) -> list[bytes]:
    """`count` distinct JPEGs (width, height): smooth random colour fields with noise, quality 90."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        low = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
        pixels = np.clip(np.asarray(low, dtype=np.int16) + rng.integers(-12, 13, (size[1], size[0], 3)), 0, 255)
        buf = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def bodies(model: str, jpegs: list[bytes], per_request: int) -> list[bytes]:
    urls = ["data:image/jpeg;base64," + base64.b64encode(j).decode() for j in jpegs]
    return [json.dumps({"model": model, "input": urls[i:i + per_request], "encoding_format": "float",
                        "modality": "image"}).encode() for i in range(0, len(urls), per_request)]


def start_server(target: str, args, port: int, log) -> subprocess.Popen:
    if target.startswith("mmenc"):  # "mmenc-bf16": the same with --dtype bfloat16
        dtype = ["--dtype", "bfloat16"] if target == "mmenc-bf16" else []
        cmd = [sys.executable, "-m", "mmenc", "serve", "--model", args.checkpoint, "--host", HOST, "--port", str(port),
               "--cache-bytes", "0", "--device", args.device, "--served-model-name", args.checkpoint, *dtype,
               *args.serve_arg]  # the name Infinity serves it under: one request body for both
        env = dict(os.environ)
    else:
        cmd = [args.infinity_bin, "v2", "--model-id", args.checkpoint, "--engine", "torch", "--device", args.device,
               "--host", HOST, "--port", str(port), *args.infinity_arg]
        env = dict(os.environ, DO_NOT_TRACK="1", INFINITY_ANONYMOUS_USAGE_STATS="0", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1")
        env.pop("PYTHONPATH", None)  # Infinity's own venv (transformers < 5), not this one's
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, timeout: float, log_path: str) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {open(log_path).read()[-3000:]}")
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout:.0f} s: {open(log_path).read()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def post(conn: http.client.HTTPConnection, body: bytes) -> tuple[int, bytes]:
    conn.request("POST", "/embeddings" if conn.infinity else "/v1/embeddings", body,
                 {"content-type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def drive(port: int, infinity: bool, warm: list[bytes], measured: list[bytes], clients: int,
          duration: float, sid: int) -> dict:
    """Warm-up (one request per client), then the measured requests closed-loop; the vectors come back too."""
    next_index, lock = [0], threading.Lock()
    latencies, errors, vectors = [], [], {}

    def connect():
        conn = http.client.HTTPConnection(HOST, port, timeout=300)
        conn.infinity = infinity
        return conn

    def warm_client(c: int) -> None:
        status, reply = post(connect(), warm[c % len(warm)])
        if status != 200:
            raise RuntimeError(f"warm-up request failed ({status}): {reply[:300]!r}")

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(warm_client, range(clients)))
    deadline = [0.0]

    def client(_: int) -> None:
        conn = connect()
        while time.perf_counter() < deadline[0]:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= len(measured):
                return
            begin = time.perf_counter()
            status, reply = post(conn, measured[i])
            latencies.append(time.perf_counter() - begin)
            if status != 200:
                errors.append(f"{status}: {reply[:200]!r}")
                continue
            for item in json.loads(reply)["data"]:
                vectors[(i, item["index"])] = np.asarray(item["embedding"], dtype=np.float32)

    cpu0, by_process0, start = session_cpu_s(sid), process_cpu_s(sid), time.perf_counter()
    deadline[0] = start + duration
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall, cpu = time.perf_counter() - start, session_cpu_s(sid) - cpu0
    by_process = process_cpu_s(sid)
    spent = {pid: s - by_process0.get(pid, (0.0, ""))[0] for pid, (s, _) in by_process.items()}
    for pid in sorted(spent, key=spent.get, reverse=True)[:8]:  # where the server's CPU time went
        print(f"  server process {pid}: {spent[pid]:.1f} CPU s over the phase: {by_process[pid][1]}", file=sys.stderr)
    lat = sorted(latencies)
    return {"images": len(vectors), "wall_s": wall, "images_per_s": len(vectors) / wall, "errors": errors,
            "server_cpu_s": cpu, "images_per_cpu_s": len(vectors) / cpu if cpu > 0 else float("nan"),
            "p50_s": statistics.median(lat) if lat else float("nan"),
            "p90_s": lat[int(0.9 * (len(lat) - 1))] if lat else float("nan"), "vectors": vectors}


def process_cpu_s(sid: int) -> dict[int, tuple[float, str]]:
    """{pid: (user + system CPU seconds, its thread count and command line cut to 100 characters)} of session
    `sid`."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid, fields in processes():
        if int(fields[3]) == sid:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    name = f.read().replace(b"\0", b" ").decode(errors="replace")[:100]
            except OSError:
                name = "?"
            out[pid] = ((int(fields[11]) + int(fields[12])) / tick, f"[{fields[17]} threads] {name}")
    return out


def offline(args, jpegs: list[bytes]) -> dict:
    """mmenc's Encoder.encode(pooled=True) over the measured JPEGs, in this process (after one warm-up call)."""
    import torch

    from mmenc import Encoder

    kwargs = json.loads(args.offline_kwargs)
    with Encoder(args.checkpoint, device=args.device, **kwargs) as enc:
        enc.encode(jpegs[:args.per_request * args.clients], pooled=True)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = enc.encode(jpegs, pooled=True)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    del out
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the servers started next get the whole device
    return {"images": len(jpegs), "wall_s": wall, "images_per_s": len(jpegs) / wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="a SiglipModel checkpoint folder (with preprocessor and tokenizer files)")
    p.add_argument("--write-checkpoint", metavar="DIR", help="write a random-weight SiglipModel there first")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--checkpoint-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--only-write", action="store_true", help="write the checkpoint and stop")
    p.add_argument("--targets", default="mmenc,infinity,mmenc,infinity",
                   help="runs in this order (A/B/A/B): mmenc, mmenc-bf16 (--dtype bfloat16), infinity")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--per-request", type=int, default=4)
    p.add_argument("--images", type=int, default=256, help="distinct JPEGs measured per run (each sent once)")
    p.add_argument("--size", default="640x480", help="JPEG width x height")
    p.add_argument("--duration", type=float, default=120.0, help="most seconds of the measured phase per run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--offline", action="store_true", help="also time Encoder.encode(pooled=True) in this process")
    p.add_argument("--offline-kwargs", default="{}", help='the offline Encoder\'s keyword arguments as JSON, e.g. '
                   '\'{"dtype": "bfloat16", "compile": true, "cuda_graphs": true}\' (the flags given to the server)')
    p.add_argument("--serve-arg", action="append", default=[], help="extra `mmenc serve` flag (repeat)")
    p.add_argument("--infinity-bin", default="/work/venvs/infinity/bin/infinity_emb")
    p.add_argument("--infinity-arg", action="append", default=[], help="extra `infinity_emb v2` flag (repeat)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, help="write the rows there too")
    args = p.parse_args()
    if args.write_checkpoint:
        write_checkpoint(args.write_checkpoint, args.preset, args.checkpoint_dtype)
        args.checkpoint = args.checkpoint or args.write_checkpoint
        if args.only_write:
            return 0
    if not args.checkpoint:
        p.error("--checkpoint (or --write-checkpoint) is needed")
    w, _, h = args.size.lower().partition("x")
    warm_count = args.clients * args.per_request
    jpegs = make_jpegs(args.images + warm_count, (int(w), int(h)), seed=1)
    warm = bodies(args.checkpoint, jpegs[args.images:], args.per_request)
    measured = bodies(args.checkpoint, jpegs[:args.images], args.per_request)
    rows = []
    if args.offline:
        rows.append({"run": "offline", **offline(args, jpegs[:args.images])})
        print(f"offline Encoder.encode(pooled=True): {rows[-1]['images_per_s']:.1f} images/s", file=sys.stderr)
    runs = {}
    for k, target in enumerate(t.strip() for t in args.targets.split(",") if t.strip()):
        port, log_path = free_port(), f"/tmp/embeddings_load_{target}_{k}.log"
        with open(log_path, "w") as log:
            proc = start_server(target, args, port, log)
            try:
                ready = wait_ready(proc, port, args.ready_timeout, log_path)
                result = drive(port, target == "infinity", warm, measured, args.clients, args.duration, proc.pid)
            finally:
                stop_server(proc)
        runs.setdefault(target, result["vectors"])
        rows.append({"run": f"{k + 1}:{target}", "ready_s": ready, **{k2: v for k2, v in result.items()
                                                                        if k2 != "vectors"}})
        print(f"run {k + 1} {target}: {result['images_per_s']:.1f} images/s, p50 {result['p50_s'] * 1e3:.0f} ms, "
              f"{len(result['errors'])} errors {result['errors'][:2]}", file=sys.stderr)
    (first, a), *others = runs.items() if runs else ((None, {}),)
    for name, b in others:
        common = sorted(set(a) & set(b))
        cos = [float(a[i] @ b[i] / (np.linalg.norm(a[i]) * np.linalg.norm(b[i]))) for i in common]
        if cos:
            print(f"cosine {first} vs {name}, the same {len(cos)} images: min {min(cos):.6f}, "
                  f"mean {statistics.mean(cos):.6f}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "errors"} | {"errors": len(r.get("errors", []))}
                       for r in rows], f, indent=1)
    print(f"\n{'run':<14} {'images':>7} {'wall s':>7} {'images/s':>9} {'p50 ms':>7} {'p90 ms':>7} {'errors':>6} "
          f"{'server CPU s':>12} {'images/CPU s':>12}")
    nan = float("nan")
    for r in rows:
        print(f"{r['run']:<14} {r['images']:>7} {r['wall_s']:>7.1f} {r['images_per_s']:>9.1f} "
              f"{r.get('p50_s', nan) * 1e3:>7.0f} {r.get('p90_s', nan) * 1e3:>7.0f} {len(r.get('errors', [])):>6} "
              f"{r.get('server_cpu_s', nan):>12.1f} {r.get('images_per_cpu_s', nan):>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
