"""One output folder, one writer: an exclusive advisory lock on a directory.

Two processes writing into one output folder corrupt each other: two evaluations append
to one generations file, two trainings interleave checkpoints and logs. Every command
that owns an output folder takes this lock first; a second process is refused with the
holder's pid, host, command and start time, and how to fix it.

Usage::

    from mmtune.io.locks import DirectoryLockedError, lock_directory

    lock = lock_directory(out_dir, purpose="evaluation", hint="choose another output_dir")
    ...                                  # write into out_dir
    lock.release()                       # or let the process exit

    with lock_directory(out_dir, purpose="generation"):
        ...

How it works, and why:

- ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<dir>/.mmtune.lock``. The kernel drops the
  lock when the holder's file descriptor closes, which includes every way a process can
  die (``kill -9``, out-of-memory, a node reboot for a local file system), so a lock is
  never stale and a resume never has to delete anything. The file itself stays (it then
  holds the last holder's details, which mean nothing without the lock); deleting it on
  release would let two processes lock two different files of the same name.
- The file records the holder (``pid``, ``host``, ``command``, ``since``, ``purpose``)
  so that the refusal can name it. Secrets in ``key=value`` arguments and secret values of
  the environment anywhere in the command are replaced by ``***`` (:mod:`mmtune.io.secrets`).
- Within one process the lock is re-entrant and counted: a second :func:`lock_directory`
  of the same folder (a recipe rebuilt in a notebook, an evaluation nested in a
  training run's folder) succeeds and the lock is released with the last handle. A
  ``flock`` is held per open file, so without this count a process would refuse itself.
- A forked child (a DataLoader worker) closes its copy of the descriptor at once, so a
  holder killed with ``kill -9`` does not leave its lock held by orphaned workers.
- Under multi-process training only the main process locks: the ranks of one job share
  the folder legitimately. The caller broadcasts a refusal so that every rank stops with
  the same message (see :class:`mmtune.training.loop.SFTRecipe`).
- On a file system without ``flock`` support (some Lustre mounts without ``-o flock``)
  the folder is used unlocked after a warning: refusing every run there would be worse.
  NFSv4 and local file systems support it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mmtune.io.disk import disk_full_guard
from mmtune.io.nofollow import open_output_fd

__all__ = ["LOCK_FILE", "DirectoryLockedError", "DirectoryLock", "lock_directory", "read_holder", "pid_alive"]

LOCK_FILE = ".mmtune.lock"
"""Name of the lock file inside a locked directory."""

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class DirectoryLockedError(RuntimeError):
    """Another process holds the directory's lock; ``holder`` is what it recorded."""

    def __init__(self, message: str, holder: Optional[dict[str, Any]] = None):
        super().__init__(message)
        self.holder = holder or {}


@dataclass
class _Held:
    fd: int
    count: int


# One entry per directory this process holds (lock file real path -> descriptor). This is
# process-wide by nature: the kernel's flock is per open file, and the at-fork hook below
# must find every descriptor to close it in a child.
_HELD: dict[str, _Held] = {}
_MUTEX = threading.Lock()


def _close_in_child() -> None:
    for held in _HELD.values():
        try:
            os.close(held.fd)  # the parent's lock stays: its own descriptor still refers to it
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


@dataclass
class DirectoryLock:
    """A held directory lock; :meth:`release` it, use it as a context manager, or let the process end."""

    directory: Path
    path: Path
    """The lock file."""
    held: bool = True
    """False when the file system does not support locks (the directory is used unlocked)."""
    _key: str = field(default="", repr=False)  # the lock file's real path when taken (the folder may move)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        """Drop this handle; the lock goes with the last handle of this process (idempotent)."""
        if self._released or not self.held:
            self._released = True
            return
        self._released = True
        key = self._key or os.path.realpath(self.path)
        with _MUTEX:
            held = _HELD.get(key)
            if held is None:
                return
            held.count -= 1
            if held.count > 0:
                return
            del _HELD[key]
            try:
                os.ftruncate(held.fd, 0)  # no stale details for the next reader
            finally:
                fcntl.flock(held.fd, fcntl.LOCK_UN)
                os.close(held.fd)

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _command() -> str:
    """This process's command line, secrets in ``key=value`` arguments replaced by ``***``."""
    from mmtune.io.secrets import is_secret_key, redact_text

    args = []
    for arg in [os.path.basename(sys.executable), *sys.argv]:
        key, sep, _ = arg.partition("=")
        args.append(f"{key}=***" if sep and is_secret_key(key.lstrip("+~").rsplit(".", 1)[-1]) else arg)
    command = shlex.join(args)
    return redact_text(command if len(command) <= 500 else command[:497] + "...")


