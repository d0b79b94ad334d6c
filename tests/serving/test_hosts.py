"""The serving group's heartbeat (serving.hosts) over loopback sockets in one process, and
what a lost host does to the scheduler and the service: every admitted request answered
once with 503, nothing after it, new requests refused. The two-process kill tests are in
tests/sharding/test_host_loss.py (slow tier)."""

import socket
import struct
import threading
import time

import numpy as np
import pytest

from serving.hosts import HostLostError, HostMonitor, heartbeat_address
from serving.scheduler import Request, Scheduler
from serving.service import HOST_LOST, Service
from tests.helpers import free_port
from tests.serving.conftest import test_config
from tests.serving.test_scheduler import FakeEngine, collect

LIMIT = 0.3  # loss tests: how soon a silent peer is lost
HEALTHY_LIMIT = 1.0  # the no-loss test: room for a loaded machine's thread scheduling


class Losses:
    def __init__(self):
        self.seen, self.event = [], threading.Event()

    def __call__(self, process_id, reason):
        self.seen.append((process_id, reason, time.monotonic()))
        self.event.set()


def _leader(followers=1, limit=LIMIT):
    losses = Losses()
    port = free_port()
    monitor = HostMonitor.lead(("localhost", port), followers + 1, limit, on_lost=losses)
    return monitor, losses, ("localhost", port)


def _raw_follower(address, process_id=1):
    sock = socket.create_connection(address, timeout=5)
    sock.sendall(struct.pack("!i", process_id))
    return sock


def test_heartbeat_address_defaults_to_the_coordinator_port_plus_one():
    assert heartbeat_address("10.0.0.1:1234") == ("10.0.0.1", 1235)
    assert heartbeat_address("host:1234", 9000) == ("host", 9000)
    with pytest.raises(ValueError, match="host_timeout_s"):
        HostMonitor(0)


def test_a_taken_heartbeat_port_is_named():
    with socket.create_server(("", free_port())) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"heartbeat_port {port}: process 0 cannot listen"):
            HostMonitor.lead(("localhost", port), 2, LIMIT)


def test_a_healthy_group_is_never_lost_and_stops_with_a_goodbye():
    leader, leader_losses, address = _leader(limit=HEALTHY_LIMIT)
    follower_losses = Losses()
    follower = HostMonitor.follow(address, 1, HEALTHY_LIMIT, on_lost=follower_losses)
    time.sleep(2 * HEALTHY_LIMIT)  # beats every limit / 5 keep both sides alive
    assert not leader_losses.seen and not follower_losses.seen
    assert [p.process_id for p in leader.peers] == [1]
    follower.stop()  # as a follower does after process 0's shutdown
    leader.stop()
    time.sleep(1.5 * HEALTHY_LIMIT)
    assert not leader_losses.seen and not follower_losses.seen


def test_a_follower_that_closes_without_goodbye_is_lost_at_once():
    leader, losses, address = _leader()
    sock = _raw_follower(address)
    time.sleep(0.2)  # joined
    sock.close()  # what the kernel does for a killed process
    assert losses.event.wait(10)
    process_id, reason, _ = losses.seen[0]
    # From the closed connection itself, not from the limit (that reason says "silent").
    assert process_id == 1 and "closed without a goodbye" in reason
    assert leader.wait_lost(0) and "process 1" in leader.message()
    leader.stop()


def test_a_silent_follower_is_lost_after_the_limit():
    leader, losses, address = _leader()
    sock = _raw_follower(address)  # connected, then says nothing (a hung host)
    t0 = time.monotonic()
    assert losses.event.wait(10)
    process_id, reason, when = losses.seen[0]
    assert process_id == 1 and f"silent for {LIMIT:g} s" in reason
    assert LIMIT * 0.9 <= when - t0 <= 10 * LIMIT  # not before the limit; loaded CI machines lag
    assert len(losses.seen) == 1  # once
    sock.close()
    leader.stop()


def test_a_follower_loses_a_silent_process_zero():
    server = socket.create_server(("localhost", 0))
    address = ("localhost", server.getsockname()[1])
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    losses = Losses()
    HostMonitor.follow(address, 1, LIMIT, on_lost=losses)
    assert losses.event.wait(10)
    assert losses.seen[0][0] == 0 and "silent" in losses.seen[0][1]
    server.close()


def _request(name, deliver, tokens=8):
    return Request(id=name, prompt=np.arange(1, tokens + 1, dtype=np.int32),
                   max_tokens=10_000, deliver=deliver)


def test_fail_all_answers_every_request_once_and_stops_the_worker():
    gate = threading.Event()

    class BlockingEngine(FakeEngine):
        def decode(self, batch):  # a collective with a dead peer: never returns in time
            gate.wait(10)
            raise HostLostError("gone")

    scheduler = Scheduler(BlockingEngine())
    scheduler.start()
    runs, waits = [collect() for _ in range(2)], [collect() for _ in range(2)]
    for i, (_, _, deliver) in enumerate(runs):
        scheduler.submit(_request(f"run{i}", deliver))
    time.sleep(0.3)  # both prefilled (chunks of 4), decoding: blocked in decode
    for i, (_, _, deliver) in enumerate(waits):  # no free slot: they wait
        scheduler.submit(_request(f"wait{i}", deliver))
    time.sleep(0.1)
    scheduler.fail_all(503, "a host was lost", "host_lost")
    for events, done, _ in runs + waits:
        assert done.wait(2)
        assert events[-1].kind == "error" and events[-1].status == 503
        assert events[-1].message == "a host was lost"
    gate.set()  # the worker's call fails now: it must deliver nothing more
    time.sleep(0.2)
    for events, _, _ in runs + waits:
        assert [e.kind for e in events].count("error") == 1 and events[-1].kind == "error"
    late_events, late_done, deliver = collect()
    scheduler.submit(_request("late", deliver))
    assert late_done.wait(1) and late_events[-1].status == 503
    scheduler._thread.join(2)
    assert not scheduler._thread.is_alive()


def test_service_turns_unhealthy_and_refuses_once_a_host_is_lost():
    service = Service(test_config(), loader=lambda: None)
    scheduler = Scheduler(FakeEngine())
    service.scheduler, service.state = scheduler, "ready"
    events, done, deliver = collect()
    scheduler.submit(_request("admitted", deliver))  # not started: no worker
    service.host_lost(1, "silent for 10 s")
    assert service.lost.is_set() and service.state == HOST_LOST
    status, body = service.health()
    assert status == 503 and body["status"] == HOST_LOST and "process 1" in body["error"]
    assert done.wait(1) and events[-1].status == 503 and "process 1" in events[-1].message
    from serving.protocol import APIError

    with pytest.raises(APIError, match="host of the serving group was lost") as e:
        service.admit()
    assert e.value.status == 503


def test_a_stop_without_goodbye_ends_the_followers():
    leader, _, address = _leader()
    losses = Losses()
    HostMonitor.follow(address, 1, LIMIT, on_lost=losses)
    time.sleep(0.2)
    leader.stop(goodbye=False)  # process 0 whose model failed to load
    assert losses.event.wait(10)
    assert losses.seen[0][0] == 0 and "without a goodbye" in losses.seen[0][1]
