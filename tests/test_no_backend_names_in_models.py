"""Model files never name a platform or a backend: MMEncoderAttention and the platform decide. Nor do
they import the backends floor by any path: the helpers they need live below it (mmenc.utils), and the
attention layer and its packed layout come from mmenc.attention. The layers import it through one door
only, mmenc.backends.linear: the platform picks a linear backend (Platform.get_linear_backend, asked by
the engine), and the parallel linears run the one they are handed (mmenc.layers.linear_kernels), with
the fused layers reading its FP8 rows (QuantizedRows); they never choose one themselves."""
import ast
import pathlib
import re

import pytest

from mmenc.backends import AttentionBackendEnum

MMENC = pathlib.Path(__file__).resolve().parents[1] / "mmenc"
MODELS = MMENC / "models"

# Platform checks, backend selection and the kernel packages themselves.
FORBIDDEN = [
    r"current_platform", r"mmenc\.platforms", r"\bPlatform\b", r"DeviceInfo",
    r"\bis_cuda\(", r"\bis_rocm\b", r"\bis_nvidia\b", r"\bis_xpu\b", r"\bis_tpu\b", r"\bis_cpu\(",
    r"torch\.version\.(hip|cuda)", r"torch\.cuda\b", r"get_device_capability", r"gcnArchName",
    r"AttentionBackendEnum", r"mmenc\.backends\b", r"get_vit_attn_backend", r"get_backend_class",
    r"\bflash_attn", r"\bflash_attn_varlen_func\b", r"\bxformers\b", r"\baiter\b", r"\btorch_xla\b", r"\bpallas\b",
    r"\btriton\b", r"flex_attention", r"scaled_dot_product_attention", r"\bsdpa\b",
    *(rf"\b{member.name}\b" for member in AttentionBackendEnum),
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in FORBIDDEN))


def violations(root: pathlib.Path) -> list[str]:
    """'file:line: text' for each line under `root` (all .py files) naming a platform or backend."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = PATTERN.search(line)
            if match:
                found.append(f"{path}:{number}: {match.group(0)!r} in {line.strip()!r}")
    return found


def test_models_name_no_platform_or_backend():
    assert MODELS.is_dir()
    found = violations(MODELS)
    assert not found, ("model files must not name a platform or an attention backend (use MMEncoderAttention "
                       "and let the platform choose):\n" + "\n".join(found))


def test_checker_reports_file_and_line(tmp_path):
    (tmp_path / "tower.py").write_text(
        "import torch\n"
        "x = 1\n"
        "if current_platform.is_cuda():\n"
        "    import flash_attn\n"
        "backend = AttentionBackendEnum.TORCH_SDPA\n"
        "out = F.scaled_dot_product_attention(q, k, v)\n"
        "# plain comment about attention\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.py").write_text("name = 'xformers'\n")
    found = violations(tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == [
        f"{tmp_path / 'sub' / 'deep.py'}:1", f"{tmp_path / 'tower.py'}:3", f"{tmp_path / 'tower.py'}:4",
        f"{tmp_path / 'tower.py'}:5", f"{tmp_path / 'tower.py'}:6"]


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) for every mmenc module a file imports, whatever the spelling: `import a.b`,
    `from a.b import c` (as a.b and a.b.c), `from a import b`, relative imports resolved."""
    package = ".".join(path.relative_to(MMENC.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name == "mmenc" or name.startswith("mmenc.")]


def backend_imports(root: pathlib.Path, allowed: tuple[str, ...] = ()) -> list[str]:
    """'file:line: module' for each import under `root` of mmenc.backends (or below it) not in `allowed`."""
    def inside(name, top):
        return name == top or name.startswith(top + ".")

    return [f"{path}:{line}: {name}" for path in sorted(root.rglob("*.py")) for line, name in imported_modules(path)
            if inside(name, "mmenc.backends") and not any(inside(name, a) for a in allowed)]


@pytest.mark.parametrize("floor,allowed", [("models", ()), ("layers", ("mmenc.backends.linear",))])
def test_towers_and_layers_do_not_import_the_backends(floor, allowed):
    found = backend_imports(MMENC / floor, allowed)
    door = f"; the one import allowed here: {', '.join(allowed)}" if allowed else ""
    assert not found, (f"mmenc/{floor} imports the backends floor (to_device, LRUCache: mmenc.utils; the layer "
                       f"and make_cu_seqlens: mmenc.attention{door}):\n" + "\n".join(found))


def test_backend_import_check_sees_every_spelling(tmp_path, monkeypatch):
    tower = MMENC / "models" / "_probe_tower.py"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, encoding=None: (
        "import mmenc.backends.device\n"
        "from mmenc import backends\n"
        "from ..backends.packing import pack_info\n"
        "from mmenc.utils.device_copy import to_device\n"
        "from mmenc.backends.linear import LinearBackendEnum\n"))
    lines = [(line, name) for line, name in imported_modules(tower)]
    assert (1, "mmenc.backends.device") in lines and (2, "mmenc.backends") in lines
    assert (3, "mmenc.backends.packing") in lines and (4, "mmenc.utils.device_copy") in lines
