"""What the ``auto`` family refuses, by kind."""

from __future__ import annotations

from mmtune.core.images import UnsupportedImageError as BaseUnsupportedImageError
from mmtune.models.authority import ProcessorMismatchError

__all__ = ["RemoteCodeError", "TemplateNotPrefixStableError", "UnsupportedImageError", "UnsupportedProcessorError"]


class TemplateNotPrefixStableError(ValueError):
    """Rendering more turns changed the text of earlier turns."""


class UnsupportedProcessorError(ProcessorMismatchError):
    """The checkpoint's processor cannot be reproduced image by image (see the module doc)."""


class RemoteCodeError(ValueError):
    """The checkpoint needs code shipped with it and ``model.trust_remote_code`` is off."""


class UnsupportedImageError(BaseUnsupportedImageError):
    """An image the checkpoint's processor refuses (too small, extreme aspect ratio)."""

