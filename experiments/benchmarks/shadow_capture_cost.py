"""The cost of watching a 4K prefill on the shipped model (hierarchical, 1408 candidate
tokens): prefill step seconds unwatched vs every chunk watched (serving.shadow's capturing
step), and the shadow seconds (re-selection + recall), alternating runs on the same engine.

    python -m experiments.benchmarks.shadow_capture_cost > capture_cost.json

(results/serving/rollout/capture_cost.json is its run of record.)"""

import json
import time

import numpy as np


def main():
    import model
    from serving.engine import Engine
    from serving.shadow import ShadowSampler

    net, _ = model.load_default_model()
    net = model.with_config(net, net.config.replace(indexer="hierarchical"))
    engine = Engine(net, max_context=8192, slots=1, shadow=ShadowSampler(1.0, 16, 1.0))
    rng = np.random.default_rng(0)

    def run(watch):
        state = engine.begin_prefill(rng.integers(1, 256, 4097))
        while not state.done:
            engine.prefill_step(state, "plan" if watch else None)
        return state.step_seconds, sum(r.seconds for r in state.shadow)

    t0 = time.perf_counter()
    run(False), run(True)  # compiles
    print("compiled in", round(time.perf_counter() - t0, 1), "s", flush=True)
    out = {"plain": [], "watched": [], "shadow": []}
    for _ in range(5):
        out["plain"].append(run(False)[0])
        step, shadow = run(True)
        out["watched"].append(step)
        out["shadow"].append(shadow)
    summary = {k: round(float(np.median(v)), 4) for k, v in out.items()}
    summary["capture_overhead"] = round(summary["watched"] / summary["plain"] - 1, 4)
    summary["shadow_over_plain"] = round(summary["shadow"] / summary["plain"], 4)
    print(json.dumps({"runs": out, "median": summary}))


if __name__ == "__main__":
    main()
