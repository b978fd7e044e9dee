"""What a data path is, said truly: missing, a directory, or not a regular file (a FIFO, a socket,
a device) — each its own one-line error naming the path and what was expected."""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["regular_file", "directory"]

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _stat(path: Path, who: str, expected: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{who}: {str(path)!r} does not exist (expected {expected})") from None


def regular_file(path: str | Path, who: str, expected: str) -> Path:
    """``path`` if it is a regular file (or a link to one).

    Raises:
        FileNotFoundError: it does not exist.
        ValueError: it is a directory, or not a regular file (FIFO, socket, device) — read, a FIFO
            would block and a device never ends.
    """
    p = Path(path)
    mode = _stat(p, who, expected).st_mode
    if stat.S_ISDIR(mode):
        raise ValueError(f"{who}: {str(p)!r} is a directory, expected {expected}")
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        raise ValueError(f"{who}: {str(p)!r} is not a regular file (it is {kind}), expected {expected}")
    return p


def directory(path: str | Path, who: str, expected: str) -> Path:
    """``path`` if it is a directory.

    Raises:
        FileNotFoundError: it does not exist.
        ValueError: it is a file (or another non-directory).
    """
    p = Path(path)
    if not stat.S_ISDIR(_stat(p, who, expected).st_mode):
        raise ValueError(f"{who}: {str(p)!r} is not a directory, expected {expected}")
    return p
