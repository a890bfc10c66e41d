"""The Encoder stream's window of tower calls in flight (mmenc.engine.inflight.ChunkWindow) and the
finite flag it reads (mmenc.engine.checks.FiniteFlag), with fake device flags: results handed out one
chunk behind, in order; flags read only once their call is done, or when the host is `depth` calls
ahead (the memory bound); strict mode reads before handing out; non-finite chunks named by input index."""
import logging
import time

import pytest
import torch

from mmenc.engine.checks import FiniteFlag, NonFiniteOutputError, finite_flag
from mmenc.engine.inflight import ChunkWindow, Launched
from mmenc.models.base import TowerOutput
from mmenc.preprocess.pipeline import Chunk
from mmenc.tally import Tally


class _Flag:
    """A FiniteFlag stand-in: `done` says whether the device finished the call; wait() records itself."""

    def __init__(self, name: str, log: list, finite: bool = True):
        self.name, self.log, self.finite, self.done = name, log, finite, False

    def ready(self) -> bool:
        return self.done

    def wait(self) -> None:
        if not self.done:  # waiting for a finished call costs nothing: not logged
            self.log.append(f"wait {self.name}")
        self.done = True

    def value(self) -> bool:
        self.wait()
        return self.finite


def _launched(k: int, log: list, finite: bool = True) -> Launched:
    emb = torch.full((2, 3), float("nan") if not finite else 1.0)
    chunk = Chunk(torch.zeros(8, 4), torch.tensor([[1, 2, 2], [1, 2, 2]]), [2 * k, 2 * k + 1], [])
    return Launched(chunk, TowerOutput(emb), _Flag(f"c{k}", log, finite), [1, 1])


def test_window_hands_out_one_behind_and_waits_only_for_the_oldest_beyond_depth():
    log: list = []
    window = ChunkWindow(depth=2, strict=False, tally=Tally())
    handed = []
    for k in range(5):
        handed += [c.chunk.indices[0] // 2 for c in window.push(_launched(k, log))]
        assert handed == list(range(k)), f"after launching chunk {k}: handed out {handed}"
    # chunks 0..4 never finished by themselves: the window waits for the oldest only once 3 are unread
    assert log == ["wait c0", "wait c1", "wait c2"], log
    handed += [c.chunk.indices[0] // 2 for c in window.drain()]
    assert handed == [0, 1, 2, 3, 4] and log[3:] == ["wait c3", "wait c4"]


def test_window_reads_finished_calls_without_waiting():
    log: list = []
    window = ChunkWindow(depth=2, strict=False, tally=Tally())
    first = _launched(0, log)
    window.push(first)
    first.flag.done = True  # the device finished chunk 0 while the host prepared chunk 1
    window.push(_launched(1, log))
    assert first.checked and log == [], "a finished call's flag is read without a wait"


def test_window_strict_reads_a_chunk_before_handing_it_out(caplog):
    log: list = []
    window = ChunkWindow(depth=2, strict=True, tally=Tally())
    window.push(_launched(0, log))
    out = window.push(_launched(1, log))
    assert [c.chunk.indices for c in out] == [[0, 1]] and out[0].checked and log == ["wait c0"]
    window.push(_launched(2, log, finite=False))
    with pytest.raises(NonFiniteOutputError, match=r"2 of 2 image\(s\) of this call \(image indices in the call: 4, 5\)"):
        window.push(_launched(3, log))  # chunk 2 must be read before it is handed out: it is NaN


def test_window_warns_naming_input_indices_when_not_strict(caplog):
    log: list = []
    window = ChunkWindow(depth=1, strict=False, tally=Tally())
    window.push(_launched(0, log, finite=False))
    with caplog.at_level(logging.WARNING, logger="mmenc"):
        out = window.push(_launched(1, log)) + window.drain()
    assert [c.chunk.indices for c in out] == [[0, 1], [2, 3]]
    assert "non-finite embeddings" in caplog.text and "indices in the call: 0, 1" in caplog.text
    with pytest.raises(ValueError, match="chunks_in_flight=0 must be an int >= 1"):
        ChunkWindow(depth=0, strict=False, tally=Tally())


def test_finite_flag_on_cpu_reads_without_a_device():
    flag = finite_flag(torch.ones(3, 2))
    assert isinstance(flag, FiniteFlag) and flag.ready() and flag.value() is True
    assert finite_flag(torch.tensor([[1.0, float("inf")]])).value() is False
    assert finite_flag(torch.empty(0, 4)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_finite_flag_on_cuda_waits_for_its_call_only():
    """The flag's event is behind its own work: a long kernel queued after it does not delay value()
    (a device flag read by bool()/.item() would wait for it)."""
    x = torch.ones(1024, 1024, device="cuda")
    flag = FiniteFlag(x)
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU spinning queued after the flag
    begin = time.perf_counter()
    assert flag.value() is True
    waited = time.perf_counter() - begin
    assert not torch.cuda.current_stream().query(), "the later kernel should still be running"
    assert waited < 0.5, f"value() waited {waited:.2f} s: it waited for work queued after the flag"
    torch.cuda.synchronize()
