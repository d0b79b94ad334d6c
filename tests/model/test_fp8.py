"""FP8 (e4m3 + float32 block scales) checkpoints: model.pretrained.fp8 against plain numpy,
and the FP8 copy of the V3.2 fixture (experiments/crosscheck/quantize_fp8.py, blocks of
16 x 16 over matrices 16-128 wide, some not multiples of 16) loaded through the folder
reader."""

import json
import pathlib
import struct

import ml_dtypes
import numpy as np
import pytest

from model.pretrained import PretrainedFormatError, load_pretrained
from model.pretrained.fp8 import SCALE_SUFFIX, dequantize, quantize
from model.pretrained.safetensors_dir import SafetensorsCheckpoint

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "dsa"
FP8 = FIXTURES / "deepseek_v32_fp8"


def _raw_tensors(file):
    """Every tensor of a safetensors file from its bytes (numpy + ml_dtypes, no safetensors)."""
    data = pathlib.Path(file).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    kinds = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32}
    return {name: np.frombuffer(data[8 + n + e["data_offsets"][0]:8 + n + e["data_offsets"][1]],
                                kinds[e["dtype"]]).reshape(e["shape"])
            for name, e in header.items() if e["dtype"] in kinds}


def test_quantize_keeps_each_block_within_e4m3_precision():
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(37, 70)) * rng.uniform(0.01, 10, size=(37, 1))).astype(np.float32)
    q, s = quantize(w, (16, 32))
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (3, 3)
    back = dequantize(q, s, (16, 32))
    for i in range(3):
        for j in range(3):
            block = np.s_[16 * i:16 * (i + 1), 32 * j:32 * (j + 1)]
            amax = np.abs(w[block]).max()
            # 3 mantissa bits: half an ulp of e4m3 is 2^-4 of the value (and of 448 x scale)
            assert np.all(np.abs(back[block] - w[block]) <= 2 ** -4 * np.abs(w[block])
                          + 2 ** -9 * amax)
    with pytest.raises(ValueError, match=r"scale_inv has shape \(3, 3\), .* needs \(2, 3\)"):
        dequantize(q, s, (32, 32))


def test_the_fp8_folder_reads_as_its_dequantized_blocks():
    checkpoint = SafetensorsCheckpoint(FP8)
    assert checkpoint.config["quantization_config"]["weight_block_size"] == [16, 16]
    raw = {}
    for f in checkpoint.files:
        raw.update(_raw_tensors(f))
    quantized = [n for n in raw if n + SCALE_SUFFIX in raw]
    assert len(quantized) == 113
    for name in quantized:
        q, s = raw[name].astype(np.float32), raw[name + SCALE_SUFFIX]
        want = np.empty_like(q)
        for i in range(q.shape[0]):
            for j in range(q.shape[1]):
                want[i, j] = q[i, j] * s[i // 16, j // 16]
        np.testing.assert_array_equal(checkpoint.read(name), want)
    assert any(raw[n].shape[0] % 16 or raw[n].shape[1] % 16 for n in quantized)  # edge blocks
    # Loaded: bf16 by default (FP8 is dequantized into the checkpoint's compute dtype).
    assert load_pretrained(FP8).model.config.dtype == "bfloat16"


def test_a_scale_grid_that_does_not_fit_names_the_tensor(tmp_path):
    for f in FP8.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((FP8 / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [32, 32]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PretrainedFormatError, match=r"tensor model\.layers\.\d+\..*weight: "
                                                    r"scale_inv has shape"):
        load_pretrained(tmp_path)


@pytest.mark.slow  # a heavy equivalence: default-tier headroom
def test_fp8_experts_stay_fp8_and_match_the_dequantized_model():
    """load_pretrained(fp8_experts=True): the routed experts are the file's e4m3 bytes and
    scales (transposed into dosa's layout), the model's logits those of the model whose
    experts were dequantized on load (float32 compute, so only the summation order of the
    dequantization differs), and their bytes a quarter of float32's."""
    from flax import nnx

    from model import ModelRunner

    kept = load_pretrained(FP8, dtype="float32", fp8_experts=True).model
    whole = load_pretrained(FP8, dtype="float32").model
    raw = {}
    for f in SafetensorsCheckpoint(FP8).files:
        raw.update(_raw_tensors(f))
    layer = next(i for i in range(kept.config.n_layers)
                 if hasattr(kept.layer(i).mlp, "gate_scale"))
    mlp = kept.layer(layer).mlp
    assert mlp.gate.get_value().dtype == ml_dtypes.float8_e4m3fn
    name = f"model.layers.{layer}.mlp.experts.3.down_proj.weight"
    np.testing.assert_array_equal(np.asarray(mlp.down.get_value()[3]).view(np.uint8),
                                  raw[name].T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(mlp.down_scale.get_value()[3]),
                                  raw[name + SCALE_SUFFIX].T)
    tokens = np.load(FIXTURES / "deepseek_v32" / "reference.npz")["prompt_2"]
    got, _ = ModelRunner(kept).prefill(tokens, logits_from=0)
    want, _ = ModelRunner(whole).prefill(tokens, logits_from=0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    def expert_bytes(model):
        return sum(x.nbytes for path, x in nnx.to_flat_state(nnx.state(model))
                   if path[-1] in ("gate", "up", "down") and "shared" not in path)

    assert 4 * expert_bytes(kept) == expert_bytes(whole)
    with pytest.raises(ValueError, match="fp8_experts=True needs an FP8 checkpoint"):
        load_pretrained(FIXTURES / "deepseek_v32", fp8_experts=True)
