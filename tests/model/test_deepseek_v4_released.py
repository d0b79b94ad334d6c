"""DeepSeek-V4 as released (tests/fixtures/deepseek_v4/released: the tiny fixture with FP8
attention and FP4 experts in two shards): its logits and greedy tokens equal transformers'
on the dequantized weights, and a wrong or missing scale is named with its file and tensor."""

import json
import pathlib
import shutil

import numpy as np
import pytest

from model import ModelRunner
from model.pretrained.llama import PretrainedFormatError
from model.pretrained.registry import load_pretrained
from tests.model.test_deepseek_v4_model import FIXTURE, _close

RELEASED = FIXTURE.parent / "released"


@pytest.mark.slow  # 7 s (the formats alone: tests/model/test_fp8.py)
def test_the_released_form_with_fp8_attention_and_fp4_experts_equals_transformers():
    """tests/fixtures/deepseek_v4/released: the fixture as the releases store it (released
    keys and names, two shards, FP8 e4m3 linears with ue8m0 `.scale` blocks of 128, FP4
    e2m1 routed experts packed two per byte with a ue8m0 scale per 32 values, an MTP layer)
    loads to transformers' logits on the dequantized weights within 1e-4 x max |logit|
    (transformers' own from_pretrained of the folder gave the same logits: reference.json)."""
    reference = np.load(RELEASED / "reference.npz")
    made = json.loads((RELEASED / "reference.json").read_text())
    assert made["quantized_tensors"] == {"fp8": 46, "fp4": 96}
    assert made["transformers_loading_the_released_folder"][
        "from_pretrained_max_abs_difference_prompt_0"] == 0.0
    loaded = load_pretrained(RELEASED, dtype="float32")
    assert loaded.model.config.v4.layer_types == ("sliding", "csa", "hca", "csa")
    logits = ModelRunner(loaded.model).prefill(reference["prompt_0"], logits_from=0)[0]
    _close(logits, reference["logits_0"], "released form, prompt 0")


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [1, 2])
def test_the_released_form_generates_transformers_greedy_tokens(prompt):
    reference = np.load(RELEASED / "reference.npz")
    runner = ModelRunner(load_pretrained(RELEASED, dtype="float32").model)
    tokens = reference[f"prompt_{prompt}"]
    _close(runner.prefill(tokens, logits_from=0)[0], reference[f"logits_{prompt}"],
           f"released form, prompt {prompt}")
    assert list(runner.generate(tokens, 8)) == reference[f"greedy_{prompt}"].tolist()


def _rewrite_tensor(file, name, shape, keep_bytes):
    """The safetensors `file` with tensor `name` re-declared as `shape`, its first
    keep_bytes bytes kept (a misshapen tensor as a broken conversion would write)."""
    from model.pretrained.fp8 import read_header

    header, start = read_header(file)
    data = pathlib.Path(file).read_bytes()[start:]
    out, chunks, offset = {}, [], 0
    for key, (dtype, key_shape, (a, b)) in header.items():
        raw = data[a:b]
        if key == name:
            raw, key_shape = raw[:keep_bytes], shape
        out[key] = {"dtype": dtype, "shape": list(key_shape),
                    "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(out).encode()
    text += b" " * (-len(text) % 8)
    pathlib.Path(file).write_bytes(len(text).to_bytes(8, "little") + text + b"".join(chunks))


def test_a_missing_or_misshapen_scale_names_the_file_and_the_tensor(tmp_path):

    folder = tmp_path / "released"
    shutil.copytree(RELEASED, folder)
    shard = folder / "model-00002-of-00002.safetensors"
    _rewrite_tensor(shard, "layers.2.ffn.experts.3.w1.scale", (32, 1), 32)  # [32, 2] in file
    with pytest.raises(PretrainedFormatError, match=r"model-00002-of-00002.safetensors: tensor "
                       r"layers.2.ffn.experts.3.w1.weight: scale has shape \(32, 1\)"):
        load_pretrained(folder, dtype="float32")
    index = json.loads((RELEASED / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.1.attn.wq_b.scale"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(RELEASED / shard.name, shard)
    with pytest.raises(PretrainedFormatError, match=r"model-00001-of-00002.safetensors: tensor "
                       r"layers.1.attn.wq_b.weight is float8_e4m3fn but the folder has none "
                       r"of \['layers.1.attn.wq_b.weight_scale_inv', 'layers.1.attn.wq_b.scale'"):
        load_pretrained(folder, dtype="float32")
