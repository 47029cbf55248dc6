"""Image decoding, preprocessing and a per-image on-disk cache of processed pixels.

Runs where the dataset's ``__getitem__`` runs, i.e. inside DataLoader workers, never in
the training process's main loop. Each image is decoded once per (file content,
processor settings): the cache stores the padded and resized ``uint8`` image (a quarter
of the float tensor's size; normalisation is re-applied per batch in float32), so later
epochs and re-runs skip the JPEG decode and the resize.

Cache layout: ``<cache_dir>/<settings hash>/<key[:2]>/<key>.px``: a small header (magic,
dtype, dims) and the raw array (a plain format: ``np.load``'s header parsing alone
costs about as much as reading a cached image). Keys are a hash of the
file's bytes (``key: content``, default: moving or renaming files keeps the cache) or of
``(path, size, mtime)`` (``key: stat``: no read of the file at all on a hit). Writes are
atomic (temp file + rename), so concurrent workers and ranks may share one directory.

A file that cannot be decoded raises :class:`CorruptImageError` naming the file, the
dialogue and the turn; datasets in ``skip`` mode catch it and count the sample instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.encoding import ImageRef
    from mmtune.models.base import ModelAdapter

__all__ = ["CorruptImageError", "ImageStats", "ImagePipeline", "image_size"]


_MAGIC = b"MMP1"
_DTYPES = {b"u": "|u1", b"f": "<f4"}
_DTYPES_REV = {v: k for k, v in _DTYPES.items()}


def _read(path: str) -> np.ndarray | None:
    """A cached array, or None when the file is not one (torn write, foreign file)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    if len(data) < 6 or data[:4] != _MAGIC or data[4:5] not in _DTYPES:
        return None
    ndim = data[5]
    start = 6 + 4 * ndim
    if len(data) < start:
        return None
    shape = tuple(int(x) for x in np.frombuffer(data, dtype="<i4", count=ndim, offset=6))
    dtype = np.dtype(_DTYPES[data[4:5]])
    if len(data) - start != int(np.prod(shape)) * dtype.itemsize:
        return None
    # bytearray: a writable buffer, so torch.from_numpy does not warn
    return np.frombuffer(bytearray(data[start:]), dtype=dtype).reshape(shape)


class CorruptImageError(ValueError):
    """An image file could not be decoded."""

    def __init__(self, path: str, dialogue_id: str | None, turn: int | None, cause: BaseException,
                 system_first: bool = False):
        from mmtune.data.validation import turn_label

        self.path, self.dialogue_id, self.turn = path, dialogue_id, turn
        self.turn_text = turn_label(turn, system_first)
        """``turn 2 (question)``: the turn as the reports and the viewer number it."""
        where = f"dialogue {dialogue_id!r}, {self.turn_text}" if dialogue_id is not None else "no dialogue"
        super().__init__(
            f"cannot decode image {path!r} ({where}): {type(cause).__name__}: {cause}. Replace or remove the "
            "file, or set data.validation.mode=skip (or collator.image_errors=skip) to leave such samples out, "
            "counted and reported; data.validation.check_images=decode finds them all before training"
        )


@dataclass
class ImageStats:
    """Counters of one pipeline (per worker process)."""

    decoded: int = 0
    """Images decoded and preprocessed."""
    cache_hits: int = 0
    """Images read back from the pixel cache."""
    corrupt: int = 0
    """Images that failed to decode."""


def image_size(path: str) -> tuple[int, int]:
    """``(width, height)`` from the file header only (no pixel decode)."""
    from PIL import Image as PILImage

    with PILImage.open(path) as handle:
        return handle.size


