"""Config dataclasses extended at run time by one section per registered plugin.

``ModelConfig`` holds a section per model family, ``EvalConfig`` one per benchmark and
``training.backend`` one per engine, each typed by the plugin's own ``settings_class``, so a
plugin brings its keys without an edit of the config module and an unknown key still fails
at start-up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["with_sections"]

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
        _CLASSES[key] = cls
    return _CLASSES[key]
