"""What the Encoder's calls take as their images: one input alone, or an iterable of inputs."""
import os
from collections.abc import Iterable
from typing import Any

import numpy as np
from PIL import Image

from mmenc.preprocess.video import Video


def as_items(images: Any) -> Iterable[Any]:
    """`images` as an iterable of inputs: one input alone (a str or os.PathLike path, bytes, a PIL image,
    an [H, W] or [H, W, C] numpy array, a Video) becomes a list of one, so "cat.jpg" is not read as the
    characters c, a, t; any other iterable as it is. TypeError for what is neither."""
    if isinstance(images, (str, bytes, bytearray, memoryview, os.PathLike, Image.Image, Video)):
        return [images]
    if isinstance(images, np.ndarray) and images.ndim in (2, 3):
        return [images]
    if isinstance(images, dict) or not isinstance(images, Iterable):
        raise TypeError(f"images must be one input (a path, bytes, a PIL image, a numpy array, a Video) or an "
                        f"iterable of them, got {type(images).__name__}")
    return images