class ImagePipeline:
    """Loads the images of examples as the adapter's ``pixel_values``, through a pixel cache.

    Args:
        adapter: the model adapter. When it has an ``image_transform``
            (:class:`~mmtune.models.images.SquareImage`: LLaVA, XComposer2) the cache holds
            the uint8 pixels of its ``load_uint8``, keyed on every field of the transform,
            and ``normalize_uint8`` makes them float per batch; otherwise it holds the float
            tensors of ``preprocess_images``, keyed on the image processor's settings.
        cache_dir: where to keep processed images; ``None`` disables the cache.
        key: ``"content"`` (hash of file bytes) or ``"stat"`` (path, size, mtime).
    """

    def __init__(self, adapter: "ModelAdapter", *, cache_dir: str | None = None, key: str = "content"):
        if key not in ("content", "stat"):
            raise ValueError(f"collator.image_cache_key={key!r}; use 'content' or 'stat'")
        self.adapter = adapter
        self.cache_dir = cache_dir
        self.key = key
        self.stats = ImageStats()
        transform = getattr(adapter, "image_transform", None)
        self._uint8 = dataclasses.is_dataclass(transform)
        settings: Any
        if self._uint8:  # every setting that produces the pixels is a field of the transform
            settings = {"transform": type(transform).__qualname__, **dataclasses.asdict(transform)}
        else:
            processor = getattr(adapter, "image_processor", None)
            settings = processor.to_dict() if hasattr(processor, "to_dict") else repr(processor)
        settings = {"settings": settings, "uint8": self._uint8, "family": getattr(adapter, "family", "?")}
        self.settings_hash = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]

    # -- cache -----------------------------------------------------------------------------
    def _file_key(self, path: str) -> str:
        if self.key == "stat":
            st = os.stat(path)
            raw = f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode()
            return hashlib.sha1(raw).hexdigest()
        digest = hashlib.sha1()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()

    def _cache_path(self, file_key: str) -> str:
        return os.path.join(self.cache_dir, self.settings_hash, file_key[:2], file_key + ".px")

    def _write(self, target: str, array: np.ndarray) -> None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
        try:
            code = _DTYPES_REV[array.dtype.str]
            header = _MAGIC + code + bytes([array.ndim]) + np.asarray(array.shape, dtype="<i4").tobytes()
            with os.fdopen(fd, "wb") as handle:
                handle.write(header)
                handle.write(np.ascontiguousarray(array).tobytes())
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    # -- loading ---------------------------------------------------------------------------
    def _decode(self, path: str) -> np.ndarray:
        if self._uint8:
            return np.ascontiguousarray(self.adapter.load_uint8(path))
        return self.adapter.preprocess_images([path])[0].numpy()

    def load_one(
        self, path: str, *, dialogue_id: str | None = None, turn: int | None = None, raw: bool = False,
        system_first: bool = False,
    ) -> "torch.Tensor":
        """One image as a float tensor [3, H, W] (``raw=True``: before :meth:`finalize`)."""
        try:
            array = None
            target = None
            if self.cache_dir is not None:
                target = self._cache_path(self._file_key(path))
                if os.path.exists(target):
                    array = _read(target)
                    if array is not None:
                        self.stats.cache_hits += 1
            if array is None:
                array = self._decode(path)
                self.stats.decoded += 1
                if target is not None:
                    self._write(target, array)
        except FileNotFoundError as err:
            self.stats.corrupt += 1
            raise CorruptImageError(path, dialogue_id, turn, err, system_first) from err
        except CorruptImageError:
            raise
        except Exception as err:  # PIL raises many types (UnidentifiedImageError, OSError, SyntaxError...)
            self.stats.corrupt += 1
            raise CorruptImageError(path, dialogue_id, turn, err, system_first) from err
        tensor = torch.from_numpy(array)
        return tensor if raw else self.finalize(tensor)

    def finalize(self, pixels: "torch.Tensor") -> "torch.Tensor":
        """Raw pixels (uint8 for adapters with a uint8 path) -> the model's float pixel_values."""
        if pixels.dtype == torch.uint8:
            return self.adapter.normalize_uint8(pixels)
        return pixels

    def load(
        self, refs: Sequence["ImageRef"], *, dialogue_id: str | None = None, raw: bool = False,
        system_first: bool = False,
    ) -> "torch.Tensor | None":
        """All images of one example, stacked in order ([N, 3, H, W]); ``None`` without images.

        ``raw=True`` keeps uint8 pixels (a quarter of the float size through the DataLoader's
        worker queues); the collator then normalises the whole batch with :meth:`finalize`.
        """
        if not refs:
            return None
        return torch.stack(
            [self.load_one(ref.path, dialogue_id=dialogue_id, turn=ref.turn, raw=raw, system_first=system_first)
             for ref in refs]
        )

