"""A Hugging Face Hub cache laid out on disk from a local folder, as huggingface_hub keeps a download:

    <cache>/models--org--name/blobs/<sha256 of the file>
    <cache>/models--org--name/snapshots/<revision>/<file>  ->  ../../blobs/<sha256>
    <cache>/models--org--name/refs/main                        (the revision)
    <cache>/models--org--name/.no_exist/<revision>/<file>      (files the Hub said it does not have)

Tests point HF_HUB_CACHE at <cache> and set HF_HUB_OFFLINE=1: nothing touches the network.
"""
import hashlib
import os
import pathlib
from collections.abc import Iterable

REVISION = "0123456789abcdef0123456789abcdef01234567"


def put_in_hub_cache(cache: str | os.PathLike, repo_id: str, folder: str | os.PathLike,
                     files: Iterable[str] | None = None, absent: Iterable[str] = (),
                     revision: str = REVISION) -> pathlib.Path:
    """Cache `files` of `folder` (default: all) as `repo_id` at `revision` (refs/main points at it);
    `absent`: names recorded as missing on the Hub. Returns the snapshot folder."""
    folder = pathlib.Path(folder)
    repo = pathlib.Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot, blobs = repo / "snapshots" / revision, repo / "blobs"
    snapshot.mkdir(parents=True, exist_ok=True)
    blobs.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in folder.iterdir() if p.is_file()) if files is None else list(files)
    for name in names:
        data = (folder / name).read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    for name in absent:
        marker = repo / ".no_exist" / revision / name
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot
