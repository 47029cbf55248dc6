"""Data formats: one module per file format, each a registered :class:`DataFormat`.

A format detects its records (``mmtune data check FILE``, ``data.files``), converts one
record into a :class:`~mmtune.core.dialogue.Dialogue` (or the problems that prevent it)
and names the keys its records hold, for the message when no format fits a file. The
readers, the config checks and the data check ask :mod:`.registry`; nothing else
branches on a format's name. The built-in formats are the modules of this package
(``llava``, ``mmdu``, ``xcomposer2``, ``messages``), imported on first use; a format outside
the package registers with :func:`register_format` by being imported.
"""

from mmtune.data.formats.base import ConvertContext, DataFormat, Detection
from mmtune.data.formats.registry import detect_format, format_names, get_format, register_format

__all__ = ["ConvertContext", "DataFormat", "Detection", "detect_format", "format_names", "get_format",
           "register_format"]
