"""One image's bytes -> (pixel_values, grid_thw), with the server's pixel limit. The one place the
server preprocesses, so a faster (parallel) preprocessing path can replace it alone."""
import io
import warnings

import torch
from PIL import Image, UnidentifiedImageError

from mmenc.preprocess.images import ImageLoadError
from mmenc.serving.inputs import ItemError


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the file header, without decoding the pixels."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data)) as img:
            return img.size


def preprocess_image(processor, data: bytes, index: int,
                     max_pixels: int) -> tuple[torch.Tensor, torch.Tensor] | ItemError:
    """pixel_values float32 [patches, C*tp*p*p] and grid_thw int64 [1, 3] exactly as
    `Encoder.preprocess([data])`, or the ItemError saying why the image was refused."""
    try:
        w, h = image_size(data)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        return ItemError("invalid_image", f"images[{index}]: not a decodable image ({e})")
    if w * h > max_pixels:
        return ItemError("image_too_large", f"images[{index}]: {w}x{h} = {w * h} pixels exceeds max_image_pixels="
                                            f"{max_pixels}; downscale it or raise --max-image-pixels")
    try:
        return processor([data])
    except ImageLoadError as e:
        return ItemError("invalid_image", f"images[{index}]: {str(e).removeprefix('image #0: ')}")
    except ValueError as e:  # the processor's own checks (e.g. aspect ratio over 200)
        return ItemError("unsupported_image", f"images[{index}]: {e}")
