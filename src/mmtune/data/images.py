"""Image decoding, preprocessing and a per-image on-disk cache of processed pixels.

Runs where the dataset's ``__getitem__`` runs, i.e. inside DataLoader workers, never in
the training process's main loop. Each image is decoded once per (file content,
processor settings): the cache stores the adapter's ``load_image`` array, the padded and
resized ``uint8`` image for every shipped family (a quarter of the float tensor's size;
normalisation is re-applied per batch in float32), so later epochs and re-runs skip the
JPEG decode and the resize. Arrays of one sample may have different shapes (Qwen2-VL
keeps each image's aspect ratio); the adapter's ``image_batch`` finishes them.

Cache layout: ``<cache_dir>/<settings hash>/<key[:2]>/<key>.px``: a small header (magic,
dtype, dims) and the raw array, or for an adapter whose ``load_image`` gives one image's named
inputs (the ``auto`` family: what its processor returns for that image alone) each named array
so (a plain format: ``np.load``'s header parsing alone
costs about as much as reading a cached image). Keys are a hash of the
file's bytes (``key: content``, default: moving or renaming files keeps the cache) or of
``(path, size, mtime)`` (``key: stat``: no read of the file at all on a hit). Writes are
atomic (temp file + rename), so concurrent workers and ranks may share one directory.

A file that cannot be read or decoded raises :class:`CorruptImageError` naming the file, the
dialogue and the turn; datasets in ``skip`` mode catch it and count the sample instead. A file
that decodes but whose conversion into the model's inputs fails (the processor, or the code that
stores its output) raises :class:`~mmtune.core.images.ImageInputError` naming the file, the model
and the input: no sample is skipped for it, since every image would be.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from mmtune.core.images import CorruptImageError, ImageInputError, ImageTooLargeError, decode_problem, image_size

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.encoding import ImageRef
    from mmtune.models.base import ModelAdapter

__all__ = ["CorruptImageError", "ImageInputError", "ImageStats", "ImagePipeline", "image_size"]


_MAGIC = b"MMP1"
_MAGIC_NAMED = b"MMPN"  # several named arrays: one image's inputs as a processor returns them
_DTYPES = {b"u": "|u1", b"f": "<f4", b"l": "<i8", b"i": "<i4", b"b": "|b1"}
_DTYPES_REV = {v: k for k, v in _DTYPES.items()}


def _parse(data: bytes) -> np.ndarray | None:
    """One array from its bytes (header + raw), or None when they are not one."""
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


def _parse_named(data: bytes) -> dict[str, np.ndarray] | None:
    """Named arrays: count, then per array its name and its :func:`_parse` bytes, each length-prefixed."""
    out: dict[str, np.ndarray] = {}
    try:
        count, at = data[4], 5
        for _ in range(count):
            size = data[at]
            name = data[at + 1 : at + 1 + size].decode()
            at += 1 + size
            length = int.from_bytes(data[at : at + 8], "little")
            array = _parse(data[at + 8 : at + 8 + length])
            if array is None:
                return None
            out[name] = array
            at += 8 + length
    except (IndexError, UnicodeDecodeError):
        return None
    return out if at == len(data) else None


def _read(path: str) -> np.ndarray | dict[str, np.ndarray] | None:
    """A cached array (or named arrays), or None when the file is not one (torn write, foreign file)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    if data[:4] == _MAGIC_NAMED:
        return _parse_named(data)
    return _parse(data)


def _serialise(array: np.ndarray) -> bytes:
    array = np.ascontiguousarray(array)
    code = _DTYPES_REV[array.dtype.str]
    return _MAGIC + code + bytes([array.ndim]) + np.asarray(array.shape, dtype="<i4").tobytes() + array.tobytes()


def _serialise_any(value: np.ndarray | dict[str, np.ndarray]) -> bytes:
    if not isinstance(value, dict):
        return _serialise(value)
    parts = [_MAGIC_NAMED, bytes([len(value)])]
    for name, array in value.items():
        raw = _serialise(array)
        parts += [bytes([len(name.encode())]), name.encode(), len(raw).to_bytes(8, "little"), raw]
    return b"".join(parts)


@dataclass
class ImageStats:
    """Counters of one pipeline (per worker process)."""

    decoded: int = 0
    """Images decoded and preprocessed."""
    cache_hits: int = 0
    """Images read back from the pixel cache."""
    corrupt: int = 0
    """Images that failed to decode."""


