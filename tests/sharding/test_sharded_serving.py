"""Sharded serving (serving.engine on a mesh, serving.follower): a server on a mesh answers
what the single-device server answers, on one process with fake devices and on two
processes (jax.distributed over localhost, gloo CPU collectives) where process 0 serves
HTTP and process 1 replays its engine steps. Slow tier: subprocesses with fake devices."""

import json
import signal
import subprocess
import sys

import pytest

from tests.sharding.serving_group import MESH, ROOT, Group, env
from tests.sharding.serving_worker import PROMPT_A, PROMPT_B, http_requests


@pytest.mark.slow
def test_one_process_mesh_server_equals_one_device():
    proc = subprocess.run([sys.executable, "-m", "tests.sharding.serving_worker", "mesh", MESH],
                          cwd=ROOT, env=env(4), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    r = json.loads(line[len("RESULT "):])
    single, sharded = r["single"], r["sharded"]
    # The slot caches really are split as the rules say (batch, the stack's layers,
    # positions, kv heads).
    assert sharded["slot_k_sharding"] == "P(None, None, 'sequence', 'tensor')"
    assert single["hit_cached"] == sharded["hit_cached"] == 128  # two 64-token blocks
    for key in ("plain_text", "plain_usage", "stream_text", "hit_text"):
        assert sharded[key] == single[key], key
    assert sharded["plain_text"] == sharded["stream_text"]
    # Token ids: two requests decoded together, then one hitting the prefix cache.
    assert [d["cache_hit_tokens"] for d in sharded["direct"]] == [0, 0, 128]
    assert all(len(d["tokens"]) == 6 for d in sharded["direct"])
    assert sharded["direct"] == single["direct"]


def _reference():
    """The single-device server's answers (in this process, on its one device)."""
    from serving.service import Service
    from tests.serving.conftest import API_KEY, RunningServer, test_config, tiny_loaded

    service = Service(test_config(), loader=tiny_loaded)
    running = RunningServer(service)
    service.start()
    assert service.wait_ready(120), service.error
    try:
        return http_requests(running.url, API_KEY)
    finally:
        running.stop()


@pytest.mark.slow
def test_two_processes_serve_like_one_device(tmp_path):
    group = Group(tmp_path)
    try:
        expected = _reference()  # while the two processes load and warm up
        group.wait_healthy(240)
        got = http_requests(group.url, group.api_key)
        group.procs[0].send_signal(signal.SIGTERM)  # drain, stop, tell the follower to stop
        codes = [p.wait(60) for p in group.procs]
    finally:
        group.close()
    assert codes == [0, 0], group.output()
    assert got == expected
    assert got["hit_cached"] == 128 and got["plain_text"] == got["stream_text"]
    follower_log = group.logs[1].read_text()
    assert "following process 0" in follower_log
    assert "shutdown from process 0 after" in follower_log
    assert "lost process" not in group.output(tail=100_000)  # a goodbye, not a loss
    assert len(PROMPT_A) == 150 and PROMPT_B[:128] == PROMPT_A[:128]


CANARY = {"indexer": "hierarchical", "candidate_tokens": 32, "share": 0.5,
          "model_version": "tiny-hier", "shadow_rate": 1.0}


def _sided_answers(url, api_key):
    """Greedy texts of PROMPT_A on each forced side, their fingerprints, and the canary's
    shadow recall sums per layer from /metrics."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"}
    out = {}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        for side in ("baseline", "canary"):
            r = client.post("/v1/completions", headers={"X-Dosa-Side": side},
                            json=dict(prompt=PROMPT_A, max_tokens=6, temperature=0,
                                      ignore_eos=True))
            out[side] = [r.status_code, r.headers.get("x-dosa-side"),
                         r.json()["system_fingerprint"], r.json()["choices"][0]["text"]]
        metrics = client.get("/metrics").text
    out["recall_sums"] = sorted(line for line in metrics.splitlines()
                                if line.startswith("dosa_selection_recall_sum"))
    return out


@pytest.mark.slow
def test_two_processes_serve_a_canary_like_one_device(tmp_path):
    """The leader's broadcast carries each call's variant and its shadow rows: the two
    processes answer each side as one device does, with the same shadow recall."""
    from serving.service import Service
    from tests.serving.conftest import API_KEY, RunningServer, test_config, tiny_loaded

    group = Group(tmp_path, canary=CANARY, shadow_max_seconds_per_s=1.0)
    try:
        service = Service(test_config(canary=CANARY, shadow_max_seconds_per_s=1.0),
                          loader=tiny_loaded)
        running = RunningServer(service)
        service.start()
        assert service.wait_ready(240), service.error
        try:
            expected = _sided_answers(running.url, API_KEY)
        finally:
            running.stop()
        group.wait_healthy(300)
        got = _sided_answers(group.url, group.api_key)
        group.procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in group.procs]
    finally:
        group.close()
    assert codes == [0, 0], group.output()
    assert got["baseline"][:3] == [200, "baseline", "dosa-baseline-dosa-tiny-untrained"]
    assert got["canary"][:3] == [200, "canary", "dosa-canary-tiny-hier"]
    assert got["baseline"] == expected["baseline"] and got["canary"] == expected["canary"]
    assert len(got["recall_sums"]) == 2  # layers 0 and 1 of the canary
    for a, b in zip(got["recall_sums"], expected["recall_sums"]):
        assert a.rsplit(" ", 1)[0] == b.rsplit(" ", 1)[0]
        assert abs(float(a.rsplit(" ", 1)[1]) - float(b.rsplit(" ", 1)[1])) < 1e-6
