"""Image loader: accepted inputs, RGB conversion, and every error path naming its input."""
import io

import numpy as np
import pytest
from PIL import Image

from mmenc.preprocess import ImageLoadError, load_image, load_images


def _png(path, h=20, w=30, mode="RGB"):
    rng = np.random.default_rng(0)
    shape = (h, w) if mode == "L" else (h, w, len(mode))
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)
    return path


def _write(path, data):
    path.write_bytes(data)
    return path


def test_inputs_become_rgb_uint8(tmp_path):
    p = _png(tmp_path / "a.png")
    ref = np.asarray(Image.open(p).convert("RGB"))
    for item in (p, str(p), p.read_bytes(), Image.open(p), ref, ref.astype(np.float32) / 255):
        out = load_image(item)
        assert out.dtype == np.uint8 and out.shape == (20, 30, 3)
        np.testing.assert_array_equal(out, ref)
    gray = load_image(np.full((4, 5), 7, np.uint8))
    assert gray.shape == (4, 5, 3) and (gray == 7).all()
    assert load_image(np.zeros((4, 5, 1), np.uint8)).shape == (4, 5, 3)


def test_alpha_composited_onto_white():
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[0, 0, 3] = 255  # opaque red-ish; the rest fully transparent -> white
    out = load_image(rgba)
    assert tuple(out[0, 0]) == (200, 0, 0) and tuple(out[1, 1]) == (255, 255, 255)
    np.testing.assert_array_equal(load_image(Image.fromarray(rgba)), out)


@pytest.mark.parametrize("make,needle", [
    (lambda d: d / "missing.png", "cannot read file"),
    (lambda d: _write(d / "empty.png", b""), "empty file"),
    (lambda d: _write(d / "junk.png", b"not an image at all"), "not an image"),
    (lambda d: d, "directory"),
])
def test_file_errors_name_the_path(tmp_path, make, needle):
    path = make(tmp_path)
    with pytest.raises(ImageLoadError, match=needle) as e:
        load_image(path)
    assert str(path) in str(e.value)


def test_truncated_file(tmp_path):
    data = _png(tmp_path / "ok.png", 64, 64).read_bytes()
    bad = tmp_path / "cut.png"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageLoadError, match="corrupt or truncated") as e:
        load_image(bad)
    assert "cut.png" in str(e.value)


def test_decompression_bomb_limit(tmp_path):
    p = _png(tmp_path / "big.png", 100, 100)
    with pytest.raises(ImageLoadError, match="decompression bomb.*max_pixels=5000") as e:
        load_image(p, max_pixels=5000)
    assert "big.png" in str(e.value)
    assert load_image(p, max_pixels=10_000).shape == (100, 100, 3)


@pytest.mark.parametrize("arr,needle", [
    (np.zeros((0, 5, 3), np.uint8), "zero-size"),
    (np.zeros((4, 5, 2), np.uint8), "shape"),
    (np.zeros((3, 4, 5, 3), np.uint8), "shape"),
    (np.zeros((4, 5, 3), np.int32), "dtype int32"),
    (np.full((4, 5, 3), 2.0, np.float32), r"\[0, 1\]"),
])
def test_array_errors_name_the_index(arr, needle):
    with pytest.raises(ImageLoadError, match=needle) as e:
        load_images([np.zeros((2, 2, 3), np.uint8), arr])
    assert "image #1" in str(e.value)


def test_zero_size_pil_and_bad_type():
    with pytest.raises(ImageLoadError, match="image #0: zero-size"):
        load_images([Image.new("RGB", (0, 3))])
    with pytest.raises(ImageLoadError, match="image #0: unsupported input type int"):
        load_images([3])


def test_partial_failure_contract(tmp_path):
    good = _png(tmp_path / "good.png")
    items = [good, tmp_path / "nope.jpg", np.zeros((3, 3, 3), np.uint8), b"garbage"]
    imgs, fails = load_images(items, errors="skip")
    assert len(imgs) == 2 and [f.index for f in fails] == [1, 3]
    assert "nope.jpg" in fails[0].name and fails[1].name == "image #3"
    with pytest.raises(ImageLoadError) as e:  # all inputs tried, every failure listed
        load_images(items)
    msg = str(e.value)
    assert "2 of 4" in msg and "nope.jpg" in msg and "image #3" in msg
    with pytest.raises(ValueError, match="errors='ignore'"):
        load_images(items, errors="ignore")


def test_bytes_roundtrip():
    buf = io.BytesIO()
    Image.new("P", (3, 2), 1).save(buf, format="PNG")
    assert load_image(buf.getvalue()).shape == (2, 3, 3)


def _animated_gif(path, frames=3):
    pictures = [Image.new("RGB", (8, 6), (40 * i, 0, 0)) for i in range(frames)]
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=50, loop=0)
    return path


def test_animated_gif_loads_first_frame_with_a_warning(tmp_path, mmenc_caplog):
    path = _animated_gif(tmp_path / "anim.gif")
    out = load_image(str(path))
    assert out.shape == (6, 8, 3) and tuple(out[0, 0]) == tuple(np.asarray(Image.open(path).convert("RGB"))[0, 0])
    warnings = [r.getMessage() for r in mmenc_caplog.records if r.levelname == "WARNING"]
    assert any("anim.gif' has 3 frames" in w and "first frame only" in w for w in warnings), warnings


def test_single_frame_gif_has_no_warning(tmp_path, mmenc_caplog):
    path = _animated_gif(tmp_path / "still.gif", frames=1)
    load_image(str(path))
    assert not [r for r in mmenc_caplog.records if "frames" in r.getMessage()]


def test_bomb_message_names_the_cli_flag(tmp_path):
    p = _png(tmp_path / "big.png", h=20, w=30)
    with pytest.raises(ImageLoadError, match=r"big\.png.*exceeds max_pixels=100.*--max-image-pixels"):
        load_image(p, max_pixels=100)


def test_exif_orientation_applied_and_plain_images_untouched(tmp_path):
    """An EXIF rotation is applied (6: rotate 90 degrees clockwise); orientation 1 or none loads as stored."""
    a = np.zeros((20, 40, 3), np.uint8)
    a[:, :20] = 255  # left half white
    for orientation, want_shape in [(None, (20, 40, 3)), (1, (20, 40, 3)), (6, (40, 20, 3))]:
        img, exif = Image.fromarray(a), Image.Exif()
        if orientation is not None:
            exif[0x0112] = orientation
        path = tmp_path / f"o{orientation}.png"
        img.save(path, exif=exif)
        got = load_image(str(path))
        assert got.shape == want_shape, (orientation, got.shape)
        if orientation == 6:  # rotated clockwise: the white left half is now the top
            assert got[:20].min() == 255 and got[20:].max() == 0
        else:
            assert np.array_equal(got, a)
