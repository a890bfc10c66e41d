"""The benchmark suite: one entry point for anyone with a GPU (or, for a few stages, a CPU).

    python benchmarks/run.py --out results/my-run                       # the default stages
    python benchmarks/run.py --out results/my-run --stages attn,towers  # some of them
    python benchmarks/run.py --list                                     # what each stage runs

Each stage runs its commands one after another (this Python, `python -m mmenc ...` and the scripts
next to this file) with a time limit each; their output goes to the console and to
OUT/<stage>.log, the JSON they write to OUT/, and OUT/summary.json lists every command with its exit
status and wall time. Stages that need CUDA are skipped (and say so) on a machine without it.
Measurement lives in the scripts and in `mmenc bench` (CUDA events after warm-up, transformers
side by side on the same weights); this file only runs them.

Optional kernels (FlashAttention-4) are picked up when importable; installing them is up to the
machine (see benchmarks/README.md for the optional wheel helpers).
"""
import argparse
import dataclasses
import datetime
import json
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable

HERE = pathlib.Path(__file__).resolve().parent
PY = sys.executable
MMENC = [PY, "-m", "mmenc"]
FAMILIES = ["Qwen/Qwen2-VL-72B-Instruct", "Qwen/Qwen3-VL-235B-A22B-Instruct", "zai-org/GLM-4.1V-9B-Thinking",
            "moonshotai/Kimi-K2.5"]


@dataclasses.dataclass(frozen=True)
class Step:
    argv: list[str]
    timeout_s: int


@dataclasses.dataclass(frozen=True)
class Stage:
    help: str
    steps: Callable[[pathlib.Path], list[Step]]  # out folder -> the commands
    needs_cuda: bool = True


def _script(name: str, *args: str) -> list[str]:
    return [PY, str(HERE / name), *args]


def _families(out: pathlib.Path) -> list[Step]:
    steps = []
    for model in FAMILIES:
        tag = model.replace("/", "_")
        steps.append(Step([*MMENC, "bench", "--model", model, "--load-format", "dummy", "--json", str(out / f"bench_{tag}.json")], 150))
        steps.append(Step([*MMENC, "bench", "--model", model, "--load-format", "dummy", "--compile", "--no-hf",
                           "--json", str(out / f"bench_{tag}_compile.json")], 200))
    return steps


# OCR-lineage towers (issue 15): largest published size -> its realistic workload (document pages)
OCR_FAMILIES = {"zai-org/GLM-OCR": "8xpage-p14", "PaddlePaddle/PaddleOCR-VL": "8xpage-p14",
                "baidu/ERNIE-4.5-VL-424B-A47B-PT": "8xpage-p14", "tencent/HunyuanOCR": "8xpage-p16"}


def _ocr(out: pathlib.Path) -> list[Step]:
    steps = []
    for model, workload in OCR_FAMILIES.items():
        tag = model.replace("/", "_")
        load = ["--model", model, "--load-format", "dummy", "--workload", workload, "--workload", "32x448px"]
        steps.append(Step([*MMENC, "bench", *load, "--json", str(out / f"bench_{tag}.json")], 240))
        steps.append(Step([*MMENC, "bench", *load, "--compile", "--json", str(out / f"bench_{tag}_compile.json")],
                          300))
    return steps


