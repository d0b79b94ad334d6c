"""A two-process serving group (jax.distributed over localhost, gloo CPU collectives) for
the slow tier: process 0 serves HTTP, process 1 follows. `kill_timeline` kills one process
with a request in flight and records, in seconds after the kill, what clients and the
operator see."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import yaml

from tests.helpers import free_port
from tests.sharding.serving_worker import PROMPT_A

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESH = "sequence=2,tensor=2"  # tiny preset: 4 heads, 2 kv heads, d_ff 128
CONFIG_KEYS = ("model", "max_context", "decode_slots", "queue_size", "cache_block_tokens",
               "api_key", "batching_window_ms", "warmup_max_context", "request_timeout_s")


def env(devices):
    out = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    out.pop("DOSA_API_KEY", None)
    return out


class Group:
    """Both processes of `python -m serving` on MESH (or `module` with `module_args` in
    front of serving's flags: tests.sharding.slow_serving), logs under `folder`."""

    def __init__(self, folder, *, module="serving", module_args=(), **config):
        from tests.serving.conftest import test_config

        cfg = test_config()
        path = folder / "serving.yaml"
        path.write_text(yaml.safe_dump({**{k: getattr(cfg, k) for k in CONFIG_KEYS},
                                        "heartbeat_port": free_port(), **config}))
        self.api_key = cfg.api_key
        self.port, self.address = free_port(), f"localhost:{free_port()}"
        self.url = f"http://127.0.0.1:{self.port}"
        variables = env(2)
        variables["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # two writers of one cache entry
        self.logs = [folder / f"process{i}.log" for i in range(2)]
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", module, *module_args, "--config", str(path), "--port",
             str(self.port), "--mesh", MESH, "--coordinator-address", self.address,
             "--num-processes", "2", "--process-id", str(i)],
            cwd=ROOT, env=variables, stdout=log.open("w"), stderr=subprocess.STDOUT)
            for i, log in enumerate(self.logs)]

    def wait_healthy(self, timeout=240):
        from tests.serving.conftest import wait_healthy

        wait_healthy(self.url, self.procs, timeout, output=self.output)

    def output(self, tail=3000):
        return "\n".join(f"--- process {i}\n{log.read_text()[-tail:]}"
                         for i, log in enumerate(self.logs))

    def headers(self):
        return {"Authorization": f"Bearer {self.api_key}"}

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(30)


class Stream:
    """A streaming completion on its own thread: `first` is set at its first token;
    `outcome` says how it ended ("done", "error: <message>" from an in-stream error chunk,
    "status <code>", "transport: <exception>") and `ended` when (time.monotonic())."""

    def __init__(self, group, *, prompt=PROMPT_A, max_tokens=300):
        self.first, self.finished = threading.Event(), threading.Event()
        self.outcome = self.ended = None
        self.tokens = 0
        body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                    stream=True)
        self._thread = threading.Thread(target=self._run, args=(group, body), daemon=True)
        self._thread.start()

    def _run(self, group, body):
        try:
            with httpx.Client(base_url=group.url, headers=group.headers(), timeout=120) as c, \
                    c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    self.outcome = f"status {r.status_code}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[len("data: "):])
                    if "error" in data:
                        self.outcome = f"error: {data['error']['message']}"
                        return
                    if any(ch.get("text") for ch in data.get("choices", [])):
                        self.tokens += 1
                        self.first.set()
                self.outcome = "done"
        except Exception as e:  # noqa: BLE001 - what the client saw is the result
            self.outcome = f"transport: {type(e).__name__}: {e}"
        finally:
            self.ended = time.monotonic()
            self.first.set()
            self.finished.set()


def kill_timeline(folder, victim, *, how=signal.SIGKILL, observe_s=60.0, **config):
    """Starts a group, streams a long completion, sends `how` to process `victim` after its
    first token (SIGKILL: a dead process, its sockets closed by the kernel; SIGSTOP: a hung
    host, sockets open and silent), then watches for `observe_s` s (or until every other
    process exited) -> dict of what
    happened, times in s after the kill: health (first non-200 answer: time, status, body),
    stream (outcome, time), new_request (status and body of a completion sent once health
    turned), exits ({process: [time, code]}), and the processes' log tails."""
    group = Group(folder, **config)
    try:
        group.wait_healthy()
        stream = Stream(group)
        assert stream.first.wait(120), group.output()
        assert stream.outcome is None, f"the request ended before the kill: {stream.outcome}"
        tokens_before = stream.tokens
        t0 = time.monotonic()
        group.procs[victim].send_signal(how)
        out = dict(victim=victim, signal=signal.Signals(how).name,
                   tokens_before_kill=tokens_before, health=None,
                   new_request=None, exits={})
        while time.monotonic() - t0 < observe_s:
            now = time.monotonic() - t0
            for i, p in enumerate(group.procs):
                if p.poll() is not None and i not in out["exits"]:
                    out["exits"][i] = [round(now, 2), p.returncode]
            others = set(range(len(group.procs))) - ({victim} if how == signal.SIGSTOP else set())
            if others <= set(out["exits"]) and stream.finished.is_set():
                break
            if out["health"] is None and 0 not in out["exits"]:
                try:
                    r = httpx.get(f"{group.url}/health", timeout=1)
                    if r.status_code != 200:
                        out["health"] = [round(now, 2), r.status_code, r.json()]
                except httpx.TransportError as e:
                    out["health"] = [round(now, 2), None, f"{type(e).__name__}"]
            if out["health"] is not None and out["new_request"] is None \
                    and 0 not in out["exits"]:
                try:
                    r = httpx.post(f"{group.url}/v1/completions", headers=group.headers(),
                                   json=dict(prompt=[1, 2, 3], max_tokens=2), timeout=5)
                    out["new_request"] = [round(time.monotonic() - t0, 2), r.status_code,
                                          r.text[:300]]
                except httpx.TransportError as e:
                    out["new_request"] = [round(time.monotonic() - t0, 2), None,
                                          type(e).__name__]
            time.sleep(0.1)
        out["stream"] = [stream.outcome,
                         None if stream.ended is None else round(stream.ended - t0, 2)]
        out["logs"] = group.output(tail=1500)
        return out
    finally:
        for p in group.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        group.close()


if __name__ == "__main__":  # python -m tests.sharding.serving_group VICTIM OBSERVE_S FOLDER
    victim, observe_s, folder = int(sys.argv[1]), float(sys.argv[2]), pathlib.Path(sys.argv[3])
    folder.mkdir(parents=True, exist_ok=True)
    result = kill_timeline(folder, victim, observe_s=observe_s)
    logs = result.pop("logs")
    print(json.dumps(result, indent=1))
    print(logs)
