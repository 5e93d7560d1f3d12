"""Files that an interruption cannot leave half-written: write a temporary file next to the
target, then rename it over the target (`os.replace` is atomic on one file system). Every
piece of run state that `--resume` reads back goes through these two functions."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def save_atomic(obj, path: Path) -> None:
    """torch.save, atomically."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    """Path.write_text, atomically."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
