"""File modes: weights written world-readable like every other file of a checkpoint.

safetensors 0.8 writes each file through a temporary file that it renames into place
(safetensors PR #764); the temporary file is created with mode 0600 whatever the
process umask says, and the rename keeps it. So ``model.safetensors`` (from
transformers' ``save_pretrained``, accelerate's ``save_state`` or ``save_file``) ends up
readable by its owner only, while ``config.json`` beside it gets the usual 0644: a
checkpoint another user (a serving account, a container user) cannot load.
:func:`restore_default_modes` gives such files the mode a plain ``open()`` would have
given them, ``0o666 & ~umask``, so the whole folder follows the umask again.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["current_umask", "default_file_mode", "restore_default_modes"]

_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where the kernel reports it
    (``/proc/self/status``, Linux 4.7+); elsewhere set and restored under a lock."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: ``0o666`` without the umask's bits."""
    return 0o666 & ~current_umask()


def restore_default_modes(folder: str | os.PathLike, pattern: str = "*.safetensors") -> list[Path]:
    """Give every file under ``folder`` matching ``pattern`` (recursively) the umask's
    default mode; returns the files whose mode changed."""
    mode = default_file_mode()
    changed = []
    for path in sorted(Path(folder).rglob(pattern)):
        if path.is_file() and not path.is_symlink() and (path.stat().st_mode & 0o777) != mode:
            os.chmod(path, mode)
            changed.append(path)
    return changed
