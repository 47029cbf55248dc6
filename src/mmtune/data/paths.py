"""Where an image path from a data file points: one rule for data check, training and evaluation.

Data files come from elsewhere, so an image path in them is not trusted to name any
file on the machine. Every reader and benchmark loader resolves paths with
:class:`ImagePathRules`:

* a **relative** path (``pics/a.jpg``) is joined to the image root (``image_root``, or
  the data file's folder when unset);
* a **format-rooted** path (the MMDU benchmark's ``/mmdu_pics/a.jpg``; every format but
  ``messages``) is joined to the image root too, unless it already lies inside the root;
* the joined path must stay inside the root after ``..`` and symlinks are resolved,
  otherwise the image is a ``path_outside_root`` problem (a symlink leading out of the
  root, as an unpacked archive may carry, is accepted only when absolute paths are
  allowed: that setting means "files outside the image root may be read");
* a **plain absolute** path that exists outside the root (``/home/me/a.jpg``, or any
  absolute path of the ``messages`` format) is used as it is only when absolute paths
  are allowed explicitly (``data.allow_absolute_image_paths=true``,
  ``eval.allow_absolute_image_paths=true``, ``--allow-absolute-paths``); otherwise it is
  a ``path_outside_root`` problem that says so.

A path holding a NUL byte names no file at all: it is an ``invalid_image_path`` problem
of its record (never an error of the whole file).

Each result carries how the path was built, so a missing image's report shows the path
that was tried and where it came from.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["ALLOW_ABSOLUTE_HINT", "ImagePathError", "ImagePathRules", "ResolvedImage"]

ALLOW_ABSOLUTE_HINT = (
    "move the file under the image root, or allow absolute image paths explicitly "
    "(data.allow_absolute_image_paths=true, eval.allow_absolute_image_paths=true or --allow-absolute-paths)"
)


class ImagePathError(ValueError):
    """An image path was rejected: it resolves outside the allowed image roots, or names no file."""


@dataclass(frozen=True)
class ResolvedImage:
    """One image path after resolution."""

    path: str
    """The file to read (or, for a problem, the path that was tried)."""
    how: str
    """How ``path`` was built, for reports (``image_root /r + relative path 'a.jpg'``)."""
    problem: Optional[str] = None
    """``None``, ``"path_outside_root"`` or ``"invalid_image_path"`` (a NUL byte in it)."""
    detail: str = ""
    """What is wrong and how to fix it, when ``problem`` is set."""
    root: Optional[str] = None
    """The real image root ``path`` was found inside (it must stay there when opened);
    ``None`` for a path accepted outside it (absolute paths allowed) or rejected."""

    def checked(self) -> str:
        """``path``, or :class:`ImagePathError` when the path was rejected."""
        if self.problem:
            raise ImagePathError(self.detail)
        return self.path


@functools.lru_cache(maxsize=65536)
def _real_folder(folder: str) -> str:
    return os.path.realpath(folder)


def real_path(path: str) -> str:
    """``os.path.realpath(path)`` with the folder's resolution remembered: a data file names
    hundreds of thousands of images in a few folders, and resolving every component of every
    path again (an ``lstat`` each) was most of the cost of reading llava-665k. The file itself
    is still checked (one ``lstat``): a symlinked image resolves in full."""
    return _real_of_normal(os.path.abspath(path))


def _real_of_normal(path: str) -> str:
    """:func:`real_path` of an absolute, normalised path."""
    if os.path.islink(path):
        return os.path.realpath(path)
    folder, sep, name = path.rpartition(os.sep)
    if not name or not sep:
        return _real_folder(path)
    real = _real_folder(folder or os.sep)
    return real + name if real.endswith(os.sep) else real + os.sep + name


def _inside(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _under(path: str, root: str, prefix: str) -> bool:
    """``path`` is ``root`` or inside it (``prefix``: the root with one trailing separator)."""
    return path == root or path.startswith(prefix)


@dataclass(frozen=True)
class ImagePathRules:
    """How the image paths of one data file are resolved (see the module docstring).

    Args:
        root: the image root (absolute or relative to the working directory).
        allow_absolute: accept plain absolute paths outside the root.
        strip_prefix: removed from the start of every path first (``/mmdu_pics/``).
        join_rooted: join absolute paths to the root (the datasets' rooted paths);
            ``False`` for user-made files whose absolute paths are real ones.
    """

    root: str
    allow_absolute: bool = False
    strip_prefix: Optional[str] = None
    join_rooted: bool = True
    extra_roots: tuple[str, ...] = ()
    """More folders whose files absolute paths may name: mmtune's own (the embedded images
    of a Parquet input, stored under the data cache by :mod:`mmtune.data.tables`)."""

    @functools.cached_property
    def real_root(self) -> str:
        return real_path(self.root)

    @functools.cached_property
    def abs_root(self) -> str:
        return os.path.normpath(os.path.abspath(self.root))

    @functools.cached_property
    def _prefixes(self) -> tuple[str, str]:
        """The absolute and the real root, each with one trailing separator."""
        return self.abs_root.rstrip(os.sep) + os.sep, self.real_root.rstrip(os.sep) + os.sep

    def describe(self) -> str:
        """The rule in one line, for ``mmtune data check``."""
        rooted = "relative and rooted (/dir/x.jpg) paths" if self.join_rooted else "relative paths"
        absolute = "used as they are" if self.allow_absolute else "rejected (path_outside_root)"
        prefix = f", after removing prefix {self.strip_prefix!r}" if self.strip_prefix else ""
        return (f"{rooted} joined to {os.path.abspath(self.root)}{prefix} and kept inside it; "
                f"absolute paths outside it {absolute}")

    def _contained(self, joined: str, how: str) -> ResolvedImage:
        joined = os.path.normpath(joined)
        abs_prefix, real_prefix = self._prefixes
        if not _under(joined, self.abs_root, abs_prefix):
            return ResolvedImage(
                joined, how, "path_outside_root",
                f"{joined} ({how}) climbs out of the image root {os.path.abspath(self.root)} through '..'; "
                "fix the path in the data file or point image_root at the folder holding it",
            )
        real = _real_of_normal(joined)  # joined is absolute: the root is
        if _under(real, self.real_root, real_prefix):
            return ResolvedImage(joined, how, root=self.real_root)
        if self.allow_absolute:
            return ResolvedImage(joined, how)
        return ResolvedImage(
            joined, how, "path_outside_root",
            f"{joined} ({how}) leads through a symlink to {real}, outside the image root {self.real_root}; "
            f"point image_root at the real folder, or {ALLOW_ABSOLUTE_HINT.split(', or ', 1)[1]}",
        )

    @functools.cached_property
    def _resolved(self) -> dict[str, ResolvedImage]:
        return {}

    def resolve(self, raw: str) -> ResolvedImage:
        """Resolve one path exactly as written in the data file (remembered: records share
        images, as llava-665k's COCO records do, and a file's images do not move while it is read)."""
        known = self._resolved.get(raw)
        if known is None:
            if len(self._resolved) >= 1 << 17:  # bounded
                self._resolved.clear()
            known = self._resolved[raw] = self._resolve(raw)
        return known

    def _resolve(self, raw: str) -> ResolvedImage:
        if "\0" in raw:
            # The OS refuses such a name (Python raises "embedded null byte" on any use);
            # it is one record's problem, not the whole file's.
            return ResolvedImage(
                raw, "as written", "invalid_image_path",
                f"image path {raw!r} holds a NUL byte (\\x00), which no file name can; correct it in the data file",
            )
        path = raw
        if self.strip_prefix and path.startswith(self.strip_prefix):
            path = path[len(self.strip_prefix):]
        if path.startswith("file://"):
            path = path[len("file://"):]
        root = self.abs_root
        if not os.path.isabs(path):
            return self._contained(os.path.join(root, path), f"image_root {root} + relative path {path!r}")
        real = real_path(path)
        if _inside(real, (self.real_root,)):
            return ResolvedImage(os.path.normpath(path), "absolute path inside the image root", root=self.real_root)
        for extra in map(real_path, self.extra_roots):
            if _inside(real, (extra,)):
                return ResolvedImage(os.path.normpath(path), "embedded image, stored by content", root=extra)
        if self.join_rooted:
            joined = os.path.join(root, path.lstrip("/"))
            if os.path.exists(joined) or not os.path.exists(path):
                return self._contained(joined, f"image_root {root} + rooted path {path!r}")
        if self.allow_absolute:
            return ResolvedImage(os.path.normpath(path), "absolute path, used as is (absolute paths allowed)")
        return ResolvedImage(
            os.path.normpath(path), "absolute path", "path_outside_root",
            f"absolute path {path} is outside the image root {root}; {ALLOW_ABSOLUTE_HINT}",
        )
