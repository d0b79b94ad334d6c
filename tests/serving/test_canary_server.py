"""A canary rollout end to end (slow tier: it starts a server): the tiny model (random
weights) served flat, with a hierarchical canary of a small budget over the same weights.
Both sides warm before ready; each response names its side; metrics carry each side's
model_version; the canary's shadow recall reaches /metrics; the prefix cache is per side;
the admin endpoint is authenticated, validated, and its changes during concurrent requests
lose none and leave none on a half-changed config."""

import asyncio
import json

import httpx
import pytest

from serving.service import Service
from tests.serving.conftest import AUTH, RunningServer, test_config, tiny_loaded

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serving-canary")]

BASE, CANARY = "dosa-tiny-untrained", "tiny-hier"
PROMPT = "".join(chr(97 + (i * 11) % 26) for i in range(200))


def metric_value(text, name, **labels):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


@pytest.fixture(scope="module")
def canary_server():
    config = test_config(queue_size=64, canary={
        "indexer": "hierarchical", "candidate_tokens": 32, "share": 0.5,
        "model_version": CANARY, "shadow_rate": 1.0}, shadow_max_seconds_per_s=1.0)
    service = Service(config, loader=tiny_loaded)
    running = RunningServer(service)
    service.start()
    assert service.wait_ready(300), service.error
    yield running
    running.stop()


@pytest.fixture
def client(canary_server):
    with httpx.Client(base_url=canary_server.url, headers=AUTH, timeout=120) as c:
        yield c


