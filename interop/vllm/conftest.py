"""One stack per family, shared by every test of that family: a tiny chat checkpoint, vLLM's OpenAI
server (image embeddings on, EC consumer on mmenc's --ec-storage tree), `mmenc serve` on the same tree
(for Qwen3-VL also with --frontends 2), one in-process vLLM LLM and one mmenc Encoder; for the video
families also a clip (mmenc.testing.clips, PyAV). The servers
start when the stack is made and boot while the offline tests run; the stack is torn down before the
next family's (pytest groups the tests by family), so at most one family's processes run at once.
Run by interop/vllm/run.sh with the interop venv's python (vLLM installed) and the checkout on PYTHONPATH.
"""
import functools
import gc
import io
import os
import pathlib

import numpy as np
import pytest

from harness import ENGINE, QUIET_ENV, mmenc_server, vllm_server
from mmenc.vllm_inputs import (EC_ONLY_ARCHITECTURES, EMBEDS_ARCHITECTURES, SAME_LENGTH_EMBEDS_ARCHITECTURES,
                               VIDEO_EMBEDS_ARCHITECTURES)

os.environ.update(QUIET_ENV)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the offline engine in this process: no second vLLM import

FAMILIES = EMBEDS_ARCHITECTURES + EC_ONLY_ARCHITECTURES  # what mmenc.vllm_inputs claims is what runs here
FRONTENDS = {"Qwen3VLForConditionalGeneration": 2}  # an extra `mmenc serve --frontends 2` for this family
SIZES = ((84, 112), (56, 84))  # (h, w) of the two test images: different sizes, so a swap changes the grids
# the test clip of the video families: 2 s at 4 fps, so Qwen2.5-VL's second_per_grid_ts (2 / 4) is not vLLM's
# default of 1.0 and Qwen3-VL samples 4 of the 8 frames (2 fps)
CLIP = dict(frames=8, size=(112, 112), fps=4)
# one more image, sent alone, where a family's packing has a path the two sizes do not reach: OneVision's
# anyres_max_9 shrinks the unpadded tile features when they pass 9 tiles' worth (336x336 px: 6x6 tiles of the
# tiny checkpoint's 56 px, 24x24 patches, downscaled to 12x12)
LARGE = {"LlavaOnevisionForConditionalGeneration": (336, 336)}


class Stack:
    def __init__(self, architecture: str, root: pathlib.Path):
        from PIL import Image

        from mmenc.testing.checkpoints.chat import CHAT_FAMILIES, save_chat_checkpoint
        from mmenc.testing.clips import write_clip

        self.architecture, self.family = architecture, CHAT_FAMILIES[architecture]
        self.folder = save_chat_checkpoint(architecture, root / "model")
        self.ec_dir = root / "ec"
        self.ec_dir.mkdir()
        rng = np.random.default_rng(0)
        self.images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
        # the images sent together as embeddings: 0 and 1; where vLLM takes one length per encoder batch, 0 and a
        # third image of 0's size (other pixels), each size also sent alone
        self.pair, self.embeds_sets = [0, 1], ([0], [0, 1])
        if architecture in SAME_LENGTH_EMBEDS_ARCHITECTURES:
            self.images.append(Image.fromarray(rng.integers(0, 256, (*SIZES[0], 3), dtype=np.uint8)))
            self.pair, self.embeds_sets = [0, len(SIZES)], ([0], [1], [0, len(SIZES)])
        if architecture in LARGE:
            self.images.append(Image.fromarray(rng.integers(0, 256, (*LARGE[architecture], 3), dtype=np.uint8)))
            # before the last set: the tests' controls (swapped, zeroed) take the last one, a pair
            self.embeds_sets = (*self.embeds_sets[:-1], [len(self.images) - 1], self.embeds_sets[-1])
        self.png = []
        for image in self.images:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            self.png.append(buf.getvalue())
        self.takes_video = architecture in VIDEO_EMBEDS_ARCHITECTURES
        self.limits = {"image": len(SIZES), **({"video": 1} if self.takes_video else {})}
        self.clip = write_clip(root / "clip.mp4", **CLIP) if self.takes_video else None
        self.vllm = vllm_server(self.folder, self.ec_dir, root / "vllm.log", self.limits)
        self.mmenc = {0: mmenc_server(self.folder, self.ec_dir, root / "mmenc.log")}
        for n in [FRONTENDS[architecture]] if architecture in FRONTENDS else []:
            self.mmenc[n] = mmenc_server(self.folder, self.ec_dir, root / f"mmenc-frontends{n}.log", frontends=n)
        self._uuids = 0
        self.answers = {}  # vLLM's own answers (image_url parts), by images
        self.takes_embeds = architecture in EMBEDS_ARCHITECTURES

    def uuid(self, what: str) -> str:
        """A uuid used once in this stack: vLLM caches by uuid (processor cache, encoder cache, prefix cache)."""
        self._uuids += 1
        return f"interop-{what}-{self._uuids}"

    @functools.cached_property
    def llm(self):
        from vllm import LLM

        return LLM(model=str(self.folder), limit_mm_per_prompt=self.limits, **ENGINE)

    @functools.cached_property
    def encoder(self):
        from mmenc import Encoder

        return Encoder(str(self.folder), dtype="float32", device="cpu")

    def close(self) -> None:
        for server in [self.vllm, *self.mmenc.values()]:
            server.stop()
        if "llm" in self.__dict__:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            del self.__dict__["llm"]
            gc.collect()
            cleanup_dist_env_and_memory()
        if "encoder" in self.__dict__:
            self.__dict__.pop("encoder").close()


@pytest.fixture(scope="session", params=FAMILIES, ids=lambda a: a.removesuffix("ForConditionalGeneration"))
def stack(request, tmp_path_factory):
    made = Stack(request.param, tmp_path_factory.mktemp(request.param))
    yield made
    made.close()
