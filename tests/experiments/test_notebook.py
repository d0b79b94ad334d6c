"""notebooks/ablations.ipynb runs top to bottom (nbclient) on SYNTHETIC saved results and on an
empty folder, in a kernel of this test's own Python environment."""

import pathlib
import sys

import nbclient
import nbformat
import pytest

from tests.experiments.test_ablations import write_synthetic

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "ablations.ipynb"


def _execute(folder, monkeypatch):
    """Runs the notebook with DOSA_ABLATIONS_DIR=folder (plus a last cell printing the kernel's
    sys.prefix) -> (every output's text, the kernel's sys.prefix, the number of PNG outputs)."""
    monkeypatch.setenv("DOSA_ABLATIONS_DIR", str(folder))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print('PREFIX=' + sys.prefix)"))
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    texts, pngs = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out["output_type"] != "error", out
            texts.append(out.get("text", ""))
            data = out.get("data", {})
            texts.append(data.get("text/plain", ""))
            pngs += "image/png" in data
    text = "".join(texts)
    prefix = text.split("PREFIX=")[1].splitlines()[0]
    return text, prefix, pngs


@pytest.mark.slow
def test_notebook_tabulates_and_plots_the_saved_ablations(tmp_path, monkeypatch):
    text, prefix, pngs = _execute(write_synthetic(tmp_path), monkeypatch)
    assert pathlib.Path(prefix) == pathlib.Path(sys.prefix)  # the venv's own kernel
    assert pngs == 3  # speedup vs recall, indexer share, decode ratio
    # SYNTHETIC: hier-block64 at 32768 tokens took 320 ms against the reference's 920 ms.
    row = next(line for line in text.splitlines() if "hier-block64" in line and "32768" in line)
    assert f"{920 / 320:.3f}" in row
    assert "hier-block128 at 32768 tokens: out of memory: synthetic" in text
    assert "skipped exact: no " in text  # a shipped ablation without results is noted


@pytest.mark.slow
def test_notebook_without_results_says_so(tmp_path, monkeypatch):
    text, _, pngs = _execute(tmp_path, monkeypatch)
    assert "No ablation results under" in text and pngs == 0
