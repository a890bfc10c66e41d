"""CustomOp: a module whose forward is chosen once, at construction, for its platform (the current
one unless the constructor is given another).

Subclasses implement `forward_native` (plain PyTorch) and may override `forward_cuda`,
`forward_hip`, `forward_cpu`, `forward_xpu`, `forward_tpu` or `forward_oot`; each defaults to
`forward_native`. A device plugin replaces a whole class with `@CustomOp.register_oot(name=...)` or
`@TheClass.register_oot`.
Which ops are enabled follows a `custom_ops` setting: ("all",) or ("none",), then "+name" /
"-name" entries; a disabled op runs `forward_native`.
"""
from collections.abc import Sequence

import torch.nn as nn

from mmenc import platforms
from mmenc.config import parse_custom_ops  # noqa: F401  (its home was here)
from mmenc.logger import init_logger, log_once

logger = init_logger(__name__)

_REGISTRY: dict[str, type["CustomOp"]] = {}
_OOT_REGISTRY: dict[str, type] = {}


def op_enabled(name: str, custom_ops: Sequence[str]) -> bool:
    """Whether op `name` is enabled under `custom_ops` (default all); later entries win."""
    enabled = True
    for item in custom_ops:
        if item in ("all", "none"):
            enabled = item == "all"
        elif item[1:] == name:
            enabled = item[0] == "+"
    return enabled


class CustomOp(nn.Module):
    name: str = ""  # set by @CustomOp.register

    def __new__(cls, *args, **kwargs):
        # By registered name only for the registered class itself: a subclass inherits `name` but
        # is its own op, and a plugin replacing the base must not silently discard it.
        own_name = cls.name if _REGISTRY.get(cls.name) is cls else None
        oot = (own_name and _OOT_REGISTRY.get(own_name)) or _OOT_REGISTRY.get(cls.__name__)
        if oot is not None and not issubclass(cls, oot):
            obj = super().__new__(oot)
            if not isinstance(obj, cls):  # Python calls __init__ only on instances of cls
                obj.__init__(*args, **kwargs)
            return obj
        return super().__new__(cls)

    def __init__(self, custom_ops: Sequence[str] = ("all",), platform: "platforms.Platform | None" = None):
        """`platform`: the platform whose forward runs (default: the current one); a layer built for
        a device of another type passes that device's (`mmenc.platforms.platform_for`)."""
        super().__init__()
        unknown = sorted({item[1:] for item in custom_ops if item[:1] in "+-"} - set(_REGISTRY))
        if unknown:
            log_once(logger, f"custom_ops names {unknown}, which no registered op has (registered: "
                             f"{sorted(_REGISTRY)}); those entries change nothing")
        self._custom_ops = tuple(custom_ops)
        self._forward_method = self.forward_method_for(platform or platforms.current_platform)

    def forward_method_for(self, platform: "platforms.Platform"):
        """The bound forward_<key> this op runs on `platform` (forward_native when disabled)."""
        if not op_enabled(self.name, self._custom_ops):
            return self.forward_native
        key = platform.custom_op_key
        method = getattr(self, f"forward_{key}", None)
        if method is None:
            raise ValueError(f"platform {platform.name!r} has custom_op_key={key!r}, but CustomOp has no "
                             f"forward_{key}; use one of cuda, hip, cpu, xpu, tpu, oot, native")
        return method

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cuda(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_hip(self, *args, **kwargs):
        return self.forward_cuda(*args, **kwargs)

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_xpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_tpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_oot(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    @classmethod
    def register(cls, name: str):
        """Class decorator: register a CustomOp subclass under `name`."""
        def decorator(op_cls):
            if name in _REGISTRY and _REGISTRY[name] is not op_cls:
                raise ValueError(f"custom op {name!r} is already registered by {_REGISTRY[name].__qualname__}")
            op_cls.name = name
            _REGISTRY[name] = op_cls
            return op_cls
        return decorator

    @classmethod
    def register_oot(cls, _decorated=None, *, name: str | None = None):
        """Class decorator for device plugins: constructing the op `name` (a registered name or a
        class name) returns an instance of the decorated class instead. Without `name` the op
        replaced is the class this is called on (vLLM's semantics):
        `@MMEncoderAttention.register_oot` replaces MMEncoderAttention."""
        if name is None and cls is CustomOp:
            raise ValueError("CustomOp.register_oot without name= names no op to replace; call it on the class "
                             "to replace (@MMEncoderAttention.register_oot) or pass name='MMEncoderAttention'")
        key = name or cls.__name__

        def decorator(oot_cls):
            _OOT_REGISTRY[key] = oot_cls
            logger.info("custom op %s replaced by out-of-tree %s", key, oot_cls.__qualname__)
            return oot_cls
        return decorator(_decorated) if _decorated is not None else decorator

    @staticmethod
    def registered() -> dict[str, type["CustomOp"]]:
        return dict(_REGISTRY)
