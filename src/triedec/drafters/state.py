"""Drafter state files (recycling's matrix, auto's output store): safetensors written atomically
and read back with their metadata, a wrong, unreadable or unsafe file refused with a clear error.

These files hold what users' requests generated, so they are kept private: a file is written
0600 through a temporary file beside it (then an atomic replace, so a reader never sees half a
file), and a directory created for it is 0700 (every missing level). A file is read only when
the current user owns it and nobody else may write it (not group- or world-writable): anyone who
can replace it could make the drafter propose what they like (output stays exact, since the
model verifies every token, but speed and what the file later holds would be theirs). The owner
and mode are checked on the open file itself, so a swap between the check and the read is not
possible.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from triedec.errors import TriedecError


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each 0700 (existing ones are left as they are)."""
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(directory, 0o700)  # whatever the umask said


def save_state(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` (on the CPU) with ``metadata`` to ``path``, 0600: a temporary file beside
    it, then an atomic replace."""
    path = Path(path)
    make_private_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")  # 0600
    os.close(fd)
    try:
        save_file({k: v.cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_private(path: Path, what: str) -> bytes:
    """The bytes of ``path``, refused unless the current user owns it and no one else may write it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise TriedecError(f"{what} {path} cannot be opened: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TriedecError(f"{what} {path} is not a regular file")
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise TriedecError(f"{what} {path} is owned by another user (uid {info.st_uid}); refusing to load it "
                               "(learned state must belong to the user that runs triedec)")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise TriedecError(f"{what} {path} may be written by other users (mode {stat.S_IMODE(info.st_mode):o}); "
                               "refusing to load it (chmod 600 it if you trust its content)")
        chunks = []
        while chunk := os.read(fd, 1 << 24):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def load_state(path: str | os.PathLike[str], what: str, kind: str, file_format: str
               ) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors saved in ``path``; ``what`` names the state in errors (``"output
    store"``), ``kind`` the file (``"store"``). A file that is unsafe (module doc), cannot be read,
    or whose metadata is not ``file_format``, is refused."""
    path = Path(path)
    data = _read_private(path, what)
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        meta = header.get("__metadata__") or {}
        tensors = load(data)
    except (SafetensorError, struct.error, ValueError, RuntimeError, AttributeError) as exc:
        raise TriedecError(f"{what} {path} is not a readable {kind} file: {exc}") from exc
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != file_format:
        raise TriedecError(f"{what} {path} is not a triedec {what} (format {found!r})")
    return meta, tensors
