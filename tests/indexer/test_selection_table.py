"""The selection table (indexer.selection) is the one list of selection kinds: a new kind is
one entry plus its function, here a toy kind defined in this file only, which the model's
config and forward pass, serving's config and metrics, the main job's modes and the cost
model then take without another file changing. A kind with settings adds its settings
class: the fields it marks `offered` become serving's switches (config keys and command-line
flags), and ModelConfig hands each layer an instance."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.ttft.config import ModeSpec
from indexer.config import FrozenConfig, offered
from indexer.costs import Op
from indexer.selection import (
    SELECTIONS,
    SelectionKind,
    register_selection,
    selection_kind,
    selection_names,
    unregister_selection,
)
from model import ModelRunner, Transformer, get_config
from model.costs import prefill_counts
from serving.config import config_from_mapping
from serving.metrics import indexer_prefill_share


def oldest_select(q, w, k, top_k, *, q_offset, config=None, summaries=None, screen=None):
    """A toy kind: every query attends to the first top_k tokens of the context."""
    positions = q_offset + jnp.arange(q.shape[0])
    first = jnp.arange(top_k)[None, :]
    return jnp.where(first <= positions[:, None], first, -1).astype(jnp.int32)


def oldest_costs(s, T, p0, kv_len, skip):
    return [Op("indexer", "oldest indices", "memory", bytes=T * s.top_k * 4)]


@pytest.fixture
def oldest():
    kind = SelectionKind("oldest", oldest_select, "the first top_k tokens", oldest_costs)
    previous = register_selection(kind)
    yield kind
    unregister_selection("oldest", previous)


def test_the_table_lists_every_kind_once():
    assert selection_names() == ("flat", "hierarchical", "streaming", "window", "oracle")
    assert selection_names(served=True) == ("flat", "hierarchical", "streaming")
    assert all(callable(kind.function) for kind in SELECTIONS.values())
    with pytest.raises(ValueError, match=r"ModelConfig.indexer must be one of \('flat', "
                                         r"'hierarchical', 'streaming', 'window', 'oracle'\), got "
                                         r"'nope'"):
        get_config("tiny", indexer="nope")
    with pytest.raises(ValueError, match=r"indexer must be null or one of \('flat', "
                                         r"'hierarchical', 'streaming'\), got 'window'"):
        config_from_mapping({"indexer": "window"})  # a baseline, not offered by serving


def test_a_new_kind_is_one_entry(oldest):
    config = get_config("tiny", indexer="oldest", top_k=8)
    assert selection_kind("oldest") is oldest
    # The forward pass selects with it, in every sparse layer, chunk by chunk.
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, 256, 100)
    _, _, got = ModelRunner(model).prefill(tokens, capture=("indices",))
    want = np.asarray(oldest_select(jnp.zeros((100, 1, 1)), None, None, 8, q_offset=0))
    np.testing.assert_array_equal(got["indices"], np.stack([want] * config.n_layers))
    # Serving offers it, the main job's modes take it, the cost model counts it.
    assert config_from_mapping({"indexer": "oldest"}).model_overrides()["indexer"] == "oldest"
    ModeSpec(name="toy", indexer="oldest").model_config(config)
    ops = {op.name: op for op in prefill_counts(config, 300, skip=True).per_layer["oldest"]}
    assert ops["oldest indices"].bytes == (64 + 64 + 64 + 64 + 64) * 8 * 4  # chunks of 64
    assert 0 < indexer_prefill_share(config, 0, 300) < indexer_prefill_share(
        config.replace(indexer="flat"), 0, 300)
    with pytest.raises(ValueError, match="one of .*'oldest'"):
        get_config("tiny", indexer="newest")


@dataclasses.dataclass(frozen=True)
class StrideSettings(FrozenConfig):
    """The toy kind's one setting, offered to serving and its command line as `stride`."""

    stride: int = offered(1, ge=1)


def stride_select(q, w, k, top_k, *, q_offset, config, summaries=None, screen=None):
    """A toy kind with a setting: query p attends to p, p - stride, p - 2 stride, ..."""
    positions = q_offset + jnp.arange(q.shape[0])
    picked = positions[:, None] - config.stride * jnp.arange(top_k)[None, :]
    return jnp.where(picked >= 0, picked, -1).astype(jnp.int32)


@pytest.fixture
def stride():
    kind = SelectionKind("stride", stride_select, "every stride-th earlier token",
                         oldest_costs, config=StrideSettings)
    previous = register_selection(kind)
    yield kind
    unregister_selection("stride", previous)


def test_a_kind_with_a_setting_is_one_entry_and_serving_offers_the_setting(stride):
    from serving.__main__ import parse_args, switch_overrides
    from serving.loading import apply_overrides, selection_summary

    # Serving's config takes the setting under its name, in any case, checked by its mark.
    served = config_from_mapping({"indexer": "stride", "STRIDE": 3})
    assert served.model_overrides() == {"indexer": "stride", "stride": {"stride": 3}}
    with pytest.raises(ValueError, match=r"serving config: stride must be null or an integer "
                                         r"in \[1, \d+\], got 0"):
        config_from_mapping({"stride": 0})
    with pytest.raises(ValueError, match=r"canary\.stride must be null or an integer"):
        config_from_mapping({"canary": {"indexer": "stride", "stride": -2}})
    # So does its command line.
    args = parse_args(["--indexer", "stride", "--stride", "3"])
    assert config_from_mapping({}, **switch_overrides(args)) == served
    # The model's config hands each layer its settings; the forward pass selects with them.
    config = apply_overrides(get_config("tiny", top_k=8), served.model_overrides())
    assert config.settings("stride") == StrideSettings(3)
    assert all(config.layer_settings(i) == StrideSettings(3) for i in range(config.n_layers))
    assert get_config("tiny", indexer="stride").layer_settings(0) == StrideSettings(1)
    assert selection_summary(config)["stride"] == 3
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(1).integers(0, 256, 100)
    _, _, got = ModelRunner(model).prefill(tokens, capture=("indices",))
    want = np.asarray(stride_select(jnp.zeros((100, 1, 1)), None, None, 8, q_offset=0,
                                    config=StrideSettings(3)))
    assert (want[50] == 50 - 3 * np.arange(8)).all()
    np.testing.assert_array_equal(got["indices"], np.stack([want] * config.n_layers))
    # A stored config keeps the settings.
    assert type(config).from_dict(json.loads(config.to_json())) == config
