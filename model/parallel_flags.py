"""The --mesh and jax.distributed flags, and their parsing, without JAX: `python -m serving`
validates them before JAX starts (model.sharding builds meshes from them)."""

import re

# "expert" splits the routed experts of a DeepSeekMoE (with "tensor": model.moe); it is
# listed before "tensor" so that a tensor group is the innermost, fastest-linked devices.
MESH_AXES = ("data", "sequence", "expert", "tensor")


def parse_mesh(text):
    """'sequence=4,tensor=2' -> {"data": 1, "sequence": 4, "expert": 1, "tensor": 2}
    (missing axes: 1).
    ValueError naming --mesh on a malformed string, an unknown axis or a size < 1."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--mesh must be 'axis=size,...' with axes from {MESH_AXES}, "
                         f"got {text!r}")
    seen = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*([a-z]+)\s*=\s*(\d+)\s*", part)
        if not m:
            raise ValueError(f"--mesh: {part!r} is not 'axis=size' (axes {MESH_AXES}, "
                             f"sizes >= 1), in {text!r}")
        axis, size = m.group(1), int(m.group(2))
        if axis not in MESH_AXES:
            raise ValueError(f"--mesh: unknown axis {axis!r}; allowed: {MESH_AXES}")
        if axis in seen:
            raise ValueError(f"--mesh: axis {axis!r} given twice in {text!r}")
        if size < 1:
            raise ValueError(f"--mesh: {axis} size must be >= 1, got {size}")
        seen.add(axis)
        sizes[axis] = size
    return sizes


DISTRIBUTED_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS",
                   "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}


def add_parallel_arguments(parser):
    """--mesh and the jax.distributed flags, shared by experiments.run and serving."""
    parser.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                        help=f"device mesh, axes {', '.join(MESH_AXES)} (e.g. sequence=4,"
                             "tensor=2; product = all devices of all processes); default: "
                             "one device")
    parser.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                        help="jax.distributed coordinator (process 0's host); default "
                             "$JAX_COORDINATOR_ADDRESS")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="processes in the job (default $JAX_NUM_PROCESSES, else 1)")
    parser.add_argument("--process-id", type=int, default=None,
                        help="this process's rank in [0, num-processes) "
                             "(default $JAX_PROCESS_ID)")


def distributed_settings(coordinator_address=None, num_processes=None, process_id=None,
                         environ=None):
    """(coordinator_address, num_processes, process_id), flags first, then the environment
    (DISTRIBUTED_ENV); num_processes defaults to 1. ValueError naming the flag when
    several processes lack a coordinator or a valid process id."""
    import os

    env = os.environ if environ is None else environ
    address = coordinator_address or env.get(DISTRIBUTED_ENV["coordinator_address"]) or None
    try:
        count = int(num_processes if num_processes is not None
                    else env.get(DISTRIBUTED_ENV["num_processes"], 1))
        pid = process_id if process_id is not None else env.get(DISTRIBUTED_ENV["process_id"])
        pid = None if pid is None else int(pid)
    except ValueError as e:
        raise ValueError(f"--num-processes / --process-id must be ints: {e}") from None
    if count < 1:
        raise ValueError(f"--num-processes must be >= 1, got {count}")
    if count > 1:
        if not address:
            raise ValueError("--coordinator-address (or $JAX_COORDINATOR_ADDRESS) is required "
                             f"with --num-processes={count}")
        if pid is None or not 0 <= pid < count:
            raise ValueError(f"--process-id must be in [0, {count - 1}] with "
                             f"--num-processes={count}, got {pid}")
    return address, count, pid
