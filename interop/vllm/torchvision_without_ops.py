"""Lets the PyPI torchvision import beside a CPU-only torch (installed into the interop venv with a
.pth line by setup.sh; not part of mmenc).

PyPI's torchvision wheels are CUDA builds: their compiled ops (torchvision/_C.so) need libtorch_cuda,
so beside torch 2.13.0+cpu they fail to load. torchvision then runs without its compiled ops (its
transforms are plain PyTorch), except that torchvision._meta_registrations registers fake kernels
for torchvision::nms and torchvision::qnms without checking that the ops exist, and the import of
torchvision fails with "operator torchvision::nms does not exist". This finder declares those two
schemas, only when torchvision's own extension did not load, just before that module runs. Calling
nms then fails with torch's "could not run torchvision::nms" error; nothing here computes anything.
"""
import importlib.abc
import importlib.machinery
import sys

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _DeclareBeforeRun(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        import torch
        import torchvision.extension

        if not torchvision.extension._has_ops():
            library = torch.library.Library("torchvision", "FRAGMENT")
            for schema in _SCHEMAS:
                library.define(schema)
            module._interop_library = library  # kept alive with the module
        self.inner.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeclareBeforeRun(spec.loader)
        return spec


if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
