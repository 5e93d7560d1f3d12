"""The teaching notebook runs top to bottom (its code cells, in order, in one namespace)."""
import json
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_simulator_collapse.ipynb"


def test_simulator_collapse_notebook_runs_top_to_bottom(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MINSCOPE_NOTEBOOK_STEPS", "2")
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    namespace = {"__name__": "__notebook__"}
    for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
        exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}[{i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "drawn reply:" in out and "gamma 8: simulator-side var" in out
    assert "single" in out and "vs" in out
