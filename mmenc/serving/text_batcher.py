"""TextBatcher: the only caller of a contrastive checkpoint's text tower in the service (`/v1/embeddings`
with text inputs). Texts from every request wait in one queue; one thread takes up to `max_texts` of
them (or what came within `max_wait_ms` of the first) into one `Encoder.embed_text` call and answers
each text's Future with EncodedImage(vector [1, dim], dim, (1, 1, tokens)): the text's token count
stands where an image's grid is (usage counts it). A text whose future was cancelled (its client
left) before its call started is dropped."""
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable

import torch

from mmenc.logger import init_logger
from mmenc.serving.formats import EncodedImage

logger = init_logger(__name__)

MAX_TEXTS = 256  # texts per text-tower call (mmenc.engine.text.TEXT_BATCH)


@dataclasses.dataclass
class TextJob:
    text: str
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    enqueued: float = dataclasses.field(default_factory=time.perf_counter)


class TextBatcher:
    def __init__(self, embed: Callable[[list[str]], torch.Tensor], count: Callable[[list[str]], list[int]],
                 max_wait_ms: float, max_texts: int = MAX_TEXTS):
        """embed(texts) -> [N, dim] (Encoder.embed_text, any device); count(texts) -> tokens per text
        (Encoder.text_tokens)."""
        self._embed, self._count = embed, count
        self.max_wait_s, self.max_texts = max_wait_ms / 1000.0, max_texts
        self._queue: queue.Queue[TextJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="mmenc-text", daemon=True)
        self._thread.start()

    def submit(self, text: str) -> concurrent.futures.Future:
        job = TextJob(text)
        self._queue.put(job)
        return job.future

    def close(self, timeout: float | None = None) -> None:
        """Finish every text queued so far, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            batch, deadline = [first], first.enqueued + self.max_wait_s
            while len(batch) < self.max_texts:
                try:
                    left = deadline - time.perf_counter()
                    job = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                batch.append(job)
            self._run([job for job in batch if job.future.set_running_or_notify_cancel()])
        while True:  # after the stop marker: what was queued behind it (nothing, unless close raced a submit)
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                self._run([job])

    def _run(self, batch: list[TextJob]) -> None:
        if not batch:
            return
        texts = [job.text for job in batch]
        try:
            vectors = self._embed(texts).to("cpu")
            tokens = self._count(texts)
        except Exception as e:  # noqa: BLE001 - the failure belongs to these texts' requests, not the server
            logger.exception("text tower call over %d texts failed", len(batch))
            for job in batch:
                job.future.set_exception(e)
            return
        for i, (job, n) in enumerate(zip(batch, tokens)):
            job.future.set_result(EncodedImage(vectors[i:i + 1].clone(), vectors.shape[1], (1, 1, n)))
