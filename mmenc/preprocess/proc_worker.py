"""A preprocessing worker process: `python -m mmenc.preprocess.proc_worker FD`, started by
mmenc.preprocess.procs.ProcessWorkers with FD its end of a Unix socket pair (a mmenc.shm.Channel).

Protocol (headers; tensors ride in shared segments, see mmenc.shm):
  parent -> worker  ("init", ImageWork, keep_free_bytes)   first message, once (keep_free_bytes: released
                                                           segments kept for reuse; the rest are destroyed)
                    ("task", seq, index, item, pil_limit, resize)  prepare one input (a path or bytes;
                                                           resize: ImageWork.prepare's, or None)
                    ("release", segment_id)                the parent copied a result away
                    ("stop",)                              finish the current task and exit
  worker -> parent  ("ready", seq, plan, encoded, resized) + [(segment, pixels)]  pixels laid out as prepared
                    ("failed", seq, LoadFailure)           the input failed (the thread mode's message)
                    ("error", seq, exception)              an unexpected error, raised in the parent

Tasks run one at a time, in the order they came; a reader thread takes releases as they arrive, so a
segment goes back to the pool while the next image decodes. The worker exits when told, or when the
parent's end of the socket closes (the parent is gone): it never outlives the parent.
"""
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import traceback

import torch
from PIL import Image

from mmenc.preprocess.images import LoadFailure
from mmenc.preprocess.prepare import ImageWork
from mmenc.preprocess.staging import layout_copy
from mmenc.shm import Channel, Segment, SegmentPool



def serve(channel: Channel) -> None:
    first = channel.recv()
    if first is None:
        return
    (kind, work, keep_free_bytes), _ = first
    if kind != "init" or not isinstance(work, ImageWork):
        raise RuntimeError(f"first message {kind!r}: expected ('init', ImageWork, keep_free_bytes) from "
                           f"mmenc.preprocess.procs")
    pool = SegmentPool(max_free_bytes=keep_free_bytes)
    lent: dict[int, Segment] = {}  # segments the parent holds, by id
    lock = threading.Lock()
    tasks: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                message = channel.recv()
            except OSError:
                message = None
            if message is None or message[0][0] == "stop":
                tasks.put(None)
                return
            header = message[0]
            if header[0] == "release":
                with lock:
                    segment = lent.pop(header[1], None)
                if segment is not None:
                    channel.return_segment(pool, segment)
            else:
                tasks.put(header)

    threading.Thread(target=read, name="mmenc-preprocess-reader", daemon=True).start()
    while (task := tasks.get()) is not None:
        _, seq, index, item, pil_limit, resize = task
        Image.MAX_IMAGE_PIXELS = pil_limit  # the parent's limit now (mmenc encode --max-image-pixels sets it)
        try:
            result = work.prepare(index, item, resize)
        except Exception as e:  # a bug, not a bad image: raised in the parent as the thread mode would
            _send_error(channel, seq, e)
            continue
        if isinstance(result, LoadFailure):
            channel.send(("failed", seq, result))
            continue
        taken: list[Segment] = []

        def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            taken.append(pool.take(max(1, torch.Size(shape).numel() * dtype.itemsize)))
            return taken[-1].tensor(shape, dtype)

        pixels = layout_copy(result.pixels, alloc)  # one copy, the decoder's memory layout kept
        with lock:
            lent[taken[0].id] = taken[0]
        channel.send(("ready", seq, result.plan, result.encoded, result.resized), [(taken[0], pixels)])


def _send_error(channel: Channel, seq: int, error: Exception) -> None:
    try:
        channel.send(("error", seq, error))
    except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
        channel.send(("error", seq, RuntimeError(f"preprocessing worker process: {traceback.format_exc()}")))


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    torch.set_num_threads(1)  # one image at a time; the parallelism is the processes
    channel = Channel(socket.socket(fileno=int(argv[1])))
    try:
        serve(channel)
    except OSError:  # the parent is gone mid-send: nothing left to answer
        pass
    channel.close()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (torch's takes seconds): nothing of ours is left to flush


if __name__ == "__main__":
    main(sys.argv)
