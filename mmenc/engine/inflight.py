"""The chunks an Encoder stream has queued on the device (`Encoder.encode`/`encode_iter`).

Results are handed out in input order, one chunk behind the newest tower call, so the host's work
for a chunk (splitting, the caller's loop body) overlaps the next tower call. Each call's
non-finite flag (mmenc.engine.checks.FiniteFlag) is read once its call is done, never by waiting
for calls queued after it; at most `depth` calls stay unread, which bounds how far the host runs
ahead of the device (inputs and outputs of at most depth + 1 chunks live on the device at once).
strict=True reads a chunk's flag before handing its results out (NonFiniteOutputError then ends the
stream); otherwise a non-finite chunk is warned about up to `depth` chunks later.
"""
import collections
import dataclasses

from mmenc.engine.checks import FiniteFlag, check_finite
from mmenc.models.base import TowerOutput
from mmenc.preprocess.pipeline import Chunk
from mmenc.tally import Tally


@dataclasses.dataclass
class Launched:
    """One chunk and, if it ran, its tower output, the output's finite flag and tokens per image."""

    chunk: Chunk
    out: TowerOutput | None = None
    flag: FiniteFlag | None = None
    tokens: list[int] | None = None
    checked: bool = False


class ChunkWindow:
    def __init__(self, *, depth: int, strict: bool, tally: Tally):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"chunks_in_flight={depth!r} must be an int >= 1 (2: the host prepares the next "
                             f"chunk while the device runs two)")
        self.depth, self.strict, self.tally = depth, strict, tally
        self._held: Launched | None = None  # the newest chunk: handed out after the next one is launched
        self._unread: collections.deque[Launched] = collections.deque()  # flags not read yet, oldest first

    def push(self, launched: Launched) -> list[Launched]:
        """Add the chunk just launched; returns the chunks to hand out now (the previous one, if any)."""
        out = [] if self._held is None else [self._held]
        self._held = launched
        if launched.out is not None and launched.flag is not None:
            self._unread.append(launched)
        else:
            launched.checked = True
        while self._unread and self._unread[0].flag.ready():  # done already: reading costs no wait
            self._read_oldest()
        while len(self._unread) > self.depth:  # the host is depth calls ahead: wait for the oldest
            self._read_oldest()
        if self.strict:
            for chunk in out:
                self._read_until(chunk)
        return out

    def drain(self) -> list[Launched]:
        """At the end of the stream: the held chunk, every flag read (waits for the device)."""
        out = [] if self._held is None else [self._held]
        self._held = None
        while self._unread:
            self._read_oldest()
        return out

    def _read_until(self, launched: Launched) -> None:
        while not launched.checked:
            self._read_oldest()

    def _read_oldest(self) -> None:
        launched = self._unread.popleft()
        with self.tally.time("device_wait_s"):
            launched.flag.wait()
        launched.checked = True
        check_finite(launched.out.embeddings, launched.tokens, self.strict, flag=launched.flag,
                     indices=launched.chunk.indices)
