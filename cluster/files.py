"""Modes of the files Hourglass writes, and writing a whole file atomically in a way that is
safe even in a folder other users can write to: the one way Hourglass writes secrets (keys,
tokens, the auth file) and small files it replaces (``cluster.json``, ready files, ``meta.json``).
docs/security.md "Secrets and data on disk".

Modes: secrets and every data file of a server are owner-only (``SECRET_MODE`` =
``DATA_MODE`` = 0600, folders ``DATA_DIR_MODE`` = 0700); certificates are 0644. Servers also
run with umask 077 (``cluster.process.restrict_umask``), so a file created without an
explicit mode is owner-only too.

Invariants of ``write_atomic(path, data, mode=m)``:

* the bytes go to a **fresh** file with a random name in ``path``'s folder, created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode ``m``: it has that mode (less the umask) from its
  first instant and is owned by the caller; no file or symlink that was there before is ever
  opened (a ``ca.key.tmp`` another user planted is left alone);
* the file is fsynced, renamed over ``path`` (``os.replace``), then the folder is fsynced: a
  reader sees the old file or the whole new one, never half of it;
* nothing is chmodded afterwards, so there is no instant in which a secret is readable;
* on an error the temporary file is removed and ``path`` is unchanged.

The folder must exist (``write_secret`` and ``write_public`` make a missing one, owner-only).
A crash between create and rename leaves ``.<name>.<random>.tmp`` behind (never read;
the stores remove them when they open: ``remove_leftover_temps``).

Example::

    write_secret(Path("secrets/ca.key"), pem)      # secrets/ca.key, 0600, ours
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

SECRET_MODE = 0o600        # keys, tokens, the auth file
DATA_MODE = 0o600          # every file a node writes under its data folder
DATA_DIR_MODE = 0o700      # every folder made for data or secrets
PUBLIC_MODE = 0o644        # certificates: anyone may read them
TMP_NAME_ATTEMPTS_MAX = 16  # random 64-bit names: a clash means someone plants names on purpose


def write_atomic(path: str | os.PathLike, data: bytes, *, mode: int) -> Path:
    """Replace ``path`` with ``data``, the new file created with ``mode`` (see the module doc).
    Returns ``path``."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(TMP_NAME_ATTEMPTS_MAX):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{path.parent}: {TMP_NAME_ATTEMPTS_MAX} random temporary names all taken")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
    return path


_TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{16}\.tmp$")


def remove_leftover_temps(folder: str | os.PathLike) -> int:
    """Remove what ``write_atomic`` left in ``folder`` when a crash came between create and
    rename (``.<name>.<16 hex>.tmp``: never read). A store calls it when it opens, with no
    writer running; returns how many were removed."""
    n = 0
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return 0
    for name in names:
        if _TEMP_NAME.match(name):
            try:
                os.unlink(os.path.join(folder, name))
                n += 1
            except FileNotFoundError:
                pass
    return n


def write_secret(path: str | os.PathLike, data: bytes) -> Path:
    """Write a key, token or any file holding a secret: owner-only (0600) from its first instant.
    A missing folder is made owner-only (0700); an existing one keeps its mode."""
    Path(path).parent.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
    return write_atomic(path, data, mode=SECRET_MODE)


def write_public(path: str | os.PathLike, data: bytes) -> Path:
    """Write a file anyone may read (a certificate) the same safe way, 0644 (a missing folder
    is made owner-only all the same)."""
    Path(path).parent.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
    return write_atomic(path, data, mode=PUBLIC_MODE)


def fsync_dir(d: str | os.PathLike) -> None:
    """fsync a directory (a created, renamed or deleted entry is durable)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
