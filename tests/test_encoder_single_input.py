"""One input alone is one item (issue 28, item 10): `Encoder.encode("cat.jpg")` encodes the file, it does not
iterate the path's characters; the same for a Path, bytes, a PIL image, an [H, W, 3] array, in encode,
encode_iter and preprocess. Something that is neither an input nor an iterable is a TypeError naming it."""
import pathlib

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc.engine.encoder import Encoder

IMAGE = pathlib.Path(__file__).parent.parent / "examples" / "images" / "square_224.jpg"


@pytest.fixture(scope="module")
def encoder(q25):
    with Encoder(q25, device="cpu", preprocess_workers=0) as enc:
        yield enc


@pytest.mark.parametrize("make", [str, lambda p: p, lambda p: p.read_bytes(), lambda p: Image.open(p).convert("RGB"),
                                  lambda p: np.asarray(Image.open(p).convert("RGB"))],
                         ids=["str", "Path", "bytes", "PIL", "array"])
def test_one_input_alone_is_one_item(encoder, make):
    want = encoder.encode([str(IMAGE)])[0]
    got = encoder.encode(make(IMAGE))
    assert isinstance(got, list) and len(got) == 1 and torch.equal(got[0], want)
    streamed = list(encoder.encode_iter(make(IMAGE)))
    assert [i for i, _ in streamed] == [0] and torch.equal(streamed[0][1], want)
    pixels, grid = encoder.preprocess(make(IMAGE))
    assert grid.shape == (1, 3) and torch.equal(pixels, encoder.preprocess([str(IMAGE)])[0])


def test_what_is_no_input_is_a_type_error(encoder):
    with pytest.raises(TypeError, match="images must be one input .* got int"):
        encoder.encode(42)
    with pytest.raises(TypeError, match="got dict"):
        encoder.encode({"a": str(IMAGE)})
