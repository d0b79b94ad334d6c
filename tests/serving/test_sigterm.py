"""`python -m serving` as a subprocess (tiny model): SIGTERM drains it - the request in flight
finishes whole, new ones and /health get 503, then the process exits with status 0."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers import free_port
from tests.serving.conftest import wait_healthy

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow  # default-tier time budget; runs in CI's slow tier
def test_sigterm_drains_then_exits(tmp_path):
    config = tmp_path / "serving.yaml"
    config.write_text("max_context: 512\ndecode_slots: 2\nqueue_size: 4\n"
                      "cache_block_tokens: 64\nwarmup_max_context: 256\n")
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "true",
           "JAX_COMPILATION_CACHE_DIR": str(REPO / ".jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.pop("DOSA_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--config", str(config),
                             "--model", "tiny", "--port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc], 120, output=proc.stdout.read)
        first_chunk, result = threading.Event(), {}

        def stream():
            body = dict(prompt="drain me", max_tokens=300, ignore_eos=True, stream=True)
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first_chunk.set()
            result["lines"] = lines

        thread = threading.Thread(target=stream)
        thread.start()
        assert first_chunk.wait(30)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health", timeout=2).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "late"}, timeout=10)
        assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
        thread.join(60)
        lines = result["lines"]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
        log = proc.stdout.read()
        assert "draining" in log and "tokens_out=300 status=200" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
