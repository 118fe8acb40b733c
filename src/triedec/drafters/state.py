"""Drafter state files (recycling's matrix, auto's output store): safetensors written atomically
and read back with their metadata, a wrong or unreadable file refused with a clear error."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from triedec.errors import TriedecError


def save_state(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` (on the CPU) with ``metadata`` to ``path``: a temporary file beside it,
    then an atomic replace, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_state(path: str | os.PathLike[str], what: str, kind: str, file_format: str
               ) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors saved in ``path``; ``what`` names the state in errors (``"output
    store"``), ``kind`` the file (``"store"``). A file that cannot be read, or whose metadata is
    not ``file_format``, is refused."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise TriedecError(f"{what} {path} is not a readable {kind} file: {exc}") from exc
    if meta.get("format") != file_format:
        raise TriedecError(f"{what} {path} is not a triedec {what} (format {meta.get('format')!r})")
    return meta, tensors
