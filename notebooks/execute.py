"""Re-execute notebooks in place with their full settings (not the test suite's fast mode), so
that they are stored with the outputs a reader gets:

    python notebooks/execute.py                        # all six (06's GPU cells skip without a CUDA GPU)
    python notebooks/execute.py 01_simulator_collapse  # one

One at a time, each in a fresh Jupyter kernel, the tiny models built cold in a temporary cache.
tests/test_notebook.py checks that the stored outputs show what the code prints today.
"""
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
CPU_NOTEBOOKS = ["01_simulator_collapse", "02_grpo_from_scratch", "03_fused_logprobs", "04_verbalized_sampling",
                 "05_cotraining_and_population", "06_real_models"]


def main(names):
    if any(n in ("-h", "--help") for n in names):
        print(__doc__.strip())
        return
    unknown = [n for n in names if not (HERE / f"{Path(n).stem}.ipynb").is_file()]
    if unknown:
        sys.exit(f"no such notebook in {HERE}: {', '.join(unknown)} (these are: "
                 f"{', '.join(sorted(p.stem for p in HERE.glob('*.ipynb')))})")
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        sys.exit("no Jupyter kernel named python3: install one with `pip install ipykernel && "
                 "python -m ipykernel install --user`")
    os.environ.pop("MINSCOPE_NOTEBOOK_FAST", None)
    os.environ["MINSCOPE_CACHE"] = tempfile.mkdtemp(prefix="minscope-notebooks-")
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    for name in names:
        path = HERE / f"{Path(name).stem}.ipynb"
        nb = nbformat.read(path, as_version=4)
        t0 = time.time()
        NotebookClient(nb, timeout=3600, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
        nbformat.write(nb, path)
        print(f"{path.name}: executed in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or CPU_NOTEBOOKS)
