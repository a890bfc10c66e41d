"""The vLLM side of `mmenc bench --vllm-python PATH`: run by that interpreter (a virtualenv with vLLM's
CPU build), not imported by mmenc. It builds vLLM's own vision tower class (Qwen2.5-VL) from a vision
config, loads the tensors it is given (transformers' tower names), runs vLLM's post-load weight
processing (on the CPU: oneDNN packing) and then answers one JSON line per request on stdin:

    {"op": "inputs", "path": F}   pixel_values, grid_thw from safetensors file F
    {"op": "run", "save": F|null, "profile": bool}
                                  one tower call; answers {"seconds": wall s, "cpu_s": this process's CPU s
                                  (user + sys, all threads)}, with "ops" (CPU s per operator, op_cpu_time.py)
                                  when profile is true; writes the output to F when asked
    {"op": "stop"}
"""
import importlib.util
import json
import pathlib
import sys
import time
import types

HERE = pathlib.Path(__file__).resolve().parent
if sys.path and pathlib.Path(sys.path[0] or ".").resolve() == HERE:
    sys.path.pop(0)  # run as a script: mmenc/bench's modules (profile.py, ...) must not shadow the stdlib's

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def _load_beside(name: str):
    """A torch-only module of mmenc/bench by its file (this interpreter has no mmenc installed)."""
    spec = importlib.util.spec_from_file_location(f"mmenc_bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_op_cpu_time = _load_beside("op_cpu_time")
OpCpuTime, process_cpu_seconds = _op_cpu_time.OpCpuTime, _op_cpu_time.process_cpu_seconds

TOWERS = {"qwen2_5_vl": ("vllm.model_executor.models.qwen2_5_vl", "Qwen2_5_VisionTransformer",
                         "transformers.models.qwen2_5_vl.configuration_qwen2_5_vl", "Qwen2_5_VLVisionConfig")}


def _no_image_processing() -> None:
    """transformers' Qwen2-VL image processor needs torchvision, which this venv need not have; vLLM
    imports one helper from it at import time, unused by the tower. Where the real module imports (the
    interop venv of interop/vllm/setup.sh has torchvision), it is used: vLLM also imports its classes."""
    import importlib

    try:
        importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
        return
    except ImportError:
        pass

    def unused(*args, **kwargs):
        raise RuntimeError("image processing is not available in the vLLM benchmark child")
    stand_in = types.ModuleType("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    stand_in.smart_resize = unused
    sys.modules.setdefault(stand_in.__name__, stand_in)


def build(spec: dict):
    import importlib

    import vllm.ir
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    module, cls, config_module, config_cls = TOWERS[spec["family"]]
    dtype = getattr(torch, spec["dtype"])
    torch.set_default_dtype(dtype)
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))  # vLLM's own CPU kernels
    context = set_current_vllm_config(config)
    context.__enter__()
    config.kernel_config.ir_op_priority.set_default()
    vllm.ir.set_default_torch_wrap(config.compilation_config.ir_enable_torch_wrap)
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{spec['port']}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    vision = getattr(importlib.import_module(config_module), config_cls)(**spec["vision_config"])
    tower = getattr(importlib.import_module(module), cls)(vision, norm_eps=spec.get("norm_eps", 1e-6),
                                                          prefix="visual").eval()
    tower.load_weights(load_file(spec["weights"]).items())
    for m in tower.modules():
        method = getattr(m, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(m)
    return tower, dtype


def main() -> None:
    _no_image_processing()
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    tower, dtype = build(spec)
    print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
    inputs = None
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "stop":
            break
        if request["op"] == "inputs":
            tensors = load_file(request["path"])
            inputs = (tensors["pixel_values"].to(dtype), tensors["grid_thw"].tolist())
            print(json.dumps({"ok": True}), flush=True)
        elif request["op"] == "run":
            ops = OpCpuTime() if request.get("profile") else None
            with torch.inference_mode():
                start, cpu = time.perf_counter(), process_cpu_seconds()
                if ops is None:
                    out = tower(*inputs)
                else:
                    with ops:
                        out = tower(*inputs)
                seconds, cpu_s = time.perf_counter() - start, process_cpu_seconds() - cpu
            if request.get("save"):
                save_file({"out": out.contiguous()}, request["save"])
            answer = {"seconds": seconds, "cpu_s": cpu_s, **({"ops": ops.as_dict()} if ops is not None else {})}
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
