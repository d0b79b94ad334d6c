"""Writes an FP8 copy of a Hugging Face DSA folder the way DeepSeek releases them: every
projection matrix as e4m3 with float32 block scales (`<name>_scale_inv`), the block size in
config.json's quantization_config; embeddings, lm_head, norms, the router and the indexer's
weights_proj stay float32 (model.pretrained.fp8 reads it back).

    python -m experiments.crosscheck.quantize_fp8 --src tests/fixtures/dsa/deepseek_v32 \
        --out tests/fixtures/dsa/deepseek_v32_fp8 --block 16,16

A block smaller than the matrices (16 x 16 on the tiny fixtures, whose matrices are 16 to 128
wide, some not multiples of 16) exercises several blocks and partial edge blocks.
"""

import argparse
import json
import pathlib
import shutil

import numpy as np

from model.pretrained.fp8 import SCALE_SUFFIX, quantize

KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "weights_proj", "eh_proj")


def quantized(name, array):
    """Whether tensor `name` is stored in FP8 (projection matrices only)."""
    return array.ndim == 2 and name.endswith(".weight") and not any(k in name for k in KEPT)


def main(argv=None):
    from safetensors.numpy import load_file, save_file

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--block", default="128,128", help="rows,cols of a scale block")
    args = p.parse_args(argv)
    src, out = pathlib.Path(args.src), pathlib.Path(args.out)
    block = tuple(int(x) for x in args.block.split(","))
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weight_map, count = {}, 0
    for file in sorted(src.glob("*.safetensors")):
        tensors = {}
        for name, array in load_file(str(file)).items():
            if quantized(name, array):
                tensors[name], tensors[name + SCALE_SUFFIX] = quantize(array, block)
                count += 1
            else:
                tensors[name] = array
        save_file(tensors, str(out / file.name))
        weight_map.update(dict.fromkeys(tensors, file.name))
    if (src / "model.safetensors.index.json").is_file():
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    for f in src.iterdir():
        if f.suffix in (".jinja",) or f.name.startswith(("tokenizer", "generation_config")):
            shutil.copy(f, out / f.name)
    for f in out.iterdir():
        f.chmod(0o644)
    print(f"wrote {out}: {count} matrices in e4m3 with {block} block scales")


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
