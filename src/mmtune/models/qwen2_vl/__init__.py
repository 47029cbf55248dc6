"""The Qwen2-VL family: Qwen2-VL, Qwen2.5-VL and Qwen3-VL on transformers' own classes.

- :mod:`.template`: the released chat templates and their turn-by-turn rendering (ChatML,
  the official fine-tuning code's conversation building and labels);
- :mod:`.images`: image token counts from the file header, pixel inputs equal to the
  image processor's (``pixel_values`` + ``image_grid_thw``);
- M-RoPE position ids: :class:`~mmtune.models.positions.RopeIndex` (shared with the ``auto`` family);
- :mod:`.adapter`: :class:`Qwen2VLAdapter` (``model.family: qwen2_vl``);
- tiny random-weight checkpoints for tests and CPU runs live in :mod:`mmtune.testing.qwen2_vl`, which
  the adapter imports only for ``model.path=null``.

See ``docs/qwen2_vl.md``.
"""

from mmtune.models.qwen2_vl.adapter import Qwen2VLAdapter, load_chat_template
from mmtune.models.qwen2_vl.classes import MODEL_TYPES, model_classes
from mmtune.models.qwen2_vl.images import QwenVLImages, UnsupportedImageError, oriented_size
from mmtune.models.positions import RopeIndex
from mmtune.models.qwen2_vl.template import (
    CHAT_TEMPLATES,
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN3_VL_CHAT_TEMPLATE,
    ChatMLRenderer,
    TemplateMismatchError,
    renderer_for_template,
    user_runs,
)

__all__ = [
    "Qwen2VLAdapter",
    "load_chat_template",
    "model_classes",
    "QwenVLImages",
    "UnsupportedImageError",
    "oriented_size",
    "RopeIndex",
    "CHAT_TEMPLATES",
    "QWEN2_VL_CHAT_TEMPLATE",
    "QWEN3_VL_CHAT_TEMPLATE",
    "ChatMLRenderer",
    "TemplateMismatchError",
    "renderer_for_template",
    "user_runs",
    "MODEL_TYPES",
]
