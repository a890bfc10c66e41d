"""One encoded image and the three ways a response carries it ("vllm", "base64", "json")."""
import base64
import dataclasses
import io

import torch


@dataclasses.dataclass(frozen=True)
class EncodedImage:
    """full: [tokens, hidden * (1 + deepstack levels)] on the CPU in the model dtype, owning its
    storage: the main embeddings first, then Qwen3-VL's deepstack features concatenated on dim 1
    (what vLLM takes as image_embeds and reads from its encoder-cache files). hidden: the main
    embeddings' width. grid_thw: (t, h, w)."""

    full: torch.Tensor
    hidden: int
    grid_thw: tuple[int, int, int]

    @property
    def num_tokens(self) -> int:
        return self.full.shape[0]

    @property
    def embeddings(self) -> torch.Tensor:
        """[tokens, hidden]: what `Encoder.encode` returns for the image."""
        return self.full if self.full.shape[1] == self.hidden else self.full[:, :self.hidden].contiguous()

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_b64(tensor: torch.Tensor) -> str:
    """base64 of torch.save(tensor): what vLLM decodes with torch.load(..., weights_only=True)."""
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getbuffer()).decode("ascii")


def render(image: EncodedImage, fmt: str, uuid: str | None) -> dict:
    """The format-specific fields of one response item."""
    if fmt == "vllm":
        grid = torch.tensor([image.grid_thw], dtype=torch.int64)
        return {"image_embeds": {"type": "image_embeds", "uuid": uuid,
                                 "image_embeds": {"image_embeds": torch_b64(image.full),
                                                  "image_grid_thw": torch_b64(grid)}}}
    embeddings = image.embeddings
    if fmt == "base64":
        raw = embeddings.view(torch.uint8).numpy()  # little-endian on every platform torch serves
        return {"embedding": base64.b64encode(raw.data).decode("ascii"), "dtype": dtype_name(embeddings.dtype),
                "shape": list(embeddings.shape)}
    if fmt == "json":
        return {"embedding": embeddings.float().tolist()}
    raise ValueError(f"format {fmt!r} is not one of vllm, base64, json")
