"""Exact mode of the hierarchical indexer: per-block upper bounds and refinement rounds.

Upper bound of a block for one query, per head j, from two bounds on the logit q_j . k_s
over the block's keys s (both valid, the tighter one is used):
- min/max keys: q_j . k_s <= sum_d max(q_jd min_bd, q_jd max_bd) = q_j+ . max_b - q_j- . min_b
  =: ub_j (q+ = ReLU(q), q- = ReLU(-q)) and q_j . k_s >= q_j+ . min_b - q_j- . max_b =: lb_j;
- radius (complete blocks): |q_j . k_s - q_j . mean_b| <= |q_j| r_b (Cauchy-Schwarz).
ReLU is monotone, so w_j * ReLU(q_j . k_s) <= w_j * ReLU(ub_j) when w_j >= 0 and
<= w_j * ReLU(lb_j) when w_j < 0 (a lower bound of the logit bounds a negative term);
the per-head bound is the sum over heads. Summing worst cases head by head pays the radius
once per head, as if every head's query pointed the same way; the joint bound pays it once:
with k_s = mean_b + delta, |delta| <= r_b, and a_j = w_j |q_j| for the heads with w_j >= 0,
sum_j w_j ReLU(q_j . k_s) <= sum_j w_j ReLU(q_j . mean_b) + sum_j a_j ReLU(q^_j . delta)
and the last sum is at most r_b * J, J = sqrt(sum_j a_j) * sqrt(lambda_max(sum_j a_j q^_j q^_j^T))
(Cauchy-Schwarz), lambda_max bounded by the largest row sum of |sqrt(a_j a_k) q^_j . q^_k|;
for nearly orthogonal head queries J ~ sqrt(H) times smaller than sum_j a_j. The block
bound is the smaller of the two. It covers the whole block, a superset of the tokens
a query sees in it. The min/max part is one product of a sign-split query
q~_j = [q+, -q-] (w_j >= 0) or [-q-, q+] (w_j < 0) with the block's [max | min].

Refinement: a block can only change a query's top_k if its bound beats the query's current
k-th score. Rounds rescore, per query tile, the `refine_blocks` unscored blocks with the
largest margin (bound minus k-th score, over the tile's queries) until no block of any
tile has a positive margin; shapes stay static (a lax.while_loop over rounds).
"""

import jax
import jax.numpy as jnp

import pallas_kernels
from indexer.block_summaries import block_means, bound_keys, visible_blocks
from indexer.candidates import joint_factor, sort_blocks, table_tokens


def block_upper_bounds(q, w, summaries, *, block_size, q_positions, backend=None):
    """f32[T, n_blocks]: an upper bound of max over the block's keys s of I[t, s]
    (-inf where the block is empty or starts after the query). q [T, H_I, d_I], w [T, H_I].
    backend is unused (plain XLA products: they need per-head logits)."""
    del backend
    qf = q.astype(jnp.float32)
    qp, qn = jax.nn.relu(qf), jax.nn.relu(-qf)
    positive = (w >= 0)[..., None]
    q_split = jnp.where(positive, jnp.concatenate([qp, -qn], axis=-1),
                        jnp.concatenate([-qn, qp], axis=-1))  # [T, H, 2 d_I]
    hp = jax.lax.Precision.HIGHEST
    # ub_j for w_j >= 0 and lb_j for w_j < 0, from min/max keys.
    minmax = jnp.einsum("thd,bd->thb", q_split, bound_keys(summaries), precision=hp)
    center = jnp.einsum("thd,bd->thb", qf, block_means(summaries), precision=hp)
    spread = jnp.linalg.norm(qf, axis=-1)[..., None] * summaries.radius  # inf: no radius
    spread = jnp.where(jnp.isinf(summaries.radius), jnp.inf, spread)
    logit = jnp.where(positive, jnp.minimum(minmax, center + spread),
                      jnp.maximum(minmax, center - spread))
    wf = w.astype(jnp.float32)[..., None]
    terms = jnp.where(wf == 0, 0.0, wf * jax.nn.relu(logit))  # [T, H, nb]
    per_head = jnp.sum(terms, axis=1)
    # Joint bound: the positive heads' radius term paid once (see the module docstring).
    negative = jnp.sum(jnp.where(positive, 0.0, terms), axis=1)
    centered = jnp.sum(jnp.where(positive, wf * jax.nn.relu(center), 0.0), axis=1)
    radius = jnp.where(jnp.isinf(summaries.radius), jnp.inf, summaries.radius)
    joint = centered + negative + joint_factor(qf, w)[:, None] * radius[None, :]
    bounds = jnp.where(jnp.isinf(radius)[None, :], per_head, jnp.minimum(per_head, joint))
    return jnp.where(visible_blocks(q_positions, summaries, block_size), bounds, -jnp.inf)


