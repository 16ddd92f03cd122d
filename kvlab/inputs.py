"""Input files read whole (API keys, audit keys, model configs): regular files only, of a bounded
size.

``read_input(path, what, limit)`` refuses, with one line naming the file and the option (``what``),
a path that does not exist, one that is not a regular file (a folder, ``/dev/zero``, a FIFO: said as
such, never read), and a file of more than ``limit`` bytes (checked on the open file, and again
while reading: a file that grows meanwhile is refused too). ``file_kind`` says what a path is.
Standard library only: the server, the doctor and the audit all use it.
"""

from __future__ import annotations

import os
import stat

__all__ = ["InputFileError", "file_kind", "read_input"]

_KINDS = [
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
]


class InputFileError(ValueError):
    """An input file that cannot be read as one: missing, not a regular file, too big or
    unreadable."""


def _kind(mode: int) -> str | None:
    """What a file of ``mode`` is, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def file_kind(path: str | os.PathLike) -> str | None:
    """``"no such file"``, ``"a folder"``, ``"a character device"``, ... or None for a regular file
    (links followed)."""
    try:
        return _kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return "no such file"
    except OSError as e:
        return f"unreadable ({e.strerror})"


def read_input(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); ``InputFileError`` naming
    ``what`` otherwise."""
    name = os.fspath(path)
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused right after, by its kind
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise InputFileError(f"{what} {name}: no such file") from None
    except IsADirectoryError:
        raise InputFileError(f"{what} {name} is a folder, not a file") from None
    except OSError as e:
        raise InputFileError(f"{what} {name}: cannot read it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if (kind := _kind(st.st_mode)) is not None:
            raise InputFileError(f"{what} {name} is {kind}, not a regular file")
        if st.st_size > limit:
            raise InputFileError(
                f"{what} {name} holds {st.st_size:,} bytes; at most {limit:,} are read"
            )
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise InputFileError(f"{what} {name}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise InputFileError(
            f"{what} {name} holds more than {limit:,} bytes; at most {limit:,} are read"
        )
    return data
