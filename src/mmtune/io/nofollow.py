"""Writing into output folders without following symbolic links.

Everything mmtune writes into an output folder (locks, checkpoints' JSON, metrics,
reports, results, generations, plots) opens its file through this module. A file name
that someone replaced by a symbolic link (``report.md -> ~/.bashrc``) would otherwise
have the link's target overwritten or appended to, wherever it is and whoever owns it.
Here the open itself refuses a link as the last path component (``O_NOFOLLOW``: no gap
between a check and the open), and the error names the link, its target and what to do.

Only the last component is protected: the folders above it are the user's choice of
output folder (a symlinked ``outputs/`` is a normal way to put runs on another disk).

Example::

    with open_output(out / "report.md") as handle:
        handle.write(text)
    write_output_text(out / "stats.json", json.dumps(stats))
"""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import IO, Any, Optional

__all__ = ["OutputLinkError", "open_output", "open_output_fd", "write_output_text", "write_output_bytes", "save_figure"]

_MODES = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "r+": os.O_RDWR | os.O_CREAT,
}


class OutputLinkError(FileExistsError, ValueError):
    """A file mmtune writes into an output folder is a symbolic link; nothing was written.

    A :class:`FileExistsError` (something is in the way) and a :class:`ValueError`, so the
    commands print it as one message like their other refusals.
    """


def _refusal(path: str | os.PathLike) -> OutputLinkError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return OutputLinkError(
        f"{path} is a symbolic link (to {target}); mmtune does not write through links in its output folders, "
        "since that would overwrite the link's target. Remove the link (rm -- "
        f"'{path}') or choose another output folder")


def open_output_fd(path: str | os.PathLike, mode: str = "w", perm: int = 0o666) -> int:
    """An OS-level descriptor of ``path`` opened for writing, never through a symbolic link.

    Args:
        mode: ``w`` (truncate), ``a`` (append), ``x`` (must not exist) or ``r+`` (read and
            write, created if missing, not truncated: a lock file).
        perm: the mode of a new file, before the umask.

    Raises:
        OutputLinkError: ``path`` is a symbolic link (dangling or not).
    """
    flags = _MODES[mode.replace("b", "").replace("t", "")]
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, perm)
    except OSError as err:
        # O_NOFOLLOW on a link gives ELOOP; O_EXCL on a (dangling) link gives EEXIST
        if err.errno in (errno.ELOOP, errno.EEXIST, errno.EMLINK) and os.path.islink(path):
            raise _refusal(path) from None
        raise


def open_output(path: str | os.PathLike, mode: str = "w", *, encoding: Optional[str] = "utf-8",
                newline: Optional[str] = None) -> IO[Any]:
    """``open(path, mode)`` for writing into an output folder, never through a symbolic link.

    ``mode`` is ``w``, ``a`` or ``x``, with ``b`` for bytes (then ``encoding`` is ignored).

    Raises:
        OutputLinkError: ``path`` is a symbolic link; nothing was written.
    """
    fd = open_output_fd(path, mode)
    if "b" in mode:
        return os.fdopen(fd, mode)
    return io.open(fd, mode, encoding=encoding, newline=newline)


def write_output_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> int:
    """``Path(path).write_text(text)``, never through a symbolic link."""
    with open_output(Path(path), "w", encoding=encoding) as handle:
        return handle.write(text)


def write_output_bytes(path: str | os.PathLike, data: bytes) -> int:
    """``Path(path).write_bytes(data)``, never through a symbolic link."""
    with open_output(Path(path), "wb") as handle:
        return handle.write(data)


def save_figure(figure: Any, path: str | os.PathLike, **savefig_kwargs: Any) -> None:
    """``figure.savefig(path, ...)`` for a matplotlib figure, never through a symbolic link
    (the format comes from the file's suffix, as savefig would take it)."""
    path = Path(path)
    with open_output(path, "wb") as handle:
        figure.savefig(handle, format=path.suffix.lstrip(".") or None, **savefig_kwargs)
