"""A serving group that loses a host (serving.hosts): two processes (jax.distributed over
localhost, gloo), one killed (SIGKILL: sockets closed) or hung (SIGSTOP: sockets open,
silent; found by the heartbeat's limit, 10 s by default) with a request in flight.
Targets (docs/sharding.md): a lost follower -> /health 503 and the request answered with
an error within 15 s, process 0 exited non-zero within 30 s; a lost process 0 -> the
follower exits non-zero within 30 s; steps longer than the limit are never a lost host.
Slow tier."""

import json
import signal
import threading
import time

import httpx
import pytest

from serving.hosts import EXIT_CODE
from tests.sharding.serving_group import Group, kill_timeline


def _show(timeline):
    print(json.dumps({k: v for k, v in timeline.items() if k != "logs"}))


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_follower_fails_its_requests_and_ends_the_group(tmp_path, how):
    t = kill_timeline(tmp_path, victim=1, how=how, observe_s=45)
    _show(t)
    outcome, answered = t["stream"]
    assert outcome.startswith("error: a host of the serving group was lost (process 1"), t
    assert answered <= 15, t
    at, status, body = t["health"]
    assert status == 503 and body["status"] == "host_lost" and at <= 15, t
    assert "process 1" in body["error"]
    assert t["new_request"][1] == 503, t  # refused, not queued
    if how == signal.SIGKILL:
        assert t["exits"][1][1] == -signal.SIGKILL
    assert t["exits"][0][1] == EXIT_CODE and t["exits"][0][0] <= 30, t
    assert "lost process 1" in t["logs"]


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_process_zero_ends_every_follower(tmp_path, how):
    t = kill_timeline(tmp_path, victim=0, how=how, observe_s=45)
    _show(t)
    when, code = t["exits"][1]
    assert code != 0 and when <= 30, t


@pytest.mark.slow
def test_steps_longer_than_the_limit_are_not_a_lost_host(tmp_path):
    # Each prefill chunk (64 tokens) sleeps 3 s on both processes; the limit is 1 s.
    group = Group(tmp_path, module="tests.sharding.slow_serving", module_args=["3"],
                  host_timeout_s=1.0, prefill_chunk=64)
    try:
        group.wait_healthy(300)
        health, done = [], []

        def ask():
            body = dict(prompt=list(range(1, 151)), max_tokens=4, temperature=0,
                        ignore_eos=True)
            r = httpx.post(f"{group.url}/v1/completions", json=body, headers=group.headers(),
                           timeout=120)
            done.append((r.status_code, time.monotonic() - t0))

        t0 = time.monotonic()
        thread = threading.Thread(target=ask, daemon=True)
        thread.start()
        while thread.is_alive():
            health.append(httpx.get(f"{group.url}/health", timeout=5).status_code)
            time.sleep(0.5)
        status, seconds = done[0]
        assert status == 200 and seconds >= 3 * 3, (done, group.output())
        assert set(health) == {200}, health
        assert all(p.poll() is None for p in group.procs)
        group.procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in group.procs]
        assert codes == [0, 0], group.output()
        assert "lost process" not in group.output(tail=100_000)
    finally:
        group.close()
