"""Helpers shared by experiment scripts: compile cache, timing, text samples, output folders.

Every script writes into its `--out` folder, by default runs/<name>/ under the current
directory (git-ignored); results of record in results/ are refreshed only on purpose
(`--out results`).
"""

import json
import os
import pathlib
import shlex
import statistics
import sys
import sysconfig
import time

import jax

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNS_DIR = pathlib.Path("runs")


def enable_compile_cache():
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", str(REPO_ROOT / ".jax_cache"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def release_programs():
    """Frees every compiled program JAX holds in memory (the persistent compilation cache
    on disk keeps them: a program used again is loaded, not compiled) and hands the memory
    the process freed back to the system (glibc's malloc_trim; elsewhere a no-op)."""
    import ctypes
    import gc

    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def block(x):
    return jax.tree.map(
        lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def time_call(fn, *, repeats=3, warmup=1):
    """Median wall seconds of fn() over `repeats` runs after `warmup` runs (compile excluded)."""
    for _ in range(warmup):
        block(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stdlib_text(n_bytes, *, skip_bytes=0):
    """At least n_bytes of real text: the running Python's standard-library sources, sorted
    by path (exists on every machine; no download)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        if skip_bytes >= len(data):
            skip_bytes -= len(data)
            continue
        data, skip_bytes = data[skip_bytes:], 0
        chunks.append(data)
        total += len(data)
        if total >= n_bytes:
            break
    return b"".join(chunks)[:n_bytes].decode("utf-8", errors="replace")


def machine_description():
    devices = jax.devices()
    return {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "device_count": len(devices), "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "python": sys.version.split()[0]}


def parse_layers(text):
    """A CLI list of layer indices, 'I,J,...' or 'none' / '' -> tuple of ints (ValueError on
    anything else). The range is checked where it is used: ModelConfig.flat_index_layers."""
    value = (text or "").strip().lower()
    if value in ("", "none"):
        return ()
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated layer indices or 'none', "
                         f"got {text!r}") from None


def parse_hierarchical(text, base):
    """A CLI 'FIELD=VALUE,...' of HierarchicalConfig fields over `base` (a HierarchicalConfig)
    -> the new config. Values are YAML scalars (4096, 0.1, null / None, true); the config
    validates them (ValueError naming the field)."""
    import yaml

    fields = dict(item.split("=", 1) for item in (text or "").split(",") if item.strip())
    return base.replace(**{k.strip(): None if v.strip() == "None" else yaml.safe_load(v)
                           for k, v in fields.items()})


def default_out_dir(name):
    """runs/<name>: where a script writes when --out is not given (git-ignored)."""
    return RUNS_DIR / name


def add_out_argument(parser, name):
    """The common --out option: an output folder, default runs/<name>/."""
    parser.add_argument("--out", default=str(default_out_dir(name)), metavar="DIR",
                        help=f"output folder (default runs/{name}/; results of record: results/)")


def display_path(path):
    """`path` relative to the current directory when it is inside it (no machine paths in
    result files), else as given."""
    path = pathlib.Path(path)
    try:
        return str(path.resolve().relative_to(pathlib.Path.cwd().resolve()))
    except ValueError:
        return str(path)


def recorded_command(module, argv=None):
    """The command line a result records: `python -m module` and its arguments (argv, default
    sys.argv[1:]), with absolute paths inside the current directory made relative, so no
    result file holds a machine path."""
    args = sys.argv[1:] if argv is None else argv
    return f"python -m {module} " + shlex.join(_relative_argument(a) for a in args)


def _relative_argument(arg):
    flag, eq, value = arg.partition("=")
    if eq and flag.startswith("--"):
        return f"{flag}={_relative_argument(value)}"
    return display_path(arg) if os.path.isabs(arg) else arg


def write_json(path, payload):
    """Writes payload as indented JSON to `path` (parent folders created) -> path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path


class CompileCounter:
    """Counts XLA backend compiles and their seconds (jax.monitoring's compile event) from
    its creation: take() -> the count since the last take, take_seconds() -> the compile
    seconds since the last take_seconds. What is timed must compile nothing."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = self.taken = 0
        self.seconds = self.seconds_taken = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._seen)

    def _seen(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration

    def take(self):
        n, self.taken = self.count - self.taken, self.count
        return n

    def take_seconds(self):
        s, self.seconds_taken = self.seconds - self.seconds_taken, self.seconds
        return s


class ProgressBar:
    """The project's one progress display (rich): a bar over `total` steps (from
    `completed`) with a status text after it; `write` prints a line above the bar. A
    context manager; `track` iterates under one."""

    def __init__(self, description, total=None, completed=0):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(),
                                  TextColumn("{task.fields[status]}"))
        self._task = self._progress.add_task(description, total=total, completed=completed,
                                             status="")

    def __enter__(self):
        self._progress.start()
        return self

    def __exit__(self, *exc):
        self._progress.stop()

    def advance(self, steps=1):
        self._progress.advance(self._task, steps)

    def status(self, text):
        self._progress.update(self._task, status=text)

    def write(self, text):
        self._progress.console.print(text, markup=False, highlight=False)


def track(iterable, description, *, total=None):
    """Iterates `iterable` under a ProgressBar (total: len(iterable) when it has one)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    with ProgressBar(description, total) as bar:
        for item in iterable:
            yield item
            bar.advance()
