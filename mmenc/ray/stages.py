"""The two Ray Data stages of the offline job, and how tensors travel between them (raw bytes in
Arrow binary columns: any dtype, bfloat16 included, any row length).

Rows: key (str), shard (int), pos (int, the image's place in its shard), error (str, "" when fine).
After `preprocess_batch`: pixels (bytes, [patches, C*tp*p*p] in pixel_dtype), grid (int64 [3]).
After `EncoderActor`: embedding (bytes, [tokens, out_hidden] in the tower's dtype, as computed),
tokens, hidden, dtype (its name), weights ("checkpoint" or "random", Encoder.weights), grid.
"""
import numpy as np
import torch

from mmenc.preprocess.images import ImageLoadError, load_image

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def read_bytes(key: str) -> bytes:
    """The file's bytes: a local path, or a URI any pyarrow filesystem reads (s3://, gs://, hdfs://, file://)."""
    if "://" not in key:
        with open(key, "rb") as f:
            return f.read()
    import pyarrow.fs

    fs, path = pyarrow.fs.FileSystem.from_uri(key)
    with fs.open_input_stream(path) as f:
        return f.read()


def preprocess_batch(batch: dict, *, processor, max_pixels: int | None, pixel_dtype: str,
                     prepare_piece=None, high_bit_depth: str = "clip") -> dict:
    """CPU stage: read, decode, resize and patchify each image alone, so a bad file fails alone
    (its row gets `error`, naming the key, and empty pixels). prepare_piece(key, piece, pixel_dtype=)
    -> (pixel bytes, grid [3]): for the rows of video pieces (`video` column set; mmenc.ray.video_rows).
    high_bit_depth: 16-bit images as load_image takes them ("clip" or "scale", the Encoder's setting)."""
    pixels, grids, errors = [], [], []
    for j, key in enumerate(batch["key"]):
        if "video" in batch and (batch["video"][j] or batch["error"][j]):  # a video piece, or a video's error
            pixels.append(b"")
            grids.append(np.zeros(3, np.int64))
            errors.append(str(batch["error"][j]))
            if errors[-1]:
                continue
            try:
                pixels[-1], grids[-1] = prepare_piece(str(key), int(batch["piece"][j]), pixel_dtype=DTYPES[pixel_dtype])
            except (ImageLoadError, OSError, ValueError) as e:
                errors[-1] = f"{key!r}: {str(e).removeprefix(repr(str(key)) + ': ')}"
            continue
        try:
            image = load_image(read_bytes(key), max_pixels=max_pixels, high_bit_depth=high_bit_depth)
            pv, grid = processor([image])  # [patches, C*tp*p*p] float32, [1, 3]
        except (ImageLoadError, OSError, ValueError) as e:
            pixels.append(b"")
            grids.append(np.zeros(3, np.int64))
            errors.append(f"{key!r}: {str(e).removeprefix('image: ')}")
            continue
        pixels.append(to_bytes(pv.to(DTYPES[pixel_dtype])))
        grids.append(grid[0].numpy())
        errors.append("")
    return {**batch, "pixels": np.array(pixels, dtype=object), "grid": np.stack(grids),
            "error": np.array(errors, dtype=object)}


class EncoderActor:
    """GPU stage: one per GPU, the tower loaded once in the constructor; a batch of rows becomes one
    encode_pixels call over its good rows (the Encoder splits it at max_batch_patches)."""

    def __init__(self, encoder_kwargs: dict, pixel_dtype: str):
        from mmenc.engine.encoder import Encoder

        self.encoder = Encoder(**encoder_kwargs)
        self.pixel_dtype = DTYPES[pixel_dtype]

    def __call__(self, batch: dict) -> dict:
        n = len(batch["key"])
        good = [i for i in range(n) if not batch["error"][i]]
        embeddings, tokens, hidden = [b""] * n, np.zeros(n, np.int64), np.zeros(n, np.int64)
        dtype = str(self.encoder.dtype).removeprefix("torch.")
        if good:
            grid = torch.as_tensor(np.stack([batch["grid"][i] for i in good]), dtype=torch.int64)  # [G, 3]
            pieces = [from_bytes(batch["pixels"][i], self.pixel_dtype, (int(g[:3].prod()), -1))  # [patches, row]
                      for i, g in zip(good, grid)]
            out = self.encoder.encode_pixels(torch.cat(pieces), grid)  # [tokens of the batch, out_hidden]
            for i, emb in zip(good, out.split(self.encoder.output_tokens(grid))):
                embeddings[i] = to_bytes(emb.cpu())
                tokens[i], hidden[i] = emb.shape
        result = {k: v for k, v in batch.items() if k != "pixels"}
        return {**result, "embedding": np.array(embeddings, dtype=object), "tokens": tokens, "hidden": hidden,
                "dtype": np.array([dtype] * n, dtype=object),
                "weights": np.array([self.encoder.weights] * n, dtype=object)}
