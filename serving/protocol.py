"""The OpenAI wire format: request parsing with clear 400s, and response / chunk bodies.

Pure functions over parsed JSON: the API module does the I/O. Every rejection is an
APIError whose body is {"error": {"message", "type", "param", "code"}} (code: the HTTP
status), never FastAPI's default 422.
"""

import dataclasses
import json
import math

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 500: "server_error", 503: "service_unavailable",
               504: "timeout_error", 499: "client_closed_request"}
MAX_STOP_STRINGS = 4
TEMPERATURE_RANGE = (0.0, 2.0)


class APIError(Exception):
    def __init__(self, status, message, *, param=None, error_type=None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.error_type = error_type or ERROR_TYPES.get(status, "server_error")

    def body(self):
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.status}}


def parse_json_body(raw, content_type):
    """The request body as a dict; 400 on a wrong content type, invalid UTF-8 or JSON, or a
    body that is not a JSON object."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(400, f"Content-Type must be application/json, got "
                            f"{content_type or 'none'!r}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


@dataclasses.dataclass
class GenerationParams:
    """A validated generation request. Exactly one of prompt_text, prompt_ids, messages."""

    prompt_text: str | None = None
    prompt_ids: list | None = None
    messages: list | None = None
    max_tokens: int | None = None  # None: the rest of the context (chat)
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    model: str | None = None


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_common(body, params, *, served_ids, default_max_tokens):
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise APIError(400, f"model must be a string, got {type(model).__name__}",
                           param="model")
        if model not in served_ids:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{sorted(served_ids)}", param="model")
    params.model = model
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", default_max_tokens))
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens <= 0):
        raise APIError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}",
                       param="max_tokens")
    params.max_tokens = max_tokens
    temperature = body.get("temperature", 1.0)
    lo, hi = TEMPERATURE_RANGE
    if temperature is None:
        temperature = 1.0
    if not _is_number(temperature) or not lo <= temperature <= hi:
        raise APIError(400, f"temperature must be a number in [{lo:g}, {hi:g}], got "
                            f"{temperature!r}", param="temperature")
    params.temperature = float(temperature)
    top_p = body.get("top_p", 1.0)
    if top_p is None:
        top_p = 1.0
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise APIError(400, f"top_p must be a number in (0, 1], got {top_p!r}", param="top_p")
    params.top_p = float(top_p)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                             or not all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, f"stop must be a non-empty string or a list of at most "
                            f"{MAX_STOP_STRINGS} non-empty strings, got {stop!r}", param="stop")
    params.stop = tuple(stop or ())
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise APIError(400, f"seed must be an integer, got {seed!r}", param="seed")
    params.seed = seed
    for name in ("stream", "ignore_eos"):
        value = body.get(name, False)
        if value is None:
            value = False
        if not isinstance(value, bool):
            raise APIError(400, f"{name} must be a boolean, got {value!r}", param=name)
        setattr(params, name, value)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False),
                                                           bool):
            raise APIError(400, "stream_options must be an object with a boolean "
                                "include_usage", param="stream_options")
        params.include_usage = options.get("include_usage", False)
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise APIError(400, f"n must be 1 (one completion per request), got {n!r}", param="n")
    for name in ("logprobs", "top_logprobs", "echo"):
        if body.get(name) not in (None, False, 0):
            raise APIError(400, f"{name} is not supported by this server", param=name)
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise APIError(400, f"best_of must be 1, got {best_of!r}", param="best_of")


def parse_completion(body, *, served_ids, vocab_size):
    """POST /v1/completions -> GenerationParams (max_tokens default 16)."""
    params = GenerationParams()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        params.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size - 1}], got "
                                f"{bad[:5]}", param="prompt")
        params.prompt_ids = list(prompt)
    elif prompt is None:
        raise APIError(400, "prompt is required", param="prompt")
    elif isinstance(prompt, list) and not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    else:
        raise APIError(400, "prompt must be a string, a list with one string or a list of "
                            f"token ids, got {type(prompt).__name__}", param="prompt")
    _check_common(body, params, served_ids=served_ids, default_max_tokens=16)
    return params


def parse_chat(body, *, served_ids):
    """POST /v1/chat/completions -> GenerationParams (max_tokens default: the rest of the
    context)."""
    params = GenerationParams()
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "messages is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects",
                       param="messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role",
                           param="messages")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"messages[{i}].content parts must be text parts",
                               param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string, got "
                                f"{type(content).__name__}", param="messages")
        parsed.append({"role": message["role"], "content": content})
    if not any(m["content"] for m in parsed):
        raise APIError(400, "messages are all empty", param="messages")
    params.messages = parsed
    _check_common(body, params, served_ids=served_ids, default_max_tokens=None)
    return params


def parse_predict(body):
    """POST /predict {"context", "query", "max_tokens"?} -> (prompt text, max_tokens)."""
    for name in ("context", "query"):
        if not isinstance(body.get(name), str):
            raise APIError(400, f"{name} must be a string, got "
                                f"{type(body.get(name)).__name__}", param=name)
    if not body["context"] and not body["query"]:
        raise APIError(400, "context and query are both empty", param="context")
    max_tokens = body.get("max_tokens", 64)
    if not _is_int(max_tokens) or max_tokens <= 0:
        raise APIError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}",
                       param="max_tokens")
    return body["context"] + "\n" + body["query"], max_tokens


def check_length(prompt_tokens, max_tokens, max_context):
    """The max_tokens to run: 400 naming the limit when the prompt or prompt + max_tokens
    does not fit the context; max_tokens None takes the rest of it."""
    if prompt_tokens >= max_context:
        raise APIError(400, f"the prompt is {prompt_tokens} tokens; the maximum context is "
                            f"{max_context} tokens (prompt + max_tokens), leaving no room to "
                            f"generate", param="prompt")
    if max_tokens is None:
        return max_context - prompt_tokens
    if prompt_tokens + max_tokens > max_context:
        raise APIError(400, f"max_tokens ({max_tokens}) plus the prompt ({prompt_tokens} "
                            f"tokens) is {prompt_tokens + max_tokens} tokens, past the maximum "
                            f"context of {max_context} tokens", param="max_tokens")
    return max_tokens


# ---------------------------------------------------------------------- response bodies

def completion_body(rid, model, created, text, finish_reason, usage, *, chat):
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice], "usage": usage}


def chunk_body(rid, model, created, *, chat, text=None, role=None, finish_reason=None,
               usage=None):
    """One SSE chunk; usage-only chunks (stream_options.include_usage) have no choices."""
    if chat:
        delta = {}
        if role is not None:
            delta["role"] = role
        if text is not None:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None,
                    "finish_reason": finish_reason}]
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["choices"] = []
        body["usage"] = usage
    return body


def sse(data):
    """One server-sent event line: `data: <json>` and a blank line."""
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


def usage_body(prompt_tokens, completion_tokens, cache_hit_tokens=None):
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cache_hit_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cache_hit_tokens}
    return usage
