"""Disk full, said plainly: which path had no space left and what is still intact.

A full disk surfaces in many disguises: ``OSError: [Errno 28]`` from a plain write,
``SafetensorError: ... No space left on device (os error 28)`` from safetensors, and
``RuntimeError: [enforce fail at inline_container.cc] . unexpected pos 420736 vs
420624`` from ``torch.save`` (its zip writer saw a short write and lost the errno).
:func:`disk_full_guard` turns each into one :class:`DiskFullError` that names the path,
what was being written, the space left on that device, and what the caller knows to be
intact (``the last complete checkpoint, checkpoints/step-6, is intact``). Any other
error passes through unchanged.

Example::

    with disk_full_guard(tmp_dir, "checkpoint step 8", intact=lambda: "checkpoint step 6 is intact"):
        accelerator.save_state(tmp_dir)
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

__all__ = ["DiskFullError", "is_disk_full", "disk_full_guard"]

# How a full disk (or an exhausted quota) reads in the messages of libraries that drop
# the errno: safetensors (Rust's io::Error) and torch's zip writer (a short write).
_MARKERS = ("no space left on device", "disk quota exceeded", "os error 28", "os error 122", "storagefull",
            "unexpected pos", "file write failed")


class DiskFullError(OSError):
    """No space (or quota) was left while writing; the message names the path and what is intact."""

    def __init__(self, message: str, path: str | os.PathLike):
        super().__init__(errno.ENOSPC, message)
        self.path = str(path)

    def __str__(self) -> str:
        return self.strerror


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) means the disk or the quota was full."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(marker in str(err).lower() for marker in _MARKERS):
            return True
        err = err.__cause__ or err.__context__
    return False


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _space(path: Path) -> str:
    """``"12.0 KiB free of 512.0 MiB now"`` on the device holding ``path`` (its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return "free space unknown"
    return f"{_size(usage.free)} free of {_size(usage.total)} now"


@contextmanager
def disk_full_guard(path: str | os.PathLike, what: str, *, intact: Optional[Callable[[], str]] = None,
                    cleanup: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """Re-raise a disk-full error inside the block as :class:`DiskFullError` about ``path``.

    Args:
        path: the file or folder being written (named in the message).
        what: what was being written (``"checkpoint step 8"``, ``"metrics.jsonl"``).
        intact: returns the sentence saying what is still complete, called only on failure.
        cleanup: called first on failure, e.g. to delete a partial copy and give back its space.

    Raises:
        DiskFullError: the block failed because no space or quota was left.
    """
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if not is_disk_full(err):
            raise
        if cleanup is not None:
            cleanup()
        path = Path(path)
        note = f" {intact()}" if intact is not None else ""
        raise DiskFullError(
            f"no space left on the device holding {path} while writing {what} ({_space(path)}; the writer said: "
            f"{type(err).__name__}: {str(err)[:200]}).{note} How to fix: free space there (or raise the quota), "
            "or point the output at a larger disk, then rerun.", path,
        ) from err
