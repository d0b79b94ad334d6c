"""Liveness of a multi-process serving group: a heartbeat of its own between process 0 and
each follower, independent of the engine's steps.

JAX's collectives cannot tell a dead host from a slow step: a broadcast to a follower that
died either fails at once (gloo sees the socket reset) or waits forever (a host that lost
power or its network), and jax.distributed's own heartbeat aborts the process only after a
minute or more, before anything has answered the clients. So process 0 listens on a TCP
port of its own (`heartbeat_port`, default the coordinator's port + 1); each follower
connects and says its process id; both ends then send one byte every host_timeout_s / 5
from a thread (a jitted step releases the GIL, so a 30-second prefill chunk does not
silence it), and each end's reader declares the peer lost when nothing arrived for
host_timeout_s, or at once when the connection closes without a goodbye (a killed
process's sockets are closed by its kernel). A graceful stop says goodbye first.

What a loss does is the caller's: process 0's Service answers every request with 503 and
exits non-zero (serving.service); a follower exits non-zero (`exit_now`), since its main
thread may be blocked in a collective that never returns.
"""

import logging
import os
import socket
import struct
import sys
import threading
import time

log = logging.getLogger("serving.hosts")

BEAT, BYE = b"\x01", b"\x00"
JOIN_TIMEOUT_S = 300.0  # followers connect while every process starts (jax's own default)
EXIT_CODE = 3  # a group that lost a host: the supervisor restarts it


class HostLostError(RuntimeError):
    """An engine call failed because a process of the group is gone."""


def heartbeat_address(coordinator_address, port=None):
    """(host, port) of process 0's heartbeat listener: the coordinator's host, `port` or
    the coordinator's port + 1."""
    host, _, coordinator_port = coordinator_address.rpartition(":")
    if port is None:
        port = int(coordinator_port) + 1
    return host or "localhost", port