def _holder_record(purpose: str) -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": _command(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "purpose": purpose}


def read_holder(directory: str | os.PathLike, name: str = LOCK_FILE) -> dict[str, Any]:
    """What the current (or last) holder of ``directory``'s lock recorded; ``{}`` if nothing."""
    try:
        text = (Path(directory) / name).read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return {}
    try:
        record = json.loads(text)
    except json.JSONDecodeError:  # the holder is writing it right now
        return {}
    return record if isinstance(record, dict) else {}


def pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` exists on this host (``True`` when that cannot be told)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def _refusal(directory: Path, holder: dict[str, Any], hint: str, name: str = LOCK_FILE) -> str:
    if holder:
        who = (f"pid {holder.get('pid')} on host {holder.get('host')}, running `{holder.get('command')}` "
               f"since {holder.get('since')}" + (f" ({holder['purpose']})" if holder.get("purpose") else ""))
        if holder.get("host") == socket.gethostname() and not pid_alive(holder.get("pid")):
            who += (f"; that pid has exited, so a process it started holds the lock now (it goes when that one "
                    f"exits; `fuser -v {directory / name}` names it)")
    else:
        who = "a process that has just taken the lock and not yet written its details"
    fix = "wait for that process to finish (or stop it)" + (f", or {hint}" if hint else ", or use another folder")
    return (f"{directory} is in use by another process: {who}. Two processes writing into one output folder "
            f"corrupt each other's files, so this one stops before writing anything. How to fix: {fix}. "
            "The lock is released when its holder exits, also when it is killed; there is no lock file to delete.")


def lock_directory(directory: str | os.PathLike, *, purpose: str = "", hint: str = "",
                   name: str = LOCK_FILE) -> DirectoryLock:
    """Take the exclusive lock on ``directory`` (created if missing) for this process.

    Args:
        directory: the output folder.
        purpose: what this process does there, recorded for a refused process's message
            (``"training"``, ``"evaluation"``).
        hint: the second way out named in the refusal, after "wait for it": e.g. ``"set
            training.output_dir to another folder"``.
        name: the lock file's name: another name locks one file's writer rather than the
            folder's (the generations files of a data-parallel run's ranks share a folder).

    Returns:
        A :class:`DirectoryLock`, held until :meth:`~DirectoryLock.release` (or a ``with``
        block's end, or the process's end).

    Raises:
        DirectoryLockedError: another process holds it; the message names the holder's
            pid, host, command and start time, and how to fix it.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    with _MUTEX:
        key = os.path.realpath(path)
        if key in _HELD:
            _HELD[key].count += 1
            return DirectoryLock(directory, path, _key=key)
        fd = open_output_fd(path, "r+", 0o644)  # a planted link must not make us write its target
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_holder(directory, name)
            raise DirectoryLockedError(_refusal(directory, holder, hint, name), holder) from None
        except OSError as err:
            os.close(fd)
            if err.errno not in _UNSUPPORTED:
                raise
            warnings.warn(f"{directory}: the file system does not support file locks ({err.strerror}); the folder "
                          "is used unlocked, so make sure no other process writes into it", RuntimeWarning,
                          stacklevel=2)
            return DirectoryLock(directory, path, held=False)
        try:
            with disk_full_guard(path, "the lock file's holder details"):
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(_holder_record(purpose)) + "\n").encode(), 0)
                os.fsync(fd)  # readers on other hosts of a shared file system see it
        except BaseException:
            os.close(fd)
            raise
        _HELD[key] = _Held(fd, 1)
    return DirectoryLock(directory, path, _key=key)
