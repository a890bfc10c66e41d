"""One image's share of the pipeline, wherever it runs: read/decode, `processor.plan`, the CPU resize
(resize="cpu") and, for a CPU device, patchify. `ImageWork.prepare(index, item)` is what a worker
thread of `Preprocessor` runs, and what a worker process runs (mmenc.preprocess.procs), so both
give the same pixels and the same failure messages. An ImageWork pickles (its processor is plain
data), which is how a worker process gets it.
"""
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mmenc.preprocess import gpu_decode
from mmenc.preprocess.images import ImageLoadError, LoadFailure, load_image
from mmenc.preprocess.plan import ImagePlan, input_name
from mmenc.preprocess.staging import chw
from mmenc.preprocess.video import VideoPiece
from mmenc.preprocess.video_frames import DecodeCursors


@dataclasses.dataclass
class Ready:
    """A prepared image. pixels: uint8 [C, h, w], resized (`resized`) or as decoded (maybe a view
    of [h, w, C] memory); for CUDA also PIL's numpy [h, w, C] as loaded; on a CPU device its patches
    [rows, ...]; or encoded JPEG bytes [n] (encoded, decode="gpu"). release: called once the pixels
    were copied away (a worker process's shared segment goes back to it); None for memory of ours."""

    index: int
    item: Any
    plan: ImagePlan
    pixels: torch.Tensor | np.ndarray
    encoded: bool = False
    release: Callable[[], None] | None = None
    resized: bool = False  # the worker resized it (else the device does)


@dataclasses.dataclass(frozen=True)
class ImageWork:
    """What a worker does to one image. decode: "cpu" | "torchvision" | "gpu" and resize: "cpu" |
    "device" as Preprocessor chose them (its "split" sets "cpu" here and passes "device" with some
    images to `prepare`); device_type: the tower's input device type; max_pixels: `load_image`'s
    decompression-bomb limit (-1: PIL's Image.MAX_IMAGE_PIXELS at call time); video: the model's
    VideoProcessor (mmenc.preprocess.video), which prepares VideoPiece items, or None."""

    processor: Any
    decode: str
    resize: str
    device_type: str
    max_pixels: int | None
    video: Any = None
    high_bit_depth: str = "clip"  # load_image's: 16-bit images as transformers converts them, or scaled
    cursors: DecodeCursors = dataclasses.field(default_factory=DecodeCursors, compare=False)  # videos' open decoders

    @property
    def patchify_in_workers(self) -> bool:
        """On a CPU device nothing crosses: the workers patchify too, in parallel."""
        return self.device_type == "cpu" and self.resize == "cpu"

    def prepare(self, index: int, item: Any, resize: str | None = None) -> Ready | LoadFailure:
        """resize: "cpu" or "device" for this image instead of self.resize (Preprocessor's "split")."""
        if isinstance(item, VideoPiece):
            return self._prepare_piece(index, item)
        name = input_name(item, index)
        resize = resize or self.resize
        try:
            if self.decode == "gpu" and (ready := self._prepare_jpeg(index, item, name)) is not None:
                return ready
            pixels = self._decode(index, item)  # RGB uint8 [3, H, W], or numpy [H, W, 3] from PIL
            height, width = pixels.shape[1:] if isinstance(pixels, torch.Tensor) else pixels.shape[:2]
            plan = self.processor.plan(height, width, index=index, name=name)
            if self.device_type == "cpu":
                pixels = torch.from_numpy(pixels.numpy().copy()) if isinstance(pixels, torch.Tensor) else chw(pixels)
            elif resize == "cpu" and isinstance(pixels, np.ndarray):
                pixels = chw(pixels)  # PIL's array is read-only: one copy
            if resize == "cpu":  # a view of [H, W, C] memory stays one: torch's uint8 kernel takes it as it is
                pixels = self.processor.resize_one(pixels, plan)
            if self.patchify_in_workers:
                pixels = self.processor.patchify(pixels, plan)
            elif isinstance(pixels, np.ndarray) and self.device_type != "cuda":  # a plain [C, H, W] tensor crosses
                pixels = chw(pixels)
            # for CUDA the calling thread copies it into pinned memory as it is (no transpose): no CUDA
            # call here, as one from another thread during a (global mode) CUDA graph capture breaks it
            return Ready(index, item, plan, pixels, resized=resize == "cpu")
        except ImageLoadError as e:  # includes ImagePreprocessError
            message = str(e) if str(e).startswith(name) else f"{name}: {e}"
            return LoadFailure(index, name, message)

    def _prepare_piece(self, index: int, piece: VideoPiece) -> Ready | LoadFailure:
        """A video piece: decode its frames (seeking) and resize them here, whatever the image resize mode
        (uint8 [n, C, h, w] crosses; on a CPU device its patches)."""
        try:
            pixels = self.video.prepare_piece(piece, self.cursors)  # a video's next piece goes on from its last
        except ImageLoadError as e:  # VideoDecodeError: names the file and the frame
            return LoadFailure(index, piece.name, str(e) if str(e).startswith(piece.name) else f"{piece.name}: {e}")
        if self.patchify_in_workers:
            pixels = self.video.patchify(pixels, piece.plan)
        return Ready(index, piece, piece.plan, pixels, resized=True)

    def _decode(self, index: int, item: Any) -> torch.Tensor | np.ndarray:
        """torchvision's decoder for a plain colour JPEG (decode="torchvision": uint8 [3, H, W], a view
        of [H, W, 3] memory), else `load_image` (RGB uint8 numpy [H, W, 3], read-only from PIL)."""
        if self.decode == "torchvision" and (data := gpu_decode.jpeg_bytes(item)) is not None:
            if gpu_decode.probe_jpeg(data, pixel_limit(self.max_pixels)) is not None:
                if (image := gpu_decode.decode_jpeg_cpu(data)) is not None:
                    return image
        return load_image(item, index=index, max_pixels=self.max_pixels, high_bit_depth=self.high_bit_depth)

    def _prepare_jpeg(self, index: int, item: Any, name: str) -> Ready | None:
        if (data := gpu_decode.jpeg_bytes(item)) is None:
            return None  # not encoded, or unreadable: load_image reports it
        if (size := gpu_decode.probe_jpeg(data, pixel_limit(self.max_pixels))) is None:
            return None
        plan = self.processor.plan(size[0], size[1], index=index, name=name)
        return Ready(index, item, plan, torch.frombuffer(bytearray(data), dtype=torch.uint8), encoded=True)


def pixel_limit(max_pixels: int | None) -> int | None:
    """The pixel limit `load_image(max_pixels=...)` applies (-1: PIL's MAX_IMAGE_PIXELS now)."""
    from PIL import Image

    return Image.MAX_IMAGE_PIXELS if max_pixels == -1 else max_pixels
