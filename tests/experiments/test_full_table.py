"""The evaluation's full table gathers runs of record into rows of comparable cells."""

import json

from experiments.evaluation import full_table


def _retrieval(kind, L, sequences, methods, budget=4096, indexer="idx/a"):
    cells = {}
    for name, acc, diff in methods:
        cells[name] = {"token_accuracy": acc, "token_ci95": [acc - 0.02, acc + 0.02],
                       "correct": 3, "probes": 4 * sequences, "token_vs_dense": diff,
                       "token_vs_dense_ci95": None if diff is None else [diff - .01, diff + .01]}
    return {"info": {"indexer": indexer}, "config": {"top_k": 1024, "dense_layers": []},
            "hierarchical_budget": budget,
            "lengths": [{"length": L, "retrieval": {"kind": kind, "sequences": sequences,
                                                    **cells}}]}


def _perplexity(L, windows, ppls):
    return {"info": {"indexer": "idx/a"}, "config": {"top_k": 1024, "dense_layers": [],
                                                      "index_rope_scaling": 4.0},
            "hierarchical_budget": 4096,
            "lengths": [{"length": L, "pairs": {"sparse_flat|dense": {"agreement": 0.95}},
                         "methods": {m: {"perplexity": v, "windows": windows,
                                         "ppl_vs_dense": None if m == "dense" else 0.05}
                                     for m, v in ppls.items()}}]}


def _write(root, name, data, file="eval.json"):
    (root / name).mkdir()
    (root / name / file).write_text(json.dumps(data))


def test_cells_keep_the_largest_run_and_say_where_they_come_from(tmp_path):
    _write(tmp_path, "small", _retrieval("copy", 2048, 6, [("dense", 0.9, None),
                                                          ("sparse_flat", 0.5, -0.4)]))
    _write(tmp_path, "large", _retrieval("copy", 2048, 40, [("dense", 0.87, None),
                                                           ("sparse_flat", 0.74, -0.136)]))
    _write(tmp_path, "hier", _retrieval("copy", 2048, 40, [("sparse_hier", 0.51, -0.361)],
                                        budget=1024))
    _write(tmp_path, "ppl1", _perplexity(8192, 1, {"dense": 5.755, "sparse_flat": 6.35}))
    _write(tmp_path, "ppl4", _perplexity(8192, 4, {"dense": 7.27, "sparse_flat": 7.60}))
    _write(tmp_path, "proxy", {"indexer": "idx/b", "method": "sparse_flat",
                               "config": {"top_k": 1024, "dense_layers": []}, "copy": [
        {"length": 4096, "sequences": 16, "dense": 0.794, "method": 0.578,
         "vs_dense": -0.216, "vs_dense_ci95": [-0.261, -0.171]}]}, file="proxy.json")
    rows = full_table.gather(tmp_path)
    copy = rows[("idx/a", "copy", 2048, "top_k 1024")]
    assert copy["cells"]["sparse_flat"]["sparse_flat"][0] == 40  # the 40-sequence run wins
    assert copy["cells"]["sparse_flat"]["sparse_flat"][1]["acc"] == 0.74
    assert "sparse_hier (budget 1024)" in copy["cells"]["sparse_hier"]
    assert len(copy["folders"]) == 2 and not any("small" in f for f in copy["folders"])
    # Perplexities over different windows never share a row.
    assert {k[3] for k in rows if k[1] == "perplexity"} == {
        "top_k 1024, index rope x4; 1 window(s)", "top_k 1024, index rope x4; 4 window(s)"}
    text = full_table.markdown(rows)
    assert "74.0 [72.0, 76.0]; **-13.6** [-14.6, -12.6]" in text
    assert "sparse_hier (budget 1024): 51.0" in text
    assert "7.600 (+5.00%); top-1 0.950" in text
    assert "| idx/b | copy | 4096 | top_k 1024 | 16 seq | 79.4 | - | 57.8; **-21.6**" in text


def test_a_proxy_that_did_not_record_its_setting_claims_none(tmp_path):
    _write(tmp_path, "proxy", {"indexer": "idx/c", "method": "sparse_flat", "copy": [
        {"length": 2048, "sequences": 40, "dense": 0.874, "method": 0.854,
         "vs_dense": -0.02, "vs_dense_ci95": [-0.036, -0.004]}]}, file="proxy.json")
    (key,) = full_table.gather(tmp_path)
    assert key[3] == "setting not recorded (the indexer's own top_k)"
    # The proxy's own copy run beside it carries the cell with its setting: no second row.
    (tmp_path / "proxy" / "copy_2048").mkdir()
    (tmp_path / "proxy" / "copy_2048" / "eval.json").write_text(json.dumps(_retrieval(
        "copy", 2048, 40, [("dense", 0.874, None), ("sparse_flat", 0.854, -0.02)],
        indexer="idx/c")))
    assert list(full_table.gather(tmp_path)) == [("idx/c", "copy", 2048, "top_k 1024")]


def test_an_indexer_is_its_weights_not_its_folder(tmp_path, monkeypatch):
    """Runs of the same weights from two folders share rows; a folder whose weights were
    replaced since (a better indexer shipped) is marked on the rows of its old weights."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "indexer.safetensors").write_bytes(b"new weights")
    new = full_table.file_sha256(tmp_path / "ckpt" / "indexer.safetensors")
    old = "0" * 64
    monkeypatch.setattr(full_table, "REPO_ROOT", tmp_path)
    results = tmp_path / "results"
    results.mkdir()

    def run(name, folder, digest, length):
        data = _retrieval("copy", length, 16, [("dense", 0.8, None), ("sparse_flat", 0.7, -0.1)],
                          indexer=folder)
        data["info"]["indexer_sha256"] = digest
        _write(results, name, data)

    run("before", "ckpt", old, 2048)
    run("stage", "stage4", new, 2048)
    run("shipped", "ckpt", new, 4096)
    rows = full_table.gather(results)
    assert {key[0] for key in rows} == {old, new}
    names = {key[0]: slot["indexer"] for key, slot in rows.items()}
    assert names[old] == "ckpt (earlier weights) [sha256 00000000]"
    assert names[new] == f"ckpt = stage4 (not in this checkout) [sha256 {new[:8]}]"
    assert len([key for key in rows if key[0] == new]) == 2  # its 2K and 4K rows


def test_a_stage_shipped_after_its_evaluation_is_named_where_it_lives_now(tmp_path,
                                                                         monkeypatch):
    shipped = tmp_path / "checkpoints" / "model"
    shipped.mkdir(parents=True)
    (shipped / "indexer.safetensors").write_bytes(b"stage weights")
    digest = full_table.file_sha256(shipped / "indexer.safetensors")
    monkeypatch.setattr(full_table, "REPO_ROOT", tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    data = _retrieval("copy", 2048, 16, [("dense", 0.8, None), ("sparse_flat", 0.7, -0.1)],
                      indexer="retrofit/stage6")
    data["info"]["indexer_sha256"] = digest
    _write(results, "stage6", data)
    (slot,) = full_table.gather(results).values()
    assert slot["indexer"] == (f"checkpoints/model (now) = retrofit/stage6 (not in this "
                               f"checkout) [sha256 {digest[:8]}]")
