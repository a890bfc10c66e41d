"""One image's bytes -> what the batcher needs, with the server's pixel limit. The one place the
server preprocesses.

Processors with the per-image API (`plan`, `resize_one`, `patchify`, `normalize`, `as_pixel_values`:
QwenVLProcessor, KimiProcessor) take the uint8 path: decode, plan and resize on the CPU (a pool
thread; PIL and torch's resize release the GIL), patchify still in uint8; the batcher moves a whole
batch's uint8 patches to the tower's device at once (a quarter of float32's bytes) and normalizes
them there (`normalize_rows`). The values equal `Encoder.preprocess([data])`'s (same kernels, same
elementwise arithmetic; tests/test_preprocess_pipeline.py). Other processors run whole, in float32."""
import io
import warnings

import torch
from PIL import Image, UnidentifiedImageError

from mmenc.preprocess.images import ImageLoadError, load_image, size_text, without_reprs
from mmenc.preprocess.plan import ImagePreprocessError
from mmenc.serving.inputs import ItemError

_PER_IMAGE_API = ("plan", "resize_one", "patchify", "normalize", "as_pixel_values")


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the file header, without decoding the pixels."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data)) as img:
            return img.size


def has_per_image_api(processor) -> bool:
    return all(callable(getattr(processor, name, None)) for name in _PER_IMAGE_API)


def preprocess_image(processor, data: bytes, index: int, max_pixels: int,
                     uint8: bool = False) -> tuple[torch.Tensor, torch.Tensor] | ItemError:
    """(pixel_values, grid_thw int64 [1, 3]) or the ItemError saying why the image was refused.
    pixel_values: float32 [patches, C*tp*p*p] exactly as `Encoder.preprocess([data])`; with
    uint8=True (needs `has_per_image_api(processor)`) the uint8 patches [patches, *row_shape] that
    `normalize_rows` turns into those values."""
    try:
        w, h = image_size(data)
    except Image.DecompressionBombError:  # over twice PIL's limit: PIL refuses it from the header
        return ItemError("image_too_large", f"images[{index}]: more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels, "
                                            f"PIL's decompression-bomb limit (refused from the header, not decoded); "
                                            f"the server takes at most max_image_pixels={max_pixels}: downscale it")
    except UnidentifiedImageError:
        return ItemError("invalid_image", f"images[{index}]: not an image (PIL cannot identify the format)")
    except (OSError, ValueError, SyntaxError) as e:
        return ItemError("invalid_image", f"images[{index}]: not a decodable image ({without_reprs(e)})")
    if w * h > max_pixels:
        return ItemError("image_too_large", f"images[{index}]: {size_text(w, h)} = {w * h} pixels exceeds "
                                            f"max_image_pixels={max_pixels}; downscale it or raise --max-image-pixels")
    try:
        if not uint8:
            return processor([data])
        array = load_image(data, index=0, max_pixels=None)  # RGB uint8 [H, W, 3]; the limit is checked above
        plan = processor.plan(array.shape[0], array.shape[1], index=0)
        pixels = torch.from_numpy(array.transpose(2, 0, 1).copy())  # uint8 [C, H, W]
        resized = processor.resize_one(pixels, plan).contiguous()
        grid = torch.tensor([list(plan.grid)], dtype=torch.int64)
        return processor.patchify(resized, plan).contiguous(), grid
    except ImagePreprocessError as e:  # the processor's size rules (e.g. aspect ratio over 200)
        return ItemError("unsupported_image", f"images[{index}]: {e.reason}")
    except ImageLoadError as e:
        return ItemError("invalid_image", f"images[{index}]: {without_reprs(str(e).removeprefix('image #0: '))}")
    except ValueError as e:  # the processor's own checks (e.g. aspect ratio over 200)
        return ItemError("unsupported_image", f"images[{index}]: {e}")


def normalize_rows(processor, patches: torch.Tensor) -> torch.Tensor:
    """uint8 patches [P, *row_shape] (any device) -> float32 pixel_values [P, C*tp*p*p] on that device."""
    return processor.as_pixel_values(processor.normalize(patches))
