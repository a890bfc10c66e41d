"""torch.save bytes of a response tensor without torch.save.

torch.save writes a zip archive whose bytes depend only on the tensor's dtype and shape, except the
data record and its CRC-32 (and `.data/serialization_id`, an id torch draws per save; every answer
of one shape here carries its template's). `save_bytes` keeps, per (dtype, shape), the archive of
a zero tensor cut around its data record, and writes an answer as prefix + the tensor's bytes +
suffix with that record's CRC-32 patched in (zlib computes it with the GIL released). That is a
copy and a CRC instead of torch's pickler and zip writer (about 1/5 of the time, measured in
docs/serving.md); torch.load reads the result as the same tensor (tests/test_serve_overlap.py)."""
import io
import struct
import threading
import zipfile
import zlib

import torch

_MAX_TEMPLATES = 64


class _Template:
    """torch.save of a zero tensor, cut: prefix | data (nbytes) | suffix; crc_at: offsets (in the
    whole archive) of the data record's CRC-32 fields."""

    def __init__(self, tensor: torch.Tensor):
        buf = io.BytesIO()
        torch.save(torch.zeros_like(tensor), buf)
        raw = buf.getvalue()
        nbytes = tensor.numel() * tensor.element_size()
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
        start = info.header_offset + 30 + name_len + extra_len
        if info.file_size != nbytes or info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"torch.save's data record is {info.file_size} bytes (compression "
                             f"{info.compress_type}); expected {nbytes} stored bytes")
        crc = struct.pack("<I", info.CRC)
        self.crc_at = [i for i in _find_all(raw, crc) if not start <= i < start + nbytes]
        if not 1 <= len(self.crc_at) <= 3:
            raise ValueError(f"found the data record's CRC-32 {len(self.crc_at)} times in torch.save's "
                             f"archive; expected 1 to 3 (local header, data descriptor, central directory)")
        self.prefix, self.suffix, self.start, self.nbytes = raw[:start], raw[start + nbytes:], start, nbytes


def _find_all(data: bytes, needle: bytes) -> list[int]:
    found, i = [], data.find(needle)
    while i != -1:
        found.append(i)
        i = data.find(needle, i + 1)
    return found


class TensorSaver:
    """save_bytes(tensor) == what torch.load reads back as `tensor` (CPU, contiguous). Thread safe."""

    def __init__(self, max_templates: int = _MAX_TEMPLATES):
        self._templates: dict[tuple, _Template] = {}
        self._lock = threading.Lock()
        self.max_templates = max_templates

    def save_bytes(self, tensor: torch.Tensor) -> bytes:
        return b"".join(self.save_pieces(tensor))

    def save_pieces(self, tensor: torch.Tensor) -> list:
        """save_bytes(tensor) as consecutive pieces [head, middle, tail] whose lengths, but the
        last's, are multiples of 3, so their base64 encodings concatenate to the whole one's. The
        middle (nearly all the bytes) is a view of the tensor's memory: nothing copies it."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            buf = io.BytesIO()
            torch.save(tensor, buf)
            return [buf.getvalue()]
        template = self._template(tensor)
        data = tensor.view(-1).view(torch.uint8).numpy().data  # little-endian, as torch.save writes
        crc = struct.pack("<I", zlib.crc32(data))
        start, n = template.start, template.nbytes
        if n < 6:  # too short to cut: one piece
            whole = bytearray(template.prefix) + data + template.suffix
            for at in template.crc_at:
                whole[at:at + 4] = crc
            return [bytes(whole)]
        cut = (-start) % 3  # head = prefix + the data's first `cut` bytes: a multiple of 3
        end = cut + (n - cut) // 3 * 3  # the middle: data[cut:end]
        head, tail = bytearray(template.prefix) + data[:cut], bytearray(data[end:]) + template.suffix
        for at in template.crc_at:  # each CRC-32 field lies in the prefix or the suffix
            if at < start:
                head[at:at + 4] = crc
            else:
                at -= start + end
                tail[at:at + 4] = crc
        return [bytes(head), data[cut:end], bytes(tail)]

    def _template(self, tensor: torch.Tensor) -> _Template:
        key = (tensor.dtype, tuple(tensor.shape))
        with self._lock:
            template = self._templates.get(key)
        if template is None:
            template = _Template(tensor)
            with self._lock:
                if len(self._templates) >= self.max_templates:
                    self._templates.pop(next(iter(self._templates)))
                self._templates[key] = template
        return template
