"""Every registered tower architecture through the same checks, from its one row in
`mmenc.testing.checkpoints.FAMILIES` (a new tower is tested by adding its row there):

parity with transformers (fp32 CPU, several images of different sizes and a video in one call) and
bf16 closeness; shapes and finiteness; batch composition and order independence; plan caching;
config and input errors that name the value; the processor; every built-in name built on the meta
device with the language model's width (and transformers' parameter count); tensor-parallel
("weights") and data-parallel modes over 2 gloo processes equal to one process.
Family files keep only family-specific math (windows, interpolation, deepstack, pooling, video).
"""
import dataclasses
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from mmenc.engine.tower import LoadedTower, build_tower, run_tower
from mmenc.models.base import TowerOutput, vision_model_type, vlm_config_dict
from mmenc.models.registry import builtin_model_names, get_builtin_config, supported_architectures
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close, relative_error
from mmenc.testing.spmd import check_modes_match, free_port

pytest.importorskip("transformers")

TOL = 1e-5
BF16_TOL = 3e-2
GRID = torch.tensor([[1, 2, 2], [1, 6, 10], [2, 8, 6], [1, 10, 4]])  # smallest, non-square, 2-frame video, tall
ARCHS = sorted(ck.FAMILIES)


@dataclasses.dataclass
class Family:
    """One architecture's tiny checkpoint, loaded, run once on its grid (GRID, or the row's own for
    fixed-size towers), and transformers' answer."""

    arch: str
    case: ck.FamilyCase
    folder: str
    hf_model: Any
    loaded: LoadedTower
    pixels: torch.Tensor
    out: TowerOutput
    reference: tuple[torch.Tensor, list]
    grid: torch.Tensor


def _flat_extras(out: TowerOutput) -> list[torch.Tensor]:
    """The tower's extra outputs as one list of tensors, in key order (Qwen3-VL: its deepstack features)."""
    return [t for value in out.extras.values() for t in (value if isinstance(value, (list, tuple)) else [value])]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """prepared(arch) -> Family, or None where this transformers cannot write the architecture;
    each checkpoint is written and run once per module."""
    cache: dict[str, Family | None] = {}

    def prepare(arch: str) -> Family | None:
        if arch not in cache:
            case = ck.FAMILIES[arch]
            try:
                folder, hf_model = case.save(tmp_path_factory.mktemp(arch))
            except ImportError:
                cache[arch] = None
                return None
            loaded = build_tower(str(folder), device="cpu")
            grid = torch.tensor(case.grid) if case.grid is not None else GRID
            pixels = case.pixels(grid, seed=3)
            cache[arch] = Family(arch, case, str(folder), hf_model, loaded, pixels, run_tower(loaded, pixels, grid),
                                 case.reference(hf_model, pixels, grid), grid)
        return cache[arch]
    return prepare


@pytest.fixture(scope="module", params=ARCHS)
def family(request, prepared) -> Family:
    found = prepared(request.param)
    if found is None:
        pytest.skip(f"this transformers cannot write {request.param}")
    return found


def _arch(key: str, case: ck.FamilyCase) -> str:
    return case.architecture or key


def test_table_covers_the_registry():
    aliases = {alias for case in ck.FAMILIES.values() for alias in case.aliases}
    rows = {_arch(key, case) for key, case in ck.FAMILIES.items()}
    from mmenc.models.registry import model_specs

    vision_only = {a for arch in supported_architectures() for spec in model_specs(arch)
                   for a in spec.vision_architectures}  # tests/test_vision_only.py covers these
    missing = set(supported_architectures()) - rows - aliases - vision_only
    assert not missing, f"add a FamilyCase row for {sorted(missing)} to FAMILIES in mmenc/testing/checkpoints/__init__.py"
    unknown = (rows | aliases) - set(supported_architectures())
    assert not unknown, f"FAMILIES names {sorted(unknown)}, which the registry does not serve"


