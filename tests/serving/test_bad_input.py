"""Every bad input gets a clear error in the OpenAI error format (400, not FastAPI's 422;
401 for auth; 404 for an unknown model), the server stays healthy and a request running
meanwhile is not affected."""

import json
import threading

import httpx
import pytest

from tests.serving.conftest import AUTH

# One worker runs every test of the shared server (tests/serving/conftest.py), so it
# starts once (pyproject: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("serving-server")

JSON = {**AUTH, "Content-Type": "application/json"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def case(path, content, *, headers=JSON, status=400, param=None, says=""):
    if not isinstance(content, bytes):
        content = json.dumps(content).encode()
    return pytest.param(path, content, headers, status, param, says, id=says or str(param))


CASES = [
    case(COMPLETIONS, b'{"prompt": "hi", "max_tokens": ', says="not valid JSON"),
    case(COMPLETIONS, b'{"prompt": "\xff\xfe bad bytes"}', says="not valid UTF-8"),
    case(COMPLETIONS, b"prompt=hi", headers={**AUTH, "Content-Type": "text/plain"},
         says="Content-Type must be application/json"),
    case(COMPLETIONS, b'["a list"]', says="must be a JSON object"),
    case(COMPLETIONS, {"prompt": 42}, param="prompt", says="prompt must be a string"),
    case(COMPLETIONS, {"prompt": "hi", "max_tokens": "10"}, param="max_tokens",
         says="max_tokens must be an integer"),
    case(COMPLETIONS, {"prompt": "hi", "stream": "yes"}, param="stream",
         says="stream must be a boolean"),
    case(COMPLETIONS, {"prompt": "hi", "stop": [1, 2]}, param="stop", says="stop must be"),
    case(COMPLETIONS, {"prompt": "hi", "seed": 1.5}, param="seed", says="seed must be"),
    case(COMPLETIONS, {"prompt": ""}, param="prompt", says="prompt must not be empty"),
    case(COMPLETIONS, {"max_tokens": 3}, param="prompt", says="prompt is required"),
    case(CHAT, {"messages": []}, param="messages", says="messages must be a non-empty list"),
    case(CHAT, {"messages": [{"role": "user", "content": 5}]}, param="messages",
         says="content must be a string"),
    case(COMPLETIONS, {"prompt": "x" * 600}, param="prompt",
         says="the prompt is 601 tokens; the maximum context is 512 tokens"),
    case(COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, param="max_tokens",
         says="max_tokens must be an integer >= 1, got 0"),
    case(COMPLETIONS, {"prompt": "hi", "max_tokens": -3}, param="max_tokens",
         says="got -3"),
    case(COMPLETIONS, {"prompt": "x" * 500, "max_tokens": 100}, param="max_tokens",
         says="past the maximum context of 512 tokens"),
    case(COMPLETIONS, {"prompt": "hi", "temperature": 2.5}, param="temperature",
         says="temperature must be a number in [0, 2]"),
    case(COMPLETIONS, {"prompt": "hi", "temperature": -0.1}, param="temperature",
         says="got -0.1"),
    case(COMPLETIONS, {"prompt": "hi", "top_p": 0}, param="top_p",
         says="top_p must be a number in (0, 1]"),
    case(COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, param="top_p", says="got 1.5"),
    case(COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}, status=404, param="model",
         says="model 'gpt-4' does not exist"),
    case(CHAT, {"messages": [{"role": "user", "content": "hi"}]}, param="messages",
         says="has no chat template"),
    case("/predict", {"context": 1, "query": "q"}, param="context", says="context must be"),
    case(COMPLETIONS, {"prompt": "hi"}, headers={"Content-Type": "application/json"},
         status=401, says="missing API key"),
    case(COMPLETIONS, {"prompt": "hi"},
         headers={"Content-Type": "application/json", "Authorization": "Bearer wrong"},
         status=401, says="invalid API key"),
    case("/predict", {"context": "c", "query": "q"},
         headers={"Content-Type": "application/json"}, status=401, says="missing API key"),
    case("/nowhere", {}, status=404, says="Not Found"),
]


@pytest.mark.parametrize("path,content,headers,status,param,says", CASES)
def test_bad_input_gets_a_clear_error(server, path, content, headers, status, param, says):
    r = httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    assert says in error["message"], error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_bad_inputs_do_not_disturb_a_running_request(server, client):
    """A stream runs while every bad input above is sent; it finishes whole."""
    body = dict(prompt="undisturbed", max_tokens=80, temperature=0, ignore_eos=True)
    reference = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    result = {}

    def stream():
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        result["text"] = "".join(c["choices"][0]["text"] for c in chunks)

    thread = threading.Thread(target=stream)
    thread.start()
    for p in CASES:
        path, content, headers, status, *_ = p.values
        assert httpx.post(f"{server.url}{path}", content=content, headers=headers,
                          timeout=30).status_code == status
    thread.join(60)
    assert result["text"] == reference


def test_health_and_metrics_need_no_api_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
