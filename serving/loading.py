"""Which model a server runs (the shipped checkpoint, the random `tiny` preset, a pretrained
model by name, or a path), and the engine built and warmed up around it: what every process
of a server runs first, leader and followers alike."""

import dataclasses
import logging
import pathlib
import time

from indexer.selection import offered_settings

log = logging.getLogger("serving.loading")


@dataclasses.dataclass
class LoadedModel:
    model: object  # model.Transformer with the serving config's switches applied
    tokenizer: object  # encode / decode / bos_id / eos_id / chat_prompt / vocab_size
    model_id: str
    description: str


def load_model(name, overrides=None, *, mesh=None, context=None, fp8_experts=False):
    """-> LoadedModel. name: "default" (checkpoints/small, or $DOSA_CHECKPOINT), "tiny"
    (random UNTRAINED weights, for tests and development), a name in
    model.pretrained.PRETRAINED, or a path (a dosa checkpoint folder, a .gguf file, a Hugging
    Face folder). overrides: ModelConfig run-time switches; a "hierarchical" dict changes
    only the knobs it names. mesh: a DSA checkpoint streams its parameters onto it as it
    loads, after a check that it fits with a cache of `context` tokens
    (model.pretrained.load_pretrained). fp8_experts: an FP8 DSA folder's routed experts
    stay FP8 (load_pretrained(fp8_experts=True))."""
    import flax.nnx as nnx

    import model as dosa_model
    from model.pretrained import ByteTokenizer, load_pretrained

    if fp8_experts and not pathlib.Path(name).is_dir():
        raise ValueError(f"fp8_experts applies to an FP8 DeepSeek-V3.2 / GLM-5 folder, not "
                         f"model {name!r}")
    if name in ("default", "small"):
        net, metadata = dosa_model.load_default_model()
        step = metadata.get("step")
        loaded = LoadedModel(net, ByteTokenizer(), "dosa-small",
                             f"shipped byte-level checkpoint {dosa_model.default_checkpoint_dir()}"
                             + (f" (step {step})" if step is not None else ""))
    elif name == "tiny":
        net = dosa_model.Transformer(dosa_model.get_config("tiny"), rngs=nnx.Rngs(0))
        loaded = LoadedModel(net, ByteTokenizer(), "dosa-tiny-untrained",
                             "tiny preset with RANDOM, UNTRAINED weights (tests, development): "
                             "its output is noise")
    elif pathlib.Path(name).is_dir() and dosa_model.has_checkpoint(name):
        net, _, _ = dosa_model.restore_checkpoint(name)
        loaded = LoadedModel(net, ByteTokenizer(), pathlib.Path(name).name,
                             f"dosa checkpoint {name}")
    else:
        pretrained = load_pretrained(name, mesh=mesh, context=context,
                                     fp8_experts=fp8_experts)
        model_id = pretrained.info.get("name") or pathlib.Path(name).stem
        loaded = LoadedModel(pretrained.model, pretrained.tokenizer, model_id,
                             f"pretrained {pretrained.info.get('path')} "
                             f"(indexer: {pretrained.info.get('indexer')})")
    if overrides:
        loaded.model = dosa_model.with_config(loaded.model,
                                              apply_overrides(loaded.model.config, overrides))
    return loaded


def apply_overrides(config, overrides):
    """config.replace(**overrides), where a selection kind's name maps to changes to its
    settings (ServingConfig.model_overrides: {"hierarchical": {"candidate_tokens": ...}})."""
    overrides = dict(overrides)
    for kind in offered_kinds():
        changes = overrides.pop(kind, None)
        if changes is not None:
            config = config.with_settings(kind, **changes)
    return config.replace(**overrides)


def offered_kinds():
    return {setting.kind for setting in offered_settings().values()}


def selection_summary(config):
    """The selection switches of a ModelConfig, as GET /admin/rollout and the log show them:
    attention, indexer, top_k, the offered settings of its kind (by field name) and
    indexer_types."""
    out = {"attention": config.attention, "indexer": config.indexer, "top_k": config.top_k}
    settings = config.settings(config.indexer)
    for setting in offered_settings().values():
        if setting.kind == config.indexer:
            out[setting.field] = getattr(settings, setting.field)
    if config.indexer_types:
        out["indexer_types"] = "".join("S" if t == "shared" else "F"
                                       for t in config.indexer_types)
    return out


def cache_layout(cfg, mesh):
    """"paged" or "slots": the config's cache_layout ("auto": paged on one device). ValueError
    for paged on a mesh (the pool is one device's)."""
    if cfg.cache_layout == "auto":
        return "paged" if mesh is None else "slots"
    if cfg.cache_layout == "paged" and mesh is not None:
        raise ValueError("serving config: cache_layout 'paged' runs on one device; a mesh "
                         "(--mesh, several processes) serves with 'slots' or 'auto'")
    return cfg.cache_layout


