"""experiments.ttft.ablations: the ablations' saved results as table rows, on SYNTHETIC
results.json files (made-up numbers in the main job's schema; nothing here was measured)."""

import json

import pytest

from experiments.ttft.ablations import (
    TABLE_COLUMNS,
    ablation_names,
    ablation_rows,
    load_ablations,
    missing_ablations,
    row_cells,
    skipped_notes,
)

REFERENCE = "sparse-flat"
LENGTHS = (16384, 32768)
# SYNTHETIC (ttft ms, decode step ms, indexer share, recall) per (mode, length) of two
# ablations; the numbers are made up to give known ratios.
SYNTHETIC = {
    "block_size": {
        (REFERENCE, 16384): (400.0, 8.0, 0.50, None),
        (REFERENCE, 32768): (920.0, 10.0, 0.62, None),
        ("hier-block32", 16384): (320.0, 8.8, 0.30, 0.91),
        ("hier-block32", 32768): (460.0, 11.0, 0.25, 0.88),
        ("hier-block64", 16384): (250.0, 8.4, 0.21, 0.86),
        ("hier-block64", 32768): (320.0, 10.5, 0.18, 0.83),
    },
    "query_tile": {
        (REFERENCE, 16384): (410.0, 8.2, 0.51, None),
        (REFERENCE, 32768): (900.0, 10.2, 0.61, None),
        ("hier-tile1", 16384): (380.0, 8.2, 0.45, 0.95),
        ("hier-tile1", 32768): (700.0, 10.4, 0.40, 0.94),
        ("hier-tile16", 16384): (260.0, 8.3, 0.22, 0.90),
        ("hier-tile16", 32768): (360.0, 10.3, 0.20, 0.89),
    },
}
SKIPPED = ("block_size", "hier-block128", 32768, "out of memory: synthetic")


def _run(length, mode, ttft, decode, share, recall):
    return {"context_len": length, "mode": mode, "attention": "sparse",
            "ttft_ms": {"median": ttft, "min": ttft * 0.98, "max": ttft * 1.02,
                        "runs": [ttft * 0.98, ttft * 1.02]},
            "indexer_ms": share * ttft, "attention_ms": 0.3 * ttft,
            "other_ms": (0.7 - share) * ttft, "indexer_share": share,
            "decode_step_ms": {"median": decode, "min": decode, "max": decode},
            "recall": recall, "iou": None if recall is None else recall * 0.9,
            "top1_agreement": None if recall is None else 0.97,
            "logit_kl": None if recall is None else 0.01,
            "top1_agreement_vs_dense": None, "logit_kl_vs_dense": None,
            "config": {"top_k": 512}}


def synthetic_results(name):
    """One SYNTHETIC results.json dict in the main job's schema (experiments/run.py)."""
    table = SYNTHETIC[name]
    modes = list(dict.fromkeys(mode for mode, _ in table))
    runs = [_run(length, mode, *table[(mode, length)]) for length in LENGTHS for mode in modes]
    if SKIPPED[0] == name:  # as experiments.ttft.study writes a run that did not fit
        modes.append(SKIPPED[1])
        runs.append({"context_len": SKIPPED[2], "mode": SKIPPED[1], "skipped": SKIPPED[3],
                     "ttft_ms": None, "indexer_ms": None, "attention_ms": None,
                     "other_ms": None, "indexer_share": None, "recall": None, "iou": None,
                     "top1_agreement": None, "logit_kl": None})
    return {"config": {"reference": REFERENCE, "compare": modes[1], "lengths": list(LENGTHS),
                       "modes": [{"name": m, "attention": "sparse",
                                  "indexer": "flat" if m == REFERENCE else "hierarchical",
                                  "hierarchical": {}, "overrides": {}, "max_length": None}
                                 for m in modes]},
            "model": "SYNTHETIC numbers (test fixture, nothing measured)",
            "random_weights": False,
            "env": {"jax": "0.0", "backend": "synthetic", "device": "synthetic"},
            "method": {}, "runs": runs, "summary": {}, "command": f"synthetic {name}",
            "wall_s": 0.0}


def write_synthetic(folder):
    """Writes folder/<name>/results.json for every SYNTHETIC ablation; -> folder."""
    for name in SYNTHETIC:
        (folder / name).mkdir(parents=True)
        (folder / name / "results.json").write_text(json.dumps(synthetic_results(name)))
    return folder


def test_rows_hold_the_ratios_against_the_reference_at_the_same_length():
    rows = {(r["mode"], r["context_len"]): r for r in ablation_rows(
        synthetic_results("block_size"))}
    hier = rows[("hier-block64", 32768)]
    assert hier["speedup"] == pytest.approx(920.0 / 320.0)
    assert hier["decode_ratio"] == pytest.approx(10.5 / 10.0)
    assert (hier["recall"], hier["indexer_share"], hier["reference"]) == (0.83, 0.18, False)
    assert rows[("hier-block32", 16384)]["speedup"] == pytest.approx(400.0 / 320.0)
    ref = rows[(REFERENCE, 16384)]
    assert ref["reference"] and ref["speedup"] == 1.0 and ref["recall"] is None
    skipped = rows[("hier-block128", 32768)]
    assert skipped["skipped"] == SKIPPED[3]
    assert skipped["speedup"] is None and skipped["decode_ratio"] is None


def test_a_missing_reference_run_leaves_the_ratios_unmeasured():
    results = synthetic_results("query_tile")
    results["runs"] = [r for r in results["runs"]
                       if not (r["mode"] == REFERENCE and r["context_len"] == 32768)]
    rows = {(r["mode"], r["context_len"]): r for r in ablation_rows(results)}
    assert rows[("hier-tile16", 32768)]["speedup"] is None
    assert rows[("hier-tile16", 32768)]["decode_ratio"] is None
    assert rows[("hier-tile16", 16384)]["speedup"] == pytest.approx(410.0 / 260.0)


def test_row_cells_format_every_column():
    rows = ablation_rows(synthetic_results("block_size"))
    cells = {(r["mode"], r["context_len"]): row_cells(r) for r in rows}
    assert cells[("hier-block64", 32768)] == ["32768", "hier-block64", "2.875", "0.8300",
                                              "0.7470", "0.9700", "0.0100", "0.18", "1.05"]
    assert cells[(REFERENCE, 16384)][:3] == ["16384", "sparse-flat (ref)", "1.000"]
    assert cells[(REFERENCE, 16384)][3] == "-"
    assert cells[("hier-block128", 32768)][2:4] == ["skipped", "-"]
    assert skipped_notes(rows) == [f"hier-block128 at 32768 tokens: {SKIPPED[3]}"]
    assert all(len(c) == len(TABLE_COLUMNS) for c in cells.values())


def test_load_and_missing(tmp_path):
    write_synthetic(tmp_path)
    (tmp_path / "exact").mkdir()  # a folder without results.json is not an ablation's result
    loaded = load_ablations(tmp_path)
    assert list(loaded) == ["block_size", "query_tile"]
    assert loaded["block_size"] == synthetic_results("block_size")
    assert load_ablations(tmp_path / "nowhere") == {}
    names = ablation_names()
    assert {"block_size", "query_tile", "exact", "flat_index_layers"} <= set(names)
    missing = missing_ablations(tmp_path)
    assert "exact" in missing and "block_size" not in missing
    assert sorted(missing + ["block_size", "query_tile"]) == names


def test_invalid_json_names_the_file(tmp_path):
    (tmp_path / "exact").mkdir()
    (tmp_path / "exact" / "results.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"exact/results.json: not valid JSON"):
        load_ablations(tmp_path)
