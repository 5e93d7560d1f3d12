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
    # the world's exact values, as the README states them
    assert "0.240 on real users, 0.988 inside the gamma=8 users" in out
    assert "references: random 0.107, best fixed 0.336, best adaptive 0.692" in out
    assert "drawn reply:" in out and "true top-5 :" in out and "gamma 8: simulator-side var" in out
    for arm in ("single", "vs    "):
        assert f"{arm} after 2 steps: train reward" in out and "real users 0." in out