STAGES: dict[str, Stage] = {
    "env": Stage("versions, GPUs and the attention backends chosen here", lambda out: [
        Step([PY, "-c", "import torch, transformers; print('torch', torch.__version__, 'transformers', "
                        "transformers.__version__, 'cuda', torch.version.cuda, [torch.cuda.get_device_name(i) "
                        "for i in range(torch.cuda.device_count())])"], 60),
        Step([*MMENC, "--version"], 30),
        Step([*MMENC, "backends", "--head-size", "80", "--dtype", "bfloat16"], 60)], needs_cuda=False),
    "tests": Stage("every GPU test: pytest -m 'gpu or multigpu'", lambda out: [
        Step([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or multigpu", str(HERE.parent / "tests")],
             600)]),
    "attn": Stage("attention kernels side by side (every usable backend, both packs, 4 head sizes)", lambda out: [
        Step(_script("attention_bench.py", "--out", str(out / "attn.json")), 300)]),
    "sweep": Stage("TRITON_ATTN config sweep", lambda out: [
        Step(_script("attention_bench.py", "--sweep-only", "--out", str(out / "sweep.json")), 300)]),
    "towers": Stage("mmenc bench, Qwen2.5-VL-7B, both workloads, vs transformers: eager and compiled", lambda out: [
        Step([*MMENC, "bench", "--json", str(out / "bench_qwen25.json")], 200),
        Step([*MMENC, "bench", "--compile", "--no-hf", "--json", str(out / "bench_qwen25_compile.json")], 240)]),
    "graphs": Stage("mmenc bench --compile --cuda-graphs vs transformers", lambda out: [
        Step([*MMENC, "bench", "--compile", "--cuda-graphs", "--json", str(out / "bench_qwen25_graphs.json")], 240)]),
    "families": Stage("mmenc bench for the other families' largest towers", _families),
    "siglip": Stage("SigLIP so400m/14 at 384 px and SigLIP2 so400m/16 NaFlex (mixed aspect ratios) vs transformers",
                    lambda out: [
        Step([*MMENC, "bench", "--model", "google/siglip-so400m-patch14-384", "--load-format", "dummy", "--workload", "siglip-32x384px",
              "--json", str(out / "bench_siglip.json")], 200),
        Step([*MMENC, "bench", "--model", "google/siglip2-so400m-patch16-naflex", "--load-format", "dummy", "--workload", "naflex256-mix-32",
              "--workload", "naflex1024-mix-32", "--json", str(out / "bench_siglip2.json")], 240),
        Step(_script("siglip_e2e.py", "--json", str(out / "siglip_e2e.json")), 300)]),
    "clip": Stage("CLIP ViT-L/14-336 (batches of 32 and 256) vs transformers eager/compiled, timm compiled, open_clip",
                  lambda out: [
        Step(_script("clip_peers.py", "--json", str(out / "clip_peers.json")), 420),
        Step([*MMENC, "bench", "--model", "openai/clip-vit-large-patch14-336", "--load-format", "dummy", "--workload", "clip-32x336px",
              "--workload", "clip-256x336px", "--compile", "--cuda-graphs", "--json", str(out / "bench_clip.json")],
             300)]),
    "ocr": Stage("mmenc bench for GLM-OCR, PaddleOCR-VL, ERNIE-4.5-VL, HunyuanOCR vs transformers, eager and "
                 "compiled (document pages and 448 px crops)", _ocr),
    "kimi": Stage("Kimi-K2.5 MoonViT vs transformers' remote-code tower", lambda out: [
        Step(_script("kimi_vs_transformers.py", "--compile", "--json", str(out / "kimi_compile.json")), 240)]),
    "multigpu": Stage("1 GPU vs 2 GPUs, data and weights modes, both stagings", lambda out: [
        Step(_script("multigpu_bench.py", "--staging", "pinned,device", "--out", str(out / "multigpu.json")), 300)]),
    "parity": Stage("full-size bf16 towers vs transformers fp32 on the same weights", lambda out: [
        Step(_script("parity_fp32.py", "--compile"), 300)]),
    "fa4-cost": Stage("FlashAttention-4 first-use compile time per shape class", lambda out: [
        Step(_script("fa4_first_use.py", "--json", str(out / "fa4_cost.json")), 300)]),
    "video": Stage("mmenc bench --video: a 60 s 1280x720 H.264 clip at 2 fps, 1 and 16 of them, compiled + CUDA "
                   "graphs, vs the tower alone and transformers (needs av: pip install its wheel first)", lambda out: [
        Step([*MMENC, "bench", "--video", "--compile", "--cuda-graphs", "--video-dir", str(out),
              "--json", str(out / "bench_video.json")], 600)]),
    "cpu-parity": Stage("full-size towers in float32 on CPU vs transformers (slow; no GPU needed)", lambda out: [
        Step(_script("fullsize_parity_cpu.py"), 3600)], needs_cuda=False),
}
DEFAULT = ["env", "tests", "attn", "towers", "graphs", "families", "kimi", "multigpu", "parity"]


def run_step(step: Step, log) -> dict:
    """Run one command; its output goes to the console and `log`. Returns its summary row."""
    line = " ".join(step.argv)
    log.write(f"$ {line}\n")
    log.flush()
    start = time.monotonic()
    proc = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    timer = threading.Timer(step.timeout_s, proc.kill)  # a silent hang is ended too
    timer.start()
    for text in proc.stdout:
        sys.stdout.write(text)
        log.write(text)
    rc = proc.wait()
    timer.cancel()
    timed_out = time.monotonic() - start >= step.timeout_s
    seconds = round(time.monotonic() - start, 1)
    log.write(f"# exit {rc}{' (time limit)' if timed_out else ''} after {seconds}s\n")
    return {"command": line, "rc": rc, "seconds": seconds, "timed_out": timed_out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="folder for the logs and JSON results (created)")
    parser.add_argument("--stages", default=",".join(DEFAULT),
                        help=f"comma-separated stages (default: {','.join(DEFAULT)}); see --list")
    parser.add_argument("--list", action="store_true", help="list the stages and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, stage in STAGES.items():
            print(f"{name:<11} {stage.help}{'' if stage.needs_cuda else ' (CPU ok)'}")
        return 0
    if args.out is None:
        parser.error("--out DIR is required: the folder the results go to")
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; known: {', '.join(STAGES)}")
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "stages": {}}
    for name in stages:
        stage = STAGES[name]
        print(f"== {datetime.datetime.now():%H:%M:%S} stage {name}", flush=True)
        if stage.needs_cuda and not torch.cuda.is_available():
            print(f"stage {name} skipped: it needs CUDA and none is available", flush=True)
            summary["stages"][name] = {"skipped": "needs CUDA"}
            continue
        with open(args.out / f"{name}.log", "w") as log:
            summary["stages"][name] = [run_step(step, log) for step in stage.steps(args.out)]
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    failed = [n for n, rows in summary["stages"].items() if isinstance(rows, list) and any(r["rc"] for r in rows)]
    print(f"== done; results in {args.out}" + (f"; stages with a failed command: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
