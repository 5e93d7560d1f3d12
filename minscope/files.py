"""Files that an interruption cannot leave half-written: write a temporary file next to the
target, then rename it over the target (`os.replace` is atomic on one file system). Every
piece of run state that `--resume` reads back goes through these functions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def _replace(path, write) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_atomic(obj, path: Path) -> None:
    """torch.save, atomically."""
    _replace(path, lambda tmp: torch.save(obj, tmp))


def write_text_atomic(path: Path, text: str) -> None:
    """Path.write_text, atomically."""
    _replace(path, lambda tmp: tmp.write_text(text))


def truncate_log(path: Path, last_step: int) -> None:
    """Keep the lines of a JSONL metrics log up to step `last_step`: a resumed run redoes
    the steps after its saved state, and must not log them twice."""
    path = Path(path)
    if path.exists():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= last_step]
        write_text_atomic(path, "".join(ln + "\n" for ln in kept))
