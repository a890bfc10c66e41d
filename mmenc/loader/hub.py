"""A Hugging Face Hub id ("Qwen/Qwen2.5-VL-7B-Instruct") as a local checkpoint folder, through huggingface_hub.

    folder = hub_snapshot("Qwen/Qwen2.5-VL-7B-Instruct", shards_for)   # .../models--Qwen--.../snapshots/<rev>

The local cache comes first: when every file needed is in it (`huggingface_hub`'s layout, HF_HUB_CACHE /
HF_HOME), nothing is asked of the network. Otherwise, unless HF_HUB_OFFLINE is set, only these files are
downloaded: config.json, the processor configs, model.safetensors.index.json, the safetensors shards that
hold the tower's tensors per that index (`shards_for` picks them, from the tower's weight prefixes), and,
for contrastive checkpoints (`text=True`), the tokenizer files. A failure says what was missing, where
it was looked for and how to fix it (download it, give a folder, or ask for random weights).
"""
import pathlib
import re
from collections.abc import Callable, Iterable
from typing import Any

from mmenc.loader.checkpoint import INDEX_FILE, _read_json
from mmenc.logger import init_logger

logger = init_logger(__name__)

CONFIG = "config.json"
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.model")
SINGLE_FILE = "model.safetensors"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class HubModelError(ValueError):
    """A Hub id that cannot be turned into a local folder: not cached and offline, no such repository,
    no network. The message names the id, the cache and the fix."""


def looks_like_repo_id(model: str) -> bool:
    """`org/name` as the Hub spells repository ids (not a path that exists: the caller checks that first)."""
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model and not model.endswith((".", "-"))


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it."""
    from huggingface_hub import constants

    check = getattr(constants, "is_offline_mode", None)
    return bool(check()) if callable(check) else bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


class _Repo:
    """Files of one repository at one revision: from the cache first, else downloaded (unless offline).
    The first file found pins the commit, so every file comes from the same snapshot."""

    def __init__(self, repo_id: str, revision: str | None):
        self.repo_id, self.revision, self.downloaded = repo_id, revision, []

    def get(self, filename: str, required: bool) -> pathlib.Path | None:
        import huggingface_hub
        from huggingface_hub import errors

        cached = huggingface_hub.try_to_load_from_cache(self.repo_id, filename, revision=self.revision)
        if isinstance(cached, str):
            return self._pin(pathlib.Path(cached))
        known_absent = cached is not None  # huggingface_hub's marker: the Hub said it has no such file
        if known_absent or offline():
            if required:
                raise self._missing(filename, known_absent)
            return None
        try:
            path = huggingface_hub.hf_hub_download(self.repo_id, filename, revision=self.revision)
        except errors.LocalEntryNotFoundError as e:  # no network (also an EntryNotFoundError): below
            raise self._unreachable(filename, e) from e
        except errors.EntryNotFoundError:
            if required:
                raise self._missing(filename, True) from None
            return None
        except errors.RepositoryNotFoundError as e:
            raise HubModelError(f"model {self.repo_id!r}: no such repository on the Hugging Face Hub (or it is "
                                f"private or gated: log in with `hf auth login` and accept its terms); pass a local "
                                f"checkpoint folder, or --load-format dummy for random weights") from e
        except errors.RevisionNotFoundError as e:
            raise HubModelError(f"model {self.repo_id!r}: revision {self.revision!r} does not exist") from e
        except OSError as e:  # timeouts, refused connections, HTTP errors
            raise self._unreachable(filename, e) from e
        self.downloaded.append(filename)
        return self._pin(pathlib.Path(path))

    def _unreachable(self, filename: str, e: BaseException) -> HubModelError:
        detail = str(e).splitlines()[0] if str(e) else "no detail"
        return HubModelError(f"model {self.repo_id!r}: {filename} is not in the Hugging Face cache ({cache_dir()}) "
                             f"and downloading it failed ({type(e).__name__}: {detail}); check the network, pass a "
                             f"local checkpoint folder, or --load-format dummy for random weights")

    def _pin(self, path: pathlib.Path) -> pathlib.Path:
        if self.revision is None and path.parent.parent.name == "snapshots":
            self.revision = path.parent.name  # the commit: later files from the same snapshot
        return path

    def _missing(self, filename: str, known_absent: bool) -> HubModelError:
        if known_absent:
            return HubModelError(f"model {self.repo_id!r}: the repository has no {filename}; mmenc reads "
                                 f"safetensors checkpoints in the transformers layout (config.json + *.safetensors)")
        return HubModelError(
            f"model {self.repo_id!r} is not a local folder and its {filename} is not in the Hugging Face cache "
            f"({cache_dir()}), and HF_HUB_OFFLINE is set, so nothing is downloaded; download it first "
            f"(`hf download {self.repo_id}`, or run once without HF_HUB_OFFLINE), pass a local checkpoint folder, "
            f"or pass --load-format dummy (load_format='dummy') for random weights")


def hub_snapshot(repo_id: str, shards_for: Callable[[dict[str, Any], Iterable[str]], set[str]] | None,
                 *, revision: str | None = None, text: Callable[[dict[str, Any]], bool] = lambda config: False
                 ) -> pathlib.Path:
    """The snapshot folder of `repo_id` holding what mmenc reads (see the module docstring).

    shards_for(config.json dict, tensor names of the index) -> the tensor names the tower needs, from which
    the shard files are chosen; None: no weights (random weights: config and processor files only).
    text(config): also the tokenizer files (a contrastive checkpoint's text tower; its shards come with
    `shards_for`'s names). Raises HubModelError."""
    repo = _Repo(repo_id, revision)
    config_path = repo.get(CONFIG, required=True)
    config = _read_json(config_path)
    for name in PROCESSOR_FILES + (TOKENIZER_FILES if text(config) else ()):
        repo.get(name, required=False)
    if shards_for is not None:
        index = repo.get(INDEX_FILE, required=False)
        if index is None:
            repo.get(SINGLE_FILE, required=True)
        else:
            weight_map = _read_json(index).get("weight_map") or {}
            wanted = shards_for(config, list(weight_map))
            for shard in sorted({weight_map[name] for name in wanted}):
                repo.get(shard, required=True)
    if repo.downloaded:
        logger.info("%s: downloaded %s into %s", repo_id, ", ".join(repo.downloaded), cache_dir())
    return config_path.parent
