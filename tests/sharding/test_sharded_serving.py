"""Sharded serving (serving.engine on a mesh, serving.follower): a server on a mesh answers
what the single-device server answers, on one process with fake devices and on two
processes (jax.distributed over localhost, gloo CPU collectives) where process 0 serves
HTTP and process 1 replays its engine steps. Slow tier: subprocesses with fake devices."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import yaml

from tests.sharding.serving_worker import PROMPT_A, PROMPT_B, http_requests
from tests.sharding.test_sharding import _free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESH = "sequence=2,tensor=2"  # tiny preset: 4 heads, 2 kv heads, d_ff 128


def _env(devices):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu"}
    env.pop("DOSA_API_KEY", None)
    return env


@pytest.mark.slow
def test_one_process_mesh_server_equals_one_device():
    proc = subprocess.run([sys.executable, "-m", "tests.sharding.serving_worker", "mesh", MESH],
                          cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    r = json.loads(line[len("RESULT "):])
    single, sharded = r["single"], r["sharded"]
    # The slot caches really are split as the rules say (batch, positions, kv heads).
    assert sharded["slot_k_sharding"] == "P(None, 'sequence', 'tensor')"
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
    from tests.serving.conftest import API_KEY, test_config, wait_healthy

    cfg = test_config()
    config = tmp_path / "serving.yaml"
    config.write_text(yaml.safe_dump(
        {k: getattr(cfg, k) for k in ("model", "max_context", "decode_slots", "queue_size",
                                      "cache_block_tokens", "api_key", "batching_window_ms",
                                      "warmup_max_context", "request_timeout_s")}))
    port, address = _free_port(), f"localhost:{_free_port()}"
    env = _env(2)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # two writers of one cache entry
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "serving", "--config", str(config), "--port", str(port),
         "--mesh", MESH, "--coordinator-address", address, "--num-processes", "2",
         "--process-id", str(i)], cwd=ROOT, env=env, stdout=log.open("w"),
        stderr=subprocess.STDOUT) for i, log in enumerate(logs)]
    try:
        expected = _reference()  # while the two processes load and warm up
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs, 240, output=lambda: logs[0].read_text()[-4000:])
        got = http_requests(url, API_KEY)
        procs[0].send_signal(signal.SIGTERM)  # drain, stop, tell the follower to stop
        codes = [p.wait(60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], [log.read_text()[-3000:] for log in logs]
    assert got == expected
    assert got["hit_cached"] == 128 and got["plain_text"] == got["stream_text"]
    follower_log = logs[1].read_text()
    assert "following process 0" in follower_log
    assert "shutdown from process 0 after" in follower_log
    assert len(PROMPT_A) == 150 and PROMPT_B[:128] == PROMPT_A[:128]