def test_matches_transformers(family):
    want, want_extras = family.reference
    err = assert_close(family.out.embeddings, want, f"{family.arch} grid={family.grid.tolist()}", TOL)
    print(f"{family.arch} grid={family.grid.tolist()}: relative error {err:.2e} (tolerance {TOL:.0e})")
    got_extras = _flat_extras(family.out)
    assert len(got_extras) == len(want_extras), f"{family.arch}: {len(got_extras)} extra outputs, " \
                                                f"transformers gives {len(want_extras)}"
    for k, (got, ref) in enumerate(zip(got_extras, want_extras)):
        err = assert_close(got, ref, f"{family.arch} extra output {k}", TOL)
        print(f"{family.arch} extra output {k}: relative error {err:.2e} (tolerance {TOL:.0e})")


def test_bfloat16_stays_close(family):
    """bf16 weights and activations against transformers' fp32 answer."""
    bf16 = build_tower(family.folder, dtype="bfloat16", device="cpu")
    out = run_tower(bf16, family.pixels, family.grid).embeddings
    assert out.dtype == torch.bfloat16
    err = relative_error(out, family.reference[0])
    print(f"{family.arch} bf16: relative error {err:.2e} (tolerance {BF16_TOL:.0e})")
    assert err < BF16_TOL, f"{family.arch} bf16: relative error {err:.2e} exceeds tolerance {BF16_TOL:.0e}"


def test_shapes_and_finite(family):
    loaded, out = family.loaded, family.out
    assert loaded.dtype == torch.float32 and loaded.load_format == "auto"
    tokens = sum(loaded.output_tokens(family.grid))
    assert out.embeddings.shape[0] == tokens, f"{family.arch}: {out.embeddings.shape[0]} rows, expected {tokens}"
    for k, tensor in enumerate([out.embeddings, *_flat_extras(out)]):
        assert tensor.shape[0] == tokens, f"{family.arch}: output {k} has {tensor.shape[0]} rows, expected {tokens}"
        assert torch.isfinite(tensor).all(), f"{family.arch}: output {k} is not finite"


def test_batch_composition_and_order(family):
    loaded, pixels, expected = family.loaded, family.pixels, family.out
    grid = family.grid
    tokens = loaded.output_tokens(grid)
    per_image = pixels.split(grid[:, :3].prod(-1).tolist())  # (t, h, w): anyres rows add the image size
    expected_rows = expected.embeddings.split(tokens)
    order = [2, 0, 3, 1]
    shuffled = run_tower(loaded, torch.cat([per_image[i] for i in order]), grid[order]).embeddings
    shuffled_rows = shuffled.split([tokens[i] for i in order])
    for pos, i in enumerate(order):
        alone = run_tower(loaded, per_image[i], grid[i:i + 1]).embeddings
        for what, value in (("a reordered batch", shuffled_rows[pos]), ("a call of its own", alone)):
            assert_close(value, expected_rows[i], f"{family.arch}: image {i} in {what}", TOL)


def test_plan_is_cached_per_grid(family):
    tower = family.loaded.tower
    grid = family.grid
    first = tower.plan(grid, "cpu")
    assert tower.plan(grid.clone(), "cpu") is first, f"{family.arch}: the same grid built its plan twice"
    other = tower.plan(grid[:2], "cpu")
    assert other is not first and tower.plan(grid[:2].clone(), "cpu") is other


def test_config_errors_name_the_field(family):
    config = family.loaded.config
    width = config.head_dim * config.num_heads
    bad = next(n for n in range(3, width + 2) if width % n)
    with pytest.raises(ValueError, match=rf"num_heads={bad}\b"):
        dataclasses.replace(config, num_heads=bad)
    with pytest.raises(ValueError, match=r"depth=0\b"):
        dataclasses.replace(config, depth=0)


