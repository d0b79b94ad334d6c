"""Refusing what cannot fit, from the config alone (model.memory): per-device weights as the
sharding rules split them, the cache at a context, a prefill's working set."""

import pathlib

import jax
import pytest
from flax import nnx

from model.dsa_presets import V32_CONFIG
from model.memory import check_fits, memory_per_device, param_bytes_per_device
from model.pretrained import load_pretrained
from model.pretrained.mla_moe import dsa_config
from model.pretrained.safetensors_dir import DSA_FAMILIES

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "dsa" / "deepseek_v32"

# DeepSeek-V3.2's released config.json (model.dsa_presets), FP8 weights in blocks of 128.
V32 = dict(V32_CONFIG, quantization_config=dict(quant_method="fp8", fmt="e4m3",
                                                weight_block_size=[128, 128]))


def test_parameter_bytes_are_the_models_own():
    model = load_pretrained(FIXTURE).model
    real = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    assert param_bytes_per_device(model.config, {}) == (real, real)
    per, total = param_bytes_per_device(model.config, {"tensor": 2})
    assert total == real and real / 2 < per < real  # heads and MLPs split, the rest whole


def test_a_checkpoint_that_does_not_fit_is_refused_before_loading():
    with pytest.raises(ValueError, match=r"does not fit: it needs .* MB per device on mesh "
                                         r"\{\} \(weights"):
        load_pretrained(FIXTURE, device_memory=2e6)
    assert load_pretrained(FIXTURE, device_memory=1e9).model.config.n_layers == 3


@pytest.mark.slow  # traces the 61-layer model's shapes (~4 s)
def test_deepseek_v32_on_eight_gpus():
    config = dsa_config(V32, DSA_FAMILIES["deepseek_v32"], source="V3.2", dtype="bfloat16")
    need = memory_per_device(config, {"tensor": 8}, 131072)
    # 671.9B parameters stored in bf16 (param_dtype, as the checkpoint loads): 1.34 TB
    # (+ 0.22 GB: norms and routers stay float32, and the untrained coarse screens)
    assert 0 < need["weights_all"] - 2 * 671_877_944_064 < 0.25e9
    with pytest.raises(ValueError, match=r"needs 187\.0 GB per device on mesh \{'tensor': 8\} "
                                         r"\(weights 174\.7 GB of 1344\.0 GB in bfloat16.*"
                                         r"each device has 80\.0 GB and the 8 devices "
                                         r"640\.0 GB in all"):
        check_fits(config, {"tensor": 8}, 131072, 80e9, source="DeepSeek-V3.2 on 8 x A100")
    # 8 x H200 (141 GB) do not hold it in bf16 either: the replicated embeddings, latents
    # and indexers add 6.7 GB to 1/8 of the rest.
    assert need["total"] > 141e9 and need["kv_cache"] == 131072 * 61 * 1152
    # With the routed experts kept in FP8 (load_pretrained(fp8_experts=True)) they do;
    # 8 x A100 / H100 (80 GB) still do not.
    fp8 = config.replace(moe=config.moe.replace(fp8_block=(128, 128)))
    assert check_fits(fp8, {"tensor": 8}, 131072, 141e9)["weights_all"] < 691e9  # ~690 GB
    with pytest.raises(ValueError, match=r"needs 105\.3 GB per device on mesh \{'tensor': 8\} "
                                         r"\(weights 93\.0 GB of 690\.2 GB in bfloat16 with the "
                                         r"routed experts in FP8 e4m3.*each device has 80\.0 GB"):
        check_fits(fp8, {"tensor": 8}, 131072, 80e9, source="DeepSeek-V3.2 on 8 x A100")
    # An expert axis splits only the experts (attention heads split over tensor=2 here).
    assert memory_per_device(config, {"expert": 4, "tensor": 2}, 131072)["weights"] > \
        need["weights"]
