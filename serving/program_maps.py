"""Compiled programs against the kernel's limit on a process's memory mappings.

Every program XLA compiles for the CPU keeps about three mappings per kernel (its code, its
read-only and its writable data) until jax drops the program, and Linux caps a process's
mappings (`vm.max_map_count`, 65,530 by default). Past the cap an mmap inside XLA fails and
the process dies in whatever it compiles next ("LLVM ERROR: Unable to allocate section
memory", or a segmentation fault). A server compiles a bounded set of programs, but the set
grows with its config: a canary doubles it, shadow recall adds the capturing steps, the
paged engine a decode step per batch size and key length. Measured with the shipped model
before the layer scan (docs/serving.md): the default config with a hierarchical canary
died at warm-up holding 64,447 mappings.

`MapBudget` keeps a server under the cap whatever its config: the warm-up stops compiling
ahead once the process holds WARM_SHARE of the cap (the rest compile on first use), and
between two engine turns, when programs were compiled since the last look and the process
holds more than DROP_SHARE, jax's compiled programs are dropped (`jax.clear_caches`: each
compiles again on its next use, from the persistent compilation cache when one is set).
Reading /proc/self/maps costs milliseconds at tens of thousands of lines, so it is read
only after a compile.
"""

import gc
import logging
import threading

import jax

log = logging.getLogger(__name__)

WARM_SHARE = 0.4   # the warm-up compiles ahead while the process holds less of the cap
DROP_SHARE = 0.75  # past this share, compiled programs are dropped between turns
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def map_usage():
    """(mappings this process holds, the kernel's cap vm.max_map_count), or (0, 0) where
    /proc does not tell (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as cap:
            return sum(1 for _ in maps), int(cap.read())
    except OSError:
        return 0, 0


class MapBudget:
    """The process's mappings against the cap (module docstring). One per process:
    `budget()`."""

    def __init__(self, usage=map_usage):
        self._usage = usage
        self._compiles = 0  # counted by the listener (any thread)
        self._seen = -1     # compiles at the last look
        self.held, self.cap = usage()
        self.drops = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if event == COMPILE_EVENT:
            self._compiles += 1

    def _look(self):
        if self._compiles != self._seen:
            self._seen = self._compiles
            self.held, self.cap = self._usage()
        return self.held, self.cap

    def usage(self):
        """(mappings held, the cap) as of the last compile."""
        return self._look()

    def warm_room_for(self, part, parts):
        """A warm-up's `room` callable: whether it may compile more, while the process holds
        less than part / parts of WARM_SHARE of the cap above what it held when asked (the
        warm-ups of several engines share the budget, the first the first part)."""
        held, cap = self._look()
        ceiling = held + (WARM_SHARE * cap - held) * part / parts
        return lambda: not cap or self._look()[0] < ceiling

    def check(self):
        """Between two engine turns (the engine's thread): drops jax's compiled programs
        when the process holds more than DROP_SHARE of the cap -> whether it did."""
        held, cap = self._look()
        if not cap or held <= DROP_SHARE * cap:
            return False
        jax.clear_caches()
        gc.collect()
        self.drops += 1
        self._seen = -1  # look again
        after, _ = self._look()
        log.warning("compiled programs dropped: the process held %d memory mappings of the "
                    "kernel's %d (vm.max_map_count), %d after; they compile again on use "
                    "(docs/serving.md, \"Compiled programs and vm.max_map_count\")",
                    held, cap, after)
        return True


_BUDGET = []
_LOCK = threading.Lock()


def budget():
    """The process's MapBudget (made on first use)."""
    with _LOCK:
        if not _BUDGET:
            _BUDGET.append(MapBudget())
        return _BUDGET[0]
