"""Reference fixtures for two DeepSeek-sparse-attention families, from Hugging Face transformers.

Builds tiny random float32 models with transformers 5.23's own DeepseekV32ForCausalLM
(`deepseek_v32`) and GlmMoeDsaForCausalLM (`glm_moe_dsa`, GLM-5), eager attention, and writes
`<out>/<family>/`: config.json; weights under the RELEASED checkpoint names (per-expert
gate/up/down_proj, what transformers' conversion maps FROM) plus multi-token-prediction tensors a
loader must skip, reloading in transformers to identical logits; a 512-token byte-level BPE
tokenizer (+ chat template for GLM-5); reference.npz (prompts, logits, indexer top-k indices and
scores, greedy tokens); reference.json (versions, seeds, configs, checks, near-tie gaps, notes).

Reference environment (never dosa's .venv), system Python 3.11; jinja2 renders chat templates:
  python3.11 -m venv /work/refenv && /work/refenv/bin/pip install \\
      /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl \\
      'transformers==5.23.*' safetensors tokenizers numpy jinja2
  /work/refenv/bin/python -m experiments.crosscheck.dsa_families --out tests/fixtures/dsa

Tests need neither torch nor a network: they read the committed fixtures. Imports nothing of dosa.
"""

import argparse
import json
import logging
import os
import re
import sys
import tempfile

import numpy as np
import safetensors
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.core_model_loading import revert_weight_conversion

SIZES = dict(
    vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    index_head_dim=16, index_topk=16, max_position_embeddings=256, rms_norm_eps=1e-6,
    tie_word_embeddings=False)
# Key names as transformers 5.23 checks them (modeling_rope_utils._validate_yarn_rope_parameters).
YARN_V32 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
            "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale_all_dim": 1.0}
YARN_GLM = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "mscale": 1.0,
            "original_max_position_embeddings": 32, "mscale_all_dim": 1.0}
# DeepSeek keeps BOS/EOS at ids 0/1 and its chat markers after the text vocabulary; GLM keeps all
# its special tokens after the text vocabulary, in the released order.
V32_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
V32_MARKERS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
GLM_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>"]
# Simplified GLM-4.5/GLM-5-style template, written offline (the public one is not reachable).
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>\n{{ m.content }}"
    "{%- elif m.role == 'user' -%}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>\n"
    "<think>{{ m.reasoning_content | default('') }}</think>\n{{ m.content }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '\\n<think></think>' }}"
    "{%- endif -%}{%- endif -%}")
# Weight seeds: picked by a small scan (1-13) for few rejected prompt draws, balanced experts.
FAMILIES = {
    "deepseek_v32": dict(
        cfg_cls=DeepseekV32Config, model_cls=DeepseekV32ForCausalLM, weight_seed=8,
        kwargs=dict(num_hidden_layers=3, index_n_heads=4, n_group=4, topk_group=2,
                    rope_parameters=YARN_V32, bos_token_id=0, eos_token_id=1)),
    "glm_moe_dsa": dict(
        cfg_cls=GlmMoeDsaConfig, model_cls=GlmMoeDsaForCausalLM, weight_seed=11,
        kwargs=dict(num_hidden_layers=4, index_n_heads=2, n_group=1, topk_group=1,
                    index_topk_freq=2, index_skip_topk_offset=1, rope_parameters=YARN_GLM,
                    bos_token_id=None, eos_token_id=[500, 507, 509], pad_token_id=500)),
}
PROMPT_LENGTHS = (40, 57, 64)
PROMPT_SEED, CALIB_SEED, NEW_TOKENS, TIE_TOL, MAX_DRAWS = 7, 12345, 8, 1e-4, 200
STD, EMB_MEAN_STD, NORM_STD, BIAS_STD = 0.3, 1.0, 0.1, 0.1
MASKED = torch.finfo(torch.float32).min  # eager causal mask; index_scores + mask == MASKED exactly


