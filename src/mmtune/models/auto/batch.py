"""Stage 5: the batch's image inputs (as the processor made them, joined as it joins them) and its
token inputs (Gemma 3's ``token_type_ids``). Positions are the encoder's shared stage
(:class:`~mmtune.models.positions.RopePositions`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

from mmtune.core.images import CorruptImageError, ImageInputError, ImageTooLargeError
from mmtune.models.auto.errors import UnsupportedImageError
from mmtune.models.base import InputJoin

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["BatchStage", "from_array", "to_array"]

#: floating dtypes stored widened to float32 (exact: float32 holds every value of each) where
#: numpy, or the pixel cache's format, has no type for them
_WIDENED = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def to_array(value: "torch.Tensor") -> "np.ndarray":
    """A processor output as a numpy array for the pixel cache, value for value: a floating dtype
    numpy or the cache lacks (Llama 4's image processor returns bfloat16) is stored as float32,
    which holds each of its values exactly, and :func:`from_array` restores it."""
    import torch

    if str(value.dtype).removeprefix("torch.") in _WIDENED:
        return value.to(torch.float32).numpy()
    return value.numpy()


def from_array(value: Any, dtype: "torch.dtype | None") -> "torch.Tensor":
    """The tensor of :func:`to_array`'s array (or of a tensor), in the processor's ``dtype``
    where :func:`to_array` widened it (the same values: the conversion back is exact)."""
    import torch

    tensor = torch.as_tensor(value)
    if dtype is not None and str(dtype).removeprefix("torch.") in _WIDENED and tensor.dtype == torch.float32:
        return tensor.to(dtype)
    return tensor


class BatchStage:
    """Image inputs and token inputs from the processor (the image stage of the ``auto`` family)."""

    # -- the batch: image inputs -----------------------------------------------------------------
    def image_input_joins(self) -> dict[str, InputJoin]:
        """The join of each image input, found at start-up from the processor itself."""
        return dict(self._joins)

    def _decode(self, path: str):
        from transformers.image_utils import load_image

        self.config.image_limits.check_file(path)  # from the header, before the decode
        return load_image(path)

    def load_image(self, path: str) -> dict[str, "np.ndarray"]:
        """The processor's image inputs of this one image (what the pixel cache stores)."""
        try:
            out = self._call([self._decode(path)])
        except CorruptImageError:
            raise
        except (OSError, SyntaxError, ImageTooLargeError) as err:  # not an image PIL can read, or above the limits
            raise CorruptImageError(path, None, None, err) from err
        except ValueError as err:  # the processor's refusal of this image (its size, its aspect ratio)
            raise UnsupportedImageError(path, None, None, f"{type(err).__name__}: {err}") from err
        except Exception as err:  # noqa: BLE001 - the file decoded: the processor itself failed
            raise ImageInputError(path, self.config.path, err) from err
        arrays = {}
        for name in self.image_input_names:
            if name not in out and name in self._empty_parts:
                continue  # this image has no rows of it (the join adds none: join_image_inputs)
            try:
                arrays[name] = to_array(out[name])
            except Exception as err:  # noqa: BLE001 - the file decoded: a conversion failure, named as one
                raise ImageInputError(path, self.config.path, err, input_name=name) from err
        return arrays

    def image_batch(self, images: Sequence[Any]) -> dict[str, "torch.Tensor"]:
        """Cached per-image inputs (dicts of arrays or tensors) joined as the processor joins them,
        each in the dtype the processor made it (bfloat16 from Llama 4's: see :func:`to_array`)."""
        dtypes = getattr(self, "_input_dtypes", {})
        parts = [{k: from_array(v, dtypes.get(k)) for k, v in image.items()} for image in images]
        return self.join_image_inputs(parts)

    def image_inputs(self, paths: Sequence[str]) -> dict[str, "torch.Tensor"]:
        return self.image_batch([self.load_image(p) for p in paths])

    def join_image_inputs(self, parts: Sequence[dict[str, "torch.Tensor"]]) -> dict[str, "torch.Tensor"]:
        """:meth:`ModelAdapter.join_image_inputs`, where the processor leaves an input out for an image
        that has no rows of it (Step3p7's ``pixel_values_local`` for an image it makes no local crops
        of): such a part adds no rows, and an input no part has rows of is left out, as the processor
        leaves it out of a call on such images only."""
        import torch

        empty = self._empty_parts
        if not empty:
            return super().join_image_inputs(parts)
        filled = [{**{name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in empty.items()
                      if name not in part}, **part} for part in parts]
        joined = super().join_image_inputs(filled)
        return {name: value for name, value in joined.items() if not (name in empty and value.numel() == 0)}

    def pixel_settings(self) -> dict[str, Any]:
        """The processor's settings (image processor included): the pixel cache's key."""
        settings = self.processor.to_dict() if hasattr(self.processor, "to_dict") else repr(self.processor)
        return {"settings": {"class": type(self.processor).__name__, **settings} if isinstance(settings, dict)
                else settings, "uint8": False}

    def preprocess_images(self, paths: list[str]) -> "torch.Tensor":
        inputs = self.image_inputs(paths)
        if set(inputs) != {"pixel_values"} or inputs["pixel_values"].ndim != 4:
            raise NotImplementedError(
                f"the processor of {self.config.path!r} gives {sorted(inputs)}, not pixel_values [N, 3, H, W] "
                "alone: use adapter.image_inputs(paths)"
            )
        return inputs["pixel_values"]

    def _image_marks(self) -> list[int] | None:
        """The token ids the processor marks 1 in its ``mm_token_type_ids`` (each image one run, of
        the length the class's rule gives), for the rope index; ``None`` where it returns none."""
        table = self._token_marks.get("mm_token_type_ids")
        return None if table is None else [token for token, value in table.items() if value == 1]

    def token_inputs(self, input_ids: "torch.Tensor") -> dict[str, "torch.Tensor"]:
        """The processor's text-aligned inputs (Gemma 3's ``token_type_ids``: 1 on its image tokens;
        ERNIE-4.5-VL's ``moe_mm_token_type_ids``), computed from ``input_ids`` as the processor gives
        each token id its value (0 for an id it gives none)."""
        import torch

        out = {}
        for name, table in self._token_marks.items():
            values = torch.zeros_like(input_ids, dtype=torch.long)
            for value in set(table.values()):
                marked = torch.tensor([t for t, v in table.items() if v == value], dtype=input_ids.dtype)
                values[torch.isin(input_ids, marked)] = value
            out[name] = values
        return out

    @functools.cached_property
    def _dummy_image_inputs(self) -> dict:
        from PIL import Image as PILImage

        out = self._call([PILImage.new("RGB", (64, 64), (0, 0, 0))])
        return {name: out[name] for name in self.image_input_names if name in out}
