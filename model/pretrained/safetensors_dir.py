"""Reading a Hugging Face model folder: config.json, *.safetensors (one file or shards with
model.safetensors.index.json), tokenizer.json. Which family it holds (Llama, DeepSeek-V3.2,
GLM-5) decides how it becomes a dosa model (model.pretrained.registry)."""

import json
import pathlib

import numpy as np

from model.pretrained import fp8
from model.pretrained.deepseek_v4 import FAMILY as DEEPSEEK_V4
from model.pretrained.deepseek_v32 import FAMILY as DEEPSEEK_V32
from model.pretrained.glm_moe_dsa import FAMILY as GLM_MOE_DSA
from model.pretrained.llama import LlamaHParams, PretrainedFormatError

# The DeepSeek-style families (model.pretrained.mla_moe), by model_type.
DSA_FAMILIES = {f.model_type: f for f in (DEEPSEEK_V32, GLM_MOE_DSA, DEEPSEEK_V4)}
# architectures / model_type -> family ("llama" or a DSA_FAMILIES key).
ARCHITECTURES = {"LlamaForCausalLM": "llama",
                 **{f.architecture: f.model_type for f in DSA_FAMILIES.values()}}
MODEL_TYPES = {"llama": "llama", **{name: name for name in DSA_FAMILIES}}


