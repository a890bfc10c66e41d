"""Model files never name a platform or a backend: MMEncoderAttention and the platform decide."""
import pathlib
import re

from mmenc.attention.backend_enum import AttentionBackendEnum

MODELS = pathlib.Path(__file__).resolve().parents[1] / "mmenc" / "models"

# Platform checks, backend selection and the kernel packages themselves.
FORBIDDEN = [
    r"current_platform", r"mmenc\.platforms", r"\bPlatform\b", r"DeviceInfo",
    r"\bis_cuda\(", r"\bis_rocm\b", r"\bis_nvidia\b", r"\bis_xpu\b", r"\bis_tpu\b", r"\bis_cpu\(",
    r"torch\.version\.(hip|cuda)", r"torch\.cuda\b", r"get_device_capability", r"gcnArchName",
    r"AttentionBackendEnum", r"mmenc\.attention\.backends", r"get_vit_attn_backend", r"get_backend_class",
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