def test_input_errors_name_the_value(family):
    loaded, case = family.loaded, family.case
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match=r"grid_thw describes 16\b"):
        run_tower(loaded, case.pixels(grid)[:15], grid)
    bad = [1, 3, 4] if loaded.config.spatial_merge_size > 1 else [1, 0, 4]  # no merge: any positive size is valid
    with pytest.raises(ValueError, match=rf"grid_thw\[0\] = \({bad[0]}, {bad[1]}, {bad[2]}\)"):
        run_tower(loaded, case.pixels(torch.tensor([bad])), torch.tensor([bad]))


def test_processor_resolves(family):
    assert callable(family.loaded.processor)


def _serves(key: str, case: ck.FamilyCase, hf_config: dict) -> bool:
    """Whether the row `key` covers a checkpoint of this config.json (architecture, vision tower)."""
    arch = hf_config["architectures"][0]
    return (arch == _arch(key, case) or arch in case.aliases) and case.vision_model_type in (
        None, vision_model_type(hf_config))


def _row(hf_config: dict) -> tuple[str, ck.FamilyCase]:
    """(table key, row) serving this config.json as its own row or as an alias."""
    for key, case in ck.FAMILIES.items():
        if _serves(key, case, hf_config):
            return key, case
    raise AssertionError(f"no FAMILIES row serves {hf_config['architectures']}")


def test_every_row_has_builtins():
    configs = [get_builtin_config(name)[1] for name in builtin_model_names()]
    for key, case in ck.FAMILIES.items():
        assert any(_serves(key, case, c) for c in configs), f"{key} has no built-in name to build on the meta device"


@pytest.mark.parametrize("name", builtin_model_names())
def test_builtin_builds_on_meta(name, prepared):
    """The built-in config builds without memory; a meta forward yields the language model's width;
    the parameter count equals transformers' tower at the same sizes."""
    _, hf_config = get_builtin_config(name)
    arch = hf_config["architectures"][0]
    key, case = _row(hf_config)
    assert name.startswith(case.builtin_prefix), f"{name}: expected a name starting {case.builtin_prefix!r}"
    loaded = build_tower(name, load_format="dummy", device="meta")
    assert loaded.load_format == "dummy" and loaded.dtype == torch.bfloat16
    grid = torch.tensor(case.meta_grid if case.meta_grid is not None else [[1, 4, 4], [1, 4, 6]])  # images only
    # one patch per row at the built-in's own patch size (SigLIP's built-ins: 14 / 16, its tiny rows: 8)
    shape = case.patch_shape if len(case.patch_shape) > 1 else (loaded.config.patch_features,)
    pixels = torch.empty(int(grid[:, :3].prod(-1).sum()), *shape, device="meta")
    out = run_tower(loaded, pixels, grid).embeddings
    vlm = vlm_config_dict(hf_config)  # Qwen-Omni: under thinker_config
    text_width = case.output_width(hf_config) if case.output_width else (vlm.get("text_config") or vlm)["hidden_size"]
    assert tuple(out.shape) == (sum(loaded.output_tokens(grid)), text_width), \
        f"{name}: output {tuple(out.shape)}, expected ({sum(loaded.output_tokens(grid))}, {text_width})"
    ours = sum(p.numel() for p in loaded.tower.parameters())
    family = prepared(key) if case.hf_tower is not None and arch == _arch(key, case) else None
    if family is None:
        print(f"{name}: {ours / 1e6:.1f}M tower parameters (no transformers tower to compare)")
        return
    theirs = ck.hf_tower_parameters(case, family.hf_model, hf_config)
    print(f"{name}: {ours / 1e6:.1f}M tower parameters (transformers: {theirs / 1e6:.1f}M)")
    assert ours == theirs, f"{name}: {ours} tower parameters, transformers' tower has {theirs}"


def test_parallel_modes_equal_one_process(prepared):
    """One spawn of 2 gloo ranks checks every architecture in weights mode (heads, MLPs and mergers
    split in two) and data mode (images split across ranks) against the single-process output."""
    families = [f for f in map(prepared, ARCHS) if f is not None]
    cases = [(f.folder, f.pixels, f.grid, f.out) for f in families]
    mp.spawn(check_modes_match, args=(2, free_port(), cases), nprocs=2, join=True)
