"""A real server on a loopback port, running the tiny model (random weights) in-process."""

import socket
import threading
import time

import httpx
import pytest

from serving.config import ServingConfig
from serving.server import make_server
from serving.service import Service

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def wait_healthy(url, procs, timeout, output=lambda: ""):
    """Polls url/health until 200; AssertionError when one of the server processes `procs`
    exits or `timeout` s pass (with output(): what the servers printed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"a server process exited:\n{output()}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the server did not become ready in {timeout} s:\n{output()}")


def tiny_loaded():
    import flax.nnx as nnx

    import model
    from model.pretrained import ByteTokenizer
    from serving.loading import LoadedModel

    net = model.Transformer(model.get_config("tiny"), rngs=nnx.Rngs(0))
    return LoadedModel(net, ByteTokenizer(), "dosa-tiny-untrained", "tiny, random weights")


class RunningServer:
    """A DrainingServer on 127.0.0.1:<free port> in a thread; `url`, `service`, `stop()`."""

    def __init__(self, service):
        self.service = service
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = make_server(service, host="127.0.0.1", port=0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.service.stop()


def test_config(**changes):
    values = dict(model="tiny", max_context=512, decode_slots=2, max_running=4, queue_size=2,
                  cache_block_tokens=64, api_key=API_KEY, batching_window_ms=0.0,
                  warmup_max_context=256, request_timeout_s=60.0)
    values.update(changes)
    return ServingConfig(**values)


test_config.__test__ = False  # a helper, not a test


@pytest.fixture(scope="session")
def server():
    """The shared server (admission limit 2, 2 decode slots, API key `test-key`). Its
    loader waits for a gate, so /health is seen answering 503 before the model is ready."""
    gate = threading.Event()

    def loader():
        gate.wait(30)
        return tiny_loaded()

    service = Service(test_config(), loader=loader)
    running = RunningServer(service)
    service.start()
    running.health_before_ready = httpx.get(f"{running.url}/health")
    gate.set()
    assert service.wait_ready(120), service.error
    yield running
    running.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c
