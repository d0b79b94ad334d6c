"""What the generating endpoints share: a request's async side (`Generation`: its engine
request, event queue and text), chat prompts, routing to a rollout side,
admission, and answering whole or as a server-sent event stream. A client that goes away
cancels its request (streaming: the response task is cancelled; otherwise a watcher polls
for the disconnect), which frees its decode slot at the worker's next turn."""

import asyncio
import logging
import secrets
import time
import uuid

import numpy as np
from fastapi.responses import JSONResponse, StreamingResponse

from serving import protocol
from serving.engine import Sampling
from serving.protocol import APIError
from serving.scheduler import Request as EngineRequest
from serving.text import TextStream

log = logging.getLogger("serving.requests")


def chat_prompt_ids(tokenizer, model_id, messages):
    """The prompt ids of `messages` in the model's chat format (model.pretrained.chat); 400
    naming what is wrong for a model without one or messages its format refuses."""
    from model.pretrained.chat import ChatFormatError, chat_format_of
    from model.pretrained.chat import chat_prompt_ids as render

    if chat_format_of(tokenizer) is None:
        raise APIError(400, f"model {model_id!r} has no chat template; use /v1/completions "
                            "with a plain prompt", param="messages")
    try:
        return render(tokenizer, messages)
    except ChatFormatError as e:
        raise APIError(400, str(e), param="messages") from None


class Generation:
    """One admitted request's async side: its engine request, its event queue and text."""

    def __init__(self, service, *, rid, prompt_ids, max_tokens, params, arrival, side="baseline",
                 variant=None):
        """side, variant: the rollout side it was routed to and that side's Variant (None:
        the main config's engine)."""
        self.service, self.rid, self.arrival = service, rid, arrival
        self.side = side
        index = variant.index if variant is not None else 0
        self.metrics = service.metrics_of[index] if service.metrics_of else service.metrics
        self.fingerprint = f"dosa-{side}-{self.metrics.labels['model_version']}"
        loop = asyncio.get_running_loop()
        self.queue = asyncio.Queue()
        tokenizer = service.loaded.tokenizer
        seed = params.seed if params.seed is not None else secrets.randbits(31)
        temperature, top_p = params.sampling
        stop_ids = frozenset() if params.ignore_eos else tokenizer.stop_ids
        self.request = EngineRequest(
            id=rid, prompt=np.asarray(prompt_ids, np.int32), max_tokens=max_tokens,
            deliver=lambda event: loop.call_soon_threadsafe(self.queue.put_nowait, event),
            sampling=Sampling(temperature, top_p, seed), stop_token_ids=stop_ids,
            timeout_s=service.config.request_timeout_s, arrival=arrival, variant=index)
        self.text = TextStream(tokenizer, params.stops)
        self.ttft = None
        self.finish_reason = None
        self.status = 200

    def start(self):
        metrics = self.metrics
        metrics.prompt_tokens.labels(**metrics.labels).inc(len(self.request.prompt))
        self.service.scheduler.submit(self.request)

    async def pieces(self):
        """Yields text pieces as they become safe to send; sets finish_reason at the end;
        raises APIError when the engine failed the request (timeout, internal error)."""
        while True:
            event = await self.queue.get()
            if event.kind == "token":
                if self.ttft is None:
                    self.ttft = time.perf_counter() - self.arrival
                    self.metrics.observe_ttft(self.ttft, len(self.request.prompt))
                piece = self.text.add(event.token)
                if piece:
                    yield piece
                if self.text.stopped:
                    self.service.scheduler.cancel(self.request)
                    self.finish_reason = "stop"
                    return
            elif event.kind == "done":
                if self.ttft is None and self.request.first_token_time is not None:
                    # The first token was a stop token: the answer was ready then all the same.
                    self.ttft = self.request.first_token_time - self.arrival
                    self.metrics.observe_ttft(self.ttft, len(self.request.prompt))
                rest = self.text.flush()
                if rest:
                    yield rest
                self.finish_reason = event.finish_reason
                return
            else:
                self.status = event.status
                error = APIError(event.status, event.message, error_type=event.error_type)
                error.recorded = True  # close() counts and logs it, not the error handler
                raise error

    def usage(self):
        return protocol.usage_body(len(self.request.prompt), len(self.request.generated),
                                   self.request.cache_hit_tokens)

    def close(self, disconnected=False):
        """Stops the work if still running, releases admission, records and logs."""
        if self.request.finish_reason is None:
            self.service.scheduler.cancel(self.request)
        if (disconnected and self.finish_reason is None) or self.finish_reason == "cancelled":
            self.status = 499  # nginx's "client closed request": nobody read the answer
        self.service.release()
        metrics = self.metrics
        metrics.e2e.labels(**metrics.labels).observe(time.perf_counter() - self.arrival)
        metrics.finished(self.status)
        log_request(self.rid, len(self.request.prompt), self.request.cache_hit_tokens,
                    self.ttft, len(self.request.generated), self.status,
                    self.finish_reason or ("disconnected" if disconnected else "error"),
                    side=f"{self.side}:{metrics.labels['model_version']}")


