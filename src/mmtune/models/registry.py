"""Name → adapter class. Adapters register themselves; the first look-up imports the
modules of this package (the built-in families among them), so a config only has to say
``family: llava`` and a new family is one new module.

Each adapter declares ``settings_class``, the dataclass of its ``model.<family>`` section
(:class:`mmtune.models.config.FamilySettings`); :func:`settings_classes` hands them to
:func:`mmtune.models.config.model_config_class`, which composes the model config from them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from mmtune.core.plugins import import_package_modules

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.models.base import ModelAdapter
    from mmtune.models.config import ModelConfig

_ADAPTERS: dict[str, type["ModelAdapter"]] = {}


def register_adapter(cls: type["ModelAdapter"]) -> type["ModelAdapter"]:
    """Class decorator: register an adapter under its ``family`` name.

    Raises:
        ValueError: ``cls`` has no ``family`` or no ``settings_class`` (a
            :class:`~mmtune.models.config.FamilySettings` dataclass), or another class
            already holds the name.
    """
    where = f"adapter class {cls.__module__}.{cls.__qualname__}"
    problems = []
    if not getattr(cls, "family", None):
        problems.append("set the class attribute `family` (model.family names it)")
    settings = getattr(cls, "settings_class", None)
    # a FamilySettings subclass (checked by its interface: the config module composes from this one)
    if not (isinstance(settings, type) and dataclasses.is_dataclass(settings) and hasattr(settings, "set_keys")):
        problems.append("set `settings_class` to the dataclass of its model.<family> section (a FamilySettings "
                        "subclass; an empty one when the family has no keys of its own)")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    if cls.family in _ADAPTERS and _ADAPTERS[cls.family] is not cls:
        raise ValueError(f"adapter family {cls.family!r} is registered twice ({_ADAPTERS[cls.family]} and {cls})")
    _ADAPTERS[cls.family] = cls
    return cls


def _import_builtins() -> None:
    # every module of this package; the family modules register themselves (the others are
    # their shared parts), so adding a family is adding its module: there is no list to keep
    import_package_modules(__package__, str(Path(__file__).parent))


def adapter_class(family: str) -> type["ModelAdapter"]:
    if family not in _ADAPTERS:
        _import_builtins()
    if family not in _ADAPTERS:
        raise KeyError(
            f"unknown model family {family!r}; known: {sorted(_ADAPTERS)}. "
            "Set `model.family` to one of them or register your adapter with @register_adapter."
        )
    return _ADAPTERS[family]


def settings_classes() -> dict[str, type]:
    """``{family: settings dataclass}`` of every registered family (the built-in ones
    imported first): the ``model.<family>`` sections of the model config."""
    _import_builtins()
    return {family: cls.settings_class for family, cls in _ADAPTERS.items()}


def build_adapter(config: "ModelConfig") -> "ModelAdapter":
    """The adapter of ``config.family``.

    Raises:
        FileNotFoundError: ``model.path`` is a local path that does not exist (named
            here, before transformers reports it as an unknown hub id).
        ValueError: the model config is invalid (every problem listed).
    """
    from mmtune.schema_keys import model_path_problem

    config.validate()
    problem = model_path_problem(config.path)
    if problem:
        raise FileNotFoundError(problem)
    routed = adapter_class(config.family).routed_family(config)
    if routed is not None and routed != config.family:
        import logging

        logging.getLogger(__name__).info("model.family=%s: model.path=%s is encoded by the %r family",
                                         config.family, config.path, routed)
        original = config.family
        config = dataclasses.replace(config, family=routed)
        try:
            config.validate()
        except ValueError as err:
            raise ValueError(f"model.family={original} hands model.path={config.path} to the {routed!r} family "
                             f"(its model_type is one that family encodes): {err}") from err
    return adapter_class(config.family)(config)
