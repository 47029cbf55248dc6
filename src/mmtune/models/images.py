"""Image files -> the square ``uint8`` pixels a family's vision tower sees, shared by the families.

LLaVA-1.5 and InternLM-XComposer2 both feed a CLIP tower a fixed square: LLaVA-1.5
pads the image to a square with its mean colour first (the original ``expand2square``,
``image_aspect_ratio: pad``) or stretches it (``resize``), XComposer2 always stretches.
:class:`SquareImage` holds those settings and does the decoding and resizing;
:class:`SquareImageAdapter` gives an adapter ``load_uint8`` and ``preprocess_images`` from
it, leaving only the normalisation to the family (each one's numerics match its
official preprocessing to the bit, and they differ).

The pixel cache (:class:`~mmtune.data.images.ImagePipeline`) stores what
:meth:`SquareImage.load_uint8` returns and keys it on every field of the
:class:`SquareImage`, so a setting that changes the pixels always changes the key.

Every image is checked against :class:`~mmtune.core.images.ImageLimits` (the
adapter's ``model.image_limits``) from its header, before it is decoded or padded: the
padding canvas of a 1 x 30000 PNG would be 30000 x 30000. The limits refuse images and
never change pixels, so they are not part of the cache key.

:func:`oriented_size` is the size rule every processor-driven family shares: an image's
``(width, height)`` after its EXIF orientation, read from the file header without a decode
(what ``transformers.image_utils.load_image`` hands the processor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

    from mmtune.core.images import ImageLimits

__all__ = ["SquareImage", "SquareImageAdapter", "noise_image", "oriented_size"]

_EXIF_ORIENTATION = 0x0112
_TRANSPOSED = (5, 6, 7, 8)  # EXIF orientations that swap width and height


def noise_image(width: int, height: int, seed: int):
    """A PIL image of seeded uniform noise: the start-up probes' images (no two rows alike, so a
    processor that reorders or crops them shows it)."""
    import numpy as np
    from PIL import Image as PILImage

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return PILImage.fromarray(pixels, "RGB")


def oriented_size(path: str) -> tuple[int, int]:
    """``(width, height)`` after the EXIF orientation, from the file header (no pixel decode).

    A PNG's EXIF chunk is read only when it precedes the pixel data (where the PNG
    specification puts it); finding a later one would mean decoding the file.
    """
    from PIL import Image as PILImage

    with PILImage.open(path) as handle:
        width, height = handle.size
        orientation = 1
        if handle.format != "PNG" or "exif" in handle.info:
            orientation = handle.getexif().get(_EXIF_ORIENTATION, 1)
    return (height, width) if orientation in _TRANSPOSED else (width, height)


@dataclass(frozen=True)
class SquareImage:
    """How an image file becomes ``uint8 [3, size, size]`` pixels (RGB, channels first)."""

    size: int
    """Side of the square, in pixels (the vision tower's input resolution)."""
    pad: bool = False
    """Pad to a square filled with :attr:`fill` before resizing, so the whole image stays
    visible undistorted (LLaVA-1.5 training); off: stretch to the square."""
    fill: tuple[int, int, int] = (0, 0, 0)
    """Colour of the padding (LLaVA-1.5: the image mean, as uint8)."""
    resample: str = "bicubic"
    """PIL resampling filter; bicubic is what the official pipelines of both families use."""

    def from_pil(self, image: Any, limits: "ImageLimits | None" = None, *, name: str = "image") -> "np.ndarray":
        """A PIL image as ``uint8 [3, size, size]``.

        Raises:
            ImageTooLargeError: its size is above ``limits`` (default: the default limits; they
                bound the padding canvas too); ``name`` says which image in the message.
        """
        import numpy as np
        from PIL import Image as PILImage

        from mmtune.core.images import ImageLimits

        (limits or ImageLimits()).check(name, *image.size)
        resample = PILImage.Resampling[self.resample.upper()]
        size = self.size
        if image.mode != "RGB":
            image = image.convert("RGB")
        width, height = image.size
        if self.pad and width > height:
            # Landscape: PIL resamples horizontally, then vertically (uint8 in between), so
            # the horizontal pass can skip the constant pad rows: the same pixels as
            # resizing the padded square (a test checks equality), with 1/4 less work.
            image = image.resize((size, height), resample)
            canvas = PILImage.new("RGB", (size, width), self.fill)
            canvas.paste(image, (0, (width - height) // 2))
            image = canvas
        elif self.pad and width != height:
            side = max(width, height)
            canvas = PILImage.new("RGB", (side, side), self.fill)
            canvas.paste(image, ((side - width) // 2, (side - height) // 2))
            image = canvas
        if image.size != (size, size):
            image = image.resize((size, size), resample)
        return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))

    def load_uint8(self, path: str, limits: "ImageLimits | None" = None) -> "np.ndarray":
        """Decode the file at ``path`` and make it square: ``uint8 [3, size, size]``.

        Raises:
            ImageTooLargeError: the header states a size above ``limits`` (nothing is decoded).
        """
        from mmtune.core.images import ImageLimits

        limits = limits or ImageLimits()
        limits.check_file(path)
        from PIL import Image as PILImage

        with PILImage.open(path) as handle:
            handle.load()
            return self.from_pil(handle, limits, name=path)


class SquareImageAdapter:
    """Adapter images through a :class:`SquareImage` (mixed into a ``ModelAdapter``).

    The family sets ``image_transform`` and implements ``normalize_uint8`` (uint8 pixels ->
    the model's float ``pixel_values``); the pixel cache stores ``load_uint8`` output and
    normalises whole batches at once.
    """

    image_transform: SquareImage
    config: Any
    """The adapter's ModelConfig; its ``image_limits`` bound every image before it is decoded."""

    def normalize_uint8(self, pixels: "torch.Tensor") -> "torch.Tensor":
        raise NotImplementedError(f"{type(self).__name__} does not say how its uint8 pixels are normalised")

    def load_uint8(self, path: str) -> "np.ndarray":
        """Decode and square one image: ``uint8 [3, S, S]`` (what the pixel cache stores)."""
        return self.image_transform.load_uint8(path, self.image_limits)

    @property
    def image_limits(self) -> "ImageLimits":
        from mmtune.core.images import ImageLimits

        return getattr(getattr(self, "config", None), "image_limits", None) or ImageLimits()

    def preprocess_images(self, paths: list[str]) -> "torch.Tensor":
        """The model's ``pixel_values`` [N, 3, S, S] of the image files at ``paths``."""
        import numpy as np
        import torch

        if not paths:
            size = self.image_transform.size
            return torch.zeros(0, 3, size, size)
        return self.normalize_uint8(torch.from_numpy(np.stack([self.load_uint8(path) for path in paths])))

    # the model-agnostic batch (models/base.py): the cache holds the squared uint8 image
    def load_image(self, path: str) -> "np.ndarray":
        """What the pixel cache stores: :meth:`load_uint8`."""
        return self.load_uint8(path)

    def image_batch(self, images: Sequence["torch.Tensor"]) -> dict[str, "torch.Tensor"]:
        """``{"pixel_values": [N, 3, S, S]}`` of uint8 images from :meth:`load_image` (normalised
        elementwise, so normalising a batch at once or sample by sample gives the same bits)."""
        import torch

        if not images:
            size = self.image_transform.size
            return {"pixel_values": torch.zeros(0, 3, size, size)}
        return {"pixel_values": self.normalize_uint8(torch.stack(list(images)))}

    def pixel_settings(self) -> dict[str, Any]:
        """Every field of :attr:`image_transform`: all that decides the cached pixels."""
        transform = self.image_transform
        return {"settings": {"transform": type(transform).__qualname__, **dataclasses.asdict(transform)}, "uint8": True}
