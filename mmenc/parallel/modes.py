"""Which tensor-parallel mode a tower runs in over `world` ranks."""
from collections.abc import Mapping

TP_MODES = ("weights", "data")


def resolve_tp_mode(mode: str, num_heads: int | None, world: int,
                    sizes: Mapping[str, int] | None = None) -> tuple[str, str | None]:
    """("weights" | "data", reason or None). Weights mode needs `num_heads` (and every size in
    `sizes`, e.g. {"intermediate_size": 3420}) divisible by `world`; otherwise data mode, with the
    reason to log. `mode` as MultiModalConfig normalised it (the one place spellings such as "weight" are
    read)."""
    check_tp_mode(mode)
    if mode == "data" or world == 1:
        return mode, None
    for name, n in {**({"num_heads": num_heads} if num_heads is not None else {}), **(sizes or {})}.items():
        if n % world:
            return "data", (f"{name}={n} is not divisible by tensor_parallel_size={world}, so the tower cannot be "
                            f"sharded by weights; using mm_encoder_tp_mode='data' (a full replica per rank, "
                            f"images split across ranks)")
    return mode, None


def check_tp_mode(mode: str) -> None:
    """ValueError unless `mode` is "weights" or "data" (normalise other spellings with MultiModalConfig)."""
    if mode not in TP_MODES:
        raise ValueError(f"mode={mode!r}: expected 'weights' or 'data' (MultiModalConfig(mm_encoder_tp_mode=...) "
                         f"reads the other spellings, e.g. 'weight')")