class SafetensorsCheckpoint:
    """A folder holding config.json, one or more *.safetensors and tokenizer.json:
    `.family` ("llama", "deepseek_v32", "glm_moe_dsa", "deepseek_v4"), `.config` (config.json),
    `.hparams` (Llama only), `.read(hf_name)` -> float32 numpy, `.names`, `.tokenizer()`."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{self.path}: no config.json (a Hugging Face model folder "
                                    "holds config.json, *.safetensors and tokenizer.json)")
        try:
            self.config = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise PretrainedFormatError(f"{config_path}: invalid JSON ({e})") from e
        archs = self.config.get("architectures") or []
        family = {ARCHITECTURES[a] for a in archs if a in ARCHITECTURES}
        if not family and self.config.get("model_type") in MODEL_TYPES:
            family = {MODEL_TYPES[self.config["model_type"]]}
        if len(family) != 1:
            raise PretrainedFormatError(
                f"{config_path}: architectures {archs}, model_type "
                f"{self.config.get('model_type')!r}; dosa loads {sorted(ARCHITECTURES)} "
                f"(model_type {sorted(MODEL_TYPES)})")
        self.family = family.pop()
        self._headers = {}
        self.index = self._tensor_index()
        self.files = sorted(set(self.index.values()))
        self.hparams = self._hparams() if self.family == "llama" else None

    @property
    def names(self):
        return tuple(self.index)

    def _tensor_index(self):
        """tensor name -> file: from model.safetensors.index.json's weight_map when there
        is one (every file it names must exist), else from the files' own headers."""
        index_path = self.path / "model.safetensors.index.json"
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise PretrainedFormatError(f"{index_path}: not a safetensors index "
                                            f"({type(e).__name__}: {e})") from e
            out = {}
            for name, file in weight_map.items():
                out[name] = self.path / file
                if not out[name].is_file():
                    raise PretrainedFormatError(f"{index_path}: tensor {name} is in {file}, "
                                                "which is not in the folder")
            return out
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors file")
        return {name: f for f in files for name in self._keys(f)}

    @staticmethod
    def _keys(file):
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="numpy") as handle:
                return list(handle.keys())
        except Exception as e:
            raise PretrainedFormatError(f"{file}: not a readable safetensors file "
                                        f"({type(e).__name__}: {e})") from e

    def _hparams(self):
        c = self.config

        def get(key, default=KeyError):
            if key not in c:
                if default is KeyError:
                    raise PretrainedFormatError(f"{self.path / 'config.json'}: key {key!r} "
                                                "is missing")
                return default
            return c[key]

        d_model, n_heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return LlamaHParams(
            vocab_size=int(get("vocab_size")), d_model=d_model,
            n_layers=int(get("num_hidden_layers")), n_heads=n_heads,
            n_kv_heads=int(get("num_key_value_heads", n_heads)),
            head_dim=int(get("head_dim", None) or d_model // n_heads),
            d_ff=int(get("intermediate_size")), rope_theta=float(get("rope_theta", 10000.0)),
            norm_eps=float(get("rms_norm_eps", 1e-6)),
            context_length=int(get("max_position_embeddings", 2048)),
            tie_embeddings=bool(get("tie_word_embeddings", False)))

    def read(self, name):
        """Tensor `name` as float32: FP8 e4m3 weights dequantized with their block scales,
        FP4 ones (int8, two e2m1 values per byte) with theirs (model.pretrained.fp8)."""
        stored = self._stored_dtype(name)
        if stored in fp8.PACKED_FP4 and self._scale_name(name) is not None:
            packed = self._read_stored(name)
            scale = self._read_scale(name)
            try:
                return fp8.dequantize_fp4(packed, scale)
            except ValueError as e:
                raise PretrainedFormatError(f"{self.index[name]}: tensor {name}: {e}") from e
        q = self._read_stored(name)
        if q.dtype not in fp8.RAW_DTYPES.values():
            return np.asarray(q, np.float32)
        _, scale, block = self._scales(name, q)
        try:
            return fp8.dequantize(q, scale, block)
        except ValueError as e:
            raise PretrainedFormatError(f"{self.index[name]}: tensor {name}: {e}") from e

    def read_fp8(self, name):
        """An FP8 tensor as stored -> (e4m3 [R, C], f32 block scales, (b_rows, b_cols));
        PretrainedFormatError naming the tensor when it is not FP8 or its scales do not
        cover it."""
        q = self._read_stored(name)
        if q.dtype not in fp8.RAW_DTYPES.values():
            raise PretrainedFormatError(f"{self.index[name]}: tensor {name} is {q.dtype}, not "
                                        "FP8: only an FP8 checkpoint's experts stay in FP8")
        return self._scales(name, q)

    def _stored_dtype(self, name):
        file = self.index.get(name)
        if file is None:
            return None
        try:
            return self._header(file)[0][name][0]
        except Exception:
            return None  # unreadable: _read_stored names the file

    def _read_stored(self, name):
        """Tensor `name` as stored: float32 for numpy-readable dtypes (ints kept for a packed
        FP4 weight), the raw float8 type for FP8 values and ue8m0 scales."""
        file = self.index.get(name)
        if file is None:
            raise PretrainedFormatError(f"{self.path}: tensor {name} is missing: it is in none "
                                        f"of {[f.name for f in self.files]}")
        try:
            header, data_start = self._header(file)
            dtype = header[name][0]
            if dtype in fp8.RAW_DTYPES or dtype in fp8.SCALE_DTYPES:
                return fp8.read_raw(file, header[name], data_start)
            from safetensors import safe_open

            with safe_open(str(file), framework="numpy") as handle:
                value = handle.get_tensor(name)
            return value if dtype in fp8.PACKED_FP4 else np.asarray(value, np.float32)
        except Exception as e:
            raise PretrainedFormatError(f"{file}: tensor {name} cannot be read: "
                                        f"{type(e).__name__}: {e}") from e

    def _scale_name(self, name):
        return next((s for s in fp8.scale_names(name) if s in self.index), None)

    def _read_scale(self, name):
        scale = self._scale_name(name)
        return fp8.scale_values(self._read_stored(scale), self._stored_dtype(scale))

    def _scales(self, name, q):
        file = self.index[name]
        block = fp8.block_size(self.config, self.path / "config.json")
        if block is None or self._scale_name(name) is None:
            raise PretrainedFormatError(f"{file}: tensor {name} is {q.dtype} but the folder "
                                        f"has none of {fp8.scale_names(name)} / no fp8 "
                                        "quantization_config")
        scale_inv = self._read_scale(name)
        want = tuple(-(-n // b) for n, b in zip(q.shape, block))
        if tuple(scale_inv.shape) != want:
            raise PretrainedFormatError(
                f"{file}: tensor {name}: scale_inv has shape {tuple(scale_inv.shape)}, a "
                f"{list(q.shape)} matrix in blocks of {block} needs {want}")
        return q, scale_inv, block

    def _header(self, file):
        if file not in self._headers:
            self._headers[file] = fp8.read_header(file)
        return self._headers[file]

    def tokenizer(self, chat_format=None):
        from model.pretrained.tokenizer import tokenizer_from_hf_folder

        return tokenizer_from_hf_folder(self.path, self.config, chat_format)
