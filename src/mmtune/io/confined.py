"""Reading a file that must lie inside a folder, checked on the file actually opened.

Checking a path and then opening it leaves a window: a file inside the folder replaced by
a symlink (or a folder on its way replaced by one) between the check and the open makes
the open follow it to any file the process can read. :func:`read_inside` opens first and
then asks the kernel which file the descriptor refers to (``/proc/self/fd`` on Linux,
``F_GETPATH`` on macOS), so the containment is checked on the very file whose bytes are
returned, at the moment it is read. Symlinks that stay inside the folder are followed.
"""

from __future__ import annotations

import os
import stat
from typing import Optional

__all__ = ["OutsideRoot", "read_inside"]


class OutsideRoot(ValueError):
    """The file opened lies outside the folder it must stay in, or is no regular file."""


def _opened_path(fd: int) -> str:
    """The real path of the file behind ``fd``, as the kernel knows it."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass
    import fcntl

    if hasattr(fcntl, "F_GETPATH"):
        return fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(4096)).split(b"\0", 1)[0].decode()
    raise OSError("this system cannot tell which file a descriptor refers to (no /proc/self/fd, no F_GETPATH)")


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def read_inside(path: str, root: Optional[str]) -> bytes:
    """The bytes of the regular file ``path``, which must lie inside ``root`` when opened.

    Args:
        root: the folder (any spelling; its real path is compared); ``None``: not confined.

    Raises:
        OutsideRoot: the file opened is outside ``root`` (a symlink, perhaps put there
            after the data was checked), or is not a regular file (a FIFO, a device).
        OSError: the file cannot be opened.
    """
    # O_NONBLOCK: opening a FIFO planted in its place must not wait for a writer
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OutsideRoot(f"{path} is not a regular file; only image files are read")
        if root is not None:
            real, real_root = _opened_path(fd), os.path.realpath(root)
            if not _inside(real, real_root):
                raise OutsideRoot(f"{path} leads to {real}, outside the image root {real_root}, when opened; "
                                  "refused (was it replaced by a symlink?)")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read()
    finally:
        os.close(fd)
