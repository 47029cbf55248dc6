"""Qwen-VL image inputs: token counts from the file header, pixels exactly as the processor.

An image of (oriented) size ``W x H`` is resized by transformers' ``smart_resize`` to
``H' x W'`` (multiples of ``patch_size * merge_size``, ``min_pixels <= H' W' <= max_pixels``,
aspect ratio kept as closely as possible; tiny images are scaled *up* to ``min_pixels``),
cut into ``(H'/patch) x (W'/patch)`` patches (``image_grid_thw`` = ``[1, H'/patch, W'/patch]``),
and merged ``merge_size x merge_size`` into ``H' W' / (patch * merge)^2`` image tokens.

- :meth:`QwenVLImages.grid` computes that from the file header only (PIL's ``open`` reads the
  size and the EXIF orientation without decoding pixels).
- :meth:`QwenVLImages.load_uint8` decodes as transformers' ``load_image`` does (what the
  processor's ``apply_chat_template`` path uses: EXIF orientation applied, RGB) and runs the
  processor's own conversion and resize: the uint8 ``[3, H', W']`` image a pixel cache stores.
- :meth:`QwenVLImages.inputs_uint8` runs the processor on those images with the resize
  switched off: rescale, normalise and patchify, so the result equals the processor on the
  decoded files bit for bit (a test checks it).

``smart_resize`` refuses aspect ratios above 200; such images raise
:class:`UnsupportedImageError` naming the file, the dialogue and the turn. Before that,
and before any decode, an image is checked against ``model.image_limits``
(:class:`~mmtune.core.images.ImageLimits`) from its header: ``smart_resize`` bounds
the resized image, but the decoded source is as large as the file says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from mmtune.core.images import CorruptImageError, ImageLimits, ImageTooLargeError
from mmtune.core.images import UnsupportedImageError as BaseUnsupportedImageError
from mmtune.models.images import oriented_size

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["UnsupportedImageError", "oriented_size", "QwenVLImages"]

class UnsupportedImageError(BaseUnsupportedImageError):
    """An image the Qwen-VL image processor refuses (aspect ratio above 200)."""

    refused_by = "the Qwen-VL image processor"
    fix = "Crop or pad the image to an aspect ratio of at most 200:1, or remove the record"


class QwenVLImages:
    """Image token counts and pixel inputs of one checkpoint's image processor.

    Args:
        image_processor: a ``Qwen2VLImageProcessorPil`` (the class the Qwen-VL checkpoints
            name, PIL backend: no torchvision needed).
        vision_config: the model's vision config; its patching must match the processor's.
        where: the checkpoint, for error messages.
        limits: largest images decoded (``model.image_limits``).

    Raises:
        ValueError: the processor is of another kind, does not resize, or patches differently
            from the vision tower (both numbers named).
    """

    def __init__(self, image_processor: Any, vision_config: Any, where: str, limits: ImageLimits | None = None):
        from transformers.image_utils import SizeDict
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        p = image_processor
        if not isinstance(p, Qwen2VLImageProcessorPil):
            raise ValueError(
                f"the image processor of {where} is a {type(p).__name__}; the qwen2_vl adapter needs transformers' "
                "Qwen2VLImageProcessorPil (what Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoints name, PIL backend)"
            )
        problems = []
        if not p.do_resize:
            problems.append("do_resize is false (Qwen-VL needs every side a multiple of patch_size x merge_size)")
        for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                             ("temporal_patch_size", "temporal_patch_size")):  # fmt: skip
            if getattr(p, ours) != getattr(vision_config, theirs):
                problems.append(f"image processor {ours}={getattr(p, ours)} but "
                                f"vision_config.{theirs}={getattr(vision_config, theirs)}")  # fmt: skip
        size = p.size if isinstance(p.size, SizeDict) else SizeDict(**p.size)
        if not size.shortest_edge or not size.longest_edge:
            problems.append(f"size={dict(size)} has no shortest_edge (min_pixels) / longest_edge (max_pixels)")
        elif size.shortest_edge > size.longest_edge:
            problems.append(f"min_pixels={size.shortest_edge} is above max_pixels={size.longest_edge}")
        if problems:
            raise ValueError(f"the image processor of {where} does not fit its model: " + "; ".join(problems))
        self.processor = p
        self.patch_size = int(p.patch_size)
        self.merge_size = int(p.merge_size)
        self.factor = self.patch_size * self.merge_size
        self.size = size
        self.min_pixels = int(size.shortest_edge)
        self.max_pixels = int(size.longest_edge)
        self.patch_dim = 3 * int(p.temporal_patch_size) * self.patch_size**2
        self.limits = limits or ImageLimits()
        self._grids: dict[str, tuple[int, int, int]] = {}

    # -- counting ----------------------------------------------------------------------------
    def grid_for_size(self, width: int, height: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patches of an image of this size (raises ``ValueError`` for aspect ratios > 200)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        resized_height, resized_width = smart_resize(
            height, width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )
        return 1, resized_height // self.patch_size, resized_width // self.patch_size

    def grid(self, path: str, *, dialogue_id: str | None = None, turn: int | None = None) -> tuple[int, int, int]:
        """``image_grid_thw`` of the image file at ``path``, from its header; memoized by path.

        Raises:
            UnsupportedImageError: the processor refuses the image's aspect ratio.
            CorruptImageError: the file cannot be opened as an image.
        """
        grid = self._grids.get(path)
        if grid is not None:
            return grid
        try:
            width, height = oriented_size(path)
        except Exception as err:  # PIL raises many types for bad files (OSError, SyntaxError ...)
            raise CorruptImageError(path, dialogue_id, turn, err) from err
        try:
            grid = self.grid_for_size(width, height)
        except ValueError as err:  # smart_resize refuses aspect ratios above 200
            raise UnsupportedImageError(path, dialogue_id, turn, f"it is {width} x {height} px and {err}") from err
        try:  # counting is arithmetic; the limits are for the decode that follows
            self.limits.check(path, width, height)
        except ImageTooLargeError as err:
            raise CorruptImageError(path, dialogue_id, turn, err) from err
        if len(self._grids) < 1 << 20:  # bounded: one entry per distinct file
            self._grids[path] = grid
        return grid

    def tokens(self, grid: Sequence[int]) -> int:
        """Image tokens of a ``(t, h, w)`` grid (the processor's ``grid.prod() // merge_size**2``)."""
        t, h, w = grid
        return t * h * w // self.merge_size**2

    # -- pixels ------------------------------------------------------------------------------
    def load_uint8(self, path: str) -> "np.ndarray":
        """Decode and resize one image: uint8 ``[3, H', W']``, before rescale and normalisation.

        The same calls as the processor on ``transformers.image_utils.load_image(path)``:
        its ``process_image`` (RGB conversion, channels first) and its ``resize``.
        """
        import numpy as np
        from transformers.image_utils import load_image

        self.limits.check_file(path)  # from the header: nothing is decoded for a refused image
        p = self.processor
        image = p.process_image(load_image(path), do_convert_rgb=p.do_convert_rgb)
        resized = p.resize(image, size=self.size, resample=p.resample, factor=self.factor)
        return np.ascontiguousarray(resized, dtype=np.uint8)

    def inputs_uint8(self, images: Sequence[Any]) -> dict[str, "torch.Tensor"]:
        """``pixel_values`` [sum of patches, 3 x temporal_patch x patch x patch] float32 and
        ``image_grid_thw`` [N, 3] long of already resized uint8 images ([3, H', W'] arrays or
        tensors), in order; zero rows for no images."""
        import numpy as np
        import torch

        if not images:
            return {
                "pixel_values": torch.zeros(0, self.patch_dim),
                "image_grid_thw": torch.zeros(0, 3, dtype=torch.long),
            }
        arrays = [image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image) for image in images]
        out = self.processor(
            images=arrays, do_resize=False, do_convert_rgb=False, input_data_format="channels_first",
            return_tensors="pt",
        )  # fmt: skip
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def inputs(self, paths: Sequence[str]) -> dict[str, "torch.Tensor"]:
        """:meth:`inputs_uint8` of the decoded, resized files."""
        return self.inputs_uint8([self.load_uint8(path) for path in paths])

    def settings(self) -> dict[str, Any]:
        """What determines the pixels an image becomes (part of pixel / length cache keys)."""
        p = self.processor
        return {
            "class": type(p).__name__,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": int(p.temporal_patch_size),
            "mean": list(p.image_mean),
            "std": list(p.image_std),
            "rescale_factor": float(p.rescale_factor),
            "resample": int(p.resample),
            "convert_rgb": bool(p.do_convert_rgb),
        }