class ImagePipeline:
    """Loads the images of examples as the adapter's image inputs, through a pixel cache.

    The cache holds one array per image, whatever the adapter's
    :meth:`~mmtune.models.base.ModelAdapter.load_image` returns (LLaVA, XComposer2: the
    squared uint8 image; Qwen2-VL: the resized uint8 image, a different shape per image;
    otherwise the float pixel values), keyed on the adapter's
    :meth:`~mmtune.models.base.ModelAdapter.pixel_settings` (every field of a
    :class:`~mmtune.models.images.SquareImage`, every setting of a Qwen-VL image processor).
    :meth:`inputs` finishes cached images into the model inputs with the adapter's
    ``image_batch`` (normalisation, patchifying).

    Args:
        adapter: the model adapter.
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
        settings = {**adapter.pixel_settings(), "family": getattr(adapter, "family", "?")}
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

    def _write(self, target: str, array: np.ndarray | dict[str, np.ndarray]) -> None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(_serialise_any(array))
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    # -- loading ---------------------------------------------------------------------------
    def _decode(self, path: str) -> np.ndarray | dict[str, np.ndarray]:
        value = self.adapter.load_image(path)
        if isinstance(value, dict):  # one image's named inputs (a processor-driven family)
            return {name: np.ascontiguousarray(v) for name, v in value.items()}
        return np.ascontiguousarray(value)

    def load_one(
        self, path: str, *, dialogue_id: str | None = None, turn: int | None = None, raw: bool = False,
        system_first: bool = False,
    ) -> "torch.Tensor":
        """One image: its ``pixel_values`` ([3, H, W] float, for a family whose only image input
        they are), or with ``raw=True`` the cached array as a tensor, before :meth:`inputs`."""
        try:
            array = None
            target = None
            if self.cache_dir is not None:
                target = self._cache_path(self._file_key(path))
                if os.path.exists(target):
                    array = _read(target)
                    if array is not None:
                        self.stats.cache_hits += 1
            fresh = array is None
            if fresh:
                array = self._decode(path)
                self.stats.decoded += 1
        except CorruptImageError:
            raise
        except ImageInputError as err:
            raise err.at(dialogue_id, turn, system_first) from err.cause
        except Exception as err:  # noqa: BLE001 - told apart by decoding the file again
            raise self._problem(path, err, dialogue_id, turn, system_first) from err
        if fresh and target is not None:  # outside the try: a full disk is no bad image
            self._write(target, array)
        tensor = ({name: torch.from_numpy(v) for name, v in array.items()} if isinstance(array, dict)
                  else torch.from_numpy(array))
        return tensor if raw else self.pixel_values([tensor])[0]

    def _problem(self, path: str, err: Exception, dialogue_id: str | None, turn: int | None,
                 system_first: bool) -> Exception:
        """The error of a failed :meth:`_decode`: a :class:`CorruptImageError` where the file is missing,
        too large or does not decode (PIL's own errors are many types: decoding the file again tells),
        else an :class:`ImageInputError` naming the model, since the file is fine."""
        if isinstance(err, (OSError, ImageTooLargeError)) or decode_problem(path) is not None:
            self.stats.corrupt += 1
            return CorruptImageError(path, dialogue_id, turn, err, system_first)
        model = getattr(getattr(self.adapter, "config", None), "path", None) or getattr(self.adapter, "family", None)
        return ImageInputError(path, model, err, dialogue_id=dialogue_id, turn=turn, system_first=system_first)

    def load_images(self, refs: Sequence["ImageRef"], *, dialogue_id: str | None = None,
                    system_first: bool = False) -> list["torch.Tensor"]:
        """The cached arrays of one example's images, in order (shapes may differ): what a
        dataset loads in its worker and :meth:`inputs` finishes. ``system_first``: the dialogue
        opens with a system turn, which error messages do not count."""
        return [self.load_one(ref.path, dialogue_id=dialogue_id, turn=ref.turn, raw=True, system_first=system_first)
                for ref in refs]

    def inputs(self, images: Sequence["torch.Tensor"]) -> dict[str, "torch.Tensor"]:
        """Cached arrays (from :meth:`load_images`) -> the model's image inputs, one tensor per
        name of the adapter's ``image_input_names``, the images' rows in order along dim 0."""
        return self.adapter.image_batch(images)

    def pixel_values(self, images: Sequence["torch.Tensor"]) -> "torch.Tensor":
        """:meth:`inputs` of a family whose only image input is ``pixel_values``: that tensor.

        Raises:
            ValueError: the family has other image inputs too (use :meth:`inputs`).
        """
        inputs = self.inputs(images)
        if set(inputs) != {"pixel_values"}:
            raise ValueError(
                f"the {getattr(self.adapter, 'family', '?')} adapter's image inputs are {sorted(inputs)}, not "
                "pixel_values alone: use ImagePipeline.inputs (or load_inputs)"
            )
        return inputs["pixel_values"]

    def finalize(self, pixels: "torch.Tensor") -> "torch.Tensor":
        """Stacked raw pixels (uint8 for adapters with a uint8 path) -> the model's float pixel_values."""
        if pixels.dtype == torch.uint8:
            return self.pixel_values(list(pixels))
        return pixels

    def load_inputs(self, refs: Sequence["ImageRef"], *, dialogue_id: str | None = None) -> dict[str, "torch.Tensor"] | None:
        """The image inputs of one example's images; ``None`` without images."""
        if not refs:
            return None
        return self.inputs(self.load_images(refs, dialogue_id=dialogue_id))

    def load(
        self, refs: Sequence["ImageRef"], *, dialogue_id: str | None = None, raw: bool = False,
        system_first: bool = False,
    ) -> "torch.Tensor | None":
        """All images of one example stacked in order ([N, 3, H, W] pixel_values, for a family
        whose only image input they are); ``None`` without images. ``raw=True`` stacks the
        cached uint8 pixels instead (images of one shape), finished later by :meth:`finalize`."""
        if not refs:
            return None
        images = self.load_images(refs, dialogue_id=dialogue_id, system_first=system_first)
        return torch.stack(images) if raw else self.pixel_values(images)

