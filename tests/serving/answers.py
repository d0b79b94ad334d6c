"""What the server answers (status and body) to every bad input of test_bad_input.py, to more
bad inputs of each field, and to a completion, a chat and two streams sent with the official
openai client. recorded_answers.json holds the answers of the server before its requests
became pydantic models (serving/protocol.py parsed them by hand); test_recorded_answers.py
checks that today's server gives the same ones.

    python -m tests.serving.answers   # re-records (only when an answer is meant to change)

Ids and timestamps are replaced by placeholders; prompts stay under one cache block, so no
answer depends on which requests came before it.
"""

import json
import pathlib

import httpx

from tests.serving.conftest import API_KEY
from tests.serving.test_bad_input import CASES, CHAT, COMPLETIONS, JSON

RECORDED = pathlib.Path(__file__).with_name("recorded_answers.json")
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
HI = {"prompt": "hi", "max_tokens": 2, "temperature": 0}

# Each field's other bad values, and accepted spellings whose answers must not change.
MORE_CASES = [
    (COMPLETIONS, {**HI, "n": 2}), (COMPLETIONS, {**HI, "n": True}), (COMPLETIONS, {**HI, "n": 1}),
    (COMPLETIONS, {**HI, "logprobs": 2}), (COMPLETIONS, {**HI, "echo": True}),
    (COMPLETIONS, {**HI, "top_logprobs": 1}), (COMPLETIONS, {**HI, "logprobs": None}),
    (COMPLETIONS, {**HI, "best_of": 3}), (COMPLETIONS, {**HI, "best_of": 1}),
    (COMPLETIONS, {**HI, "stream_options": {"include_usage": "yes"}}),
    (COMPLETIONS, {**HI, "stream_options": []}),
    (COMPLETIONS, {**HI, "stop": ["a", "b", "c", "d", "e"]}), (COMPLETIONS, {**HI, "stop": ""}),
    (COMPLETIONS, {**HI, "stop": [""]}), (COMPLETIONS, {**HI, "stop": 5}),
    (COMPLETIONS, {**HI, "stop": None}), (COMPLETIONS, {**HI, "stop": "zz"}),
    (COMPLETIONS, {**HI, "seed": True}), (COMPLETIONS, {**HI, "seed": "1"}),
    (COMPLETIONS, {**HI, "seed": 7, "temperature": 1.0}),
    (COMPLETIONS, {**HI, "ignore_eos": 1}), (COMPLETIONS, {**HI, "stream": None}),
    (COMPLETIONS, {**HI, "temperature": None, "seed": 3}),
    (COMPLETIONS, {**HI, "temperature": True}), (COMPLETIONS, {**HI, "temperature": "0.5"}),
    (COMPLETIONS, {**HI, "temperature": 1, "seed": 3}),
    (COMPLETIONS, {**HI, "top_p": None}), (COMPLETIONS, {**HI, "top_p": False}),
    (COMPLETIONS, {**HI, "max_tokens": True}), (COMPLETIONS, {**HI, "max_tokens": 2.0}),
    (COMPLETIONS, {**HI, "max_tokens": None}),
    (COMPLETIONS, {"prompt": "hi", "max_completion_tokens": 0}),
    (COMPLETIONS, {"prompt": "hi", "max_completion_tokens": 3, "temperature": 0}),
    (COMPLETIONS, {**HI, "model": 3}), (COMPLETIONS, {**HI, "model": "dosa-tiny-untrained"}),
    (COMPLETIONS, {**HI, "model": None}),
    (COMPLETIONS, {**HI, "prompt": ["one string"]}), (COMPLETIONS, {**HI, "prompt": ["a", "b"]}),
    (COMPLETIONS, {**HI, "prompt": [104, 105]}), (COMPLETIONS, {**HI, "prompt": [104, 9999]}),
    (COMPLETIONS, {**HI, "prompt": [104, -1]}), (COMPLETIONS, {**HI, "prompt": [104, True]}),
    (COMPLETIONS, {**HI, "prompt": []}), (COMPLETIONS, {**HI, "prompt": [""]}),
    (COMPLETIONS, {**HI, "prompt": None}), (COMPLETIONS, {**HI, "prompt": {"text": "hi"}}),
    (COMPLETIONS, {**HI, "user": "someone", "frequency_penalty": 0}),
    (CHAT, {"messages": "hi"}), (CHAT, {"messages": None}), (CHAT, {}),
    (CHAT, {"messages": [{"role": 1, "content": "hi"}]}), (CHAT, {"messages": ["hi"]}),
    (CHAT, {"messages": [{"content": "hi"}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}),
    (CHAT, {"messages": [{"role": "user"}]}),
    (CHAT, {"messages": [{"role": "user", "content": ""}]}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
    ("/predict", {"context": "", "query": ""}), ("/predict", {"context": "c"}),
    ("/predict", {"context": "c", "query": "q", "max_tokens": 0}),
    ("/predict", {"context": "c", "query": "q", "max_tokens": "2"}),
    ("/predict", {"context": "c", "query": "q", "max_tokens": 2}),
    ("/predict", []), ("/predict", b"{"),
]


def _normalised(value):
    """`value` with ids, timestamps and TTFTs replaced by placeholders."""
    if isinstance(value, dict):
        return {k: ("<" + k + ">" if k in ("id", "created", "ttft_ms") and v is not None
                    else _normalised(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalised(v) for v in value]
    return value


def raw_answers(url):
    """[path, request body, status, answer body] of every bad input and MORE_CASES."""
    answers = []
    requests = [(p.values[0], p.values[1], p.values[2]) for p in CASES]
    requests += [(path, body if isinstance(body, bytes) else json.dumps(body).encode(), JSON)
                 for path, body in MORE_CASES]
    for path, content, headers in requests:
        r = httpx.post(f"{url}{path}", content=content, headers=headers, timeout=60)
        answers.append([path, content.decode("utf-8", "backslashreplace"),
                        dict(sorted((k, v) for k, v in headers.items() if k != "Authorization")),
                        r.status_code, _normalised(r.json())])
    return answers


def client_answers(url, tokenizer):
    """What the openai client returns for a completion, a chat and both streamed: each
    response (or stream chunk) as the client parsed it."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    common = dict(model="dosa-tiny-untrained", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    dump = lambda response: _normalised(response.model_dump(mode="json", exclude_unset=True))  # noqa: E731, E501
    out = {"completion": dump(client.completions.create(prompt="Once upon", **common)),
           "completion_stream": [dump(c) for c in client.completions.create(
               prompt="Once upon", stream=True, stream_options={"include_usage": True},
               **common)]}
    tokenizer.chat_template = CHATML
    try:
        out["chat"] = dump(client.chat.completions.create(messages=messages, **common))
        out["chat_stream"] = [dump(c) for c in client.chat.completions.create(
            messages=messages, stream=True, **common)]
    finally:
        tokenizer.chat_template = None
    try:
        client.completions.create(prompt="hi", model="dosa-tiny-untrained", max_tokens=0)
    except openai.BadRequestError as e:
        out["bad_request"] = [type(e).__name__, e.status_code, _normalised(e.body)]
    return out


def answers(server):
    """Every answer, from the running test server `server` (tests/serving/conftest.py)."""
    return {"http": raw_answers(server.url),
            "openai": client_answers(server.url, server.service.loaded.tokenizer)}


def main():
    from serving.service import Service
    from tests.serving.conftest import RunningServer, test_config, tiny_loaded

    service = Service(test_config(), loader=tiny_loaded)
    running = RunningServer(service)
    service.start()
    assert service.wait_ready(300), service.error
    try:
        recorded = answers(running)
    finally:
        running.stop()
    RECORDED.write_text(json.dumps(recorded, indent=1, ensure_ascii=False) + "\n")
    print(f"{RECORDED}: {len(recorded['http'])} HTTP answers, "
          f"{len(recorded['openai'])} openai client answers")


if __name__ == "__main__":
    main()
