"""The OpenAI wire format: the requests as pydantic models (FastAPI validates them; a
failure is explained by the field's `Invalid` note), errors, and response / chunk bodies.

Every rejection is an APIError whose body is {"error": {"message", "type", "param",
"code"}} (code: the HTTP status), never FastAPI's default 422.
"""

import inspect
import json
from typing import Annotated, ClassVar, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 500: "server_error", 503: "service_unavailable",
               504: "timeout_error", 499: "client_closed_request"}
MAX_STOP_STRINGS = 4


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


# ---------------------------------------------------------------------- request models

class Invalid:
    """A field's note of how its failure is told to the client: `message` formatted with
    got (the value sent, through `shown`), type (its type's name) and index (the list
    index the failure is at); or a callable (value, index) -> message. `required`: the
    message when the field is missing or null."""

    def __init__(self, message, *, param=None, required=None, shown=None):
        self.message, self.param, self.required = message, param, required
        self.shown = shown or (lambda value: value)

    def explain(self, value, index):
        if value is None and self.required:
            return self.required
        if callable(self.message):
            return self.message(value, index)
        return self.message.format(got=self.shown(value), type=type(value).__name__,
                                   index=index)


class Refused(ValueError):
    """A validator's refusal, told to the client as it is (param: the field to name)."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.message, self.param = message, param


def explain(model, error, body):
    """The APIError (400) that tells the client why `body` failed `model` (FastAPI's
    RequestValidationError `error`): the first failure, in the order of the model's fields,
    told by its Refused message or its field's Invalid note; a field without a note (or a
    model without notes) gets pydantic's own words."""
    failures = [e for e in error.errors() if tuple(e.get("loc", ()))[:1] == ("body",)]
    if not failures:
        return APIError(400, str(error))
    # The endpoint's own fields (prompt, messages) first, then the shared ones in order.
    own = inspect.get_annotations(model)
    first = min(failures, key=lambda e: len(e["loc"]) > 1 and e["loc"][1] not in own)
    loc = tuple(first["loc"])[1:]
    refused = (first.get("ctx") or {}).get("error")
    name = loc[0] if loc and isinstance(loc[0], str) else None
    if isinstance(refused, Refused):
        return APIError(400, refused.message, param=refused.param or name)
    field = model.model_fields.get(name) if name else None
    note = next((m for m in field.metadata if isinstance(m, Invalid)), None) if field else None
    if note is None:
        where = "; ".join(f"{'.'.join(str(x) for x in tuple(e['loc'])[1:]) or 'body'}: "
                          f"{e['msg']}" for e in failures)
        return APIError(400, f"invalid {model.model_config.get('title') or 'request'}: "
                             f"{where}")
    index = next((x for x in loc[1:] if isinstance(x, int)), None)
    value = body.get(name) if isinstance(body, dict) else None
    return APIError(400, note.explain(value, index), param=note.param or name)


def _as_list(stop):
    return [stop] if isinstance(stop, str) else stop


def _not_supported(name):
    return Annotated[Literal[False, 0] | None,
                     Invalid(f"{name} is not supported by this server")]