def exit_now(code=EXIT_CODE):
    """Ends the process at once (logs flushed), skipping atexit: jax.distributed's shutdown
    would wait for the lost peer."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Peer:
    """One heartbeat connection: a reader thread that calls on_lost(peer, reason) once when
    the other end goes silent or closes without saying goodbye."""

    def __init__(self, sock, process_id, limit_s, on_lost):
        self.sock, self.process_id, self.limit_s = sock, process_id, limit_s
        self.on_lost = on_lost
        self.said_bye = False  # the other end stopped on purpose
        self.closed = False  # this end stopped
        self.last_seen = time.monotonic()
        sock.settimeout(limit_s)
        threading.Thread(target=self._read, name=f"dosa-heartbeat-read-{process_id}",
                         daemon=True).start()

    def _read(self):
        while True:
            try:
                data = self.sock.recv(64)
            except TimeoutError:
                return self._lose(f"silent for {self.limit_s:g} s")
            except OSError as e:  # a reset: the peer died with our beats unread
                return self._lose(f"connection closed without a goodbye ({e})")
            if not data:
                return self._lose("connection closed without a goodbye")
            self.last_seen = time.monotonic()
            if BYE in data:
                self.said_bye = True
                return None

    def _lose(self, reason):
        if not self.closed and not self.said_bye:
            self.on_lost(self.process_id, reason)

    def send(self, message):
        try:
            self.sock.sendall(message)
        except OSError as e:
            self._lose(f"connection closed without a goodbye (send: {e})")

    def close(self, goodbye):
        if self.closed:
            return
        if goodbye:
            self.send(BYE)
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class HostMonitor:
    """One process's end of the group's heartbeats. `lead` (process 0) and `follow` (the
    others) make one; on_lost(process_id, reason) is called once, from a heartbeat thread,
    for the first peer lost (process 0 watches every follower; a follower watches
    process 0)."""

    def __init__(self, limit_s, on_lost=None):
        if not limit_s > 0:
            raise ValueError(f"host_timeout_s must be > 0, got {limit_s!r}")
        self.limit_s = limit_s
        self.on_lost = on_lost
        self.peers = []
        self.lost = None  # (process_id, reason) of the first peer lost
        self._lost_event = threading.Event()
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ setup

    @classmethod
    def lead(cls, address, num_processes, limit_s, on_lost=None):
        """Process 0: listens at `address` (host, port) and accepts the num_processes - 1
        followers in the background (a follower that never connects is lost after
        JOIN_TIMEOUT_S)."""
        monitor = cls(limit_s, on_lost)
        try:
            server = socket.create_server(("", address[1]), reuse_port=False)
        except OSError as e:
            raise OSError(e.errno, f"heartbeat_port {address[1]}: process 0 cannot listen "
                          f"there ({e.strerror}); set heartbeat_port in the serving config to "
                          f"a free port (1-65535) that every process can reach") from e
        server.settimeout(JOIN_TIMEOUT_S)
        monitor._server = server
        threading.Thread(target=monitor._accept, args=(server, num_processes - 1),
                         name="dosa-heartbeat-accept", daemon=True).start()
        monitor._start_beating()
        log.info("heartbeat: listening on port %d for %d followers, limit %g s", address[1],
                 num_processes - 1, limit_s)
        return monitor

    def _accept(self, server, followers):
        joined = set()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(joined) < followers and not self._stopped.is_set():
            try:
                server.settimeout(max(0.1, deadline - time.monotonic()))
                sock, _ = server.accept()
                sock.settimeout(JOIN_TIMEOUT_S)
                (process_id,) = struct.unpack("!i", _recv_exactly(sock, 4))
            except (OSError, struct.error) as e:
                if self._stopped.is_set():
                    return
                if time.monotonic() >= deadline:
                    missing = followers - len(joined)
                    return self._lose(-1, f"{missing} follower(s) did not connect their "
                                          f"heartbeat within {JOIN_TIMEOUT_S:g} s ({e})")
                continue
            joined.add(process_id)
            with self._lock:
                self.peers.append(_Peer(sock, process_id, self.limit_s, self._lose))
            log.info("heartbeat: process %d joined", process_id)
        server.close()

    @classmethod
    def follow(cls, address, process_id, limit_s, on_lost=None):
        """A follower: connects to process 0's listener at `address` (retrying while it
        starts, up to JOIN_TIMEOUT_S) and says its process id."""
        monitor = cls(limit_s, on_lost)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            try:
                sock = socket.create_connection(address, timeout=max(1.0, limit_s))
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"cannot reach process 0's heartbeat at "
                                       f"{address[0]}:{address[1]} within "
                                       f"{JOIN_TIMEOUT_S:g} s: {e}") from e
                time.sleep(0.2)
        sock.sendall(struct.pack("!i", process_id))
        monitor.peers.append(_Peer(sock, 0, limit_s, monitor._lose))
        monitor._start_beating()
        log.info("heartbeat: connected to process 0 at %s:%d, limit %g s", *address, limit_s)
        return monitor

    def _start_beating(self):
        threading.Thread(target=self._beat, name="dosa-heartbeat-send", daemon=True).start()

    def _beat(self):
        interval = self.limit_s / 5
        while not self._stopped.wait(interval):
            with self._lock:
                peers = list(self.peers)
            for peer in peers:
                if not peer.closed:
                    peer.send(BEAT)

    # ------------------------------------------------------------------ loss

    def _lose(self, process_id, reason):
        with self._lock:
            if self.lost is not None or self._stopped.is_set():
                return
            self.lost = (process_id, reason)
        log.error("heartbeat: lost process %d (%s)", process_id, reason)
        try:
            if self.on_lost is not None:
                self.on_lost(process_id, reason)
        finally:
            self._lost_event.set()

    def wait_lost(self, timeout):
        """Whether a peer is (or within `timeout` s becomes) lost and its on_lost ran."""
        return self._lost_event.wait(timeout)

    def message(self):
        """What a client is told once a host is lost."""
        if self.lost is None:
            return None
        process_id, reason = self.lost
        who = "a follower" if process_id < 0 else f"process {process_id}"
        return f"a host of the serving group was lost ({who}: {reason}); the group restarts"

    def stop(self, goodbye=True):
        """Stops watching and closes every connection: with a goodbye (a graceful stop: no
        peer declares this process lost) or without (the peers lose this process at once:
        process 0 whose model failed to load ends its followers so)."""
        self._stopped.set()
        with self._lock:
            peers = list(self.peers)
        for peer in peers:
            peer.close(goodbye=goodbye)
        server = getattr(self, "_server", None)
        if server is not None:
            server.close()


def _recv_exactly(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("connection closed during the handshake")
        data += chunk
    return data
