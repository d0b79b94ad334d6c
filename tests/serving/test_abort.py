"""The anchors' reliability check: 200 requests whose clients hang up once the server has
admitted them, then a new request succeeds within 5 s (a disconnect must cancel its work).

The clients hang up when the server says all 200 are admitted (not after a fixed client
deadline): on a loaded 2-core machine a fixed deadline can expire before a request even
reaches the server, and then nothing is tested.
"""

import asyncio
import time

import httpx
import pytest

from serving.service import Service
from tests.serving.conftest import AUTH, RunningServer, test_config, tiny_loaded

N_REQUESTS = 200
MAX_TOKENS = 480  # the tiny server's context is 512 tokens


@pytest.mark.slow
def test_200_aborted_requests_then_a_new_one_succeeds_within_5_s():
    service = Service(test_config(queue_size=256, decode_slots=4), loader=tiny_loaded)
    running = RunningServer(service)
    service.start()
    try:
        assert service.wait_ready(120), service.error

        async def abort_all():
            async with httpx.AsyncClient(base_url=running.url, headers=AUTH,
                                         timeout=httpx.Timeout(60),
                                         limits=httpx.Limits(max_connections=300)) as c:
                tasks = [asyncio.create_task(c.post("/v1/completions", json=dict(
                    prompt=f"abort {i}", max_tokens=MAX_TOKENS, ignore_eos=True,
                    stream=bool(i % 2)))) for i in range(N_REQUESTS)]
                deadline = time.monotonic() + 60
                while service.active < N_REQUESTS and not any(t.done() for t in tasks):
                    assert time.monotonic() < deadline, f"{service.active} admitted"
                    await asyncio.sleep(0.01)
                admitted = service.active
                for t in tasks:  # hang up: cancelling the call closes its connection
                    t.cancel()
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                return admitted, outcomes

        admitted, outcomes = asyncio.run(abort_all())
        # All were in the server, none had finished, when their clients hung up.
        assert admitted == N_REQUESTS
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
        start = time.monotonic()
        r = httpx.post(f"{running.url}/v1/completions", headers=AUTH,
                       json=dict(prompt="after the storm", max_tokens=8, ignore_eos=True),
                       timeout=5)
        assert r.status_code == 200 and time.monotonic() - start < 5
        assert r.json()["usage"]["completion_tokens"] == 8
        deadline = time.monotonic() + 10
        while service.active or service.scheduler.counts() != (0, 0):
            assert time.monotonic() < deadline, "aborted requests kept running"
            time.sleep(0.05)
        # By id, not by position: the new request may finish while the engine is still
        # dropping aborted ones (a non-streaming request's disconnect is polled).
        finished = {rid: (reason, tokens) for rid, reason, tokens
                    in service.scheduler.finished_log}
        assert finished.pop(r.json()["id"]) == ("length", 8)
        aborted = [(rid, *rest) for rid, rest in finished.items()]
        # Every aborted request reached the engine and was stopped there: none ran to its
        # max_tokens, all ended "cancelled" (the engine saw the disconnect).
        assert len(aborted) == N_REQUESTS
        assert all(reason == "cancelled" and tokens < MAX_TOKENS
                   for _, reason, tokens in aborted), aborted
        metrics = httpx.get(f"{running.url}/metrics").text
        assert 'dosa_request_errors_total{model_version="dosa-tiny-untrained",status="499"} ' \
               f'{N_REQUESTS}.0' in metrics
    finally:
        running.stop()
