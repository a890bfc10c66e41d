"""One encoded image and the three ways a response carries it ("vllm", "base64", "json")."""
import dataclasses
import io
import json

import torch

from mmenc.serving.b64 import b64encode
from mmenc.serving.tensor_bytes import TensorSaver


@dataclasses.dataclass(frozen=True)
class EncodedImage:
    """full: [tokens, hidden * (1 + deepstack levels)] on the CPU in the model dtype, owning its
    storage: the main embeddings first, then Qwen3-VL's deepstack features concatenated on dim 1
    (what vLLM takes as image_embeds and reads from its encoder-cache files). hidden: the main
    embeddings' width. grid_thw: (t, h, w). video: a video's VideoInfo as a dict (grid_thw rows,
    frames, timestamps, second_per_grid_ts, ...; mmenc.serving.video), None for an image."""

    full: torch.Tensor
    hidden: int
    grid_thw: tuple[int, int, int]
    video: dict | None = None

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


def dumps(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def torch_b64(tensor: torch.Tensor, saver: TensorSaver | None = None) -> list[bytes]:
    """base64 (ASCII bytes, in consecutive pieces) of torch.save(tensor): what vLLM decodes with
    torch.load(..., weights_only=True). With a TensorSaver, its template bytes instead of torch.save
    (the same tensor once loaded), the tensor's memory encoded where it lies."""
    if saver is not None:
        return [b64encode(piece) for piece in saver.save_pieces(tensor)]
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return [b64encode(buf.getbuffer())]


def _video_fields(video: dict, saver: TensorSaver | None) -> list[bytes]:
    """The fields of a video's `vllm` part after its embeddings, as vLLM's chat API takes one part (it stacks
    each field over the request's video parts): video_grid_thw int64 [3] (one grid row; [rows, 3] for a
    family of several, which vLLM takes no embeddings of), second_per_grid_ts float64 [] (a scalar:
    Qwen2.5-VL, Qwen3-Omni), timestamps float64 [t] (Qwen3-VL, GLM-4.1V, Kimi)."""
    rows = video["grid_thw"]
    out = [b'","video_grid_thw":"', *torch_b64(torch.tensor(rows[0] if len(rows) == 1 else rows, dtype=torch.int64),
                                                saver)]
    if video.get("second_per_grid_ts") is not None:
        out += [b'","second_per_grid_ts":"',
                *torch_b64(torch.tensor(float(video["second_per_grid_ts"]), dtype=torch.float64), saver)]
    if video.get("timestamps") is not None:
        out += [b'","timestamps":"', *torch_b64(torch.tensor(video["timestamps"], dtype=torch.float64), saver)]
    return out


def render_item(image: EncodedImage, fmt: str, meta: dict, saver: TensorSaver | None = None,
                grid: bool = True) -> list[bytes]:
    """One response item as JSON text fragments: `meta` (index, uuid, ...) plus the format's fields.
    The large base64 strings are spliced in as bytes (base64 needs no JSON escaping), so no JSON
    encoder scans megabytes of them, and stay separate fragments (see Body). saver: see torch_b64.
    grid: the `vllm` image part is {"image_embeds", "image_grid_thw"} (the Qwen2-VL lineage); False: the
    base64 tensor alone, what vLLM's chat API takes for the LLaVA families (mmenc.vllm_inputs.takes_grid)."""
    head = dumps(meta)[:-1] + b","  # '{...,' : the object stays open for the format's fields
    if fmt == "vllm" and image.video is not None:  # vLLM's video_embeds content part
        return [head, b'"video_embeds":{"type":"video_embeds","uuid":', dumps(meta.get("uuid")),
                b',"video_embeds":{"video_embeds":"', *torch_b64(image.full, saver),
                *_video_fields(image.video, saver), b'"}}}']
    if fmt == "vllm" and not grid:
        return [head, b'"image_embeds":{"type":"image_embeds","uuid":', dumps(meta.get("uuid")),
                b',"image_embeds":"', *torch_b64(image.full, saver), b'"}}']
    if fmt == "vllm":
        grid_thw = torch.tensor(image.grid_thw, dtype=torch.int64)  # [3]: vLLM stacks one per content part
        return [head, b'"image_embeds":{"type":"image_embeds","uuid":', dumps(meta.get("uuid")),
                b',"image_embeds":{"image_embeds":"', *torch_b64(image.full, saver), b'","image_grid_thw":"',
                *torch_b64(grid_thw, saver), b'"}}}']
    embeddings = image.embeddings
    if fmt == "base64":
        raw = embeddings.view(torch.uint8).numpy()  # little-endian on every platform torch serves
        return [head, b'"embedding":"', b64encode(raw.data), b'","dtype":', dumps(dtype_name(embeddings.dtype)),
                b',"shape":', dumps(list(embeddings.shape)), b"}"]
    if fmt == "json":
        return [head, b'"embedding":', dumps(embeddings.float().tolist()), b"}"]
    raise ValueError(f"format {fmt!r} is not one of vllm, base64, json")


class Body:
    """A response body as a list of pieces, written in order without joining them: fragments under
    `big` bytes are joined as they come, larger ones (the base64 of embeddings) are kept as they are,
    so the body's megabytes are never copied into one string (see http.PiecesResponse)."""

    def __init__(self, big: int = 1 << 16):
        self.pieces: list[bytes] = []
        self._small: list[bytes] = []
        self.big = big

    def add(self, *fragments: bytes) -> None:
        for fragment in fragments:
            if len(fragment) < self.big:
                self._small.append(fragment)
                continue
            if self._small:
                self.pieces.append(b"".join(self._small))
                self._small = []
            self.pieces.append(fragment)

    def done(self) -> list[bytes]:
        if self._small:
            self.pieces.append(b"".join(self._small))
            self._small = []
        return self.pieces
