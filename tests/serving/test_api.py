"""The HTTP API end to end: a real server on a loopback port (tiny model, random weights)."""

import asyncio
import json
import time

import httpx
import pytest

from tests.serving.conftest import AUTH

# One worker runs every test of the shared server (tests/serving/conftest.py), so it
# starts once (pyproject: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("serving-server")

MODEL = "dosa-tiny-untrained"


def sse_events(lines):
    """The JSON payloads of an SSE stream, and whether it ended with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
        else:
            assert not done, "data after [DONE]"
            events.append(json.loads(data))
    return events, done


def metric_value(text, name, **labels):
    """The value of one sample of a Prometheus exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                return float(value)
    return 0.0


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_health_answers_503_while_loading_then_200(server, client):
    before = server.health_before_ready
    assert before.status_code == 503 and before.json()["status"] == "loading"
    after = client.get("/health")
    assert after.status_code == 200 and after.json()["status"] == "ready"


def test_streamed_completion_matches_the_non_streamed_one(client):
    body = dict(prompt="The quick brown fox", max_tokens=12, temperature=0, ignore_eos=True)
    plain = client.post("/v1/completions", json=body).json()
    with client.stream("POST", "/v1/completions",
                       json={**body, "stream": True,
                             "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events, done = sse_events(response.iter_lines())
    assert done
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert "".join(texts) == plain["choices"][0]["text"]
    assert texts[0], "the first chunk carries generated text (no empty chunk before prefill)"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    usage = events[-1]["usage"]
    assert usage == plain["usage"] or usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] == len("The quick brown fox") + 1  # bytes + BOS
    assert plain["usage"]["completion_tokens"] == 12 and plain["model"] == MODEL


def test_metrics_names_and_ttft_counts_the_request(client):
    names = ["dosa_time_to_first_token_seconds", "dosa_inter_token_latency_seconds",
             "dosa_e2e_request_latency_seconds", "dosa_request_queue_time_seconds",
             "dosa_request_prefill_time_seconds", "dosa_indexer_prefill_share",
             "dosa_prefix_cache_hit_rate", "dosa_prefix_cache_queries_total",
             "dosa_prefix_cache_hits_total", "dosa_num_requests_running",
             "dosa_num_requests_waiting", "dosa_request_errors_total",
             "dosa_prefix_cache_bytes_per_token"]
    count = "dosa_time_to_first_token_seconds_count"
    labels = dict(model_version=MODEL, indexer="flat", context_bucket="256")
    before = metric_value(httpx.get(f"{client.base_url}/metrics").text, count, **labels)
    r = client.post("/v1/completions", json=dict(prompt="count me", max_tokens=2))
    assert r.status_code == 200
    text = httpx.get(f"{client.base_url}/metrics").text  # open: no API key needed
    for name in names:
        assert f"# TYPE {name}" in text or f"# HELP {name} " in text, name
    assert metric_value(text, count, **labels) == before + 1
    assert 'le="160.0"' in text
    share = metric_value(text, "dosa_indexer_prefill_share", model_version=MODEL)
    assert 0.0 < share < 1.0


def test_ttft_counts_a_request_whose_first_token_is_a_stop_token(server, client, monkeypatch):
    # Every token stops: the answer (empty, finish_reason "stop") is ready at the first token.
    tokenizer = server.service.loaded.tokenizer
    monkeypatch.setattr(tokenizer, "stop_ids", frozenset(range(tokenizer.vocab_size)))
    count = "dosa_time_to_first_token_seconds_count"
    labels = dict(model_version=MODEL, indexer="flat", context_bucket="256")
    before = metric_value(httpx.get(f"{client.base_url}/metrics").text, count, **labels)
    r = client.post("/v1/completions", json=dict(prompt="stop at once", max_tokens=4))
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["text"] == ""
    text = httpx.get(f"{client.base_url}/metrics").text
    assert metric_value(text, count, **labels) == before + 1


def test_predict_returns_a_greedy_answer_and_its_ttft(client):
    r = client.post("/predict", json=dict(context="some context", query="a question?",
                                          max_tokens=5))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["ttft_ms"] > 0 and body["completion_tokens"] <= 5
    again = client.post("/predict", json=dict(context="some context", query="a question?",
                                              max_tokens=5)).json()
    assert again["answer"] == body["answer"]  # greedy
    assert body["prompt_tokens"] == len("some context\na question?") + 1


def test_models_lists_the_served_model(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL] and data[0]["max_model_len"] == 512


def test_repeated_prefix_hits_the_cache_and_gives_the_same_output(client):
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(200))  # 200 bytes + BOS
    body = dict(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)
    metrics = lambda: httpx.get(f"{client.base_url}/metrics").text
    hits_before = metric_value(metrics(), "dosa_prefix_cache_hits_total")
    cold = client.post("/v1/completions", json=body).json()
    warm = client.post("/v1/completions", json=body).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Full blocks of 64 tokens, leaving at least the last token to prefill: 3 blocks.
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert metric_value(metrics(), "dosa_prefix_cache_hits_total") == hits_before + 192
    # A prompt sharing only the first 100 tokens reuses the first block only.
    other = client.post("/v1/completions", json={**body, "prompt": prompt[:100] + "x" * 50})
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_admission_limit_2_serves_2_of_10_concurrent_requests(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c:
            body = dict(prompt="hold a slot", max_tokens=150, ignore_eos=True)
            return await asyncio.gather(*(c.post("/v1/completions", json=body)
                                          for _ in range(10)))

    responses = asyncio.run(run())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 2 + [503] * 8
    rejected = next(r for r in responses if r.status_code == 503).json()["error"]
    assert "admission limit of 2" in rejected["message"] and rejected["code"] == 503
    assert all(r.json()["usage"]["completion_tokens"] == 150
               for r in responses if r.status_code == 200)


def test_client_disconnect_stops_the_work_and_frees_the_slot(server, client):
    service = server.service
    body = dict(prompt="a long answer", max_tokens=400, ignore_eos=True, stream=True)
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        rid = json.loads(first[len("data: "):])["id"]
    # Closed after one chunk: the worker drops the request at its next turn.
    finished = lambda: [f for f in service.scheduler.finished_log if f[0] == rid]
    assert wait_until(finished), "the request was never stopped"
    _, reason, tokens_out = finished()[0]
    assert reason == "cancelled" and tokens_out < 400
    assert wait_until(lambda: service.active == 0 and service.scheduler.counts() == (0, 0))
    r = client.post("/v1/completions", json=dict(prompt="next", max_tokens=3))
    assert r.status_code == 200


def test_timeout_stops_the_request_with_504(server):
    from serving.engine import Sampling
    from serving.scheduler import Request

    events = []
    request = Request(id="t", prompt=[1, 2, 3], max_tokens=400, deliver=events.append,
                      sampling=Sampling(), timeout_s=0.05)
    server.service.scheduler.submit(request)
    assert wait_until(lambda: events and events[-1].kind == "error")
    assert events[-1].status == 504 and len(request.generated) < 400


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_string_ends_the_text_before_it(client, as_list):
    body = dict(prompt="stop here", max_tokens=60, temperature=0, ignore_eos=True)
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    # A stop string taken from the greedy output itself, past its start.
    k = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[k:k + 2]
    r = client.post("/v1/completions",
                    json={**body, "stop": ["never-there", stop] if as_list else stop}).json()
    choice = r["choices"][0]
    assert choice["text"] == full[:full.find(stop)] and choice["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < 60


CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_renders_the_template_and_streams_role_with_the_first_text(server, client,
                                                                         monkeypatch):
    # The byte tokenizer has no template (400 in test_bad_input); give it one for this test.
    monkeypatch.setattr(server.service.loaded.tokenizer, "chat_template", CHATML)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    body = dict(messages=messages, max_tokens=10, temperature=0, ignore_eos=True)
    plain = client.post("/v1/chat/completions", json=body).json()
    rendered = "<|system|>be brief\n<|user|>hello\n<|assistant|>"
    assert plain["usage"]["prompt_tokens"] == len(rendered) + 1  # + BOS
    assert plain["object"] == "chat.completion"
    message = plain["choices"][0]["message"]
    assert message["role"] == "assistant"
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events, done = sse_events(r.iter_lines())
    assert done and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["choices"][0]["delta"]["content"]  # no role-only chunk before prefill
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == message["content"]
