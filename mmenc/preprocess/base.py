"""What the per-image processors share: `PatchProcessor` (the defaults of the per-image API that
mmenc.preprocess.pipeline drives: plan -> resize_one -> patchify -> normalize -> as_pixel_values,
and a sequential `__call__`), the patch cuts, the exact off-CPU resize, and the config parsing
helpers every processor config repeats.

A processor keeps only what is its own (plan, resize_one, often patchify or __call__) and sets
`config_class`; the defaults here read its config's patch_size, image_mean/std, rescale_factor,
do_rescale, do_normalize and backend.
"""
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from mmenc.preprocess import ops
from mmenc.preprocess.images import load_image
from mmenc.preprocess.plan import ImagePlan, finish_patches
from mmenc.preprocess.resize_exact import resize_uint8_exact


def check_positive_ints(config: Any, fields: Sequence[str], prefix: str = "") -> None:
    """ValueError `{prefix}{field}={value!r} must be a positive int` for the first field of `config`
    that is not a positive int."""
    for f in fields:
        v = getattr(config, f)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{prefix}{f}={v!r} must be a positive int")


def hf_rescale_normalize(d: Mapping[str, Any]) -> dict[str, Any]:
    """rescale_factor (float) and image_mean / image_std (float tuples) that a preprocessor_config.json
    dict sets (keys absent or None are left out)."""
    kw: dict[str, Any] = {}
    if d.get("rescale_factor") is not None:
        kw["rescale_factor"] = float(d["rescale_factor"])
    for k in ("image_mean", "image_std"):
        if d.get(k) is not None:
            kw[k] = tuple(float(x) for x in d[k])
    return kw


_PIL_CODES = {1: "lanczos", 2: "bilinear", 3: "bicubic"}  # PIL.Image.Resampling values configs store


def hf_resample(d: Mapping[str, Any], allowed: Sequence[str] = ("bilinear", "bicubic")) -> dict[str, str]:
    """{"resample": name} for a preprocessor_config.json `resample` (a PIL code or a name) among `allowed`,
    {} when unset; ValueError naming the value and the accepted ones."""
    value = d.get("resample")
    if value is None:
        return {}
    name = _PIL_CODES.get(value, value) if isinstance(value, int) else value
    if name not in allowed:
        codes = ", ".join(f"{c} ({n})" for c, n in _PIL_CODES.items() if n in allowed)
        raise ValueError(f"preprocessor_config resample={value!r} is not supported; expected {codes}")
    return {"resample": name}


def hf_keys(d: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The `keys` a preprocessor_config.json dict sets (not None), as they are."""
    return {k: d[k] for k in keys if d.get(k) is not None}


def patchify_raster(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """uint8 [C, h, w] (h, w multiples of p) -> uint8 [h/p * w/p, C, p, p], patches in raster order."""
    p = patch_size
    ch, h, w = image.shape
    x = image.contiguous().view(ch, h // p, p, w // p, p).permute(1, 3, 0, 2, 4)  # gh, gw, C, p, p
    return x.reshape((h // p) * (w // p), ch, p, p)


def patchify_tiles(tiles: torch.Tensor, patch_size: int) -> torch.Tensor:
    """uint8 [n, C, T, T] -> uint8 [n * (T/p)^2, C, p, p]: tile by tile, each tile's patches in raster order."""
    p = patch_size
    n, c, t, _ = tiles.shape
    x = tiles.contiguous().view(n, c, t // p, p, t // p, p).permute(0, 2, 4, 1, 3, 5)  # n, s, s, C, p, p
    return x.reshape(-1, c, p, p)


def resize_exact(image: torch.Tensor, height: int, width: int, backend: str) -> torch.Tensor:
    """uint8 [C, H, W] -> uint8 [C, height, width]: the backend's resize on the CPU; off the CPU with
    backend "torchvision", `resize_uint8_exact` (the CPU kernel's bytes, not torch's float GPU path)."""
    if image.device.type != "cpu" and backend == "torchvision":
        return resize_uint8_exact(image, height, width)
    return ops.resize_uint8(image[None], height, width, backend)[0]


class PatchProcessor:
    """Defaults of a per-image processor whose rows are (C, p, p) patches, normalized with
    `ops.rescale_normalize` and returned as they are. Subclasses set `config_class` and define
    `plan(height, width, *, index=, name=)` and `resize_one(image uint8 [C, H, W], plan)`."""

    config_class: ClassVar[type]

    def __init__(self, config: Any = None, device: str | torch.device | None = None):
        self.config = config or self.config_class()
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row of `patchify`'s output: (C, p, p)."""
        return len(self.config.image_mean), self.config.patch_size, self.config.patch_size

    def patchify(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """Resized uint8 [C, h, w] -> uint8 [gh*gw, C, p, p], patches in raster order."""
        return patchify_raster(image, self.config.patch_size)

    def normalize(self, patches: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [P, *row_shape] -> float32 [P, *row_shape] (into `out` if given)."""
        c = self.config
        return ops.rescale_normalize(patches, rescale_factor=c.rescale_factor, mean=c.image_mean, std=c.image_std,
                                     do_rescale=c.do_rescale, do_normalize=c.do_normalize, backend=c.backend,
                                     out=out)

    def as_pixel_values(self, x: torch.Tensor) -> torch.Tensor:
        """normalize's output [P, *row_shape] is already the tower's pixel_values layout."""
        return x

    def finish(self, images: Sequence[torch.Tensor], plans: Sequence[ImagePlan]) -> tuple[torch.Tensor, torch.Tensor]:
        """resize_one's uint8 output per image (one device) -> (pixel_values float32 on that device,
        grid_thw int64 [N, 3] on the CPU)."""
        return finish_patches(self, [self.patchify(im, pl) for im, pl in zip(images, plans)], plans)

    def __call__(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """images -> (pixel_values, grid_thw), one image at a time: load, plan, resize_one, then finish."""
        if len(images) == 0:
            raise ValueError("images is empty; pass at least one image")
        resized, plans = [], []
        for i, item in enumerate(images):
            array = load_image(item, index=i)  # RGB uint8 [H, W, 3]
            plans.append(self.plan(array.shape[0], array.shape[1], index=i))
            resized.append(self.resize_one(torch.tensor(array).permute(2, 0, 1).to(self.device), plans[-1]))
        return self.finish(resized, plans)
