"""python -m serving [--config FILE] [--model NAME|PATH] [--port N] [--host H] [--api-key K]
    [--mesh AXIS=N,...] [--coordinator-address HOST:PORT --num-processes N --process-id I]

Serves the shipped model by default (`--model tiny`: a random, UNTRAINED tiny model for
tests and development; `--model smollm2-135m` or a path: a pretrained model). The server
listens at once; /health answers 503 until the model is loaded and compiled.

With --mesh the model runs sharded over the mesh's devices; with several processes
(--num-processes N, each run with the same flags and its own --process-id), process 0
serves HTTP and the others replay its engine steps (serving.follower, docs/sharding.md).

Exit codes: 0 after a SIGTERM drain, 1 when the model failed to load, 2 for bad flags or
config, 3 when the group lost a host (serving.hosts: restart every process).
"""

import argparse
import logging
import os
import pathlib
import sys

from indexer.selection import offered_settings
from model.parallel_flags import add_parallel_arguments, distributed_settings, parse_mesh
from serving.config import DEFAULT_CONFIG, base_type, load_config


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="serving YAML config")
    parser.add_argument("--model", help="default | tiny (random, untrained) | smollm2-135m | "
                                        "a path (.gguf, Hugging Face folder, dosa checkpoint)")
    parser.add_argument("--port", type=int)
    parser.add_argument("--host")
    parser.add_argument("--api-key", help="require this Bearer token (default: $DOSA_API_KEY)")
    parser.add_argument("--max-context", type=int, help="override the config's max_context")
    parser.add_argument("--fp8-experts", action="store_true", default=None,
                        help="an FP8 DeepSeek-V3.2 / GLM-5 folder: keep its routed experts in "
                             "FP8 (the config's fp8_experts)")
    parser.add_argument("--indexer", help="the selection kind served (the config's indexer)")
    parser.add_argument("--top-k", type=int, help="tokens each query attends to")
    for setting in offered_settings().values():
        parser.add_argument(f"--{setting.name.replace('_', '-')}", dest=f"switch_{setting.name}",
                            type=base_type(setting.type), metavar=setting.name.upper(),
                            help=f"the {setting.kind} selection's {setting.field} (the "
                                 f"config's {setting.name})")
    add_parallel_arguments(parser)
    return parser.parse_args(argv)


def switch_overrides(args):
    """The selection switches given on the command line, as load_config overrides."""
    out = {"indexer": args.indexer, "top_k": args.top_k}
    out.update({name: getattr(args, f"switch_{name}", None) for name in offered_settings()})
    return out


def check_parallel_flags(args):
    """Validates --mesh and the jax.distributed flags without starting JAX -> number of
    processes. ValueError naming the flag: malformed values, or several processes without
    a --mesh (their devices must form one mesh)."""
    _, processes, _ = distributed_settings(args.coordinator_address, args.num_processes,
                                           args.process_id)
    if args.mesh is not None:
        parse_mesh(args.mesh)
    elif processes > 1:
        raise ValueError(f"--num-processes={processes} needs --mesh (e.g. sequence="
                         f"{processes}): the processes' devices serve as one mesh")
    return processes


def serving_mesh(args):
    """jax.distributed.initialize (several processes) and the mesh of --mesh -> Mesh or None
    (one device). ValueError when the mesh does not match the devices of every process."""
    from model.sharding import mesh_from_args

    return mesh_from_args(args)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config, model=args.model, port=args.port, host=args.host,
                             max_context=args.max_context, fp8_experts=args.fp8_experts,
                             api_key=args.api_key or os.environ.get("DOSA_API_KEY") or None,
                             **switch_overrides(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Before JAX starts: its device memory fraction (GPU_UTILIZATION) and a persistent
    # compile cache, so a restart skips most of the warm-up's compiles.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{config.gpu_utilization:g}")
    cache = pathlib.Path.home() / ".cache" / "dosa" / "jax-compile"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax"):  # orbax's restore and JAX's backend probing, at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        processes = check_parallel_flags(args)
        mesh = serving_mesh(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax

    from serving.hosts import HostMonitor, exit_now, heartbeat_address

    if config.model == "tiny":
        logging.getLogger("serving").warning("--model tiny: RANDOM, UNTRAINED weights "
                                             "(tests and development only)")
    if processes > 1:
        address, _, _ = distributed_settings(args.coordinator_address, args.num_processes,
                                             args.process_id)
        beat_at = heartbeat_address(address, config.heartbeat_port)
    if jax.process_index() != 0:  # a follower: no HTTP, replays process 0's engine calls
        from serving.follower import run_follower

        # Process 0 lost: this process's main thread may be blocked in a collective.
        hosts = HostMonitor.follow(beat_at, jax.process_index(), config.host_timeout_s,
                                   on_lost=lambda process_id, reason: exit_now())
        return run_follower(config, mesh, hosts=hosts)
    from serving.server import serve
    from serving.service import Service

    service = Service(config, mesh=mesh)
    if processes > 1:
        service.hosts = HostMonitor.lead(beat_at, processes, config.host_timeout_s,
                                         on_lost=service.host_lost)
    return serve(service, host=config.host, port=config.port)


if __name__ == "__main__":
    sys.exit(main())
