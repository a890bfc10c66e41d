"""Regional compilation of towers: every transformer block through torch.compile, attention opaque.

Towers repeat one block class tens of times (VisionBlock, or a family's own block kept in the
tower's `blocks` ModuleList, e.g. GLM-4.1V's), so compiling the block, not the whole
tower, compiles once and reuses the code for every layer (parameters are graph inputs). Inside a
block, norms, rotary, activations and residual adds fuse around the matmuls; the attention call
is the custom op `mmenc::mm_encoder_attention`, so there is no graph break and no host sync.
Shapes are dynamic in the token count, so new image sizes do not recompile.

Compiled functions are kept per (MultiModalConfig.compute_hash(), block class, backend): two
encoders with the same configuration share one compiled block. Dynamo counts recompilations per
code object, and one block class serves every tower of its families (each width, head count, norm
a guard), so a process that compiles several towers (a benchmark over families, one server holding
several models) passes dynamo's default limit of 8, which with fullgraph=True is a hard error:
compiling raises that limit to RECOMPILE_LIMIT (never lowers it).
"""
import functools
import re

import torch
import torch.nn as nn

from mmenc.config import MultiModalConfig
from mmenc.layers.vision_blocks import VisionBlock
from mmenc.logger import init_logger

logger = init_logger(__name__)

_COMPILED: dict[tuple[str, type, str, bool], object] = {}
RECOMPILE_LIMIT = 64  # block layouts (towers x configurations) one process may compile


def _allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < limit:
        setattr(config, name, limit)


def compiled_forward(cls: type, config: MultiModalConfig, backend: str = "inductor", fullgraph: bool = True):
    key = (config.compute_hash(), cls, backend, fullgraph)
    if key not in _COMPILED:
        _allow_recompiles()
        _COMPILED[key] = torch.compile(cls.forward, dynamic=True, backend=backend, fullgraph=fullgraph)
    return _COMPILED[key]


def compile_tower(tower: nn.Module, config: MultiModalConfig, backend: str = "inductor",
                  fullgraph: bool = True) -> int:
    """Compile every block of `tower` in place; returns how many blocks now run compiled."""
    blocks = [m for name, m in tower.named_modules()
              if isinstance(m, VisionBlock) or re.fullmatch(r"(.+\.)?blocks\.\d+", name)]
    for block in blocks:
        block.forward = functools.partial(compiled_forward(type(block), config, backend, fullgraph), block)
    if blocks:
        logger.info("compiled %d %s blocks with torch.compile (backend=%s, dynamic token count); the first "
                    "forward pays the compilation", len(blocks), type(blocks[0]).__name__, backend)
    return len(blocks)
