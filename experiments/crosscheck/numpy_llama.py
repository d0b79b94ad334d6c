"""An independent float32 forward of a llama GGUF in plain numpy (no dosa model code).

It reads the file with `gguf` itself and keeps llama.cpp's conventions: the attn_q / attn_k
rows stay permuted and RoPE rotates adjacent pairs (x[2i], x[2i+1]), where dosa undoes the
permutation and rotates halves; the two agree only if both are right.
"""

import gguf
import numpy as np


class NumpyLlama:
    def __init__(self, path):
        reader = gguf.GGUFReader(str(path))
        meta = {k: f.contents() for k, f in reader.fields.items()
                if k.startswith("llama.") or k == "general.architecture"}
        self.n_layers = int(meta["llama.block_count"])
        self.n_heads = int(meta["llama.attention.head_count"])
        self.n_kv = int(meta["llama.attention.head_count_kv"])
        self.d = int(meta["llama.embedding_length"])
        self.hd = self.d // self.n_heads
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        self.theta = float(meta["llama.rope.freq_base"])
        self.w = {}
        for t in reader.tensors:
            shape = tuple(int(s) for s in t.shape[::-1])
            self.w[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                        np.float32).reshape(shape)

    def _norm(self, x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + self.eps) * g

    def _rope_pairs(self, x, pos):
        # x: [T, H, hd]; rotates (x[2i], x[2i+1]) by pos * theta^(-2i/hd)
        inv = self.theta ** (-np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        ang = (pos[:, None] * inv[None, :]).astype(np.float32)
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out

    def logits(self, ids):
        """ids: int[T] -> f32[T, V], positions 0..T-1, causal."""
        ids = np.asarray(ids)
        T = ids.shape[0]
        pos = np.arange(T, dtype=np.float64)
        emb = self.w["token_embd.weight"]
        x = emb[ids]
        mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)
        rep = self.n_heads // self.n_kv
        for i in range(self.n_layers):
            p = f"blk.{i}."
            h = self._norm(x, self.w[p + "attn_norm.weight"])
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(T, self.n_heads, self.hd)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(T, self.n_kv, self.hd)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(T, self.n_kv, self.hd)
            q, k = self._rope_pairs(q, pos), self._rope_pairs(k, pos)
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            att = np.einsum("thd,shd->hts", q, k) / np.sqrt(self.hd) + mask[None]
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", att, v).reshape(T, self.d)
            x = x + o @ self.w[p + "attn_output.weight"].T
            h = self._norm(x, self.w[p + "ffn_norm.weight"])
            g = h @ self.w[p + "ffn_gate.weight"].T
            u = h @ self.w[p + "ffn_up.weight"].T
            x = x + ((g / (1 + np.exp(-g))) * u) @ self.w[p + "ffn_down.weight"].T
        x = self._norm(x, self.w["output_norm.weight"])
        out = self.w.get("output.weight", emb)
        return (x @ out.T).astype(np.float32)
