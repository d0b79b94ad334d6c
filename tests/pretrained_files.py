"""Tiny Llama checkpoints written in both formats (Hugging Face folder, GGUF) for tests."""

import json

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from model.pretrained import hf_tensor_shapes
from model.pretrained.llama import LlamaHParams

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("Ġ", "t")]
HP = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
          rope_theta=10000.0, norm_eps=1e-5, context_length=256, tie_embeddings=True)


def tiny_vocab():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = SPECIAL + alphabet + ["".join(m) for m in MERGES]
    return tokens


def hf_weights(hp, seed):
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * (0.3 if len(shape) == 2 else 0.1) +
                   (1.0 if len(shape) == 1 else 0.0)).astype(np.float32)
            for name, shape in hf_tensor_shapes(hp).items()}


def llama_cpp_permute(w, n_head):
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, written out independently
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_hf_folder(path, hp, weights, tokens):
    path.mkdir()
    config = dict(architectures=["LlamaForCausalLM"], vocab_size=hp.vocab_size,
                  hidden_size=hp.d_model, num_hidden_layers=hp.n_layers,
                  num_attention_heads=hp.n_heads, num_key_value_heads=hp.n_kv_heads,
                  intermediate_size=hp.d_ff, rope_theta=hp.rope_theta, rms_norm_eps=hp.norm_eps,
                  max_position_embeddings=hp.context_length, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    half = len(names) // 2  # two shards, as large checkpoints come
    save_file({n: weights[n] for n in names[:half]}, str(path / "model-00001.safetensors"))
    save_file({n: weights[n] for n in names[half:]}, str(path / "model-00002.safetensors"))
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(path / "tokenizer.json"))


def write_gguf(path, hp, weights, tokens):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(hp.n_layers)
    w.add_context_length(hp.context_length)
    w.add_embedding_length(hp.d_model)
    w.add_feed_forward_length(hp.d_ff)
    w.add_head_count(hp.n_heads)
    w.add_head_count_kv(hp.n_kv_heads)
    w.add_rope_freq_base(hp.rope_theta)
    w.add_layer_norm_rms_eps(hp.norm_eps)
    w.add_vocab_size(hp.vocab_size)
    w.add_rope_dimension_count(hp.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight"}
    block = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(hp.n_layers):
        for theirs, ours in block.items():
            names[f"model.layers.{i}.{theirs}.weight"] = f"blk.{i}.{ours}.weight"
    for hf, array in weights.items():
        if hf.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, hp.n_heads)
        elif hf.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, hp.n_kv_heads)
        w.add_tensor(names[hf], array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_tiny_checkpoints(tmp, seed=3):
    """-> (hparams, HF weights); writes tmp/hf (a folder) and tmp/tiny.gguf."""
    tokens = tiny_vocab()
    hp = LlamaHParams(vocab_size=len(tokens), **HP)
    weights = hf_weights(hp, seed=seed)
    write_hf_folder(tmp / "hf", hp, weights, tokens)
    write_gguf(tmp / "tiny.gguf", hp, weights, tokens)
    return hp, weights


def tiny_training_setup(tmp, monkeypatch, module):
    """A tiny GGUF in `tmp` for a training command (`module`: its list_documents reads the
    first 40 corpus documents only; downloads go to tmp/cache) -> the GGUF's path."""
    make_tiny_checkpoints(tmp)
    monkeypatch.setenv("DOSA_CACHE_DIR", str(tmp / "cache"))
    few = module.list_documents()[:40]
    monkeypatch.setattr(module, "list_documents", lambda: few)
    return str(tmp / "tiny.gguf")
