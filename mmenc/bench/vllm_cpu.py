"""vLLM's CPU tower beside mmenc's, on the same weights and pixels (`mmenc bench --vllm-python PATH`).

vLLM needs its own torch build, so it runs in a child process of the given interpreter
(mmenc/bench/vllm_child.py); the weights (transformers' tower names) and the pixels cross once in a
safetensors file, then each call is one JSON line each way. The time is the child's own (around the
tower call), so the pipe costs nothing of it. Families: VLLM_FAMILIES.
"""
import json
import pathlib
import socket
import subprocess
import tempfile

import torch
from safetensors.torch import load_file, save_file

from mmenc.models.base import vision_config_dict

# architecture -> the child's family key
VLLM_FAMILIES = {"Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
CHILD = pathlib.Path(__file__).with_name("vllm_child.py")


def vllm_tower_available(architecture: str) -> str | None:
    """None if the vLLM side can run this architecture, else the reason."""
    if architecture not in VLLM_FAMILIES:
        return f"no vLLM tower wired for {architecture} (supported: {', '.join(VLLM_FAMILIES)})"
    return None


class VllmTower:
    """vLLM's tower in a child process: `run(pixel_values, grid_thw)` -> (seconds, output or None)."""

    def __init__(self, python: str, hf_config: dict, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 threads: int, port: int | None = None):
        arch = (hf_config.get("architectures") or ["?"])[0]
        why = vllm_tower_available(arch)
        if why:
            raise ValueError(why)
        self._dir = tempfile.TemporaryDirectory(prefix="mmenc-vllm-")
        weights = pathlib.Path(self._dir.name) / "weights.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(weights))
        spec = {"family": VLLM_FAMILIES[arch], "vision_config": vision_config_dict(hf_config), "weights": str(weights),
                "dtype": str(dtype).removeprefix("torch."), "threads": threads, "port": port or _free_port()}
        self._proc = subprocess.Popen([python, str(CHILD), json.dumps(spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        self._answer()  # {"ready": ...}
        weights.unlink()
        self._key = None

    def _answer(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM child ({CHILD.name}) exited with {self._proc.wait()}; its stderr says why")
        return json.loads(line)

    def _ask(self, **request) -> dict:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return self._answer()

    def run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, keep_output: bool = False):
        """One tower call on these inputs (sent once while they stay the same): (seconds, output or None)."""
        seconds, out, _ = self.run_timed(pixel_values, grid_thw, keep_output)
        return seconds, out

    def run_timed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, keep_output: bool = False,
                  profile: bool = False):
        """One tower call: (wall seconds, output or None, {"cpu_s": the child's CPU seconds (user + sys, all
        its threads), "ops": CPU seconds per operator with profile=True (mmenc.bench.op_cpu_time)})."""
        key = (pixel_values.data_ptr(), tuple(pixel_values.shape), tuple(map(tuple, grid_thw.tolist())))
        folder = pathlib.Path(self._dir.name)
        if key != self._key:
            save_file({"pixel_values": pixel_values.detach().float().contiguous().cpu(),
                       "grid_thw": grid_thw.cpu().contiguous()}, str(folder / "inputs.safetensors"))
            self._ask(op="inputs", path=str(folder / "inputs.safetensors"))
            self._key = key
        out_path = folder / "out.safetensors"
        answer = self._ask(op="run", save=str(out_path) if keep_output else None, profile=profile)
        out = load_file(str(out_path))["out"] if keep_output else None
        return answer["seconds"], out, {k: v for k, v in answer.items() if k != "seconds"}

    def close(self) -> None:
        if self._proc.poll() is None:
            self._ask_stop()
        self._dir.cleanup()

    def _ask_stop(self) -> None:
        self._proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
        self._proc.stdin.close()
        self._proc.wait(timeout=60)


def _free_port() -> int:
    """A loopback TCP port free a moment ago (vLLM's one-process gloo group listens on it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
