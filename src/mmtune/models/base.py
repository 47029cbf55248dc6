"""The model adapter contract: what the collator, trainer and evaluator need from a model family.

An adapter renders a :class:`~mmtune.data.dialogue.Dialogue` into token *chunks*
turn by turn (never by string surgery on a rendered prompt), says how many tokens
each image becomes, preprocesses images, loads the model, and names its module
groups (vision tower / projector / language model) and the config that holds RoPE.

Every adapter uses the same convention for images in a token sequence: an image
becomes ``num_tokens`` copies of ``image_token_id``; the model replaces the
embeddings at those positions with the image's features. So ``input_ids ==
image_token_id`` is the image-token mask (Partial LoRA's ``im_mask``), and truncation
and packing only ever move whole :class:`ImageChunk` objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Union

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from mmtune.data.dialogue import Dialogue, Image

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenChunk:
    """Token ids that go into the sequence as they are.

    ``trainable`` chunks get labels equal to their ids (assistant content and its
    end-of-turn token); all others get ``IGNORE_INDEX``.
    """

    ids: tuple[int, ...]
    trainable: bool = False

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class ImageChunk:
    """One image: ``num_tokens`` copies of the adapter's ``image_token_id``, labels ignored."""

    image: "Image"
    num_tokens: int

    def __len__(self) -> int:
        return self.num_tokens


Chunk = Union[TokenChunk, ImageChunk]


@dataclass
class EncodedTurn:
    """The chunks of one turn, including the template's role header and end-of-turn tokens."""

    role: str
    chunks: list[Chunk]

    @property
    def length(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def num_images(self) -> int:
        return sum(1 for c in self.chunks if isinstance(c, ImageChunk))


@dataclass
class EncodedDialogue:
    """A dialogue rendered by an adapter's chat template.

    ``prefix`` (BOS, system prompt) is never dropped; ``turns`` map one-to-one onto the
    dialogue's non-system turns; ``suffix`` (e.g. a final EOS) is appended after the
    last kept turn. Truncation drops whole trailing user/assistant exchanges.
    """

    dialogue_id: str
    prefix: list[Chunk]
    turns: list[EncodedTurn]
    suffix: list[Chunk] = field(default_factory=list)

    @property
    def length(self) -> int:
        return (
            sum(len(c) for c in self.prefix)
            + sum(t.length for t in self.turns)
            + sum(len(c) for c in self.suffix)
        )


@dataclass
class ModuleGroups:
    """Which top-level modules of a model form its vision tower, projector and language model.

    Used for freezing and per-group learning rates. Every trainable parameter of the
    model belongs to exactly one group.
    """

    vision: list["nn.Module"]
    projector: list["nn.Module"]
    language_model: list["nn.Module"]


class ModelAdapter(ABC):
    """Base class of one model family's adapter (one file per family).

    Subclasses set ``family`` and are registered with
    :func:`mmtune.models.registry.register_adapter`. An adapter instance is built from
    a :class:`mmtune.models.config.ModelConfig` and loads its tokenizer/processor on
    construction (cheap); the model itself is loaded by :meth:`load_model`.
    """

    family: ClassVar[str]
    #: token id repeated ``num_tokens`` times for each image
    image_token_id: int
    #: generation stops at any of these
    stop_token_ids: list[int]
    #: default LoRA target module names (peft ``target_modules``)
    default_lora_targets: ClassVar[list[str]] = []

    @abstractmethod
    def encode_dialogue(
        self,
        dialogue: "Dialogue",
        *,
        system_prompt: str | None = None,
        train_on: str = "all_assistant",
        add_generation_prompt: bool = False,
    ) -> EncodedDialogue:
        """Render ``dialogue`` into chunks.

        Args:
            system_prompt: overrides the template's default system prompt ("" = none).
            train_on: ``"all_assistant"`` (default) or ``"last_assistant"``.
            add_generation_prompt: append the assistant header after a final user turn,
                for generation; no suffix is added then.
        """

    @abstractmethod
    def image_token_count(self, image: "Image") -> int:
        """Tokens the image becomes. Must not decode pixels when the count is fixed;
        dynamic-resolution models read only the image header."""

    @abstractmethod
    def preprocess_images(self, paths: list[str]) -> "torch.Tensor":
        """Decode and preprocess images into the model's ``pixel_values`` ([N, 3, H, W])."""

    @abstractmethod
    def load_model(self, **kwargs: Any) -> "nn.Module":
        """Load (or, for a random-init config, build) the model.

        Keyword arguments: ``torch_dtype``, ``attn_implementation`` and any family
        extras. ``trust_remote_code`` is honoured only when the model config enables it.
        """

    @abstractmethod
    def module_groups(self, model: "nn.Module") -> ModuleGroups:
        """The vision / projector / language-model split of ``model``."""

    @abstractmethod
    def text_config(self, config: Any) -> Any:
        """The (nested) config object that holds the language model's RoPE settings."""

    def loss_modules(self, model: "nn.Module") -> tuple["nn.Module", "nn.Module"]:
        """``(body, head)`` of ``model`` (possibly wrapped): ``body``'s output carries the final,
        normed hidden states as ``last_hidden_state`` and ``head`` maps them to logits.

        The training loss reads these two instead of full-vocabulary logits
        (:mod:`mmtune.training.loss`); families that do not say fall back to logits.
        """
        raise NotImplementedError(f"the {self.family} adapter does not name its hidden-state body and output head")

    @abstractmethod
    def vision_dummy_loss(self, model: "nn.Module") -> "torch.Tensor":
        """A zero-valued scalar that runs the vision tower (and projector) on a dummy image.

        Added to the loss of text-only batches so every rank calls the vision tower every
        step (DeepSpeed ZeRO-3 hangs otherwise) and vision parameters get zero, not
        ``None``, gradients.
        """
