import gc
import os
import pathlib

# Persistent compile cache: repeated runs (and CI re-runs) skip most XLA compiles.
_cache = pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_cache))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
# Tests run tiny shapes, where XLA's compile time dwarfs run time: skipping most of its
# optimisation passes cuts the cold-cache suite by about a quarter. Numerics are unchanged
# up to float rounding, which every tolerance already allows.
jax.config.update("jax_disable_most_optimizations", True)


# Slow tests that run servers or groups of processes with timed expectations (a request
# answered within seconds, a lost host noticed in time): CI runs them alone, the rest of the
# slow tier on two workers (.ci/run).
SERIAL = ("tests/serving/", "tests/sharding/test_sharded_serving.py",
          "tests/sharding/test_host_loss.py")


def pytest_collection_modifyitems(config, items):
    root = pathlib.Path(__file__).resolve().parent.parent
    for item in items:
        where = item.path.relative_to(root).as_posix()
        if item.get_closest_marker("slow") and where.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (pyproject's addopts): the default tier's tests are independent
    and mostly compile (one core each), so they run on up to 4 cores; the slow tier runs
    end-to-end scripts and servers with timed expectations (a request answered within 5 s),
    which must not share the machine with each other: in this process, no workers."""
    if "slow" in (config.getoption("markexpr") or "").replace("not slow", ""):
        return 0
    return max(1, min(4, len(os.sched_getaffinity(0))))


def _memory_maps() -> tuple[int, int]:
    """(mappings this process holds, the kernel's limit `vm.max_map_count`), or (0, 0) off
    Linux."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():
    """Every compiled XLA:CPU program keeps a few memory mappings until jax drops it, and the
    slow tier compiles thousands of programs in one process: past `vm.max_map_count` (65530
    by default) an mmap inside XLA fails, and the process dies compiling or serialising
    whatever program comes next (SIGSEGV or SIGABRT, docs/serving.md "Known issue"). After a
    module, past 40% of the limit, jax's caches are dropped; programs later modules need are
    compiled again (or read from the persistent cache)."""
    yield
    held, limit = _memory_maps()
    if limit and held > 0.4 * limit:
        jax.clear_caches()
        gc.collect()
