"""Image limits and image errors: bounds on an image's size, checked from its file header
before anything is allocated for it, and the errors of an image that cannot be used.

A PNG of a few hundred bytes can declare 1 x 100000 pixels. Decoding it is cheap, but
LLaVA-1.5's padding to a square then asks for a 100000 x 100000 canvas (30 GB), and a
file declaring 30000 x 30000 pixels of one colour decodes to 2.7 GB. PIL's own guard
(``Image.MAX_IMAGE_PIXELS``) looks at the source image only, and only warns below twice
its limit. So every place that makes pixels from an image file (the families' image
paths, the data check, the viewer's thumbnails, the judge's image upload) first reads
the size from the header and refuses an image whose size, area or aspect ratio is above
:class:`ImageLimits`, before a decode or a canvas exists.

The limits are the model config's ``model.image_limits`` (the model's image path is
where pixels are made, and both training and evaluation have one model section); places
that run without a model (scoring a predictions file) use the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from mmtune.core.dialogue import turn_label

__all__ = ["CorruptImageError", "ImageInputError", "ImageLimits", "ImageTooLargeError", "UnsupportedImageError",
           "decode_problem", "header_size", "image_size"]


@dataclass
class ImageLimits:
    """Largest image files mmtune decodes (``model.image_limits``); larger ones are refused
    (training with ``data.validation.mode=skip``: skipped and counted) before any decode."""

    max_side: int = 8192
    """Longest side, in pixels, of an image as its file header states it. It also bounds
    LLaVA-1.5's padding to a square (``pad``): that canvas has ``max_side ** 2`` pixels at most
    (8192: 67 M pixels, 201 MB)."""
    max_pixels: int = 89_478_485
    """Pixels (width x height) of the decoded image. The default is PIL's own decompression
    bomb threshold (``PIL.Image.MAX_IMAGE_PIXELS``: a 24-bit image of 256 MB); PIL refuses
    images above twice that itself, whatever this says."""
    max_aspect_ratio: float = 200.0
    """Longest side over shortest side. 200 is where transformers' Qwen2-VL ``smart_resize``
    refuses an image too; the thinnest images of real data sets are far below it."""

    def problems(self, key: str = "model.image_limits") -> list[str]:
        """Every invalid field, named with ``key``."""
        out = []
        for name in ("max_side", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                out.append(f"{key}.{name}={value!r} must be an integer >= 1")
        if not (math.isfinite(self.max_aspect_ratio) and self.max_aspect_ratio >= 1):
            out.append(f"{key}.max_aspect_ratio={self.max_aspect_ratio!r} must be a finite number >= 1")
        return out

    def exceeded(self, width: int, height: int) -> Optional[str]:
        """Why a ``width x height`` image is refused, naming the limit and its key; ``None`` if it is not."""
        side, short = max(width, height), min(width, height)
        if short < 1:
            return f"it is {width} x {height} px: an image needs at least one pixel each way"
        if side / short > self.max_aspect_ratio:
            return (f"it is {width} x {height} px, an aspect ratio of {side / short:.0f}:1, above "
                    f"model.image_limits.max_aspect_ratio={self.max_aspect_ratio:g}")
        if side > self.max_side:
            return (f"it is {width} x {height} px, and {side} px is above model.image_limits.max_side="
                    f"{self.max_side}")
        if width * height > self.max_pixels:
            return (f"it is {width} x {height} px = {width * height} pixels, above model.image_limits.max_pixels="
                    f"{self.max_pixels}")
        return None

    def check(self, path: str, width: int, height: int) -> None:
        """Raise :class:`ImageTooLargeError` for ``path`` when :meth:`exceeded` says why."""
        reason = self.exceeded(width, height)
        if reason is not None:
            raise ImageTooLargeError(path, (width, height), reason)

    def check_file(self, path: str) -> tuple[int, int]:
        """``(width, height)`` of the image file at ``path`` from its header, after :meth:`check`.

        Raises:
            ImageTooLargeError: the image is above a limit (or above PIL's own bomb limit).
            OSError, ValueError and PIL's errors: the file is no image PIL can open.
        """
        from PIL import Image as PILImage

        try:
            width, height = header_size(path)
        except PILImage.DecompressionBombError as err:  # above twice PIL.Image.MAX_IMAGE_PIXELS
            raise ImageTooLargeError(path, None, f"PIL refuses it: {err}") from None
        self.check(path, width, height)
        return width, height


class ImageTooLargeError(ValueError):
    """An image file states a size above :class:`ImageLimits`; nothing was decoded."""

    def __init__(self, path: str, size: Optional[tuple[int, int]], reason: str):
        self.path, self.size, self.reason = path, size, reason
        super().__init__(
            f"image {path!r} is too large to decode safely: {reason}. Crop or downscale the file, or raise the "
            "limit in the model config (model.image_limits) if such images are expected"
        )


def header_size(path: str) -> tuple[int, int]:
    """``(width, height)`` from the file header only (``PIL.Image.open`` decodes no pixel).

    PIL's warning for images above ``MAX_IMAGE_PIXELS`` is silenced: the caller's limits decide.
    """
    import warnings

    from PIL import Image as PILImage

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
        with PILImage.open(path) as handle:
            return handle.size


class CorruptImageError(ValueError):
    """An image file could not be decoded, or was refused before decoding (too large).

    ``code`` is the problem's code in reports: ``corrupt_image`` or ``image_too_large``
    (the cause is an :class:`ImageTooLargeError`); a subclass may name its own.
    """

    code = "corrupt_image"
    """Problem code of the sample left out for it (skip mode)."""

    def __init__(self, path: str, dialogue_id: str | None, turn: int | None, cause: BaseException,
                 system_first: bool = False):
        self.path, self.dialogue_id, self.turn = path, dialogue_id, turn
        self.turn_text = turn_label(turn, system_first)
        """``turn 2 (question)``: the turn as the reports and the viewer number it."""
        where = f"dialogue {dialogue_id!r}, {self.turn_text}" if dialogue_id is not None else "no dialogue"
        if isinstance(cause, ImageTooLargeError):
            self.code = "image_too_large"
            what = f"image {path!r} ({where}) is not decoded: {cause.reason}. Crop or downscale the file, raise " \
                   "model.image_limits if such images are expected,"
        else:
            what = f"cannot decode image {path!r} ({where}): {type(cause).__name__}: {cause}. Replace or remove the file,"
        super().__init__(
            f"{what} or set data.validation.mode=skip (or collator.image_errors=skip) to leave such samples out, "
            "counted and reported; data.validation.check_images=decode finds them all before training"
        )


class UnsupportedImageError(CorruptImageError):
    """An image a family's image processor refuses (too small, extreme aspect ratio).

    Families subclass it to say whose processor refused the image (``refused_by``) and what
    to do about it (``fix``); the location and the skip policy are the same for all.
    """

    code = "unsupported_image"
    refused_by = "the checkpoint's processor"
    fix = "Resize, crop or pad the image, or set data.validation.mode=skip to leave such samples out, counted " \
          "and reported"

    def __init__(self, path: str, dialogue_id: str | None, turn: int | None, detail: str,
                 system_first: bool = False):
        self.path, self.dialogue_id, self.turn = path, dialogue_id, turn
        self.turn_text = turn_label(turn, system_first)
        where = f"dialogue {dialogue_id!r}, {self.turn_text}" if dialogue_id is not None else "no dialogue"
        ValueError.__init__(self, f"image {path!r} ({where}) is refused by {self.refused_by}: {detail}. {self.fix}")


class ImageInputError(RuntimeError):
    """An image file that reads and decodes, but whose conversion into the model's image inputs
    failed (the processor's output in a dtype the code cannot store, a processor bug): no
    problem of the file, so never a :class:`CorruptImageError`, and ``skip`` modes do not leave
    such samples out (every sample with an image would go).

    Args:
        path: the image file.
        model: the model's path (or family) whose image path failed.
        cause: the error raised.
        input_name: the image input being made (``pixel_values``), where known.
        dialogue_id, turn, system_first: where the image is, as :class:`CorruptImageError` names it.
    """

    def __init__(self, path: str, model: str | None, cause: BaseException, *, input_name: str | None = None,
                 dialogue_id: str | None = None, turn: int | None = None, system_first: bool = False):
        self.path, self.model, self.cause, self.input_name = path, model, cause, input_name
        self.dialogue_id, self.turn, self.system_first = dialogue_id, turn, system_first
        where = (f"dialogue {dialogue_id!r}, {turn_label(turn, system_first)}" if dialogue_id is not None
                 else "no dialogue")
        what = f"its input {input_name!r}" if input_name else "its image inputs"
        super().__init__(
            f"image {path!r} ({where}) decodes, but making {what} for model {model!r} failed: "
            f"{type(cause).__name__}: {cause}. This is no problem of the file (skip modes do not leave such "
            "samples out): the model's image processor or mmtune's conversion of its output fails; check that "
            "the processor of model.path runs on this image with transformers, and report it with this message"
        )

    def at(self, dialogue_id: str | None, turn: int | None, system_first: bool = False) -> "ImageInputError":
        """The same error, located in a dialogue (an adapter knows the file, not the sample)."""
        return ImageInputError(self.path, self.model, self.cause, input_name=self.input_name,
                               dialogue_id=dialogue_id, turn=turn, system_first=system_first)


def decode_problem(path: str) -> Optional[BaseException]:
    """Why the file at ``path`` cannot be read and decoded as an image (PIL opens it and loads its
    pixels, as ``transformers.image_utils.load_image`` does), or ``None`` when it can: what tells
    a bad file from a failure after the decode. Run only once something has failed."""
    import warnings

    from PIL import Image as PILImage

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            with PILImage.open(path) as handle:
                handle.load()
    except Exception as err:  # noqa: BLE001 - PIL raises many types (OSError, SyntaxError, ValueError...)
        return err
    return None


def image_size(path: str) -> tuple[int, int]:
    """``(width, height)`` from the file header only (no pixel decode)."""
    from PIL import Image as PILImage

    with PILImage.open(path) as handle:
        return handle.size
