"""Typed model config (the ``model/`` config group).

The keys every family reads are the fields of :class:`ModelConfig`. Each family's own keys
live in its section, ``model.<family>``, typed by the settings dataclass declared next to
its adapter (the adapter's ``settings_class``, a :class:`FamilySettings`), as each
benchmark owns its ``eval.<name>`` section. ``ModelConfig(...)`` returns an instance of
:func:`model_config_class`: this class extended by one section per registered family, so a
new family brings its keys without an edit here::

    family: qwen2_vl
    path: Qwen/Qwen2.5-VL-7B-Instruct
    qwen2_vl:
      max_pixels: 50176

A section of another family that is set (any value off its default) is refused at start-up,
naming the key, the chosen family and the keys that family reads: a setting never does
nothing. The flat spellings of the keys that moved into sections (``model.image_size`` ...)
still load, with a warning that gives the new spelling.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from mmtune.core.images import ImageLimits
from mmtune.core.sections import Sectioned, with_sections

__all__ = ["FamilySettings", "ModelConfig", "model_config_class", "positive_or_null", "DEPRECATED_FLAT_KEYS"]

#: model keys that were flat before each family owned its section; each now lives at
#: ``model.<family>.<key>`` of the families that read it. The flat spelling still loads (moved
#: into the chosen family's section, with a warning), or is refused when that family does not
#: read the key. Closed: a family's new keys exist only in its section.
DEPRECATED_FLAT_KEYS = ("image_aspect_ratio", "image_size", "label_final_eos", "min_pixels", "max_pixels")


@dataclass
class FamilySettings:
    """Base of a family's settings, the ``model.<family>`` section (one dataclass per family,
    next to its adapter; every field with a docstring)."""

    #: the family builds a random-weight model from ``model.architecture`` when
    #: ``model.path`` is null; ``False``: it always needs a checkpoint, and refuses
    #: ``model.architecture``
    builds_random_model: ClassVar[bool] = True

    def problems(self, prefix: str) -> list[str]:
        """Every invalid value of this section, each naming its key under ``prefix``
        (``model.llava``). Default: none."""
        return []

    def set_keys(self) -> list[str]:
        """The fields of this section that differ from their defaults."""
        default = type(self)()
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(default, f.name)]


def positive_or_null(value: Optional[int], key: str, null_means: str) -> list[str]:
    """``["model.x=0 must be > 0 (or null for ...)"]`` for a set value that is not positive."""
    if value is not None and value <= 0:
        return [f"{key}={value} must be > 0 (or null for {null_means})"]
    return []


@dataclass
class ModelConfig(Sectioned):
    family: str = "llava"
    """Adapter name in the registry: ``llava``, ``auto``, ``internlm_xcomposer2`` or ``qwen2_vl``.
    Its own keys are in the section of the same name (``model.llava.image_size``)."""
    path: Optional[str] = None
    """Local checkpoint directory or hub id. ``None`` builds a random-weight model from
    ``architecture`` with a built-in tiny tokenizer (tests, demo)."""
    architecture: dict[str, Any] = field(default_factory=dict)
    """Config overrides for a random-weight model (sizes of the text and vision parts).
    Families that always load a checkpoint (``auto``) refuse it."""
    trust_remote_code: bool = False
    """Run code shipped with a checkpoint. Off unless you trust the checkpoint's source."""
    torch_dtype: str = "float32"
    """Weights dtype when loading: float32, bfloat16 or float16."""
    attn_implementation: str = "sdpa"
    """eager, sdpa or flash_attention_2 (needs the flash-attn package and a GPU)."""
    max_position_embeddings: Optional[int] = None
    """Original context window of the language model; ``None`` reads it from the config."""
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    """Largest image files decoded, checked from each file's header before any pixel or canvas
    is allocated (a tiny PNG may declare 1 x 100000 pixels). Larger images are skipped with
    their reason in training (``data.validation.mode=skip``, found by the data check) and
    refused, naming file, dialogue and turn, in strict mode and in evaluation. A saved
    checkpoint never sets these: they are always the caller's."""
    image_aspect_ratio: Optional[str] = None
    """Deprecated: write ``model.llava.image_aspect_ratio``."""
    image_size: Optional[int] = None
    """Deprecated: write ``model.<family>.image_size`` (``llava``, ``internlm_xcomposer2``)."""
    label_final_eos: Optional[bool] = None
    """Deprecated: write ``model.internlm_xcomposer2.label_final_eos``."""
    min_pixels: Optional[int] = None
    """Deprecated: write ``model.qwen2_vl.min_pixels``."""
    max_pixels: Optional[int] = None
    """Deprecated: write ``model.qwen2_vl.max_pixels``."""

    @classmethod
    def sectioned_class(cls) -> type:
        return model_config_class()

    def __post_init__(self) -> None:
        sections = _sections(type(self))
        # a section given as plain values (``ModelConfig(family="llava", llava={"image_size": 336})``)
        for name, settings_class in sections.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                from omegaconf import OmegaConf

                setattr(self, name, OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(settings_class), value)))
        own = sections.get(self.family)
        for key in DEPRECATED_FLAT_KEYS:
            value = getattr(self, key)
            if value is None or own is None or key not in {f.name for f in dataclasses.fields(own)}:
                continue  # not set, or not read by this family: validate() refuses it by name
            settings = getattr(self, self.family)
            if getattr(settings, key) is not None and getattr(settings, key) != value:
                continue  # set both ways: validate() names the clash
            warnings.warn(f"model.{key} is deprecated: write model.{self.family}.{key}={value!r}", FutureWarning,
                          stacklevel=3)
            setattr(self, self.family, dataclasses.replace(settings, **{key: value}))
            setattr(self, key, None)

    @property
    def settings(self) -> FamilySettings:
        """The section of the chosen family (``model.<family>``).

        Raises:
            KeyError: ``family`` is not a registered family.
        """
        if self.family in _sections(type(self)):
            return getattr(self, self.family)
        from mmtune.models.registry import adapter_class

        return adapter_class(self.family).settings_class()  # registered after this config was built

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        """A config from plain values (a JSON file written from one): nested sections such as
        ``image_limits`` and ``model.<family>`` become their dataclasses, and a wrong key or
        type fails here."""
        from omegaconf import OmegaConf

        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(model_config_class()), values))

    @classmethod
    def field_names(cls) -> set[str]:
        """Every key of a model config: the common ones and one section per registered family."""
        return {f.name for f in dataclasses.fields(model_config_class())}

    def unread_keys(self) -> list[tuple[str, str]]:
        """``(key, why)`` for every set key that ``family``'s adapter would not read: a set
        field of another family's section, a deprecated flat key the family does not have,
        ``architecture`` for a family that builds no random-weight model."""
        sections = _sections(type(self))
        own = type(self.settings)  # raises KeyError naming the known families
        reads = [f"model.{self.family}.{f.name}" for f in dataclasses.fields(own)]
        if own.builds_random_model:
            reads.insert(0, "model.architecture")
        why = f"by model.family={self.family!r}, which reads {', '.join(reads) or 'no family keys'}"
        found = []
        if self.architecture and not own.builds_random_model:
            found.append(("architecture", why + " (it always loads model.path)"))
        for key in DEPRECATED_FLAT_KEYS:
            if getattr(self, key) is not None:
                found.append((key, why))
        for name in sections:
            if name != self.family:
                found += [(f"{name}.{key}", why) for key in getattr(self, name).set_keys()]
        return found

    def without_unread_keys(self) -> "ModelConfig":
        """A copy with the keys the family would not read reset: for configs saved by older
        versions, or merged from another family's defaults."""
        sections = _sections(type(self))
        changes: dict[str, Any] = {}
        for key, _ in self.unread_keys():
            section, _, leaf = key.partition(".")
            if leaf:
                changes[section] = sections[section]()
            else:
                changes[key] = {} if key == "architecture" else None
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Raise one ValueError listing every invalid field (the chosen family's section
        included), and every set key that the family does not read (it would do nothing)."""
        problems = list(self.image_limits.problems())
        try:
            unread = self.unread_keys()
        except KeyError as err:
            problems.append(str(err).strip("'\""))
            unread = []
        for key, why in unread:
            value = _dotted(self, key)
            if key in DEPRECATED_FLAT_KEYS and dataclasses.is_dataclass(getattr(self, self.family, None)) \
                    and hasattr(getattr(self, self.family), key):
                problems.append(f"model.{key}={value!r} and model.{self.family}.{key}="
                                f"{getattr(getattr(self, self.family), key)!r} are both set; keep "
                                f"model.{self.family}.{key} only (model.{key} is the deprecated spelling)")
                continue
            problems.append(f"model.{key}={value!r} is not read {why}; remove it (or set it to null)")
        settings = getattr(self, self.family, None)
        if isinstance(settings, FamilySettings):
            problems += settings.problems(f"model.{self.family}")
        if problems:
            raise ValueError("invalid model config:\n  - " + "\n  - ".join(problems))


def _dotted(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _sections(cls: type) -> dict[str, type]:
    """``{family: settings class}`` of the sections a composed config class holds."""
    return getattr(cls, "_family_sections", {})


def model_config_class() -> type:
    """:class:`ModelConfig` with one section per registered family, named after it and typed
    by its adapter's ``settings_class`` (built once per set of registered families).

    Raises:
        ValueError: a family's name is one of the common keys (``model.path`` ...).
    """
    from mmtune.models.registry import settings_classes

    sections = settings_classes()
    cls = with_sections(ModelConfig, sections, clash="model family name(s) {names} collide with the model config's "
                                                     "own keys; rename the family")
    cls._family_sections = dict(sections)
    return cls