def complete(client, side=None, **body):
    headers = {"X-Dosa-Side": side} if side else {}
    r = client.post("/v1/completions", headers=headers,
                    json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                          "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r


def test_forced_sides_answer_with_their_side_metrics_and_own_cache(canary_server, client):
    base, canary = complete(client, "baseline"), complete(client, "canary")
    assert base.headers["x-dosa-side"] == "baseline"
    assert canary.headers["x-dosa-side"] == "canary"
    assert base.json()["system_fingerprint"] == f"dosa-baseline-{BASE}"
    assert canary.json()["system_fingerprint"] == f"dosa-canary-{CANARY}"
    assert base.json()["choices"][0]["text"] != canary.json()["choices"][0]["text"]
    # The prefix cache is per side: the canary's first sight of a prompt is a miss.
    assert complete(client, "baseline").json()["usage"]["prompt_tokens_details"][
        "cached_tokens"] == 192
    assert complete(client, "canary").json()["usage"]["prompt_tokens_details"][
        "cached_tokens"] == 192
    fresh = PROMPT[::-1]
    complete(client, "baseline", prompt=fresh)
    assert complete(client, "canary", prompt=fresh).json()["usage"][
        "prompt_tokens_details"]["cached_tokens"] == 0
    text = httpx.get(f"{canary_server.url}/metrics").text
    for version in (BASE, CANARY):
        assert metric_value(text, "dosa_time_to_first_token_seconds_count",
                            model_version=version) >= 3
    assert metric_value(text, "dosa_selection_recall_count", model_version=CANARY) > 0
    assert metric_value(text, "dosa_selection_recall_count", model_version=BASE) == 0
    assert metric_value(text, "dosa_shadow_rows_total", model_version=CANARY) > 0
    assert metric_value(text, "dosa_shadow_seconds_total", model_version=CANARY) > 0
    assert metric_value(text, "dosa_prefill_seconds_total", model_version=CANARY) > 0
    r = client.post("/v1/completions", headers={"X-Dosa-Side": "sideways"},
                    json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Dosa-Side"
    with client.stream("POST", "/v1/completions", headers={"X-Dosa-Side": "canary"},
                       json={"prompt": "hi", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["x-dosa-side"] == "canary"
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert {c["system_fingerprint"] for c in chunks} == {f"dosa-canary-{CANARY}"}


def test_admin_endpoint_is_authenticated_and_validated(canary_server, client):
    assert httpx.get(f"{canary_server.url}/admin/rollout").status_code == 401
    body = client.get("/admin/rollout").json()
    assert body["baseline"]["model_version"] == BASE and body["share"] == 0.5
    assert body["canary"]["selection"]["indexer"] == "hierarchical"
    assert body["canary"]["recent_recall"] is not None and body["persisted"] is False
    for bad, words in [({"action": "demote"}, "action"),
                       ({"action": "set_share"}, "set_share needs a share"),
                       ({"action": "set_share", "share": 2}, "share"),
                       ({"action": "promote", "extra": 1}, "extra")]:
        r = client.post("/admin/rollout", json=bad)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (bad, r.text)


def test_promote_and_rollback_under_load_lose_nothing_and_split_nothing(canary_server,
                                                                        client):
    reference = {f"dosa-{side}-{version}": complete(client, side).json()["choices"][0]["text"]
                 for side, version in (("baseline", BASE), ("canary", CANARY))}
    # After a promote the sides swap configs: a side's text follows its model_version.
    by_version = {BASE: reference[f"dosa-baseline-{BASE}"],
                  CANARY: reference[f"dosa-canary-{CANARY}"]}
    before = httpx.get(f"{canary_server.url}/metrics").text

    async def run():
        async with httpx.AsyncClient(base_url=canary_server.url, headers=AUTH,
                                     timeout=120) as c:
            async def one(i):
                await asyncio.sleep(0.02 * i)
                return await c.post("/v1/completions", headers={"X-Request-Id": f"load-{i}"},
                                    json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                          "ignore_eos": True})

            async def changes():
                out = []
                for action, share in [("promote", None), ("rollback", None),
                                      ("set_share", 0.5), ("promote", None),
                                      ("rollback", None), ("set_share", 0.5)]:
                    await asyncio.sleep(0.1)
                    body = {"action": action} | ({"share": share} if share else {})
                    out.append(await c.post("/admin/rollout", json=body))
                return out

            return await asyncio.gather(changes(), *(one(i) for i in range(30)))

    changes, *responses = asyncio.run(run())
    assert [r.status_code for r in changes] == [200] * 6
    assert [r.status_code for r in responses] == [200] * 30
    versions = set()
    for r in responses:
        body = r.json()
        side, version = body["system_fingerprint"].split("-", 2)[1:]
        assert r.headers["x-dosa-side"] == side
        assert body["choices"][0]["text"] == by_version[version], body["system_fingerprint"]
        assert body["usage"]["completion_tokens"] == 8
        versions.add(version)
    assert versions == {BASE, CANARY}
    after = httpx.get(f"{canary_server.url}/metrics").text
    for action, n in (("promote", 2), ("rollback", 2), ("set_share", 2)):
        assert metric_value(after, "dosa_rollout_changes_total", action=action) - \
            metric_value(before, "dosa_rollout_changes_total", action=action) == n


class _AddedMaps:
    """A memory-map cap of `cap` over the mappings added since it was made (what a process
    that starts near its cap would see): the warm-up runs out of room and the programs are
    dropped while serving, within a test's time."""

    def __init__(self, cap):
        from serving.program_maps import map_usage

        self.cap, self.base = cap, map_usage()[0]

    def __call__(self):
        from serving.program_maps import map_usage

        return max(0, map_usage()[0] - self.base), self.cap


def test_a_canary_under_a_tight_map_cap_warms_what_fits_drops_programs_and_answers_alike(
        canary_server, client, monkeypatch):
    """The mend of a server that died of its own config (a canary with shadow recall held
    64,447 memory mappings at warm-up, past the kernel's 65,530): with a cap it cannot warm
    everything under, the warm-up stops at its share, the programs are dropped between turns
    once past the drop share, and every answer equals the unlimited server's."""
    from serving import program_maps

    prompts = [PROMPT[:40], PROMPT[:150], PROMPT * 2]
    want = {(side, p): complete(client, side, prompt=p).json()["choices"][0]["text"]
            for side in ("baseline", "canary") for p in prompts}
    tight = program_maps.MapBudget(usage=_AddedMaps(cap=3000))
    monkeypatch.setattr(program_maps, "_BUDGET", [tight])
    # Room for 1024 positions: programs of their own (the fixture's are compiled already).
    config = test_config(queue_size=64, max_context=1024, canary={
        "indexer": "hierarchical", "candidate_tokens": 32, "share": 0.5,
        "model_version": CANARY, "shadow_rate": 1.0}, shadow_max_seconds_per_s=1.0,
        warmup_max_context=1024)
    service = Service(config, loader=tiny_loaded)
    running = RunningServer(service)
    service.start()
    try:
        assert service.wait_ready(300), service.error
        with httpx.Client(base_url=running.url, headers=AUTH, timeout=120) as c:
            for _ in range(2):
                for (side, p), text in want.items():
                    assert complete(c, side, prompt=p).json()["choices"][0]["text"] == text
            metrics = httpx.get(f"{running.url}/metrics").text
            assert httpx.get(f"{running.url}/health").status_code == 200
        assert tight.drops >= 1  # (the scrape may precede the last turn's check)
        assert 1 <= metric_value(metrics, "dosa_compiled_program_drops_total") <= tight.drops
        assert metric_value(metrics, "dosa_memory_maps", kind="cap") == 3000
    finally:
        running.stop()
