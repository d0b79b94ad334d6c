"""The HTTP API (FastAPI): OpenAI completions and chat completions (streaming or not), the
reference's /predict, /v1/models, /health and /metrics.

Handlers never run JAX: a request is tokenized, admitted and handed to the scheduler's
worker thread, whose events come back through an asyncio queue. A client that goes away
cancels its request (streaming: the response task is cancelled; otherwise a watcher polls
for the disconnect), which frees its decode slot at the worker's next turn.
"""

import asyncio
import hmac
import logging
import secrets
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from serving import protocol
from serving.engine import Sampling
from serving.protocol import APIError
from serving.scheduler import Request as EngineRequest
from serving.text import TextStream

log = logging.getLogger("serving.requests")
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_chat(tokenizer, model_id, messages):
    """The prompt text of `messages` under the tokenizer's chat template (jinja2, sandboxed,
    as Hugging Face renders it); 400 for a model without one."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError(400, f"model {model_id!r} has no chat template; use /v1/completions "
                            "with a plain prompt", param="messages")
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    special = {}
    for name, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id")):
        token_id = getattr(tokenizer, attr, None)
        inner = getattr(tokenizer, "tokenizer", None)
        special[name] = (inner.id_to_token(token_id)
                         if inner is not None and token_id is not None else "")
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                **special)
    except TemplateError as e:
        raise APIError(400, f"the chat template rejected these messages: {e}",
                       param="messages") from None


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
        stop_ids = frozenset() if params.ignore_eos else tokenizer.stop_ids
        self.request = EngineRequest(
            id=rid, prompt=np.asarray(prompt_ids, np.int32), max_tokens=max_tokens,
            deliver=lambda event: loop.call_soon_threadsafe(self.queue.put_nowait, event),
            sampling=Sampling(params.temperature, params.top_p, seed), stop_token_ids=stop_ids,
            timeout_s=service.config.request_timeout_s, arrival=arrival, variant=index)
        self.text = TextStream(tokenizer, params.stop)
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
    user = body.get("user") if isinstance(body, dict) else None
    key = request.headers.get("x-request-id") or (user if isinstance(user, str) and user
                                                  else rid)
    forced = request.headers.get("x-dosa-side")
    try:
        return service.rollout.route(key, forced.strip().lower() if forced else None)
    except ValueError as e:
        raise APIError(400, str(e), param="X-Dosa-Side") from None


def create_app(service):
    app = FastAPI(title="dosa serving", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    def error_response(request, error):
        if getattr(error, "recorded", False):
            return JSONResponse(error.body(), status_code=error.status)
        if service.metrics is not None:
            service.metrics.finished(error.status)
        if request.url.path not in ("/health", "/metrics"):
            log_request("-", "-", "-", None, 0, error.status, f"{request.url.path}: "
                        f"{error.message}")
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(APIError)
    async def on_api_error(request, error):
        return error_response(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, error):
        return error_response(request, APIError(error.status_code, str(error.detail)))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, error):
        return error_response(request, APIError(400, str(error)))

    def check_auth(request):
        key = service.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                "<key>'" if header else "missing API key: send "
                                "'Authorization: Bearer <key>'")

    @app.get("/health")
    async def health():
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        data = service.metrics.exposition() if service.metrics is not None else b""
        return Response(data, media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        service.require_ready()
        return {"object": "list", "data": [{
            "id": service.model_id, "object": "model", "created": int(service.started),
            "owned_by": "dosa", "max_model_len": service.max_context,
            "description": service.loaded.description}]}

    async def read_body(request):
        try:
            raw = await request.body()
        except ClientDisconnect:  # hung up before its body arrived: nothing was started
            raise APIError(499, "client closed the connection before sending its request "
                                "body") from None
        return protocol.parse_json_body(raw, request.headers.get("content-type"))

    def admit(prompt_ids, max_tokens, params, arrival, prefix, request, body):
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

    async def generate(request, chat):
        arrival = time.perf_counter()
        check_auth(request)
        service.require_ready()
        body = await read_body(request)
        tokenizer = service.loaded.tokenizer
        if chat:
            params = protocol.parse_chat(body, served_ids={service.model_id})
            text = render_chat(tokenizer, service.model_id, params.messages)
            prompt_ids = tokenizer.encode(text, bos=None)
        else:
            params = protocol.parse_completion(body, served_ids={service.model_id},
                                               vocab_size=tokenizer.vocab_size)
            prompt_ids = (params.prompt_ids if params.prompt_ids is not None
                          else tokenizer.encode(params.prompt_text, bos=None))
        gen = admit(prompt_ids, params.max_tokens, params, arrival,
                    "chatcmpl" if chat else "cmpl", request, body)
        created = int(time.time())
        if params.stream:
            return StreamingResponse(stream(gen, params, chat, created),
                                     media_type="text/event-stream",
                                     headers=side_headers(gen, **{"Cache-Control": "no-cache"}))
        text = await collect(gen, request)
        body = protocol.completion_body(gen.rid, service.model_id, created, text,
                                        gen.finish_reason, gen.usage(), chat=chat)
        body["system_fingerprint"] = gen.fingerprint
        return JSONResponse(body, headers=side_headers(gen))

    async def stream(gen, params, chat, created):
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
                if params.include_usage:
                    yield protocol.sse(protocol.chunk_body(rid, model_id, created, chat=chat,
                                                           usage=gen.usage()) | fp)
            except APIError as e:  # headers are out: the error goes in-stream
                yield protocol.sse(e.body())
            yield protocol.sse("[DONE]")
            finished = True
        finally:
            gen.close(disconnected=not finished)

    async def collect(gen, request):
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/predict")
    async def predict(request: Request):
        arrival = time.perf_counter()
        check_auth(request)
        service.require_ready()
        body = await read_body(request)
        prompt, max_tokens = protocol.parse_predict(body)
        params = protocol.GenerationParams(temperature=0.0, top_p=1.0)
        prompt_ids = service.loaded.tokenizer.encode(prompt, bos=None)
        gen = admit(prompt_ids, max_tokens, params, arrival, "predict", request, body)
        answer = await collect(gen, request)
        return JSONResponse({
            "answer": answer, "ttft_ms": round(gen.ttft * 1000, 3) if gen.ttft else None,
            "prompt_tokens": len(prompt_ids), "cache_hit_tokens": gen.request.cache_hit_tokens,
            "completion_tokens": len(gen.request.generated),
            "finish_reason": gen.finish_reason, "model": service.model_id,
            "system_fingerprint": gen.fingerprint}, headers=side_headers(gen))

    from serving.admin import add_admin_routes

    add_admin_routes(app, service, read_body)
    return app
