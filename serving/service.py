"""What the HTTP layer serves from: loading and warm-up in the background, readiness,
draining, admission control, and the engine + scheduler once loaded."""

import logging
import threading
import time

from serving.protocol import APIError

log = logging.getLogger("serving")

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"
HOST_LOST = "host_lost"


class Service:
    """loader() -> serving.loading.LoadedModel (default: load_model(config.model, ...)).

    Readiness: LOADING until the model is loaded and its buckets compiled, then READY;
    DRAINING after `drain()` (in-flight requests finish, new ones get 503); FAILED when
    loading raised (`error` says why); HOST_LOST when a process of a multi-process group
    is gone (`host_lost`: every request is answered with 503, the server exits). The
    admission count (running + waiting requests) is kept on the event loop's thread.
    """

    def __init__(self, config, *, loader=None, mesh=None):
        """mesh: None (one device) or a model.sharding mesh; when it spans several
        processes this is process 0, and its engine leads the others (serving.follower)."""
        self.config = config
        self._loader = loader
        self.mesh = mesh
        self.state = LOADING
        self.error = None
        self.loaded = self.engine = self.scheduler = self.metrics = None
        self.engines, self.metrics_of = [], []  # one per variant (serving.rollout)
        self.rollout = None
        self.model_id = None
        self.max_context = None
        self.active = 0
        self.started = time.time()
        self.hosts = None  # the group's serving.hosts.HostMonitor (several processes)
        self._ready = threading.Event()
        self.lost = threading.Event()  # set by host_lost
        self._state_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def start(self):
        threading.Thread(target=self._load, name="dosa-load", daemon=True).start()

    def wait_ready(self, timeout=None):
        self._ready.wait(timeout)
        return self.state == READY

    def _load(self):
        try:
            self._build()
            with self._state_lock:
                if self.state == LOADING:
                    self.state = READY
            log.info("ready: serving %s on up to %d tokens of context (%s)", self.model_id,
                     self.max_context, self.loaded.description)
        except Exception as e:
            with self._state_lock:
                if self.state == HOST_LOST:  # its collectives failed with the host
                    return
                log.exception("loading failed")
                self.error = f"{type(e).__name__}: {e}"
                self.state = FAILED
        finally:
            self._ready.set()

    def _build(self):
        from serving.loading import build_engines, selection_summary
        from serving.metrics import Metrics
        from serving.rollout import Rollout, Variant
        from serving.scheduler import Scheduler

        cfg = self.config
        engines, loaded, max_context = build_engines(cfg, self.mesh, loader=self._loader)
        if _process_count(self.mesh) > 1:  # every engine call is replayed by the followers
            from serving.follower import Leader

            engines = Leader.group(engines, hosts=self.hosts)
        model_id = cfg.model_version or loaded.model_id
        versions = [model_id]
        if cfg.canary is not None:
            versions.append(cfg.canary.model_version or f"{model_id}-canary")
            if versions[1] == versions[0]:
                raise ValueError(f"serving config: canary.model_version must differ from the "
                                 f"baseline's model_version ({model_id!r})")
        metrics = Metrics(model_id, indexer_label(engines[0].config))
        metrics_of = [metrics] + [metrics.for_version(v, indexer_label(e.config))
                                  for v, e in zip(versions[1:], engines[1:])]
        canary = cfg.canary
        rollout = Rollout(
            [Variant(i, v, selection_summary(e.config))
             for i, (v, e) in enumerate(zip(versions, engines))],
            share=canary.share if canary else 0.0,
            recall_floor=canary.recall_floor if canary else None,
            guard_window=canary.guard_window if canary else 20,
            on_change=lambda action, old, new: metrics.rollout_changes.labels(
                action=action).inc())
        scheduler = Scheduler(engines, metrics_of,
                              batching_window_s=cfg.batching_window_ms / 1000,
                              on_shadow=lambda variant, record: rollout.observe(
                                  variant, record.mean_recall))
        scheduler.start()
        with self._state_lock:
            self.loaded, self.engine, self.metrics = loaded, engines[0], metrics
            self.engines, self.metrics_of, self.rollout = engines, metrics_of, rollout
            self.model_id = model_id
            self.scheduler, self.max_context = scheduler, max_context
            lost = self.state == HOST_LOST
        if lost:  # lost while loading: nothing may run
            scheduler.fail_all(503, self.error, "host_lost")

    def host_lost(self, process_id, reason):
        """A process of the group is gone (serving.hosts calls this, once): /health and
        new requests get 503, every admitted request is answered with a 503 error that says
        so, and `lost` tells the server to exit non-zero."""
        with self._state_lock:
            self.state = HOST_LOST
            self.error = (self.hosts.message() if self.hosts is not None else
                          f"a host of the serving group was lost (process {process_id}: "
                          f"{reason})")
            scheduler = self.scheduler
        log.error("%s: answering every request with 503 and exiting", self.error)
        if scheduler is not None:
            scheduler.fail_all(503, self.error, "host_lost")
        self.lost.set()

    def drain(self):
        """Stops admitting requests; those in flight go on."""
        if self.state == READY:
            self.state = DRAINING
            log.info("draining: %d requests in flight, new ones get 503", self.active)

    def idle(self):
        return self.active == 0

    def stop(self):
        if self.lost.is_set():  # the group's collectives are broken: nothing to end
            return
        if self.scheduler is not None:
            self.scheduler.stop()
        leader = hasattr(self.engine, "shutdown")
        if leader:  # a Leader: end the followers' loops
            self.engine.shutdown()
        if self.hosts is not None:
            # After the followers' shutdown: goodbye, not a loss. No engine (the load
            # failed): no goodbye, so that the followers, stuck in their warm-up or their
            # first receive, exit too.
            self.hosts.stop(goodbye=leader)

    # ------------------------------------------------------------------ per request

    def health(self):
        """(HTTP status, body) of GET /health."""
        body = {"status": self.state, "model": self.model_id}
        if self.state in (FAILED, HOST_LOST):
            body["error"] = self.error
        if self.state == READY:
            running, waiting = self.scheduler.counts()
            body.update(running=running, waiting=waiting, active=self.active,
                        admission_limit=self.config.queue_size)
            return 200, body
        return 503, body

    def require_ready(self):
        if self.state == READY:
            return
        messages = {LOADING: "the model is still loading and compiling; retry shortly",
                    DRAINING: "the server is shutting down (draining); not accepting requests",
                    FAILED: f"the model failed to load: {self.error}",
                    HOST_LOST: self.error}
        raise APIError(503, messages[self.state])

    def admit(self):
        """Counts one more running-or-waiting request; 503 past the admission limit."""
        self.require_ready()
        if self.active >= self.config.queue_size:
            raise APIError(503, f"server is at its admission limit of {self.config.queue_size} "
                                f"requests (running + waiting); retry later")
        self.active += 1

    def release(self):
        self.active -= 1


def _process_count(mesh):
    """Processes whose devices `mesh` spans (1 without a mesh)."""
    if mesh is None:
        return 1
    return len({d.process_index for d in mesh.devices.flat})


def indexer_label(config):
    """What the TTFT histogram's `indexer` label says: dense, or sparse's selection."""
    return "dense" if config.attention == "dense" else config.indexer