def log_request(rid, prompt_tokens, cache_hit_tokens, ttft, tokens_out, status, reason="",
                side="-"):
    ttft_ms = f"{ttft * 1000:.1f}" if ttft is not None else "-"
    log.info("request id=%s side=%s prompt_tokens=%s cache_hit_tokens=%s ttft_ms=%s "
             "tokens_out=%s status=%s %s", rid, side, prompt_tokens, cache_hit_tokens, ttft_ms,
             tokens_out, status, reason)


def route(service, request, body, rid):
    """(side, Variant) of a new request: X-Dosa-Side forces a side; else a stable hash of
    X-Request-Id, the body's `user`, or the server's id `rid` (serving.rollout)."""
    if service.rollout is None:
        return "baseline", None
    user = getattr(body, "user", None)
    key = request.headers.get("x-request-id") or (user if isinstance(user, str) and user
                                                  else rid)
    forced = request.headers.get("x-dosa-side")
    try:
        return service.rollout.route(key, forced.strip().lower() if forced else None)
    except ValueError as e:
        raise APIError(400, str(e), param="X-Dosa-Side") from None


def admit(service, prompt_ids, max_tokens, params, arrival, prefix, request, body):
    """Checks the length, routes, admits (503 past the limit) and starts a Generation."""
    max_tokens = protocol.check_length(len(prompt_ids), max_tokens, service.max_context)
    rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
    side, variant = route(service, request, body, rid)
    service.admit()
    gen = Generation(service, rid=rid, prompt_ids=prompt_ids, max_tokens=max_tokens,
                     params=params, arrival=arrival, side=side, variant=variant)
    gen.start()
    return gen


def side_headers(gen, **more):
    return {"X-Dosa-Side": gen.side, **more}


async def generate(service, request, body, arrival, *, chat):
    """POST /v1/completions or /v1/chat/completions (`body`: a validated CompletionRequest
    or ChatRequest): check what needs the served model, admit, answer."""
    tokenizer = service.loaded.tokenizer
    if body.model is not None and body.model != service.model_id:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                            f"{[service.model_id]}", param="model")
    if chat:
        prompt_ids = chat_prompt_ids(tokenizer, service.model_id, body.conversation)
    elif isinstance(body.prompt, str):
        prompt_ids = tokenizer.encode(body.prompt, bos=None)
    else:
        bad = [t for t in body.prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size - 1}], "
                                f"got {bad[:5]}", param="prompt")
        prompt_ids = body.prompt
    gen = admit(service, prompt_ids, body.length, body, arrival,
                "chatcmpl" if chat else "cmpl", request, body)
    created = int(time.time())
    if body.stream:
        return StreamingResponse(stream(service, gen, body, chat, created),
                                 media_type="text/event-stream",
                                 headers=side_headers(gen, **{"Cache-Control": "no-cache"}))
    text = await collect(service, gen, request)
    answer = protocol.completion_body(gen.rid, service.model_id, created, text,
                                      gen.finish_reason, gen.usage(), chat=chat)
    answer["system_fingerprint"] = gen.fingerprint
    return JSONResponse(answer, headers=side_headers(gen))


async def stream(service, gen, body, chat, created):
    """The SSE chunks of `gen`; an engine error after the headers goes in-stream."""
    rid, model_id = gen.rid, service.model_id
    finished = False
    try:
        try:
            first = True
            fp = {"system_fingerprint": gen.fingerprint}
            async for piece in gen.pieces():
                yield protocol.sse(protocol.chunk_body(
                    rid, model_id, created, chat=chat, text=piece,
                    role="assistant" if chat and first else None) | fp)
                first = False
            yield protocol.sse(protocol.chunk_body(
                rid, model_id, created, chat=chat, text="" if not chat else None,
                role="assistant" if chat and first else None,
                finish_reason=gen.finish_reason) | fp)
            if body.include_usage:
                yield protocol.sse(protocol.chunk_body(rid, model_id, created, chat=chat,
                                                       usage=gen.usage()) | fp)
        except protocol.APIError as e:  # headers are out: the error goes in-stream
            yield protocol.sse(e.body())
        yield protocol.sse("[DONE]")
        finished = True
    finally:
        gen.close(disconnected=not finished)


async def collect(service, gen, request):
    """`gen`'s whole text; a client that hangs up meanwhile cancels it."""
    async def watch():
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)
        service.scheduler.cancel(gen.request)

    watcher = asyncio.create_task(watch())
    disconnected = False
    try:
        parts = [piece async for piece in gen.pieces()]
        disconnected = watcher.done()
        return "".join(parts)
    finally:
        watcher.cancel()
        gen.close(disconnected=disconnected)