class IndexerTap:
    """Keeps, per indexer call, the tensor it hands to `topk` (the scores), its `F.relu` input,
    its head weights and the indices it returns. Reimplements nothing: `Tensor.topk` and `F.relu`
    are wrapped only while an indexer runs."""

    def __init__(self, model):
        self.calls = []
        for layer in model.model.layers:
            ix = layer.self_attn.indexer
            if ix is not None:  # GLM-5 "shared" layers have none
                ix.register_forward_pre_hook(self._enter)
                ix.register_forward_hook(self._leave)
                ix.weights_proj.register_forward_hook(
                    lambda m, i, o: self.calls[-1].update(weights=o.clone()))

    def _enter(self, module, args):
        rec, self._saved = {"layer": module.layer_idx}, (torch.Tensor.topk, F.relu)
        self.calls.append(rec)
        topk, relu = self._saved

        def topk_rec(t, *a, **k):
            assert "scores" not in rec, "indexer called topk twice"
            return topk(rec.setdefault("scores", t.clone()), *a, **k)
        torch.Tensor.topk = topk_rec
        F.relu = lambda t, *a, **k: relu(rec.setdefault("pre_relu", t.clone()), *a, **k)

    def _leave(self, module, args, output):
        torch.Tensor.topk, F.relu = self._saved
        self.calls[-1]["indices"] = output.clone()

    def forward(self, model, ids):
        """One no-cache forward; returns logits and {layer: call record}."""
        self.calls = []
        with torch.no_grad():
            logits = model(torch.as_tensor(ids), use_cache=False).logits
        return logits, {c["layer"]: c for c in self.calls}


