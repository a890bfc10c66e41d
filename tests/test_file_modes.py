"""Every file mmenc writes gets the mode the process umask gives (0666 & ~umask), like a file `open()`
creates: safetensors' writer and mkstemp make 0600 files, which a vLLM process running as another
user could not read from the encoder-cache folder. Issue 28 item 9 (the `mmenc encode` output:
tests/test_cli_signals.py; Ray shards: tests/test_ray_resume.py)."""
import contextlib
import os
import stat

import pytest
import torch

from mmenc.files import current_umask, file_mode, write_atomically
from mmenc.serving.ec_storage import ECStorage


@contextlib.contextmanager
def umask(mask: int):
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o002, 0o022, 0o027])
def test_ec_storage_files_follow_the_umask(tmp_path, mask):
    with umask(mask):
        assert current_umask() == mask
        store = ECStorage(tmp_path / "ec")
        assert store.write("key-1", torch.ones(3, 4))
    path = store.path("key-1")
    assert mode(path) == 0o666 & ~mask, oct(mode(path))
    assert mode(path.parent) == 0o777 & ~mask  # the folder, as mkdir makes it
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


def test_write_atomically_follows_the_umask_and_leaves_no_temporary(tmp_path):
    from safetensors.torch import save_file

    target = tmp_path / "out.safetensors"
    with umask(0o007):
        write_atomically(target, lambda tmp: save_file({"x": torch.zeros(2)}, tmp))
        assert file_mode() == 0o660
    assert mode(target) == 0o660
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]
