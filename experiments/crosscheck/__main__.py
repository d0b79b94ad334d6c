"""Cross-check a loaded pretrained model against code that shares nothing with dosa's.

    python -m experiments.crosscheck --model smollm2-135m --tokens 1024 \
        --out results/pretrained/crosscheck

1. dosa's dense logits (model.runner, float32) vs an independent plain-numpy forward of the
   same GGUF (experiments.crosscheck.numpy_llama): top-1 agreement, max |logit difference|,
   perplexity of both, on the first --tokens tokens (no BOS) of Python's documentation text.
2. If `llama_cpp` (llama-cpp-python) is importable: tokenization of two English texts
   compared token for token, and llama.cpp's own perplexity and top-1 agreement with dosa
   (llama.cpp quantizes activations for Q4 products: a sanity check, not an equality).
"""

import argparse
import json
import pathlib
import time

import numpy as np

from experiments.common import add_out_argument, display_path, write_json
from experiments.crosscheck.numpy_llama import NumpyLlama
from experiments.text_corpus import pydoc_topics_text
from model.pretrained import load_pretrained

SECOND_TEXT = pathlib.Path("/usr/share/common-licenses/GPL-3")


def perplexity(logits, ids):
    logits = np.asarray(logits, np.float64)[:-1]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - logits[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return float(np.exp(nll.mean()))


def compare(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return dict(top1_agreement=float(np.mean(a.argmax(-1) == b.argmax(-1))),
                max_abs_logit_diff=float(np.abs(a - b).max()),
                mean_abs_logit_diff=float(np.abs(a - b).mean()))


def llama_cpp_check(path, tokenizer, texts, ids, dosa_logits):
    try:
        import llama_cpp
    except ImportError:
        return dict(skipped="llama_cpp (llama-cpp-python) is not installed")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(2048, len(ids) + 8), logits_all=True,
                          n_threads=2, verbose=False)
    tokenization = {}
    for name, text in texts.items():
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        ours = tokenizer.encode(text, bos=False)
        first = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
        tokenization[name] = dict(tokens_dosa=len(ours), tokens_llama_cpp=len(theirs),
                                  identical=ours == theirs, first_difference=first)
    llm.reset()
    llm.eval(list(map(int, ids)))
    theirs = np.asarray(llm.scores[:len(ids)], np.float32)
    return dict(version=llama_cpp.__version__, tokenization=tokenization,
                perplexity=perplexity(theirs, ids), vs_dosa=compare(theirs, dosa_logits))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=1024)
    add_out_argument(p, "crosscheck")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    pre = load_pretrained(args.model, attention="dense")
    text = pydoc_topics_text()
    ids = np.asarray(pre.tokenizer.encode(text, bos=False)[:args.tokens], np.int32)

    from model import ModelRunner  # after load: jax is configured by then

    t = time.monotonic()
    ours, _ = ModelRunner(pre.model).prefill(ids, logits_from=0)
    ours = np.asarray(ours)
    t_ours = time.monotonic() - t
    t = time.monotonic()
    ref = NumpyLlama(pre.info["path"]).logits(ids)
    t_ref = time.monotonic() - t
    result = dict(
        model=args.model, file=pre.info["path"].rsplit("/", 1)[-1], tokens=int(len(ids)),
        text="pydoc_data.topics joined in key order, first tokens, no BOS",
        dosa=dict(perplexity=perplexity(ours, ids), wall_s=round(t_ours, 1)),
        numpy_reference=dict(perplexity=perplexity(ref, ids), wall_s=round(t_ref, 1)),
        dosa_vs_numpy=compare(ours, ref))
    texts = {"pydoc_topics": text}
    if SECOND_TEXT.is_file():
        texts[SECOND_TEXT.name] = SECOND_TEXT.read_text()
    result["llama_cpp"] = llama_cpp_check(pre.info["path"], pre.tokenizer, texts, ids, ours)
    result["command"] = ("python -m experiments.crosscheck --model " + args.model +
                         f" --tokens {args.tokens} --out {display_path(out)}")
    write_json(out / "crosscheck.json", result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
