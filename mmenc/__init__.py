"""mmenc: a fast, platform-aware engine for the vision encoders of vision-language models."""
__version__ = "0.1.0"

__all__ = ["Encoder", "MultiModalConfig"]


def __getattr__(name):
    if name == "Encoder":
        from mmenc.engine.encoder import Encoder

        return Encoder
    if name == "MultiModalConfig":
        from mmenc.config import MultiModalConfig

        return MultiModalConfig
    raise AttributeError(f"module 'mmenc' has no attribute {name!r}")
