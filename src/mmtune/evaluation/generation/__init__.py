"""Answering dialogues with a model: the generator (turn by turn, KV cache kept across turns,
batched), its settings, loading a saved checkpoint to evaluate, and time estimates.

Modules: :mod:`.config` (``eval.generation``), :mod:`.generator`, :mod:`.batched_kv` (several
dialogues in one KV cache), :mod:`.loading` (checkpoint -> adapter and model),
:mod:`.throughput` (batch size by model size, time estimates), :mod:`.fingerprint` (what a
resumed generations file must match).
"""

from mmtune.evaluation.generation.config import GenerationConfig
from mmtune.evaluation.generation.generator import (
    DialogueGenerator,
    StaleGenerationsError,
    TurnRecord,
    flatten,
    question_text,
    read_generations,
)

__all__ = ["GenerationConfig", "DialogueGenerator", "StaleGenerationsError", "TurnRecord", "flatten",
           "question_text", "read_generations"]
