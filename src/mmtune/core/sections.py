"""Config dataclasses extended at run time by one section per registered plugin.

``ModelConfig`` holds a section per model family, ``EvalConfig`` one per benchmark and
``training.backend`` one per engine, each typed by the plugin's own ``settings_class``, so a
plugin brings its keys without an edit of the config module and an unknown key still fails
at start-up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Sectioned", "with_sections"]

_CLASSES: dict[tuple, type] = {}


def with_sections(base: type, sections: dict[str, type], *, clash: str) -> type:
    """``base`` with one field per entry of ``sections`` (its name, typed and defaulted by its
    settings class), under ``base``'s own name and docs; built once per set of sections.

    Args:
        clash: the error when a section's name is one of ``base``'s own keys, with ``{names}``
            where the clashing names go.

    Raises:
        ValueError: a section's name is one of ``base``'s own fields.
    """
    key = (base, *sections.items())
    if key not in _CLASSES:
        names = sorted({f.name for f in dataclasses.fields(base)} & set(sections))
        if names:
            raise ValueError(clash.format(names=names))
        fields: list[Any] = [(name, settings, dataclasses.field(default_factory=settings))
                             for name, settings in sections.items()]
        cls = dataclasses.make_dataclass(base.__name__, fields, bases=(base,))
        cls.__module__, cls.__qualname__, cls.__doc__ = base.__module__, base.__qualname__, base.__doc__
        cls._declared = base
        _CLASSES[key] = cls
    return _CLASSES[key]


class Sectioned:
    """Base of a config dataclass whose sections are added at run time (:func:`with_sections`):
    constructing the declared class builds an instance of :meth:`sectioned_class`, and pickles
    and deep copies name the declared class, since the built one exists only at run time."""

    _declared: type | None = None
    """The declared class, on a class :func:`with_sections` built (``None`` on the declared one)."""

    @classmethod
    def sectioned_class(cls) -> type:
        """The declared class with its registered sections (each declared class says how)."""
        raise NotImplementedError(f"{cls.__name__}.sectioned_class")

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls.__dict__.get("_declared") is None:
            cls = cls.sectioned_class()
        return super().__new__(cls)

    def __reduce__(self):
        return type(self)._declared, (), dict(self.__dict__)