def randomize(model, seed):
    """Re-initialises every parameter and the router bias buffer so outputs are well spread."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda shape, std: std * torch.randn(shape, generator=g)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("inv_freq"):
                continue  # RoPE tables, derived from the config
            if re.search(r"norm\.weight$", name):
                t.copy_(1.0 + rand(t.shape, NORM_STD))
            elif name.endswith(("k_norm.bias", "e_score_correction_bias")):
                t.copy_(rand(t.shape, BIAS_STD))  # non-zero: it must only steer the expert choice
            elif name == "model.embed_tokens.weight":
                # A shared offset gives the residual stream a common direction (as trained models
                # have). In a zero-mean stream the ReLU clips every indexer head for ~1/2^H of the
                # (query, key) pairs, whose scores then tie at exactly 0 across the top-k boundary
                # of nearly every prompt.
                t.copy_(rand(t.shape[1:], EMB_MEAN_STD) + rand(t.shape, STD))
            else:
                t.copy_(rand(t.shape, STD))


def condition(model, tap, ids):
    """Deterministic adjustments on a calibration batch, in layer order (each changes what later
    layers see), against ways a random model makes a poor fixture: (1) indexer heads: flip the sign
    of a head's wq_b rows / weights_proj row where its mean pre-ReLU score / mean weight is
    negative (a flip keeps the N(0, std^2) law), so with the embedding offset heads are mostly
    active and exact-0 scores (all heads clipped) rarely reach the top-k boundary; (2) router:
    subtract each expert's mean sigmoid score from e_score_correction_bias (aux-loss-free load
    balancing, as DeepSeek does), so the offset does not pick the same experts for every token;
    (3) lm_head: project out the mean final hidden direction, so one token does not win
    everywhere."""
    flips, vis = {}, torch.tril(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool))
    with torch.no_grad():
        for layer in model.model.layers:
            ix, gate = layer.self_attn.indexer, getattr(layer.mlp, "gate", None)
            if ix is not None:
                rec, n = tap.forward(model, ids)[1][ix.layer_idx], ix.n_heads
                # pre_relu: [B, S, H, T]; weights: [B, S, H]
                q_flip = [bool(rec["pre_relu"][:, :, h][:, vis].mean() < 0) for h in range(n)]
                w_flip = [bool(rec["weights"][..., h].mean() < 0) for h in range(n)]
                for h in range(n):
                    ix.wq_b.weight[h * ix.head_dim:(h + 1) * ix.head_dim] *= -1 if q_flip[h] else 1
                    ix.weights_proj.weight[h] *= -1 if w_flip[h] else 1
                flips[ix.layer_idx] = {"wq_b_heads_flipped": q_flip,
                                       "weights_proj_heads_flipped": w_flip}
            if gate is not None:
                seen = []
                handle = gate.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o[0]))
                tap.forward(model, ids)
                handle.remove()
                gate.e_score_correction_bias -= seen[0].sigmoid().mean(0)
        hidden = model.model(torch.as_tensor(ids), use_cache=False).last_hidden_state
        u = hidden.flatten(0, 1).mean(0)
        model.lm_head.weight -= (model.lm_head.weight @ u)[:, None] * u[None] / (u @ u)
    return {"indexer_sign_flips": flips}


def boundary_gap(scores, k, rows):
    """Smallest (s[k-1] - s[k]) / max|s| over query rows with more than k visible keys."""
    gap = np.inf
    for t in rows:
        v = np.sort(scores[t, :t + 1])[::-1]  # visible: key <= query
        if v.size > k:
            scale = np.abs(v).max()
            gap = min(gap, (v[k - 1] - v[k]) / scale if scale > 0 else 0.0)
    return float(gap)


def try_prompt(model, tap, ids, cfg):
    """Runs one candidate prompt; returns (record, reason to reject or None)."""
    k, L = cfg.index_topk, len(ids)
    logits, calls = tap.forward(model, ids[None])
    rec = {"prompt": ids, "logits": logits[0].numpy(), "layers": {}, "gaps": {}}
    vis = np.tril(np.ones((L, L), dtype=bool))
    for i, c in sorted(calls.items()):
        s = c["scores"][0].numpy().copy()
        assert (s[~vis] == MASKED).all() and (s[vis] > MASKED / 2).all(), "unexpected mask"
        s[~vis] = -np.inf
        rec["layers"][i] = (c["indices"][0].numpy(), s)
        rec["gaps"][i] = boundary_gap(s, k, range(L))
    with torch.no_grad():
        gen = model.generate(torch.as_tensor(ids[None]), attention_mask=torch.ones(1, L).long(),
                             max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    new = gen.sequences[0, L:].numpy()
    if len(new) < NEW_TOKENS:
        return rec, f"greedy decode hit EOS after {len(new)} tokens"
    rec["generate"] = new
    rec["logit_gap"] = min(float(np.diff(-torch.topk(lg[0], 2).values.numpy())[0]
                                 / lg[0].abs().max()) for lg in gen.logits)
    # The decode steps' indexer rows (queries L..L+7) are rows of a no-cache forward over prompt +
    # new tokens; that forward's argmax must also reproduce the cached greedy tokens.
    ext_logits, ext = tap.forward(model, np.concatenate([ids, new])[None])
    rec["decode_gaps"] = {i: boundary_gap(c["scores"][0].numpy(), k, range(L, L + NEW_TOKENS))
                          for i, c in sorted(ext.items())}
    rec["greedy_matches_no_cache"] = bool((ext_logits[0, L - 1:-1].argmax(-1).numpy()
                                           == new).all())
    for what, gaps in (("index-score near-tie, prompt rows", rec["gaps"]),
                       ("index-score near-tie, decode rows", rec["decode_gaps"]),
                       ("top-2 logit near-tie", {"greedy": rec["logit_gap"]})):
        if min(gaps.values()) < TIE_TOL:
            return rec, f"{what}: {gaps}"
    return rec, None


def train_tokenizer(family):
    """Byte-level BPE with exactly 512 tokens, trained on the stdlib's pydoc topic texts."""
    from pydoc_data.topics import topics
    first, later = (V32_SPECIALS, V32_MARKERS) if family == "deepseek_v32" else ([], GLM_SPECIALS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512 - len(later), special_tokens=first,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([topics[key] for key in sorted(topics)], trainer)
    tok.add_special_tokens(later)
    assert tok.get_vocab_size() == 512, tok.get_vocab_size()
    if family == "deepseek_v32":  # DeepSeek's tokenizer prepends BOS
        tok.post_processor = processors.TemplateProcessing(
            single=f"{V32_SPECIALS[0]} $A", special_tokens=[(V32_SPECIALS[0], 0)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=V32_SPECIALS[0],
                                       eos_token=V32_SPECIALS[1],
                                       additional_special_tokens=V32_MARKERS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=GLM_SPECIALS[0],
                                   pad_token=GLM_SPECIALS[0], chat_template=GLM_CHAT_TEMPLATE,
                                   additional_special_tokens=GLM_SPECIALS[1:])


def released_state_dict(model, cfg):
    """Weights under the released names: transformers' own inverse of its load-time conversion
    (conversion_mapping "qwen2_moe": per-expert gate/up/down_proj <-> fused experts tensors)."""
    sd = {k: v.detach().clone().contiguous()
          for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    fused, m = model.state_dict(), cfg.moe_intermediate_size
    for i, kind in enumerate(cfg.mlp_layer_types):  # check the inverse by hand
        p = f"model.layers.{i}.mlp.experts."
        for e in range(cfg.n_routed_experts if kind == "sparse" else 0):
            assert torch.equal(sd[f"{p}{e}.gate_proj.weight"], fused[p + "gate_up_proj"][e, :m])
            assert torch.equal(sd[f"{p}{e}.up_proj.weight"], fused[p + "gate_up_proj"][e, m:])
            assert torch.equal(sd[f"{p}{e}.down_proj.weight"], fused[p + "down_proj"][e])
    return sd


def mtp_tensors(sd, cfg, seed):
    """Layer N = num_hidden_layers as released checkpoints carry it (DeepSeek-V3 naming, which GLM
    shares): the MTP projections plus a renamed copy of the last indexer-running MoE layer."""
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    p = f"model.layers.{n}."
    out = {p + "embed_tokens.weight": sd["model.embed_tokens.weight"].clone(),
           p + "enorm.weight": 1 + NORM_STD * torch.randn(h, generator=g),
           p + "hnorm.weight": 1 + NORM_STD * torch.randn(h, generator=g),
           p + "eh_proj.weight": STD * torch.randn(h, 2 * h, generator=g),
           p + "shared_head.norm.weight": 1 + NORM_STD * torch.randn(h, generator=g),
           p + "shared_head.head.weight": sd["lm_head.weight"].clone()}
    full = getattr(cfg, "indexer_types", None) or ["full"] * n
    src = max(i for i in range(n) if cfg.mlp_layer_types[i] == "sparse" and full[i] == "full")
    out.update({k.replace(f"model.layers.{src}.", p, 1): t.clone()
                for k, t in sd.items() if k.startswith(f"model.layers.{src}.")})
    return out, src


def write_weights(folder, family, sd, mtp):
    meta = {"format": "pt"}
    if family == "glm_moe_dsa":
        save_file({**sd, **mtp}, os.path.join(folder, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    # Two shards split by layer, the MTP tensors in the last one, and the standard index.
    first = {k: t for k, t in sd.items() if re.match(r"model\.(embed_tokens|layers\.[01]\.)", k)}
    shards = {"model-00001-of-00002.safetensors": first,
              "model-00002-of-00002.safetensors": {
                  **{k: t for k, t in sd.items() if k not in first}, **mtp}}
    for name, tensors in shards.items():
        save_file(tensors, os.path.join(folder, name), metadata=meta)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                            for ts in shards.values() for t in ts.values())},
             "weight_map": dict(sorted((k, name) for name, ts in shards.items() for k in ts))}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return [*shards, "model.safetensors.index.json"]


class LogCapture(logging.Handler):
    """transformers' warnings as lines: folder elided, load-report rows (set order) sorted."""

    def __init__(self, folder):
        super().__init__(logging.WARNING)
        self.folder, self.lines = folder, []
        logging.getLogger("transformers").addHandler(self)

    def emit(self, record):
        text = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()).replace(self.folder, "<folder>")
        rows = text.splitlines()
        self.lines += [*rows[:3], *sorted(r for r in rows[3:] if "|" in r),
                       *(r for r in rows[3:] if "|" not in r)]

    def close(self):
        logging.getLogger("transformers").removeHandler(self)
        return self.lines


def draw_prompts(model, tap, cfg):
    """Seeded random prompts; a draw with any near-tie is rejected and redrawn, so index sets and
    greedy tokens are unambiguous for a reimplementation."""
    rng, prompts, rejected = np.random.default_rng(PROMPT_SEED), [], []
    for j, L in enumerate(PROMPT_LENGTHS):
        for draw in range(MAX_DRAWS):
            rec, why = try_prompt(model, tap, rng.integers(0, cfg.vocab_size, size=L), cfg)
            if why is None:
                assert rec["greedy_matches_no_cache"], f"prompt {j}: cached greedy != no-cache"
                prompts.append(rec)
                break
            rejected.append({"prompt": j, "draw": draw, "reason": why})
        else:
            raise RuntimeError(f"no tie-free prompt of length {L} in {MAX_DRAWS} draws")
    return prompts, rejected


NOTES = {
    "scores": "scores_{j}_{i} is the tensor the indexer's topk ran over, except that masked "
              "entries (key > query), which transformers holds as score + finfo(float32).min == "
              "finfo.min, are stored as -inf. Rows with fewer than index_topk visible keys still "
              "return index_topk indices, the extra ones at masked keys in unspecified order: "
              "compare index sets on visible keys.",
    "near_ties": "A draw is rejected if, in any indexer layer and query row with more than "
                 "index_topk visible keys (prompt rows and the 8 decode rows), (s[k-1]-s[k]) / "
                 "max|s| < tolerance, if a greedy step's top-2 logit gap / max|logit| < tolerance, "
                 "or if greedy decoding hits EOS.",
    "mtp": "Layer num_hidden_layers tensors are multi-token-prediction weights; transformers "
           "drops them as unexpected keys (its ignore pattern names only the released index).",
    "deepseek_v32": {"chat_template": "None: DeepSeek-V3.2 ships a Python message encoder, not a "
                                      "Jinja template; the tokenizer has its marker tokens."},
    "glm_moe_dsa": {
        "chat_template": "chat_template.jinja is a SIMPLIFIED GLM-4.5/GLM-5-style template "
                         "written offline (the public one was not reachable); no tools.",
        "shared_layers": "indexer_types 'shared' layers have no indexer module or tensors; they "
                         "reuse the previous full layer's indices (so no arrays for them)."},
}


def build_family(family, out_root):
    spec, folder = FAMILIES[family], os.path.join(out_root, family)
    os.makedirs(folder, exist_ok=True)
    build_log = LogCapture(folder)
    torch.manual_seed(spec["weight_seed"])
    cfg = spec["cfg_cls"](**SIZES, **spec["kwargs"], attn_implementation="eager",
                          dtype=torch.float32)
    model = spec["model_cls"](cfg).eval()
    randomize(model, spec["weight_seed"])
    tap = IndexerTap(model)
    calib = np.random.default_rng(CALIB_SEED).integers(0, cfg.vocab_size, (4, 64))
    conditioning = condition(model, tap, calib)
    prompts, rejected = draw_prompts(model, tap, cfg)

    # Files: config, weights under the released names (+ MTP), tokenizer, arrays.
    model.config.architectures = [spec["model_cls"].__name__]
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    sd = released_state_dict(model, cfg)
    with tempfile.TemporaryDirectory() as tmp:  # does save_pretrained write the released names?
        model.save_pretrained(tmp)
        saved = {k for fn in os.listdir(tmp) if fn.endswith(".safetensors")
                 for k in load_file(os.path.join(tmp, fn))}
    mtp, mtp_src = mtp_tensors(sd, cfg, spec["weight_seed"] + 1)
    weight_files = write_weights(folder, family, sd, mtp)
    train_tokenizer(family).save_pretrained(folder)
    arrays = {}
    for j, r in enumerate(prompts):
        arrays.update({f"prompt_{j}": r["prompt"].astype(np.int32),
                       f"logits_{j}": r["logits"].astype(np.float32),
                       f"generate_{j}": r["generate"].astype(np.int32)})
        for i, (idx, s) in r["layers"].items():
            arrays[f"indices_{j}_{i}"] = idx.astype(np.int32)
            arrays[f"scores_{j}_{i}"] = s.astype(np.float32)
    np.savez_compressed(os.path.join(folder, "reference.npz"), **arrays)
    build_warnings = build_log.close()

    # Reload the folder through transformers: equal tensors and logits prove the names are what
    # it maps from.
    reload_log = LogCapture(folder)
    reloaded, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    reload_warnings = reload_log.close()
    with torch.no_grad():
        again = [reloaded.eval()(torch.as_tensor(r["prompt"][None]), use_cache=False).logits[0]
                 for r in prompts]
    diffs = [float(np.abs(x.numpy() - r["logits"]).max()) for x, r in zip(again, prompts)]
    a, b = model.state_dict(), reloaded.state_dict()
    tok, sample = AutoTokenizer.from_pretrained(folder), "The with statement wraps a block."
    specials = V32_SPECIALS + V32_MARKERS if family == "deepseek_v32" else GLM_SPECIALS
    per_prompt = lambda key: {str(j): r[key] for j, r in enumerate(prompts)}
    record = {
        "family": family, "model_class": spec["model_cls"].__name__,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "numpy": np.__version__,
                     "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__},
        "command": "/work/refenv/bin/python -m experiments.crosscheck.dsa_families --out "
                   + out_root,
        "seeds": {"weights": spec["weight_seed"], "mtp_tensors": spec["weight_seed"] + 1,
                  "prompts": PROMPT_SEED, "calibration_batch": CALIB_SEED,
                  "torch_threads": torch.get_num_threads()},
        "config_kwargs": {**SIZES, **spec["kwargs"]}, "config": model.config.to_dict(),
        "init": {"matrices_and_router_weight": f"N(0, {STD}^2)",
                 "norm_weights": f"1 + N(0, {NORM_STD}^2)",
                 "k_norm_bias_and_e_score_correction_bias": f"N(0, {BIAS_STD}^2), then (2) below",
                 "embed_tokens": f"per-column offset N(0, {EMB_MEAN_STD}^2) shared by all rows "
                                 f"+ N(0, {STD}^2)",
                 "conditioning": " ".join(condition.__doc__.split()), **conditioning},
        "indexer_layers": sorted(prompts[0]["layers"]),
        "prompt_lengths": [len(r["prompt"]) for r in prompts],
        "near_tie_tolerance": TIE_TOL, "rejected_draws": rejected,
        "min_relative_topk_boundary_gap": per_prompt("gaps"),
        "min_relative_topk_boundary_gap_decode_rows": per_prompt("decode_gaps"),
        "min_relative_top2_logit_gap_greedy": per_prompt("logit_gap"),
        "checks": {
            "reload_max_abs_logit_diff": diffs,
            "reload_state_dict_bitwise_equal": a.keys() == b.keys()
            and all(torch.equal(a[k], b[k]) for k in a),
            "reload_missing_keys": sorted(info["missing_keys"]),
            "reload_unexpected_keys": sorted(info["unexpected_keys"]),
            "reload_mismatched_keys": sorted(map(str, info["mismatched_keys"])),
            "reload_warnings": reload_warnings, "build_warnings": build_warnings,
            "save_pretrained_writes_released_names": saved == set(sd),
            "cached_greedy_equals_no_cache_argmax": [r["greedy_matches_no_cache"]
                                                     for r in prompts],
            "tokenizer_roundtrip": tok.decode(tok(sample)["input_ids"],
                                              skip_special_tokens=True) == sample},
        "tokenizer": {"vocab_size": len(tok),
                      "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in specials},
                      "encode_example": {sample: tok(sample)["input_ids"]}},
        "weights": {"files": weight_files, "num_tensors": len(sd),
                    "mtp_layer": cfg.num_hidden_layers, "mtp_copied_from_layer": mtp_src,
                    "mtp_tensors": sorted(mtp)},
        "notes": {k: v for k, v in NOTES.items() if k not in FAMILIES} | NOTES[family],
    }
    if family == "glm_moe_dsa":
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        record["tokenizer"]["chat_examples"] = [
            tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kw)
            for kw in ({}, {"enable_thinking": False})]
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump(record, f, indent=2, ensure_ascii=False, default=float)
    for fn in os.listdir(folder):
        os.chmod(os.path.join(folder, fn), 0o644)
    sizes = {fn: os.path.getsize(os.path.join(folder, fn)) for fn in sorted(os.listdir(folder))}
    print(f"{family}: reload max|dlogits| {max(diffs):.3g}, {len(rejected)} rejected, {sizes}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/dsa")
    parser.add_argument("--family", choices=sorted(FAMILIES), action="append")
    args = parser.parse_args()
    torch.set_num_threads(1)  # light on a shared machine; reductions in one fixed order
    for family in args.family or sorted(FAMILIES):
        build_family(family, args.out)


if __name__ == "__main__":
    main()
