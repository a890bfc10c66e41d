"""Checkpoint loading: sharded folders, both name prefixes, only the tower's tensors read, named errors."""
import json

import pytest
import torch

import mmenc.loader.checkpoint as checkpoint
from mmenc.engine.tower import build_tower, init_dummy_weights, resolve_dtype, run_tower
from mmenc.layers.weights import load_named_weights
from mmenc.loader import iter_tower_tensors, read_config, tensor_files
from mmenc.testing.checkpoints import (hf_tower_output, random_pixels, relative_error, rewrite_checkpoint,
                                      save_qwen2_5_vl, save_qwen2_vl)

pytest.importorskip("transformers")

GRID = torch.tensor([[1, 4, 6], [2, 2, 2]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-file Qwen2.5-VL checkpoint and its transformers model."""
    return save_qwen2_5_vl(tmp_path_factory.mktemp("one_file"), seed=1)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The same kind of checkpoint cut into many small shards with an index."""
    return save_qwen2_5_vl(tmp_path_factory.mktemp("sharded"), seed=2, max_shard_size="20KB")


def _parity(folder, hf_model):
    loaded = build_tower(str(folder), device="cpu")
    pixels = random_pixels(GRID, loaded.config.patch_features)
    err = relative_error(run_tower(loaded, pixels, GRID).embeddings, hf_tower_output(hf_model, pixels, GRID))
    print(f"{folder.name}: relative error {err:.2e} (tolerance 1e-05)")
    assert err < 1e-5
    return loaded


def test_sharded_checkpoint_loads(sharded):
    folder, hf_model = sharded
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 3 and (folder / "model.safetensors.index.json").is_file()
    _parity(folder, hf_model)


def test_only_tower_tensors_are_read(sharded, monkeypatch):
    folder, _ = sharded
    opened, read = [], []
    real_open = checkpoint.safe_open

    class Spy:
        def __init__(self, path, *args, **kwargs):
            opened.append(path)
            self._f = real_open(path, *args, **kwargs)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self._f.get_tensor(name)

    monkeypatch.setattr(checkpoint, "safe_open", Spy)
    build_tower(str(folder), device="cpu")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tower_names = {n for n in index if n.startswith("visual.")}
    assert set(read) == tower_names and len(read) == len(tower_names)
    text_only = {f for n, f in index.items()} - {index[n] for n in tower_names}
    assert text_only, "the test checkpoint should have shards holding only text-model tensors"
    assert not {p for p in opened if p.rsplit("/", 1)[-1] in text_only}, "a text-only shard was opened"


def test_model_visual_prefix_is_accepted(saved, tmp_path):
    folder, hf_model = saved
    renamed = rewrite_checkpoint(folder, tmp_path / "renamed", lambda t: {
        ("model." + k if k.startswith("visual.") else k): v for k, v in t.items()})
    assert any(n.startswith("model.visual.") for n in tensor_files(renamed))
    _parity(renamed, hf_model)


def test_qwen2_vl_sharded(tmp_path):
    folder, hf_model = save_qwen2_vl(tmp_path / "q2", seed=4, max_shard_size="30KB")
    _parity(folder, hf_model)


# -- errors -----------------------------------------------------------------------------------

def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="nope.*neither an existing checkpoint folder nor a Hugging Face Hub id"):
        build_tower(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="checkpoint folder .*nope.* does not exist"):
        read_config(tmp_path / "nope")


def test_no_config_json(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json .*found: weights.safetensors"):
        build_tower(str(tmp_path))


def test_no_safetensors(saved, tmp_path):
    (tmp_path / "config.json").write_text((saved[0] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no \*\.safetensors files .*found: config.json, pytorch_model.bin"):
        build_tower(str(tmp_path), device="cpu")


def test_unknown_architecture(saved, tmp_path):
    config = json.loads((saved[0] / "config.json").read_text())
    config["architectures"] = ["Blip2ForConditionalGeneration"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\['Blip2ForConditionalGeneration'\] are not supported; supported: "
                                         r".*Qwen2_5_VLForConditionalGeneration"):
        build_tower(str(tmp_path))


def test_missing_tensor_is_named(saved, tmp_path):
    gone = "visual.blocks.2.mlp.up_proj.weight"
    broken = rewrite_checkpoint(saved[0], tmp_path / "b", lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(ValueError, match=r"lacks tensor\(s\).*visual\.blocks\.2\.mlp\.up_proj\.weight") as e:
        build_tower(str(broken), device="cpu")
    assert "gate_proj" not in str(e.value) and "blocks.1." not in str(e.value)  # only the absent one


def test_unexpected_shape_is_named(saved, tmp_path):
    def shrink(t):
        t["visual.blocks.1.norm2.weight"] = torch.ones(31)
    broken = rewrite_checkpoint(saved[0], tmp_path / "s", shrink)
    with pytest.raises(ValueError, match=r"'blocks\.1\.norm2\.weight'.*shape \(31,\); expected \(32,\)"):
        build_tower(str(broken), device="cpu")


def test_unexpected_shape_in_merged_projection_is_named(saved, tmp_path):
    def grow(t):
        t["visual.blocks.0.mlp.gate_proj.weight"] = torch.zeros(41, 32)
    broken = rewrite_checkpoint(saved[0], tmp_path / "g", grow)
    with pytest.raises(ValueError, match=r"'blocks\.0\.mlp\.gate_proj\.weight'.*41 rows; expected 40"):
        build_tower(str(broken), device="cpu")


def test_unknown_tower_tensor_is_named(saved, tmp_path):
    def add(t):
        t["visual.blocks.0.attn.extra.weight"] = torch.zeros(2)
    broken = rewrite_checkpoint(saved[0], tmp_path / "u", add)
    with pytest.raises(ValueError, match=r"'blocks\.0\.attn\.extra\.weight'.*matches no parameter"):
        build_tower(str(broken), device="cpu")


def test_no_tower_tensors(saved, tmp_path):
    text_only = rewrite_checkpoint(saved[0], tmp_path / "t", lambda t: {
        k: v for k, v in t.items() if not k.startswith("visual.")})
    with pytest.raises(ValueError, match=r"no vision-tower tensors: no name starts with any of "
                                         r"\['model\.visual\.', 'visual\.'\]"):
        build_tower(str(text_only), device="cpu")


def test_index_naming_a_missing_shard(sharded, tmp_path):
    folder = sharded[0]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text((folder / "model.safetensors.index.json").read_text())
    with pytest.raises(ValueError, match=r"lists shard file\(s\) model-\d+-of-\d+\.safetensors"):
        list(iter_tower_tensors(tmp_path, ("visual.",)))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "tiny"])
def test_damaged_safetensors_is_named(saved, tmp_path, damage):
    folder = saved[0]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    data = (folder / "model.safetensors").read_bytes()
    broken = {"truncated": data[:len(data) // 2], "garbage": b"not a safetensors file " * 4, "tiny": b"ab"}[damage]
    (tmp_path / "model.safetensors").write_bytes(broken)
    with pytest.raises(ValueError, match=r"safetensors file '.*model\.safetensors' is damaged or not a "
                                         r"safetensors file .*download or copy it again"):
        build_tower(str(tmp_path), device="cpu")


def test_damaged_shard_behind_an_index_is_named(sharded, tmp_path):
    import shutil

    folder = sharded[0]
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["visual.blocks.0.mlp.up_proj.weight"]
    data = (tmp_path / shard).read_bytes()
    (tmp_path / shard).write_bytes(data[:len(data) - 10])
    with pytest.raises(ValueError, match=rf"'.*{shard}' is damaged"):
        build_tower(str(tmp_path), device="cpu")


def test_garbage_index_json_is_named(sharded, tmp_path):
    (tmp_path / "config.json").write_text((sharded[0] / "config.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        tensor_files(tmp_path)


def test_integer_tower_weight_is_refused(saved, tmp_path):
    name = "visual.blocks.1.mlp.down_proj.weight"

    def to_int(t):
        t[name] = t[name].to(torch.int32)
    broken = rewrite_checkpoint(saved[0], tmp_path / "i", to_int)
    with pytest.raises(ValueError, match=rf"'{name}' in '.*model\.safetensors' has dtype int32; vision-tower "
                                         r"weights must be floating point"):
        build_tower(str(broken), device="cpu")


# -- weight loaders, dtype, dummy weights ------------------------------------------------------

def test_weight_loader_attribute_is_used():
    lin = torch.nn.Linear(2, 2)
    calls = []
    lin.weight.weight_loader = lambda p, t, shard=None: calls.append(tuple(t.shape))
    load_named_weights(lin, [("weight", torch.zeros(2, 2)), ("bias", torch.ones(2))])
    assert calls == [(2, 2)] and lin.bias.tolist() == [1.0, 1.0]


def test_resolve_dtype():
    bf16 = {"torch_dtype": "bfloat16"}
    assert resolve_dtype("auto", bf16, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", bf16, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", {"dtype": "float16"}, torch.device("cuda")) == torch.float16
    assert resolve_dtype("bf16", {}, torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype(torch.float16, {}, torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype='int8' is not valid"):
        resolve_dtype("int8", {}, torch.device("cpu"))


def test_dummy_weights_warn_and_are_reproducible(saved, mmenc_caplog):
    a = build_tower(str(saved[0]), load_format="dummy", device="cpu")
    assert "RANDOM weights" in mmenc_caplog.text
    b = build_tower(str(saved[0]), load_format="dummy", device="cpu")
    for (name, p), q in zip(a.tower.named_parameters(), b.tower.parameters()):  # packed (ONEDNN) linears unpacked
        assert torch.equal(*(t.to_dense() if t.is_mkldnn else t for t in (p, q))), name
    assert torch.all(a.tower.blocks[0].norm1.weight == 1)
    out = run_tower(a, random_pixels(GRID, a.config.patch_features), GRID).embeddings
    assert torch.isfinite(out).all()


def test_init_dummy_weights_skips_meta():
    lin = torch.nn.Linear(4, 4, device="meta")
    init_dummy_weights(lin)  # no error, nothing allocated


def test_bad_load_format(saved):
    with pytest.raises(ValueError, match="load_format='pt' is not valid"):
        build_tower(str(saved[0]), load_format="pt")


def test_comparable_random_weights():
    from mmenc.testing.random_weights import init_comparable_weights_

    def model():
        torch.manual_seed(123)
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 8))
    a, b = model(), model().to(torch.bfloat16)
    assert init_comparable_weights_(a, seed=7) == 6 and init_comparable_weights_(b, seed=7) == 6
    big = a[0].weight
    assert abs(big.std().item() - 0.02) < 0.001 and abs(big.mean().item()) < 0.001
    norm = dict(a.named_parameters())["1.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.02 and 0.08 < norm.std().item() < 0.12, "norm weights around 1"
    assert dict(a.named_parameters())["0.bias"].abs().max() < 0.2
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.to(torch.bfloat16), pb), f"{name}: values depend on the dtype"
    c = model()
    before = c[2].weight.clone()
    assert init_comparable_weights_(c, seed=7, include=lambda name: name.startswith("0.")) == 2
    assert torch.equal(c[2].weight, before) and torch.equal(c[0].weight, a[0].weight)
    with pytest.raises(ValueError, match="std=0 must be > 0"):
        init_comparable_weights_(c, std=0)
