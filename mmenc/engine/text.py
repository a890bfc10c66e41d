"""Texts into a contrastive model's image-embedding space: the checkpoint's own tokenizer and text tower.

    text = TextEncoder.from_checkpoint(folder, device, dtype)
    vectors = text.encode(["a photo of a cat", ...])       # [N, projection], as get_text_features

Tokenization is transformers' AutoTokenizer of the checkpoint folder (its tokenizer files; nothing is
downloaded), called as the models' documentation does: CLIP pads to the longest text of the call,
SigLIP and SigLIP2 to max_position_embeddings (64, how they were trained); both truncate to
max_position_embeddings. Every tensor the tokenizer returns (input_ids, attention_mask) goes to the tower,
so the result equals `model.get_text_features(**tokenizer(texts, ...))`.
"""
import pathlib
from collections.abc import Sequence
from typing import Any

import torch

from mmenc.loader import iter_tower_tensors, read_config
from mmenc.models.text import TEXT_PREFIXES, TextConfig, TextTower

TEXT_BATCH = 256  # texts per tower call
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model", "tokenizer.model")


class TextEncoder:
    """A text tower and its tokenizer; `encode(texts)` -> [N, projection] on `device` in `dtype`."""

    def __init__(self, tower: TextTower, tokenizer: Any, device: torch.device):
        self.tower, self.tokenizer, self.device = tower.eval(), tokenizer, device

    @classmethod
    def from_checkpoint(cls, folder: str | pathlib.Path, device: torch.device, dtype: torch.dtype) -> "TextEncoder":
        """The text tower of a CLIPModel / SiglipModel / Siglip2Model checkpoint folder and its tokenizer;
        ValueError naming what is missing."""
        folder = pathlib.Path(folder)
        config = TextConfig.from_hf(read_config(folder))
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"checkpoint {str(folder)!r} has no tokenizer files (none of "
                             f"{', '.join(TOKENIZER_FILES)}); text embeddings need the checkpoint's own tokenizer: "
                             f"copy its tokenizer files there")
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"checkpoint {str(folder)!r} has no tokenizer transformers can load ({e}); text "
                             f"embeddings need the checkpoint's tokenizer files (tokenizer.json or vocab.json + "
                             f"merges.txt / spiece.model, tokenizer_config.json) in the folder") from e
        tower = TextTower(config, device=device, dtype=dtype)
        loaded = tower.load_weights(iter_tower_tensors(folder, TEXT_PREFIXES))
        missing = sorted(n for n, _ in tower.named_parameters() if n not in loaded)
        if missing:
            raise ValueError(f"checkpoint {str(folder)!r} lacks text-tower tensor(s) {', '.join(missing[:8])}; "
                             f"expected a CLIPModel / SiglipModel / Siglip2Model checkpoint with its text model")
        return cls(tower, tokenizer, device)

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tokenizer's tensors for `texts`, padded and truncated as the family expects (module docstring)."""
        config = self.tower.config
        padding = True if config.kind == "clip" else "max_length"
        return dict(self.tokenizer(list(texts), padding=padding, truncation=True, max_length=config.max_positions,
                                   return_tensors="pt"))

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text as the tower reads it (special tokens included, truncated, padding not counted)."""
        if not texts:
            return []
        ids = self.tokenizer(list(texts), truncation=True, max_length=self.tower.config.max_positions)["input_ids"]
        return [len(row) for row in ids]

    @torch.inference_mode()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """[len(texts), projection] (the image embeddings' space), in input order."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise ValueError("texts must be a list of strings (one per text); got "
                             f"{type(texts).__name__ if isinstance(texts, str) else 'a list holding non-strings'}")
        width = self.tower.config.projection
        parts = []
        for start in range(0, len(texts), TEXT_BATCH):
            inputs = self.tokenize(texts[start:start + TEXT_BATCH])
            mask = inputs.get("attention_mask")
            parts.append(self.tower(inputs["input_ids"].to(self.device),
                                    None if mask is None else mask.to(self.device)))
        dtype = next(self.tower.parameters()).dtype
        return torch.cat(parts) if parts else torch.zeros(0, width, device=self.device, dtype=dtype)
