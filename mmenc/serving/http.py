"""HTTP helpers both route modules share (app.py's /v1/encode, embeddings.py's /v1/embeddings): the
request body read under the size limit, the work raced against the client's disconnect, and a response
sent in pieces."""
import asyncio
from collections.abc import Awaitable

from fastapi import Request
from fastapi.responses import Response

from mmenc.serving.inputs import RequestError


class PiecesResponse(Response):
    """200 application/json whose body is `pieces` (formats.Body), sent one ASGI message each with
    their total as content-length: no copy of the whole body is made (a "vllm" answer is 2.4 MB of
    base64 per 448px Qwen2.5-VL-7B image)."""

    media_type = "application/json"

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces or [b""]
        super().__init__(headers={"content-length": str(sum(len(p) for p in self.pieces))})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.pieces) - 1
        for i, piece in enumerate(self.pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i < last})


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, "body", f"body of {declared} bytes exceeds max_request_bytes={limit}",
                           kind="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, "body", f"body exceeds max_request_bytes={limit}", kind="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class ClientGone(Exception):
    """The client closed its connection before its answer was ready (the route answers 499)."""


async def until_disconnect(request: Request, work: Awaitable):
    """work's result; ClientGone (work cancelled: its inputs not yet in a tower call are dropped) if the client
    closes its connection first. Cancelled itself (the drain's cut, the host), it cancels both and re-raises."""
    work = asyncio.ensure_future(work)
    left = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        left.cancel()
        raise
    if not work.done():
        work.cancel()
        raise ClientGone()
    left.cancel()
    return work.result()
