"""Typed model config (the ``model/`` config group)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mmtune.core.images import ImageLimits

#: keys that only some families read (each adapter lists its own in ``reads_model_keys``);
#: a family that does not read one refuses it when it is set, so a setting never does nothing
FAMILY_KEYS = ("architecture", "image_aspect_ratio", "image_size", "label_final_eos", "min_pixels", "max_pixels")


@dataclass
class ModelConfig:
    family: str = "llava"
    """Adapter name in the registry: ``llava``, ``auto``, ``internlm_xcomposer2`` or ``qwen2_vl``."""
    path: Optional[str] = None
    """Local checkpoint directory or hub id. ``None`` builds a random-weight model from
    ``architecture`` with a built-in tiny tokenizer (tests, demo)."""
    architecture: dict[str, Any] = field(default_factory=dict)
    """Config overrides for a random-weight model (sizes of the text and vision parts)."""
    trust_remote_code: bool = False
    """Run code shipped with a checkpoint. Off unless you trust the checkpoint's source."""
    torch_dtype: str = "float32"
    """Weights dtype when loading: float32, bfloat16 or float16."""
    attn_implementation: str = "sdpa"
    """eager, sdpa or flash_attention_2 (needs the flash-attn package and a GPU)."""
    image_aspect_ratio: Optional[str] = None
    """LLaVA-1.5 image preprocessing: ``pad`` to a square with the mean colour (as the
    original training did; what ``null`` means) or ``resize``. Other families refuse it."""
    image_size: Optional[int] = None
    """Square input resolution (LLaVA-1.5, InternLM-XComposer2); ``None`` takes the
    processor's / checkpoint's value. Families that size images otherwise refuse it."""
    label_final_eos: Optional[bool] = None
    """InternLM-XComposer2 only: put loss on the ``\\n`` and ``</s>`` after the last answer, as
    the official fine-tuning code does (its ``mask_human_targets``; what ``null`` means).
    ``false`` labels only each answer and its ``[UNUSED_TOKEN_145]``, the tokens generation
    stops at."""
    max_position_embeddings: Optional[int] = None
    """Original context window of the language model; ``None`` reads it from the config."""
    min_pixels: Optional[int] = None
    """Qwen2-VL family: smallest image area (pixels) after resizing; smaller images are scaled
    up to it. ``None`` = the checkpoint processor's value. Fewer pixels = fewer image tokens."""
    max_pixels: Optional[int] = None
    """Qwen2-VL family: largest image area (pixels) after resizing, i.e. at most
    ``max_pixels / (patch_size * merge_size)^2`` tokens per image (28 px units for Qwen2-VL /
    Qwen2.5-VL, 32 px for Qwen3-VL). ``None`` = the checkpoint processor's value."""
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    """Largest image files decoded, checked from each file's header before any pixel or canvas
    is allocated (a tiny PNG may declare 1 x 100000 pixels). Larger images are skipped with
    their reason in training (``data.validation.mode=skip``, found by the data check) and
    refused, naming file, dialogue and turn, in strict mode and in evaluation. A saved
    checkpoint never sets these: they are always the caller's."""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        """A config from plain values (a JSON file written from one): nested sections such as
        ``image_limits`` become their dataclasses, and a wrong key or type fails here."""
        from omegaconf import OmegaConf

        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))

    def set_family_keys(self) -> list[str]:
        """The :data:`FAMILY_KEYS` this config sets (not null / empty)."""
        return [key for key in FAMILY_KEYS if getattr(self, key) not in (None, {})]

    def unread_keys(self) -> list[tuple[str, str]]:
        """``(key, why)`` for every set key that ``family``'s adapter would not read."""
        from mmtune.models.registry import adapter_class

        reads = adapter_class(self.family).reads_model_keys
        found = []
        for key in self.set_family_keys():
            if key not in reads:
                found.append((key, f"by model.family={self.family!r} (of the family-specific keys it reads "
                                   f"{', '.join(sorted(reads)) or 'none'})"))
        return found

    def without_unread_keys(self) -> "ModelConfig":
        """A copy with the keys the family would not read reset: for configs saved by older
        versions, or merged from another family's defaults."""
        import dataclasses

        defaults = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                    for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{key: defaults[key] for key, _ in self.unread_keys()})

    def validate(self) -> None:
        """Raise one ValueError listing every invalid field, and every set field that the
        family does not read (it would silently do nothing)."""
        problems = list(self.image_limits.problems())
        try:
            unread = self.unread_keys()
        except KeyError as err:
            problems.append(str(err).strip("'\""))
            unread = []
        for key, why in unread:
            problems.append(f"model.{key}={getattr(self, key)!r} is not read {why}; remove it (or set it to null)")
        for key in ("min_pixels", "max_pixels"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                problems.append(f"model.{key}={value} must be > 0 (or null for the checkpoint processor's value)")
        if self.image_size is not None and self.image_size <= 0:
            problems.append(f"model.image_size={self.image_size} must be > 0 (or null for the checkpoint's value)")
        if self.image_aspect_ratio not in (None, "pad", "resize"):
            problems.append(f"model.image_aspect_ratio={self.image_aspect_ratio!r}: use 'pad' or 'resize' (or null)")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            problems.append(f"model.min_pixels={self.min_pixels} is above model.max_pixels={self.max_pixels}")
        if problems:
            raise ValueError("invalid model config:\n  - " + "\n  - ".join(problems))
