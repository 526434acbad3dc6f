"""InferenceService: streamed generation with the base model or the app's adapters."""
# ruff: noqa: N802  (servicer method names are fixed by the generated gRPC base classes)

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from lorad.server import validation as v
from lorad.server.errors import InvalidArgument
from lorad.server.inference import (
    GenerationQueue,
    Generator,
    GenRequest,
    check_generate,
    check_repetition_penalty,
)
from lorad.server.records import Message
from lorad.server.rpc import convert as cv
from lorad.server.rpc.interceptor import principal
from lorad.server.services import Services
from lorad.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
)

FINISH: dict[str, Any] = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "context": inference_pb2.FINISH_REASON_CONTEXT,
}


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Streams generated text."""

    def __init__(self, s: Services) -> None:
        self.s = s
        self.gen = Generator(s.models)
        self.queue = GenerationQueue()
        s.on_forget.append(self.gen.drop_app)
        s.on_adapters_deleted.append(self.gen.drop)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        app_id = principal().require_app()
        which = request.WhichOneof("prompt")
        text = messages = None
        if which == "text":
            if not request.text or len(request.text.encode()) > 65_536:
                raise InvalidArgument("text", "must be 1 to 65,536 bytes of UTF-8")
            text = request.text
        elif which == "chat":
            body = cv.sample_from_pb(common_pb2.Sample(chat=request.chat))
            v.validate_samples([body], field="chat")
            messages = tuple(Message(m.role, m.content) for m in body.messages or ()) if body else ()
        else:
            raise InvalidArgument("prompt", "exactly one of text or chat must be set")
        n, temp, top_p = check_generate(request.max_tokens, request.temperature, request.top_p, list(request.stop))
        if request.base_model:
            self.s.models.entry(request.base_model, field="base_model")
        rec = None
        if request.adapter_id:
            rec = await asyncio.to_thread(self.s.library.get, app_id, request.adapter_id)
        if len(request.extra_adapter_ids) > 8:
            raise InvalidArgument("extra_adapter_ids", f"{len(request.extra_adapter_ids)} given; at most 8")
        extra = [
            await asyncio.to_thread(self.s.library.get, app_id, v.check_server_id(f"extra_adapter_ids[{i}]", a))
            for i, a in enumerate(request.extra_adapter_ids)
        ]
        penalty = check_repetition_penalty(request.repetition_penalty)
        req = GenRequest(text, messages, n, temp, top_p, request.seed, tuple(request.stop), request.base_model, penalty)
        async with self.queue.admit(app_id):
            async for piece in self._generate(req, rec, extra):
                yield piece

    async def _generate(
        self, req: GenRequest, rec: Any, extra: list[Any]
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()

        def produce() -> None:
            try:
                for piece in self.gen.stream(req, rec, stop.is_set, extra):
                    loop.call_soon_threadsafe(queue.put_nowait, piece)
                loop.call_soon_threadsafe(queue.put_nowait, None)
            except BaseException as exc:  # handed to the RPC task, which maps it
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(queue.put_nowait, exc)

        worker = loop.run_in_executor(self.queue.pool, produce)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield inference_pb2.GenerateResponse(
                    text=item.text,
                    token_count=item.token_count,
                    finish_reason=FINISH.get(item.finish, 0),
                    prompt_token_count=item.prompt_tokens,
                )
        finally:
            stop.set()
            if not worker.cancel():  # not started yet: dropped; running: ends at its next token
                with contextlib.suppress(BaseException):
                    await worker
