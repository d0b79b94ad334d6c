"""python -m serving [--config FILE] [--model NAME|PATH] [--port N] [--host H] [--api-key K]

Serves the shipped model by default (`--model tiny`: a random, UNTRAINED tiny model for
tests and development; `--model smollm2-135m` or a path: a pretrained model). The server
listens at once; /health answers 503 until the model is loaded and compiled.
"""

import argparse
import logging
import os
import pathlib
import sys

from serving.config import DEFAULT_CONFIG, load_config


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="serving YAML config")
    parser.add_argument("--model", help="default | tiny (random, untrained) | smollm2-135m | "
                                        "a path (.gguf, Hugging Face folder, dosa checkpoint)")
    parser.add_argument("--port", type=int)
    parser.add_argument("--host")
    parser.add_argument("--api-key", help="require this Bearer token (default: $DOSA_API_KEY)")
    parser.add_argument("--max-context", type=int, help="override the config's max_context")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config, model=args.model, port=args.port, host=args.host,
                             max_context=args.max_context,
                             api_key=args.api_key or os.environ.get("DOSA_API_KEY") or None)
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
    from serving.server import serve
    from serving.service import Service

    if config.model == "tiny":
        logging.getLogger("serving").warning("--model tiny: RANDOM, UNTRAINED weights "
                                             "(tests and development only)")
    return serve(Service(config), host=config.host, port=config.port)


if __name__ == "__main__":
    sys.exit(main())
