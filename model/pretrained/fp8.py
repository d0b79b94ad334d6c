"""FP8 (e4m3) checkpoint weights with block scales, as DeepSeek-V3.2 and GLM-5 release them.

config.json's `quantization_config` (quant_method "fp8", fmt "e4m3", weight_block_size
[b_rows, b_cols]) says that each quantized matrix W [R, C] is stored as e4m3 values Q
beside a float32 `<name>_scale_inv` S of shape [ceil(R / b_rows), ceil(C / b_cols)], with
W[i, j] = Q[i, j] x S[i // b_rows, j // b_cols]. Norms, the router, the embeddings and
lm_head stay in bf16 / f32. safetensors' numpy reader has no float8 type, so e4m3 tensors
are read from the file's bytes here (ml_dtypes, which JAX ships).
"""

import json
import math
import struct

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = float(ml_dtypes.finfo(E4M3).max)  # 448
RAW_DTYPES = {"F8_E4M3": E4M3, "F8_E5M2": ml_dtypes.float8_e5m2}
SCALE_SUFFIX = "_scale_inv"


def block_size(config, source):
    """(b_rows, b_cols) of config.json's fp8 quantization_config, or None (not quantized).
    ValueError naming `source` for another method or format."""
    q = config.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{source}: quantization_config {q}: dosa reads fp8 e4m3 with block "
                         "scales")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{source}: quantization_config.weight_block_size must be two positive "
                         f"ints, got {block!r}")
    return tuple(block)


def dequantize(q, scale_inv, block):
    """W = Q x S per block -> float32 [R, C] (q: e4m3 [R, C]; scale_inv f32 [ceil(R / b0),
    ceil(C / b1)]). ValueError when the scale grid does not cover the matrix."""
    R, C = q.shape
    b0, b1 = block
    want = (math.ceil(R / b0), math.ceil(C / b1))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, a [{R}, {C}] matrix in "
                         f"blocks of {block} needs {want}")
    scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), b0, 0), b1, 1)[:R, :C]
    return q.astype(np.float32) * scale


def quantize(w, block):
    """float W [R, C] -> (Q e4m3 [R, C], S f32 [ceil(R / b0), ceil(C / b1)]): each block's
    largest |value| maps to e4m3's maximum (DeepSeek's scheme; S = amax / 448)."""
    R, C = w.shape
    b0, b1 = block
    rows, cols = math.ceil(R / b0), math.ceil(C / b1)
    padded = np.zeros((rows * b0, cols * b1), np.float32)
    padded[:R, :C] = w
    amax = np.abs(padded.reshape(rows, b0, cols, b1)).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale_inv, b0, 0), b1, 1)[:R, :C]
    return (np.asarray(w, np.float32) / full).astype(E4M3), scale_inv


def read_header(file):
    """{name: (dtype string, shape, (start, end))} of a safetensors file, and the offset of
    its data."""
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), tuple(v["data_offsets"]))
            for k, v in header.items()}, 8 + n


def read_raw(file, entry, data_start):
    """One tensor of a dtype numpy lacks (RAW_DTYPES) from the file's bytes."""
    dtype, shape, (start, end) = entry
    raw = np.fromfile(file, dtype=np.uint8, count=end - start, offset=data_start + start)
    return raw.view(RAW_DTYPES[dtype]).reshape(shape)