def pool_pages(cfg, model_config, max_context, slots):
    """Pages of the paged cache: cache_pool_bytes' worth; else gpu_utilization's share of
    the device memory the weights left, where the device reports it (GPUs); else the slot
    layout's memory, `slots` caches of max_context positions."""
    import jax

    from model.buckets import length_bucket
    from model.paged_cache import RESERVED_PAGES, page_bytes
    per_page = page_bytes(model_config, cfg.cache_block_tokens)
    if cfg.cache_pool_bytes is not None:
        return max(RESERVED_PAGES + 1, cfg.cache_pool_bytes // per_page)
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        # a workspace of max_context positions and the steps' activations come out of it too
        left = stats["bytes_limit"] * cfg.gpu_utilization - stats.get("bytes_in_use", 0)
        workspace = per_page * length_bucket(max_context) // cfg.cache_block_tokens
        return max(RESERVED_PAGES + 1, int(0.8 * (left - 2 * workspace)) // per_page)
    return RESERVED_PAGES + slots * length_bucket(max_context) // cfg.cache_block_tokens


def build_engines(cfg, mesh=None, *, loader=None):
    """Loads the model, builds its Engines (on `mesh`) and warms them up -> (engines,
    loaded, max_context). engines[0] runs the main config; with a `canary:` block,
    engines[1] runs the canary's selection switches over the same weights
    (model.with_config shares the arrays), with its own decode slots and prefix cache.
    Every process of a sharded server runs this, in the same order: the warm-up's steps
    are collectives on a mesh that spans processes."""
    import jax

    from model import with_config
    from model.layer_stack import describe_plan
    from serving import program_maps
    from serving.engine import Engine
    from serving.paged_engine import PagedEngine
    from serving.prefix_cache import PrefixCache
    from serving.shadow import ShadowSampler

    t0 = time.perf_counter()
    loaded = (loader() if loader is not None
              else load_model(cfg.model, cfg.model_overrides(), mesh=mesh,
                              context=cfg.max_context, fp8_experts=cfg.fp8_experts))
    model_config = loaded.model.config
    max_context = cfg.max_context
    if max_context > model_config.max_seq_len:
        log.warning("max_context %d is past the model's max_seq_len %d: serving %d",
                    max_context, model_config.max_seq_len, model_config.max_seq_len)
        max_context = model_config.max_seq_len
    log.info("loaded %s in %.1f s: %s; its layers run as %s", loaded.model_id,
             time.perf_counter() - t0, loaded.description, describe_plan(model_config))
    variants = [(loaded.model, cfg.decode_slots, cfg.shadow_rate_for(model_config))]
    if cfg.canary is not None:
        canary = with_config(loaded.model, apply_overrides(model_config,
                                                          cfg.canary.model_overrides()))
        variants.append((canary, cfg.canary.decode_slots or cfg.decode_slots,
                         cfg.canary.shadow_rate_for(canary.config)))
    engines = []
    warm = max_context if cfg.warmup_max_context is None else cfg.warmup_max_context
    maps = program_maps.budget()
    for index, (net, slots, rate) in enumerate(variants):
        cache = PrefixCache(cfg.cache_block_tokens, max_blocks=cfg.cache_size,
                            max_bytes=cfg.cache_bytes)
        shadow = ShadowSampler(rate, cfg.shadow_rows, cfg.shadow_max_seconds_per_s,
                               seed=index)
        if cache_layout(cfg, mesh) == "paged":
            page_tokens = cfg.cache_block_tokens
            engine = PagedEngine(net, max_context=max_context, max_running=cfg.max_running,
                                 pool_pages=pool_pages(cfg, net.config, max_context, slots),
                                 page_tokens=page_tokens, prefill_chunk=cfg.prefill_chunk,
                                 cache_prefixes=cfg.cache_size > 0, shadow=shadow)
            log.info("paged cache: %d pages of %d positions, at most %d requests decoding",
                     engine.pages.n_pages, page_tokens, cfg.max_running)
        else:
            engine = Engine(net, max_context=max_context, slots=slots,
                            prefill_chunk=cfg.prefill_chunk, prefix_cache=cache, mesh=mesh,
                            shadow=shadow)
        t0 = time.perf_counter()
        # Each side may warm up to its share of what the warm-up may hold of the process's
        # memory-map cap (serving.program_maps), the baseline first. Several processes run
        # the same warm-up steps (collectives): each process's own count must not decide
        # there, so they warm everything.
        room = (maps.warm_room_for(index + 1, len(variants)) if jax.process_count() == 1
                else None)
        buckets = engine.warmup(min(warm, max_context), room=room)
        log.info("warm-up of %s (up to %d tokens): compiled %d key-length buckets in %.1f s%s%s;"
                 " the process holds %d memory mappings of %d", "the canary" if index else
                 "the baseline", min(warm, max_context), buckets, time.perf_counter() - t0,
                 f", shadow recall at rate {engine.shadow.rate:g}" if engine.shadow else "",
                 "" if mesh is None else f" on mesh {dict(mesh.shape)}", *maps.usage())
        engines.append(engine)
    return engines, loaded, max_context


def build_engine(cfg, mesh=None, *, loader=None):
    """build_engines' first engine -> (engine, loaded, max_context)."""
    engines, loaded, max_context = build_engines(cfg, mesh, loader=loader)
    return engines[0], loaded, max_context
