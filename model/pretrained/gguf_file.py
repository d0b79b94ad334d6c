"""Reading a llama.cpp GGUF file: hyper-parameters, dequantized tensors, tokenizer.

GGUF stores linear weights [out, in] (numpy order) and permutes the rows of attn_q / attn_k
per head so that llama.cpp's RoPE rotates adjacent pairs; `unpermute_rope_rows` puts them
back in the Hugging Face (rotate-half) order that dosa's RoPE uses.
"""

import pathlib

import numpy as np

from model.pretrained.llama import LlamaHParams, PretrainedFormatError

GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_BLOCK_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name):
    """GGUF tensor name -> Hugging Face name (None for tensors dosa does not use)."""
    if gguf_name in GGUF_TO_HF:
        return GGUF_TO_HF[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_BLOCK_TO_HF:
        return f"model.layers.{parts[1]}.{GGUF_BLOCK_TO_HF[parts[2]]}"
    return None


def permute_rope_rows(w, n_heads):
    """HF (rotate-half) rows -> llama.cpp (adjacent pairs) rows, per head: w [H * D, in]."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def unpermute_rope_rows(w, n_heads):
    """The inverse of permute_rope_rows: llama.cpp rows -> HF rows."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


class GGUFCheckpoint:
    """One GGUF file: `.hparams` (LlamaHParams), `.read(hf_name)` -> float32 numpy in HF
    layout, `.metadata(key)`, `.tokenizer()`."""

    def __init__(self, path):
        import gguf

        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # truncated or not a GGUF: the reader fails in many ways
            raise PretrainedFormatError(f"{self.path}: not a readable GGUF file "
                                        f"({type(e).__name__}: {e})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch = self.metadata("general.architecture")
        if arch != "llama":
            raise PretrainedFormatError(f"{self.path}: general.architecture is {arch!r}; dosa "
                                        "loads 'llama' GGUF files")
        self.hparams = self._hparams()

    def metadata(self, key, default=KeyError):
        field = self.reader.fields.get(key)
        if field is None:
            if default is KeyError:
                raise PretrainedFormatError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return field.contents()

    def _float(self, key, default):
        # GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06. The shortest
        # decimal that rounds to the same float32 is the value the checkpoint meant.
        return float(str(np.float32(self.metadata(key, default))))

    def _hparams(self):
        m = lambda k, *d: self.metadata(f"llama.{k}", *d)  # noqa: E731
        d_model, n_heads = int(m("embedding_length")), int(m("attention.head_count"))
        head_dim = int(m("rope.dimension_count", d_model // n_heads))
        vocab = self.metadata("llama.vocab_size", None)
        if vocab is None:
            vocab = len(self.metadata("tokenizer.ggml.tokens"))
        return LlamaHParams(
            vocab_size=int(vocab), d_model=d_model, n_layers=int(m("block_count")),
            n_heads=n_heads, n_kv_heads=int(m("attention.head_count_kv", n_heads)),
            head_dim=head_dim, d_ff=int(m("feed_forward_length")),
            rope_theta=self._float("llama.rope.freq_base", 10000.0),
            norm_eps=self._float("llama.attention.layer_norm_rms_epsilon", KeyError),
            context_length=int(m("context_length")),
            tie_embeddings="output.weight" not in self.tensors)

    def read(self, name):
        """A tensor by its Hugging Face name, dequantized to float32, HF layout."""
        import gguf

        gguf_name = next((g for g in self.tensors if hf_name(g) == name), None)
        if gguf_name is None:
            raise PretrainedFormatError(f"{self.path}: tensor for {name} is missing")
        t = self.tensors[gguf_name]
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise PretrainedFormatError(f"{self.path}: tensor {gguf_name} ({t.tensor_type.name}) "
                                        f"cannot be read: {type(e).__name__}: {e}") from e
        array = np.asarray(array, np.float32).reshape(tuple(int(s) for s in t.shape[::-1]))
        hp = self.hparams
        if gguf_name.endswith("attn_q.weight"):
            array = unpermute_rope_rows(array, hp.n_heads)
        elif gguf_name.endswith("attn_k.weight"):
            array = unpermute_rope_rows(array, hp.n_kv_heads)
        return array

    def tokenizer(self):
        from model.pretrained.tokenizer import tokenizer_from_gguf_metadata

        return tokenizer_from_gguf_metadata(self.metadata, source=self.path)