NonEmpty = Annotated[str, Field(min_length=1)]
MaxTokens = Annotated[int | None, Field(ge=1),
                      Invalid("max_tokens must be an integer >= 1, got {got!r}",
                              param="max_tokens")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What a completion and a chat share: the model, the length and the sampling. An
    OpenAI field this server does not read (user, frequency_penalty, ...) is accepted and
    ignored. Fields are in the order they are checked, so a request with several bad
    fields is told of the first."""

    model_config = ConfigDict(strict=True, extra="allow")
    default_max_tokens: ClassVar[int | None] = None  # None: the rest of the context

    model: Annotated[str | None, Invalid("model must be a string, got {type}")] = None
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None
    temperature: Annotated[float | None, Field(ge=0.0, le=2.0, allow_inf_nan=False),
                           Invalid("temperature must be a number in [0, 2], got {got!r}")
                           ] = None
    top_p: Annotated[float | None, Field(gt=0.0, le=1.0, allow_inf_nan=False),
                     Invalid("top_p must be a number in (0, 1], got {got!r}")] = None
    stop: Annotated[NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)]
                    | None,
                    Invalid(f"stop must be a non-empty string or a list of at most "
                            f"{MAX_STOP_STRINGS} non-empty strings, got {{got!r}}",
                            shown=_as_list)] = None
    seed: Annotated[int | None, Invalid("seed must be an integer, got {got!r}")] = None
    stream: Annotated[bool | None, Invalid("stream must be a boolean, got {got!r}")] = None
    ignore_eos: Annotated[bool | None,
                          Invalid("ignore_eos must be a boolean, got {got!r}")] = None
    stream_options: Annotated[StreamOptions | None,
                              Invalid("stream_options must be an object with a boolean "
                                      "include_usage")] = None
    n: Annotated[int | None, Field(ge=1, le=1),
                 Invalid("n must be 1 (one completion per request), got {got!r}")] = None
    logprobs: _not_supported("logprobs") = None
    top_logprobs: _not_supported("top_logprobs") = None
    echo: _not_supported("echo") = None
    best_of: Annotated[int | None, Field(ge=1, le=1),
                       Invalid("best_of must be 1, got {got!r}")] = None

    @property
    def length(self):
        """max_tokens as sent (null: the rest of the context), else max_completion_tokens,
        else the endpoint's default."""
        if "max_tokens" in self.model_fields_set:
            return self.max_tokens
        if "max_completion_tokens" in self.model_fields_set:
            return self.max_completion_tokens
        return self.default_max_tokens

    @property
    def sampling(self):
        """(temperature, top_p), null meaning OpenAI's default 1."""
        return (1.0 if self.temperature is None else float(self.temperature),
                1.0 if self.top_p is None else float(self.top_p))

    @property
    def stops(self):
        return tuple(_as_list(self.stop) or ())

    @property
    def include_usage(self):
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: a prompt (text, a list with one text, or token ids)."""

    default_max_tokens: ClassVar[int | None] = 16

    prompt: Annotated[str | list[int] | list[str],
                      Invalid("prompt must be a string, a list with one string or a list of "
                              "token ids, got {type}", required="prompt is required")]

    @pydantic.field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise Refused("prompt must be a string, a list with one string or a list of "
                              "token ids, got list")
            prompt = prompt[0]
        if not prompt:
            raise Refused("prompt must not be empty")
        return prompt


def _explain_message(message, index):
    if index is None:
        return "messages must be a non-empty list of {role, content} objects"
    message = message[index]
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return f"messages[{index}] must be an object with a string role"
    if isinstance(message.get("content"), list):
        return f"messages[{index}].content parts must be text parts"
    content = message.get("content")
    return f"messages[{index}].content must be a string, got {type(content).__name__}"


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart]

    @property
    def text(self):
        return (self.content if isinstance(self.content, str)
                else "".join(part.text for part in self.content))


class ChatRequest(SamplingRequest):
    """POST /v1/chat/completions: messages under the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1),
                        Invalid(_explain_message, required="messages is required")]

    @pydantic.field_validator("messages")
    @classmethod
    def _not_all_empty(cls, messages):
        if not any(m.text for m in messages):
            raise Refused("messages are all empty")
        return messages

    @property
    def conversation(self):
        """The messages as the chat template reads them: [{role, content (text)}]."""
        return [{"role": m.role, "content": m.text} for m in self.messages]


class PredictRequest(BaseModel):
    """POST /predict (the reference deployment's): the context and the query, greedy."""

    model_config = ConfigDict(strict=True, extra="allow")

    context: Annotated[str, Invalid("context must be a string, got {type}")]
    query: Annotated[str, Invalid("query must be a string, got {type}")]
    max_tokens: Annotated[int, Field(ge=1),
                          Invalid("max_tokens must be an integer >= 1, got {got!r}")] = 64

    @pydantic.model_validator(mode="after")
    def _something_to_answer(self):
        if not self.context and not self.query:
            raise Refused("context and query are both empty", param="context")
        return self

    @property
    def prompt(self):
        return self.context + "\n" + self.query


GREEDY = SamplingRequest(temperature=0.0)


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
