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

The directory that holds a state file must be private too (:func:`check_location`): owned by the
current user (or root) and not writable by group or others. In a directory others may write, they
could delete the file, swap it, or create its name (or the per-tenant directory beside it) before
triedec does; such a location is refused when the drafter is built (for the server's own options:
at startup), before anything is read or written there.
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

from triedec.core.errors import StateFileError


def _private_dir(directory: Path, what: str, path: Path) -> None:
    """Refuse ``directory`` (which holds ``what`` ``path``) unless it is a directory owned by the
    current user or root that neither group nor others may write."""
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise StateFileError(f"{what} {path}: {directory} is not a directory")
    if hasattr(os, "geteuid") and info.st_uid not in (os.geteuid(), 0):
        raise StateFileError(f"{what} {path}: its directory {directory} is owned by another user (uid {info.st_uid})"
                             "; choose a directory of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateFileError(f"{what} {path}: its directory {directory} may be written by other users (mode "
                             f"{stat.S_IMODE(info.st_mode):o}), who could delete, swap or pre-create the file; "
                             "choose a private directory (chmod 700)")


def check_location(path: str | os.PathLike[str], what: str = "learned-state file") -> None:
    """Refuse a state-file location others could tamper with (module doc): the directory that
    holds ``path`` must be private; where it does not exist yet (triedec creates it 0700), the
    nearest existing ancestor must not be writable by others unless it has the sticky bit (as
    ``/tmp``: others may not remove or rename what is ours there). An existing file must pass
    :func:`load_state`'s checks."""
    path = Path(path)
    directory = path.parent
    if directory.exists():
        _private_dir(directory, what, path)
    else:
        ancestor = directory.parent
        while not ancestor.exists() and ancestor.parent != ancestor:
            ancestor = ancestor.parent
        info = os.stat(ancestor)
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            raise StateFileError(f"{what} {path}: {ancestor} may be written by other users (mode "
                                 f"{stat.S_IMODE(info.st_mode):o}) and has no sticky bit, so the directories triedec "
                                 "would create there could be swapped; choose a private directory")
    if path.exists():
        _read_private(path, what, read=False)


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
        except FileExistsError:  # made by someone else meanwhile: used only if it is private
            _private_dir(directory, "a directory for learned state", directory)
            continue
        os.chmod(directory, 0o700)  # whatever the umask said


def save_state(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` (on the CPU) with ``metadata`` to ``path``, 0600: a temporary file beside
    it, then an atomic replace."""
    path = Path(path)
    make_private_dirs(path.parent)
    check_location(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")  # 0600
    os.close(fd)
    try:
        save_file({k: v.cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_private(path: Path, what: str, read: bool = True) -> bytes:
    """The bytes of ``path`` (``read`` False: only the checks), refused unless it is a regular file
    the current user owns and no one else may write."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise StateFileError(f"{what} {path} cannot be opened: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateFileError(f"{what} {path} is not a regular file")
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise StateFileError(f"{what} {path} is owned by another user (uid {info.st_uid}); refusing to load it "
                                 "(learned state must belong to the user that runs triedec)")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StateFileError(f"{what} {path} may be written by other users (mode {stat.S_IMODE(info.st_mode):o}); "
                                 "refusing to load it (chmod 600 it if you trust its content)")
        if not read:
            return b""
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
    check_location(path, what)
    data = _read_private(path, what)
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        meta = header.get("__metadata__") or {}
        tensors = load(data)
    except (SafetensorError, struct.error, ValueError, RuntimeError, AttributeError) as exc:
        raise StateFileError(f"{what} {path} is not a readable {kind} file: {exc}") from exc
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != file_format:
        raise StateFileError(f"{what} {path} is not a triedec {what} (format {found!r})")
    return meta, tensors
