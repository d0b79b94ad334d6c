"""Next-token sampling: greedy, temperature, nucleus (top-p), seeded."""

import jax
import jax.numpy as jnp


def validate_sampling(temperature, top_p):
    if not (isinstance(temperature, (int, float)) and 0.0 <= temperature <= 100.0):
        raise ValueError(f"temperature must be a number in [0, 100], got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")


@jax.jit
def sample_token(logits, key, temperature, top_p):
    """logits: f32[V] -> i32 token. temperature 0 = greedy (argmax); top_p keeps the smallest
    set of tokens whose probability mass reaches top_p (the top token always stays)."""
    greedy = jnp.argmax(logits).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    probs = jax.nn.softmax(sorted_logits)
    mass_before = jnp.cumsum(probs) - probs
    keep = mass_before < top_p
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    sampled = order[jax.random.categorical(key, sorted_logits)].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
