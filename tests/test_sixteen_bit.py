"""16-bit PNGs (issue 28, item 12): by default converted as transformers converts them (parity: values over
255 clip, the picture comes out almost white) with a warning, once per process; high_bit_depth="scale"
(`mmenc encode --high-bit-depth scale`) maps 0..65535 onto 0..255, the picture as it looks."""
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc.engine.encoder import Encoder
from mmenc.preprocess.images import load_image


@pytest.fixture
def png16(tmp_path):
    values = np.linspace(0, 65535, 48 * 64).reshape(48, 64).astype(np.uint16)  # a dark-to-bright ramp
    path = tmp_path / "ramp16.png"
    Image.fromarray(values).save(path)
    assert Image.open(path).mode.startswith("I")  # PIL reads it back as 16-bit grayscale
    return path, values


def test_default_is_transformers_conversion_with_one_warning(png16, mmenc_caplog):
    path, _ = png16
    got = load_image(path)
    assert np.array_equal(got, np.asarray(Image.open(path).convert("RGB")))  # what transformers' convert_to_rgb does
    assert got.mean() > 250  # almost white: the reason for the warning
    load_image(path)
    warnings = [r for r in mmenc_caplog.records if r.levelno == logging.WARNING and "16-bit" in r.getMessage()]
    assert len(warnings) == 1 and "--high-bit-depth scale" in warnings[0].getMessage()


def test_scale_maps_the_full_range(png16):
    path, values = png16
    got = load_image(path, high_bit_depth="scale")
    want = np.rint(values.astype(np.float64) * 255 / 65535).astype(np.uint8)
    assert got.shape == (48, 64, 3) and np.array_equal(got[..., 0], want) and np.array_equal(got[..., 2], want)
    with pytest.raises(ValueError, match="high_bit_depth='wrap' is not valid"):
        load_image(path, high_bit_depth="wrap")


def test_encoder_option(png16, q25):
    path, values = png16
    scaled = np.repeat(np.rint(values.astype(np.float64) * 255 / 65535).astype(np.uint8)[:, :, None], 3, axis=2)
    with Encoder(q25, device="cpu", high_bit_depth="scale") as enc:
        assert torch.equal(enc.encode([str(path)])[0], enc.encode([scaled])[0])
    with Encoder(q25, device="cpu") as parity:
        assert not torch.equal(parity.encode([str(path)])[0], parity.encode([scaled])[0])
