"""Encoder-cache files for vLLM's file-based EC connector (ECExampleConnector, formerly
ECSharedStorageConnector): DIR/<key>/encoder_cache.safetensors holding one tensor "ec_cache"
[tokens, hidden * (1 + deepstack levels)] in the model dtype."""
import os
import pathlib
import tempfile

import torch

from mmenc.files import write_atomically

FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"


class ECStorage:
    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--ec-storage {str(root)!r} cannot be created ({e}); pass a writable folder") from e

    def path(self, key: str) -> pathlib.Path:
        return self.root / key / FILE_NAME

    def write(self, key: str, tensor: torch.Tensor) -> bool:
        """Write `tensor` [tokens, width] for `key` unless its file exists; atomic: a temp file in the
        same folder, then rename, so a reader sees either no file or the whole file; its mode follows the
        umask (mmenc.files), so a vLLM consumer running as another user can read it. Returns True
        when a file was written."""
        from safetensors.torch import save_file

        target = self.path(key)
        if target.exists():
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        write_atomically(target, lambda path: save_file({TENSOR_NAME: tensor.contiguous()}, path), tmp=tmp)
        return True
