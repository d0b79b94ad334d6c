"""Compiling for an NVIDIA GPU on a machine without one.

With the `cuda12` extra installed (jax's CUDA plugin, whose XLA:GPU compiler and ptxas run
without a device), JAX compiles a jitted function for a GPU described by one of XLA's
target configs (the .txtpb files here, XLA's own from openxla/xla
`xla/backends/gpu/target_config/specs/`, Apache-2.0): XLA:GPU's passes, buffer assignment,
PTX and ptxas all run, so `memory_analysis()` and the optimized HLO show what a GPU host
would run. What it cannot show: autotuned tiles (no device to time them; defaults are
used), real times, and a program too big for the device still compiles (compare the bytes
yourself). docs/gpus.md has the recipe and its limits.

    target = gpu_target("h100")
    compiled, seconds = target.compile(lambda place: jax.jit(f).trace(*place(args)).lower())
    peak_bytes(compiled)
"""

import contextlib
import dataclasses
import os
import pathlib
import re

HERE = pathlib.Path(__file__).parent

# name -> (target config, what the device reports as its kind)
TARGETS = {
    "a100": ("a100_sxm_80.txtpb", "NVIDIA A100-SXM4-80GB"),
    "h100": ("h100_sxm.txtpb", "NVIDIA H100 80GB HBM3"),
    "h200": ("h200.txtpb", "NVIDIA H200 141GB HBM3e"),
}

# XLA's GPU compiler sends large sorts (top-k over long rows) to CUB, which asks a device
# for its scratch size and fails without one; XLA's own sort compiles (its memory differs
# slightly from a GPU host's).
DEVICELESS_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}


def _ensure_ptxas():
    """Triton kernels through jax-triton (tokamax's) need ptxas from the CUDA wheel: Triton
    3.9 otherwise emits PTX the wheel's ptxas rejects."""
    if "TRITON_PTXAS_BLACKWELL_PATH" in os.environ:
        return
    import jax

    ptxas = pathlib.Path(jax.__file__).parent.parent / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    if ptxas.exists():
        os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = str(ptxas)


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU to compile for: `devices` of them in one topology, each `memory_bytes`."""

    name: str
    device_kind: str
    memory_bytes: int
    topology: object
    mesh: object  # a jax.sharding.Mesh over the topology's devices, axis "x"

    @property
    def devices(self):
        return self.topology.devices

    def replicated(self):
        import jax

        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def abstract(self, tree):
        """Arrays or shape structs -> ShapeDtypeStructs placed on the target (replicated)."""
        import jax

        sharding = self.replicated()
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=sharding), tree)

    def place(self, tree):
        """abstract(), with Python ints (a step's start and row count) as int32 scalars."""
        import jax
        import jax.numpy as jnp

        return self.abstract(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((), jnp.int32) if isinstance(x, int) else x, tree))

    def compile(self, lower, *, implementations=None, dump_dir=None, mesh=None):
        """(compiled, seconds): lower(place) -> a jax Lowered, compiled for this GPU, with the
        kernel table's ops as `implementations` says ({op: name}). JAX caches traces by
        argument, not by the kernel table's choices, and dosa's inner jitted functions pick
        their kernels while tracing: every compile starts from empty caches. mesh: a mesh
        over this target's devices with the model's own axes (model.sharding.make_mesh),
        when the arguments are placed on it."""
        import time

        import jax

        import pallas_kernels

        jax.clear_caches()
        t0 = time.perf_counter()
        with self.compiling(mesh), \
                pallas_kernels.use_implementations(**(implementations or {})):
            compiled = lower(self.place).compile(self.compiler_options(dump_dir))
        return compiled, time.perf_counter() - t0

    @contextlib.contextmanager
    def compiling(self, mesh=None):
        """Trace, lower and compile inside: the target's mesh (or `mesh`, over its devices)
        and first device are the defaults, so Pallas, jax-triton and dosa's kernel table see
        a GPU, not this CPU."""
        import jax

        with jax.set_mesh(self.mesh if mesh is None else mesh), \
                jax.default_device(self.devices[0]):
            yield

    def compiler_options(self, dump_dir=None):
        options = dict(DEVICELESS_OPTIONS)
        if dump_dir is not None:
            options.update(xla_dump_to=str(dump_dir), xla_dump_hlo_as_text=True)
        return options


def peak_bytes(compiled):
    """Temporaries + arguments + outputs of a compiled program (aliased bytes once): what it
    needs on the device while it runs."""
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
               - m.alias_size_in_bytes)


def target_config_text(name):
    if name not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {name!r}")
    return (HERE / TARGETS[name][0]).read_text()


def gpu_target(name, devices=1):
    """The GpuTarget `name` (TARGETS) with `devices` GPUs in one host. JAX must run on its
    CPU backend (JAX_PLATFORMS=cpu, or jax_platforms="cpu" before any backend starts: with
    the CUDA plugin trying a GPU that is not there, the CUDA topology is not offered).
    RuntimeError naming the extra when JAX's CUDA plugin is not installed."""
    from jax.experimental import topologies

    text = target_config_text(name)
    _ensure_ptxas()
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=text,
                                                topology=f"1x1x{devices}")
    except Exception as e:  # the plugin is missing or refuses the target
        raise RuntimeError(f"cannot compile for {name} here ({type(e).__name__}: {e}); "
                           f"install the GPU compiler with: pip install -e '.[cuda12]'") from e
    memory = int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
    mesh = topologies.make_mesh(topology, (devices,), ("x",))
    return GpuTarget(name, TARGETS[name][1], memory, topology, mesh)
