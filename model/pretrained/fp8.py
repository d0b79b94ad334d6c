"""FP8 (e4m3) and FP4 (e2m1) checkpoint weights with block scales, as DeepSeek-V3.2, GLM-5
and DeepSeek-V4 release them.

config.json's `quantization_config` (quant_method "fp8", fmt "e4m3", weight_block_size
[b_rows, b_cols]) says that each quantized matrix W [R, C] is stored as e4m3 values Q
beside its scales S of shape [ceil(R / b_rows), ceil(C / b_cols)], with
W[i, j] = Q[i, j] x S[i // b_rows, j // b_cols]. V3.2 and GLM-5 name the scales
`<name>_scale_inv` (`X.weight_scale_inv`, float32); DeepSeek-V4 names them `X.scale` and
stores powers of two as ue8m0 (float8_e8m0fnu, or its bytes: 2^(byte - 127)). V4's routed
experts are FP4 (`expert_dtype` "fp4"): `X.weight` int8 [R, C / 2], two e2m1 values per
byte (low nibble first), and `X.scale` [R, C / 32], one ue8m0 scale per 32 values of a row
(transformers' integrations/finegrained_fp8.py reads both the same way). Norms, the router,
the embeddings and lm_head stay in bf16 / f32. safetensors' numpy reader has no float8
type, so those tensors are read from the file's bytes here (ml_dtypes, which JAX ships).
"""

import json
import math
import struct

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = float(ml_dtypes.finfo(E4M3).max)  # 448
RAW_DTYPES = {"F8_E4M3": E4M3, "F8_E5M2": ml_dtypes.float8_e5m2}
SCALE_DTYPES = {"F8_E8M0": ml_dtypes.float8_e8m0fnu}  # read raw, used as float32
PACKED_FP4 = ("I8", "U8")  # stored dtypes of a packed FP4 weight (beside its scales)
FP4_GROUP = 32  # values of a row per FP4 scale
SCALE_SUFFIX = "_scale_inv"
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def scale_names(name):
    """Where a weight's scales may be: `<name>_scale_inv` (V3.2, GLM-5), `X.scale` for
    `X.weight` (DeepSeek-V4)."""
    out = [name + SCALE_SUFFIX]
    if name.endswith(".weight"):
        out.append(name.removesuffix(".weight") + ".scale")
    return out


def scale_values(raw, stored_dtype):
    """Scales as float32: ue8m0 bytes (uint8) are 2^(byte - 127); float8_e8m0fnu, bf16 and
    f32 are their values."""
    if stored_dtype == "U8":
        return np.exp2(raw.astype(np.float32) - 127.0)
    return np.asarray(raw, np.float32)


def dequantize_fp4(packed, scales):
    """W [R, C] float32 from FP4 bytes packed [R, C / 2] (e2m1, low nibble first) and
    scales [R, C / FP4_GROUP] (one per 32 values of a row). ValueError when they do not
    fit."""
    u8 = np.asarray(packed).view(np.uint8)
    R, half = u8.shape
    C = 2 * half
    want = (R, -(-C // FP4_GROUP))
    if tuple(scales.shape) != want:
        raise ValueError(f"scale has shape {tuple(scales.shape)}, FP4 values [{R}, {C}] in "
                         f"groups of {FP4_GROUP} need {want}")
    values = E2M1[np.stack([u8 & 0xF, u8 >> 4], axis=-1)].reshape(R, C)
    return values * np.repeat(np.asarray(scales, np.float32), FP4_GROUP, 1)[:, :C]


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
    """One tensor of a dtype numpy lacks (RAW_DTYPES, SCALE_DTYPES) from the file's bytes."""
    dtype, shape, (start, end) = entry
    raw = np.fromfile(file, dtype=np.uint8, count=end - start, offset=data_start + start)
    return raw.view({**RAW_DTYPES, **SCALE_DTYPES}[dtype]).reshape(shape)
