"""Reading a Hugging Face Llama folder: config.json, *.safetensors, tokenizer.json."""

import json
import pathlib

import numpy as np

from model.pretrained.llama import LlamaHParams, PretrainedFormatError

ARCHITECTURES = ("LlamaForCausalLM",)


class SafetensorsCheckpoint:
    """A folder holding config.json, one or more *.safetensors and tokenizer.json:
    `.hparams`, `.read(hf_name)` -> float32 numpy, `.tokenizer()`."""

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
        if not set(archs) & set(ARCHITECTURES):
            raise PretrainedFormatError(f"{config_path}: architectures {archs}; dosa loads "
                                        f"{list(ARCHITECTURES)}")
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors file")
        self.index = {}
        for f in self.files:
            for name in self._keys(f):
                self.index[name] = f
        self.hparams = self._hparams()

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
        from safetensors import safe_open

        file = self.index.get(name)
        if file is None:
            raise PretrainedFormatError(f"{self.path}: tensor {name} is in none of "
                                        f"{[f.name for f in self.files]}")
        try:
            with safe_open(str(file), framework="numpy") as handle:
                return np.asarray(handle.get_tensor(name), np.float32)
        except Exception as e:
            raise PretrainedFormatError(f"{file}: tensor {name} cannot be read: "
                                        f"{type(e).__name__}: {e}") from e

    def tokenizer(self):
        from model.pretrained.tokenizer import tokenizer_from_hf_folder

        return tokenizer_from_hf_folder(self.path, self.config)