def merge_topk(values, tokens, new_values, new_tokens):
    """Best len(values[0]) of the union of two scored token sets (rows are queries), best
    first, ties broken by the lower token id (so the result does not depend on the order in
    which blocks were scored)."""
    top_k = values.shape[1]
    neg, tok = jax.lax.sort((-jnp.concatenate([values, new_values], axis=1),
                             jnp.concatenate([tokens, new_tokens], axis=1)),
                            dimension=1, num_keys=2)
    return -neg[:, :top_k], tok[:, :top_k]


FEW_IMPROVEMENTS = 32


def merge_improvements(values, tokens, scores, block_table, block_size, query_tile):
    """merge_topk of the current best (values, tokens) [T, top_k] with new fine scores
    [T, C] of block_table's tokens (block ids ascending, so columns run in token order),
    paying only for what can change: nothing when no new score reaches any row's k-th
    score, FEW_IMPROVEMENTS new scores when no row has more than that many, the best
    top_k new scores otherwise (same result in all three cases)."""
    top_k = values.shape[1]
    few = min(FEW_IMPROVEMENTS, scores.shape[1])
    reach = (scores >= values[:, -1:]) & (scores > -jnp.inf)
    most = jnp.max(jnp.sum(reach, axis=1))

    def merge(k):
        def run(_):
            new, cols = jax.lax.top_k(scores, k)  # stable: ties keep token order
            new_tokens = table_tokens(block_table, cols, block_size, query_tile)
            return merge_topk(values, tokens, new, new_tokens)
        return run

    branch = jnp.where(most == 0, 0, jnp.where(most <= few, 1, 2))
    return jax.lax.switch(branch, [lambda _: (values, tokens), merge(few),
                                   merge(min(top_k, scores.shape[1]))], None)


def _margins(bounds, values, scored, query_tile):
    """[n_tiles, n_blocks]: max over the tile's queries of (bound - k-th score) over the
    visible blocks a query has not scored and whose bound reaches its k-th score (a tie
    with a lower token id would change the result), inf while a query holds fewer than
    top_k scores; -inf where no query of the tile needs the block."""
    theta = values[:, -1:]
    need = (bounds >= theta) & (bounds > -jnp.inf) & ~scored
    gap = jnp.where(need, bounds - theta, -jnp.inf)
    return gap.reshape(-1, query_tile, gap.shape[1]).max(axis=1)


def refine_exact(q, w, k, bounds, values, tokens, scored, *, q_offset, block_size, query_tile,
                 refine_blocks, backend=None):
    """Rescores blocks until no unscored block can reach any query's k-th score.

    q [T, H, d], w [T, H], k [L, d]; bounds f32[T, nb] (block_upper_bounds);
    values f32[T, top_k], tokens i32[T, top_k]: the current best scores (best first,
    -inf / -1 where missing); scored bool[T, nb]: blocks already scored exactly for each
    query. Each round scores, for every tile of query_tile queries, the refine_blocks
    blocks its queries need most as one dense product. q_offset: position of row 0.
    Returns (values, tokens, scored, rounds).
    """
    T, nb = scored.shape
    per_round = min(refine_blocks, nb)
    rows = jnp.arange(T)[:, None]
    tile = rows // query_tile

    def cond(state):
        return jnp.any(state[4] > -jnp.inf)

    def body(state):
        values, tokens, scored, rounds, margins = state
        top, blocks = jax.lax.top_k(margins, per_round)
        table = sort_blocks(jnp.where(top > -jnp.inf, blocks, -1))  # [n_tiles, R]
        scores = pallas_kernels.gathered_index_scores(
            q, w, k, table, block_size=block_size, q_offset=q_offset, backend=backend)
        mine = table[tile[:, 0]]  # [T, R]: this round's blocks of each query's tile
        safe = jnp.where(mine >= 0, mine, nb)
        again = scored.at[rows, safe].get(mode="fill", fill_value=True)  # already scored
        scores = jnp.where(jnp.repeat(again, block_size, axis=1), -jnp.inf, scores)
        values, tokens = merge_improvements(values, tokens, scores, table, block_size,
                                            query_tile)
        scored = scored.at[rows, safe].set(True, mode="drop")
        margins = _margins(bounds, values, scored, query_tile)
        return values, tokens, scored, rounds + 1, margins

    init = (values, tokens, scored, jnp.int32(0), _margins(bounds, values, scored, query_tile))
    values, tokens, scored, rounds, _ = jax.lax.while_loop(cond, body, init)
    return values, tokens, scored, rounds
