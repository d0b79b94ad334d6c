"""dosa's main job: load the model, prefill a long real-text context, report TTFT, generate.

    python -m experiments.run [--tokens 4096] [--attention sparse] [--indexer flat]

Uses the shipped checkpoint (checkpoints/small) when present, else random `small` weights
(said so in the output). TTFT here = prefill start to first-token logits ready.
"""

import argparse
import pathlib
import time

import numpy as np
from flax import nnx

from experiments.common import enable_compile_cache, machine_description, stdlib_text
from experiments.checkpoints import DEFAULT_CHECKPOINT, has_checkpoint, load_default_model
from model import ModelRunner, Transformer, get_config, tokenizer


def load_model(checkpoint, **overrides):
    """(model, description): the checkpoint if it exists, else random `small` weights."""
    if has_checkpoint(checkpoint):
        return load_default_model(checkpoint, **overrides)[0], f"checkpoint {checkpoint}"
    return (Transformer(get_config("small", **overrides), rngs=nnx.Rngs(0)),
            f"random small weights (no checkpoint at {checkpoint})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="context length to prefill")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--attention", default="sparse", choices=["dense", "sparse"])
    p.add_argument("--indexer", default="flat")
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error("--tokens must be >= 1")
    enable_compile_cache()
    model, source = load_model(pathlib.Path(args.checkpoint),
                               attention=args.attention, indexer=args.indexer)
    cfg = model.config
    if args.tokens + args.new_tokens > cfg.max_seq_len:
        p.error(f"--tokens + --new-tokens must be <= max_seq_len={cfg.max_seq_len}")
    runner = ModelRunner(model)
    prompt = np.asarray(tokenizer.encode(stdlib_text(4 * args.tokens))[:args.tokens], np.int32)
    print(f"dosa main job: {source}; attention={cfg.attention} indexer={cfg.indexer} "
          f"top_k={cfg.top_k}; {machine_description()}")

    # First call compiles; the timed call is the warm one (what a server sees).
    runner.prefill(prompt, capacity=args.tokens + args.new_tokens)[0].block_until_ready()
    t0 = time.perf_counter()
    logits, cache = runner.prefill(prompt, capacity=args.tokens + args.new_tokens)
    first = int(np.argmax(np.asarray(logits)))
    ttft = time.perf_counter() - t0
    print(f"prefill of {args.tokens} tokens: TTFT {ttft * 1000:.1f} ms "
          f"({args.tokens / ttft:.0f} tokens/s)")

    out, t0 = [first], time.perf_counter()
    for i in range(args.new_tokens - 1):
        logits, cache = runner.decode(out[-1], cache, args.tokens + i)
        out.append(int(np.argmax(np.asarray(logits))))
    decode_s = time.perf_counter() - t0
    print(f"decode: {args.new_tokens - 1} tokens in {decode_s:.2f} s (includes compiles)")
    print("context tail:", repr(tokenizer.decode(prompt[-80:])))
    print("greedy continuation:", repr(tokenizer.decode(out)))


if __name__ == "__main__":
    main()
