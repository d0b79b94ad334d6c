"""Sharded serving, run in a subprocess with fake CPU devices (XLA_FLAGS set by the caller
before JAX starts); prints one RESULT JSON line. Modes:

    python -m tests.sharding.serving_worker mesh MESH
        one process: a single-device server and a server on MESH (in-process, HTTP on
        loopback ports), the same requests to both -> what each answered
"""

import json
import sys
import threading

import httpx
import numpy as np

MAX_TOKENS = 6
# Prompts as token ids (bytes of the tiny model's ByteTokenizer). B repeats A's first 128
# tokens (two 64-token cache blocks: a prefix-cache hit); C and D run together (batched
# decode in the 2 slots).
_rng = np.random.default_rng(3)
PROMPT_A = _rng.integers(1, 256, 150).tolist()
PROMPT_B = PROMPT_A[:128] + _rng.integers(1, 256, 40).tolist()
PROMPT_C = _rng.integers(1, 256, 90).tolist()
PROMPT_D = _rng.integers(1, 256, 30).tolist()


def generate_direct(service, prompts, max_tokens=MAX_TOKENS):
    """Submits every prompt to the scheduler at once (they decode together) -> per prompt
    {"tokens": generated ids, "cache_hit_tokens": n}. Greedy."""
    from serving.scheduler import Request

    done = {i: threading.Event() for i in range(len(prompts))}
    requests = [Request(id=f"direct-{i}", prompt=np.asarray(p, np.int32),
                        max_tokens=max_tokens,
                        deliver=lambda e, i=i: e.kind in ("done", "error") and done[i].set())
                for i, p in enumerate(prompts)]
    for r in requests:
        service.scheduler.submit(r)
    for i in done:
        assert done[i].wait(120), f"request {i} did not finish"
    return [{"tokens": list(r.generated), "cache_hit_tokens": r.cache_hit_tokens,
             "finish_reason": r.finish_reason} for r in requests]


def http_requests(url, api_key):
    """One greedy completion, one streaming completion and one that hits the prefix cache,
    over HTTP -> their texts, cached tokens and streamed text."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = dict(prompt=PROMPT_A, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    out = {}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        plain = client.post("/v1/completions", json=body).json()
        out["plain_text"] = plain["choices"][0]["text"]
        out["plain_usage"] = plain["usage"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            texts = []
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[len("data: "):])["choices"]
                    texts += [c["text"] for c in choices if c.get("text")]
        out["stream_text"] = "".join(texts)
        hit = client.post("/v1/completions", json={**body, "prompt": PROMPT_B}).json()
        out["hit_text"] = hit["choices"][0]["text"]
        out["hit_cached"] = hit["usage"]["prompt_tokens_details"]["cached_tokens"]
    return out


def serve_and_ask(mesh):
    """A Service (tiny model, tests/serving's config) on `mesh` behind a loopback server ->
    what it answered: HTTP requests, then a direct batch of two concurrent requests."""
    from serving.service import Service
    from tests.serving.conftest import API_KEY, RunningServer, test_config, tiny_loaded

    service = Service(test_config(), loader=tiny_loaded, mesh=mesh)
    running = RunningServer(service)
    service.start()
    assert service.wait_ready(300), service.error
    try:
        out = http_requests(running.url, API_KEY)
        out["direct"] = generate_direct(service, [PROMPT_C, PROMPT_D, PROMPT_A])
        if mesh is not None:  # one device serves from the paged cache (cache_layout auto)
            out["slot_k_sharding"] = str(getattr(service.engine.slots[0].k.sharding, "spec",
                                                 None))
    finally:
        running.stop()
    return out


def mesh(mesh_text):
    from model.sharding import make_mesh

    single = serve_and_ask(None)
    sharded = serve_and_ask(make_mesh(mesh_text))
    return {"single": single, "sharded": sharded}


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    result = {"mesh": mesh}[mode](*args)
    print("RESULT " + json.dumps(result), flush=True)
