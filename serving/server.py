"""Running the app under uvicorn, with a graceful drain on SIGTERM / SIGINT: the first
signal stops admissions (new requests and /health get 503) and lets in-flight requests
finish, for at most drain_timeout_s; then the server exits. A second signal exits at once.
A server whose model fails to load exits 1; one whose group lost a host (serving.hosts)
exits serving.hosts.EXIT_CODE once the 503s are out."""

import logging
import threading
import time

import uvicorn

from serving.hosts import EXIT_CODE as HOST_LOST_EXIT_CODE
from serving.hosts import exit_now
from serving.service import DRAINING, FAILED, READY

log = logging.getLogger("serving")
HOST_LOST_GRACE_S = 1.0  # for the 503s (and in-stream error chunks) to reach the clients


class DrainingServer(uvicorn.Server):
    def __init__(self, config, service):
        super().__init__(config)
        self.service = service
        self.exit_code = 0

    def handle_exit(self, sig, frame):
        # Not uvicorn's handler: it stops accepting connections at once (clients would see
        # refused connections, not 503) and re-raises the signal after shutdown.
        if self.service.state == READY:
            self.service.drain()
            threading.Thread(target=self._exit_when_idle, name="dosa-drain",
                             daemon=True).start()
        elif self.service.state == DRAINING:
            log.warning("second signal while draining: exiting now")
            self.should_exit = self.force_exit = True
        else:
            self.should_exit = True

    def _exit_when_idle(self):
        deadline = time.monotonic() + self.service.config.drain_timeout_s
        while not self.service.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.service.idle():
            log.warning("drain timeout (%g s): exiting with %d requests in flight",
                        self.service.config.drain_timeout_s, self.service.active)
        else:
            log.info("drained: exiting")
        self.should_exit = True

    def exit_if_load_fails(self):
        """Exits (code 1) when the model fails to load: a server that cannot serve should
        not stay up answering 503."""
        def watch():
            self.service.wait_ready()
            if self.service.state == FAILED:
                self.exit_code = 1
                self.should_exit = True

        threading.Thread(target=watch, name="dosa-load-watch", daemon=True).start()

    def exit_if_host_lost(self):
        """Exits (HOST_LOST_EXIT_CODE) soon after the group loses a host, so that a
        supervisor restarts the group."""
        def watch():
            self.service.lost.wait()
            time.sleep(HOST_LOST_GRACE_S)
            self.exit_code = HOST_LOST_EXIT_CODE
            self.should_exit = True

        threading.Thread(target=watch, name="dosa-host-watch", daemon=True).start()


def make_server(service, *, host, port, log_level="info"):
    from serving.api import create_app

    config = uvicorn.Config(create_app(service), host=host, port=port, log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=5)
    return DrainingServer(config, service)


def serve(service, *, host, port):
    """Starts loading, serves until a signal (after the drain) or a lost host, returns the
    exit code (a lost host: exits at once, skipping atexit's jax.distributed shutdown, which
    would wait for the lost peer)."""
    server = make_server(service, host=host, port=port)
    service.start()
    server.exit_if_load_fails()
    server.exit_if_host_lost()
    server.run()
    if service.lost.is_set():
        log.error("exiting %d: %s", HOST_LOST_EXIT_CODE, service.error)
        exit_now(HOST_LOST_EXIT_CODE)
    service.stop()
    return server.exit_code
