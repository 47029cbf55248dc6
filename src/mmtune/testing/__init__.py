"""Builders for tests, benchmarks and CPU demos: tiny tokenizers and random-weight checkpoints.

Nothing here is imported by the model registry; a family imports a builder only when it is
asked for a random-weight model (``model.path=null``).

- :mod:`.tokenizers`: the one tiny tokenizer builder (byte-level BPEs on a fixed corpus);
- :mod:`.qwen2_vl`: tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoints (``model.family=qwen2_vl``);
- :mod:`.checkpoints`: tiny checkpoints of transformers' image-text classes (``model.family=auto``),
  one :class:`.kind.TinyKind` entry per class in :mod:`.classes_first` and :mod:`.classes`.
"""
