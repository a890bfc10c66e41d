"""Processes and requests of the interop suite: vLLM's OpenAI server, `mmenc serve`, and what is compared.

An Answer is what vLLM decided: its greedy token ids and each one's logprob. Two answers agree when
the tokens are equal and every logprob is within TOL (fp32 on both sides, the same vLLM code after the
embeddings: differences are rounding only); a control must disagree by more than that.
"""
import base64
import dataclasses
import io
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import torch

TOL = 1e-4
MAX_TOKENS = 6
# No traffic off the machine, no model hub: vLLM's usage report and Hugging Face lookups off.
QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false"}


@dataclasses.dataclass(frozen=True)
class Answer:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]

    def gap(self, other: "Answer") -> float:
        """inf when the tokens differ, else the largest logprob difference."""
        if self.tokens != other.tokens:
            return float("inf")
        return max(abs(a - b) for a, b in zip(self.logprobs, other.logprobs))


def assert_agree(got: Answer, want: Answer, what: str) -> None:
    gap = got.gap(want)
    assert gap <= TOL, (f"{what}: vLLM's answer differs from its image answer (tokens {got.tokens} vs {want.tokens}, "
                        f"largest logprob gap {gap:.3g}, tolerance {TOL})")


def assert_differ(got: Answer, want: Answer, what: str) -> None:
    gap = got.gap(want)
    assert gap > 10 * TOL, f"control {what}: answer equals the image answer (gap {gap:.3g}): the check could not fail"


def from_request_output(output) -> Answer:
    """An Answer from vLLM's LLM.generate output (one prompt, logprobs=1)."""
    completion = output.outputs[0]
    tokens = tuple(completion.token_ids)
    return Answer(tokens, tuple(step[t].logprob for step, t in zip(completion.logprobs, tokens)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def b64_tensor(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def load_b64_tensor(text: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)


def png_data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies (no server outlives a killed run)."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """A server process on 127.0.0.1:port, its output in a log file; started at once, waited for on first use."""

    def __init__(self, name: str, argv: list[str], port: int, log: pathlib.Path, env: dict | None = None):
        self.name, self.port, self.log_path = name, port, log
        self._log = open(log, "wb")
        env = {**os.environ, **QUIET_ENV, **(env or {})}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent)
        self._ready = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 600.0) -> "Server":
        deadline = time.monotonic() + timeout
        while not self._ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    self._ready = r.status == 200
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if not self._ready:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not healthy after {timeout:.0f} s:\n{self.tail()}")
                time.sleep(0.5)
        return self

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def post(self, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
        request = urllib.request.Request(f"{self.wait().url}{path}", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def vllm_server(model: pathlib.Path, ec_dir: pathlib.Path, log: pathlib.Path, limits: dict) -> Server:
    """vLLM's OpenAI server (python -m: the `vllm` command of vllm-cpu fails on
    importlib.metadata.version("vllm")) taking embeddings, `limits` media per prompt ({"image": 2, ...}), and
    reading `ec_dir` as an EC consumer."""
    ec = {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
          "ec_connector_extra_config": {"shared_storage_path": str(ec_dir)}}
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), *ENGINE_FLAGS, "--limit-mm-per-prompt", json.dumps(limits),
            "--ec-transfer-config", json.dumps(ec)]
    # in one process: on CPU, vLLM's default is an API server, an engine-core process and a worker process,
    # each importing vLLM (about 15 s of CPU apiece here); the engine then runs in the API server's process
    return Server(f"vLLM server ({model.name})", argv, port, log, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


# The same engine settings offline (LLM(...) keywords) and for the server (flags).
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=4, seed=0,
              kv_cache_memory_bytes=64 << 20, enable_mm_embeds=True)
ENGINE_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "4", "--seed",
                "0", "--kv-cache-memory-bytes", str(64 << 20), "--enable-mm-embeds"]


def mmenc_server(model: pathlib.Path, ec_dir: pathlib.Path, log: pathlib.Path, frontends: int = 0) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "mmenc", "serve", "--model", str(model), "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port), "--ec-storage", str(ec_dir)]
    if frontends:
        argv += ["--frontends", str(frontends)]
    return Server(f"mmenc serve ({model.name}, frontends {frontends})", argv, port, log)


def chat_body(model: pathlib.Path, parts: list[dict], text: str) -> dict:
    """A chat request: the user's content parts (images or image_embeds) then the text; greedy decoding of
    MAX_TOKENS tokens whatever the model would stop at, each with its logprob, tokens as ids."""
    return {"model": str(model), "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 0, "logprobs": True, "ignore_eos": True,
            "return_tokens_as_token_ids": True}


def chat(server: Server, body: dict) -> Answer:
    status, reply = server.post("/v1/chat/completions", body)
    assert status == 200, f"vLLM answered {status}: {reply}"
    steps = reply["choices"][0]["logprobs"]["content"]
    tokens = tuple(int(step["token"].removeprefix("token_id:")) for step in steps)
    return Answer(tokens, tuple(step["logprob"] for step in steps))
