"""The model adapter contract: what the collator, trainer and evaluator need from a model family.

An adapter renders a :class:`~mmtune.core.dialogue.Dialogue` into token *chunks*
turn by turn (never by string surgery on a rendered prompt), says how many tokens
each image becomes, preprocesses images, loads the model, and names its module
groups (vision tower / projector / language model) and the config that holds RoPE.

Every adapter uses the same convention for images in a token sequence: an image
becomes ``num_tokens`` copies of ``image_token_id`` (or, where its processor says so, the
image's own expansion ``ImageChunk.ids``, around and between those copies); the model
replaces the embeddings at the ``image_token_id`` positions with the image's features. So ``input_ids ==
image_token_id`` is the image-token mask (Partial LoRA's ``im_mask``), and truncation
and packing only ever move whole :class:`ImageChunk` objects.

**The batch.** An adapter also declares and builds its own model inputs, so the
collator, packing, the training loop, generation and the planner pass them through
without naming any of them:

- images become the inputs named :attr:`ModelAdapter.image_input_names` (LLaVA-1.5 and
  InternLM-XComposer2: ``pixel_values [N, 3, H, W]``; Qwen2-VL: ``pixel_values [sum of
  patches, D]`` and ``image_grid_thw [N, 3]``). How several images' (and samples') values of
  one input are joined is declared per input by :meth:`ModelAdapter.image_input_joins`
  (an :class:`InputJoin`: concatenate along an axis, or stack on a new one, padding the other
  axes to the largest); the default concatenates every input along dim 0 in image order, so
  a batch's inputs are each sample's, joined row-major. A batch without images passes none
  of them (``None``);
- :meth:`ModelAdapter.load_image` is what the pixel cache stores per image (any shape:
  images of one sample may differ), keyed on :meth:`ModelAdapter.pixel_settings`, and
  :meth:`ModelAdapter.image_batch` turns those arrays into the model inputs;
- position ids have :attr:`ModelAdapter.position_id_rows` rows per token (1: a running
  position; 3: M-RoPE's temporal, height, width). :meth:`ModelAdapter.position_ids` gives
  one sample's rows, each packed sample starting again at 0, and
  :meth:`ModelAdapter.model_position_ids` lays a batch out as the forward takes it.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

# The encoded-example types are the contract layer's; adapters and their callers may name them from here too.
from mmtune.core.encoded import IGNORE_INDEX, Chunk, EncodedDialogue, EncodedTurn, ImageChunk, TokenChunk

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    from torch import nn

    from mmtune.core.dialogue import Dialogue, Image
    from mmtune.models.config import ModelConfig


@dataclass(frozen=True)
class InputJoin:
    """How the values of one image input for several images (or samples) become one tensor.

    ``stack=False`` concatenates along ``axis`` (InternVL's tiles, Qwen2-VL's patches: dim 0;
    Idefics3's ``[1, images, 3, H, W]``: dim 1); ``stack=True`` stacks on a new ``axis``. Every
    other axis is padded at its end to the largest value with ``pad_value`` first (LLaVA-OneVision
    pads its patch axis, Pixtral its height and width); a mask input declares the same join, so
    its padding reads as "not a pixel".

    Example::

        InputJoin(axis=0).join([torch.ones(2, 3), torch.ones(1, 5)])  # -> [3, 5], zeros at [0:2, 3:5]
    """

    axis: int = 0
    stack: bool = False
    pad_value: float = 0.0

    def join(self, values: Sequence["torch.Tensor"]) -> "torch.Tensor":
        """One tensor from ``values`` (in order).

        Raises:
            ValueError: the values differ in their number of dimensions (both named).
        """
        import torch

        values = list(values)
        ndims = {int(v.ndim) for v in values}
        if len(ndims) != 1:
            raise ValueError(f"cannot join image inputs of {sorted(ndims)} dimensions; every value must have the same")
        ndim = ndims.pop()
        keep = None if self.stack else self.axis % max(ndim, 1)
        sizes = [max(int(v.shape[d]) for v in values) for d in range(ndim)]
        padded = []
        for value in values:
            pads = []  # torch.nn.functional.pad order: last dim first, (before, after)
            for d in reversed(range(ndim)):
                pads += [0, 0 if d == keep else sizes[d] - int(value.shape[d])]
            padded.append(torch.nn.functional.pad(value, pads, value=self.pad_value) if any(pads) else value)
        return torch.stack(padded, dim=self.axis) if self.stack else torch.cat(padded, dim=keep)


@dataclass
class ModuleGroups:
    """Which top-level modules of a model form its vision tower, projector and language model (and
    the modules training never updates, :attr:`frozen`).

    Used for freezing and per-group learning rates. Every parameter of the model belongs to
    exactly one group.
    """

    vision: list["nn.Module"]
    projector: list["nn.Module"]
    language_model: list["nn.Module"]
    frozen: list["nn.Module"] = field(default_factory=list)
    """Modules training never updates (``requires_grad`` False in every mode, in no optimizer group,
    never a LoRA target): those an image-generating model does not run when it reads an image
    (Janus's VQ model and generation heads); a step of image-text training gives them no gradient."""


def unwrap_model(model: "nn.Module", expected: type | tuple[type, ...] | None = None) -> "nn.Module":
    """The model inside peft (``get_base_model``) and distributed-engine (``module``) wrappers.

    Unwrapping stops at the first ``expected`` instance (a class or a tuple of classes; default: the first transformers
    ``PreTrainedModel``), at most 8 wrappers deep.

    Raises:
        TypeError: ``expected`` is given and no such model is inside ``model``.
    """
    from transformers import PreTrainedModel

    target = expected or PreTrainedModel
    inner = model
    for _ in range(8):
        if isinstance(inner, target):
            return inner
        if hasattr(inner, "get_base_model"):  # peft
            inner = inner.get_base_model()
        elif hasattr(inner, "module"):  # a distributed engine's wrapper (DDP, ZeRO)
            inner = inner.module
        else:
            break
    if expected is None:
        return inner
    names = " / ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))
    raise TypeError(
        f"expected a {names} (possibly wrapped by peft or a distributed engine), got {type(model).__name__}; "
        "check `model.family` in the config"
    )


def find_module_groups(model: "nn.Module") -> ModuleGroups:
    """The groups of a transformers image-text model, found from its structure by transformers'
    own look-ups: the vision tower is ``get_encoder(modality="image")``, the language model is
    ``get_decoder()`` with the output embeddings; every other module of the multimodal body and
    of the model (LLaVA-OneVision's, Gemma 3's, Idefics3's projector) is the projector, and so are
    parameters held by the body or the model itself outside any child module (LLaVA-OneVision's
    ``image_newline``, which joins image features to the language model's input like the
    projector's output). A projector inside the vision tower (GLM-4.1V's ``merger``) counts with
    the tower. In a model that also writes images, the rest's modules that reading an image never
    runs (Janus's VQ model and generation heads) are ``frozen`` (:func:`_generation_only`).

    Raises:
        ValueError: transformers finds no vision tower, or no language model apart from the model;
            an image-generating model without ``get_image_features`` or ``vision_config.image_size``.
    """
    from torch import nn

    top = unwrap_model(model)
    body = getattr(top, "base_model", top)
    vision = top.get_encoder(modality="image") if hasattr(top, "get_encoder") else top
    decoder = top.get_decoder() if hasattr(top, "get_decoder") else top
    if vision in (top, body) or decoder in (top, body):
        what, how = (("vision tower", "get_encoder(modality='image')") if vision in (top, body)
                     else ("language model", "get_decoder()"))
        raise ValueError(
            f"cannot find the {what} of {type(top).__name__} (transformers' {how} finds none); "
            "write a family adapter for this model"
        )
    head = top.get_output_embeddings()
    language = [decoder] + ([head] if head is not None and head not in decoder.modules() else [])
    taken = {id(m) for m in [vision, *language]}
    projector: list[nn.Module] = []
    strays: dict[str, nn.Parameter] = {}

    def rest(module: "nn.Module", prefix: str) -> None:
        # the children outside the vision tower and language model; a child holding one of them is
        # searched further, its own parameters kept as strays
        for name, param in module.named_parameters(recurse=False):
            strays[f"{prefix}{name}".replace(".", "__")] = param
        for name, child in module.named_children():
            if id(child) in taken:
                continue
            if any(id(m) in taken for m in child.modules()):
                rest(child, f"{prefix}{name}.")
            else:
                projector.append(child)

    rest(top, "")
    seen = {id(p) for m in [vision, *language] for p in m.parameters()}
    strays = {k: p for k, p in strays.items() if id(p) not in seen}
    frozen = _generation_only(top, projector)
    projector = [m for m in projector if all(m is not f for f in frozen)]
    if strays:  # held by a ParameterDict (the same Parameter objects), so the group lists modules only
        projector.append(nn.ParameterDict(strays))
    return ModuleGroups(vision=[vision], projector=projector, language_model=language, frozen=frozen)


def image_features_method(model: "nn.Module") -> Any:
    """transformers' ``get_image_features`` of ``model`` (unwrapped): the model's own, else its body's
    (Janus keeps it on the body only); ``None`` where neither has one."""
    top = unwrap_model(model)
    body = getattr(top, "base_model", top)
    return getattr(top, "get_image_features", None) or getattr(body, "get_image_features", None)


_GENERATION_ONLY: "weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]]" = weakref.WeakKeyDictionary()


def _generation_only(top: "nn.Module", candidates: list["nn.Module"]) -> list["nn.Module"]:
    """The ``candidates`` (modules outside the vision tower and language model) that a model which
    generates more than text (transformers' ``output_modalities``: Janus writes images) does not run
    when it reads an image: its ``get_image_features`` on one blank image of its vision config's size,
    run once per model (on the meta device too) with hooks on the candidates' modules. A model that
    only writes text has none, so its groups are the structural ones.

    Raises:
        ValueError: such a model has no ``get_image_features`` or no ``vision_config.image_size``, or
            reading the blank image fails.
    """
    import torch

    if set(getattr(type(top), "output_modalities", ("text",))) <= {"text"} or not candidates:
        return []
    names = {id(m): n for n, m in top.named_modules()}
    if top not in _GENERATION_ONLY:
        features = image_features_method(top)
        vision_config = getattr(top.config, "vision_config", None)
        size = getattr(vision_config, "image_size", None)
        if features is None or not isinstance(size, int):
            raise ValueError(f"{type(top).__name__} generates {type(top).output_modalities}: mmtune finds the modules "
                             "image-text training does not run from get_image_features on an image of "
                             "vision_config.image_size, and this model has no such method or size; write a family "
                             "adapter for it (module_groups with its generation modules in `frozen`)")
        param = next(p for p in top.parameters() if p.is_floating_point())
        pixels = torch.zeros(1, getattr(vision_config, "num_channels", 3), size, size, device=param.device,
                             dtype=param.dtype)
        ran: set[int] = set()  # a candidate runs when it or any module inside it runs
        hooks = [inner.register_forward_pre_hook(lambda module, args, owner=id(m): ran.add(owner))
                 for m in candidates for inner in m.modules()]
        try:
            with torch.no_grad():
                features(pixel_values=pixels)
        except Exception as err:  # e.g. weights partitioned by DeepSpeed ZeRO-3 at load time
            raise ValueError(f"{type(top).__name__} generates {type(top).output_modalities}: reading a blank "
                             f"{size}x{size} image with get_image_features, to find the modules image-text training "
                             f"does not run, failed ({type(err).__name__}: {err}); group the model before its "
                             "weights are partitioned, or write a family adapter with those modules in `frozen`"
                             ) from err
        finally:
            for hook in hooks:
                hook.remove()
        _GENERATION_ONLY[top] = tuple(names[id(m)] for m in candidates if id(m) not in ran)
    unused = set(_GENERATION_ONLY[top])
    return [m for m in candidates if names[id(m)] in unused]


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
    #: the family-specific :class:`~mmtune.models.config.ModelConfig` keys this adapter reads
    #: (of ``FAMILY_KEYS``); any other one set in a config is refused at start-up
    reads_model_keys: ClassVar[frozenset[str]] = frozenset()
    #: hub id -> ``config.json`` of public checkpoints the shipped configs name, so
    #: ``mmtune plan`` sizes them without network access or a download
    known_architectures: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def meta_model(cls, config: "ModelConfig", checkpoint_config: dict[str, Any] | None) -> tuple["nn.Module", ModuleGroups]:
        """The family's model built on the meta device (no weight read, no memory used) and
        its module groups: what ``mmtune plan`` counts parameters on.

        Args:
            config: the run's model config.
            checkpoint_config: the checkpoint's ``config.json`` as a dict; ``None`` for a
                random-weight model (``config.path`` is None).

        Default: a random-weight model through the adapter's own :meth:`load_model` and
        :meth:`module_groups`; a checkpoint through ``AutoModelForImageTextToText`` grouped
        by :func:`find_module_groups`. A family whose checkpoints transformers cannot build
        from their config overrides this.
        """
        import torch

        if checkpoint_config is None:
            adapter = cls(config)
            # every tensor is created on the meta device: no allocation and no initialisation
            with torch.device("meta"):
                model = adapter.load_model()
            return model, adapter.module_groups(model)
        import transformers

        model_config = transformers.AutoConfig.for_model(**checkpoint_config)
        with torch.device("meta"):
            model = transformers.AutoModelForImageTextToText.from_config(model_config)
        return model, find_module_groups(model)

    @classmethod
    def routed_family(cls, config: "ModelConfig") -> str | None:
        """The family that encodes ``config``'s checkpoint instead of this one, or ``None`` (this one).

        A family whose line has classes it leaves to another family's encoder names that family
        here (the ``qwen2_vl`` family hands Qwen3.5 checkpoints to ``auto``); ``build_adapter``
        builds that family's adapter, and says so."""
        return None

    @classmethod
    def planned_image_tokens(cls, config: "ModelConfig", model_config: Any) -> int | None:
        """Tokens per image for ``mmtune plan`` (no image read), or ``None`` when the family's
        counts depend on each image (the plan then uses ``data.mixture.tokens_per_image``).

        Default: the patches of the vision config's square input (``(image_size //
        patch_size) ** 2``: 576 for LLaVA-1.5 at 336 px, 1225 for XComposer2 at 490 px).
        """
        vc = getattr(model_config, "vision_config", None)
        if vc is not None and getattr(vc, "image_size", None) and getattr(vc, "patch_size", None):
            return (int(vc.image_size) // int(vc.patch_size)) ** 2
        return None

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

    def preprocess_images(self, paths: list[str]) -> "torch.Tensor":
        """Decode and preprocess images into the model's ``pixel_values`` ([N, 3, H, W]), for a
        family whose only image input that is; the default :meth:`image_inputs` and
        :meth:`load_image` build on it. A family with other image inputs overrides those."""
        raise NotImplementedError(
            f"the {self.family} adapter has no [N, 3, H, W] pixel_values: use adapter.image_inputs(paths)"
        )

    # -- the batch: image inputs -----------------------------------------------------------------
    #: names of the model inputs images become; each concatenates along dim 0 in image order
    image_input_names: ClassVar[tuple[str, ...]] = ("pixel_values",)

    def image_input_joins(self) -> dict[str, InputJoin]:
        """How each image input joins several images and samples (see :class:`InputJoin`).
        Default: every name of :attr:`image_input_names` concatenated along dim 0."""
        return {name: InputJoin() for name in self.image_input_names}

    def join_image_inputs(self, parts: Sequence[dict[str, "torch.Tensor"]]) -> dict[str, "torch.Tensor"]:
        """One dict of model inputs from the image inputs of several images or samples (in order),
        each input joined as :meth:`image_input_joins` declares it.

        Raises:
            ValueError: a part lacks a declared input, or holds one the adapter does not declare.
        """
        joins = self.image_input_joins()
        for k, part in enumerate(parts):
            missing = sorted(set(joins) - set(part))
            extra = sorted(set(part) - set(joins))
            if missing or extra:
                raise ValueError(
                    f"image inputs {k} hold {sorted(part)}; the {self.family} adapter declares {sorted(joins)} "
                    f"(missing {missing}, undeclared {extra})"
                )
        return {name: join.join([part[name] for part in parts]) for name, join in joins.items()}

    def image_inputs(self, paths: Sequence[str]) -> dict[str, "torch.Tensor"]:
        """The model inputs of the image files at ``paths`` (in order): one tensor per name of
        :attr:`image_input_names`, each with the images' rows concatenated along dim 0."""
        return {"pixel_values": self.preprocess_images(list(paths))}

    def load_image(self, path: str) -> "np.ndarray":
        """One image decoded and preprocessed as far as it can be cached: what the pixel cache
        stores (uint8 where the family's pipeline allows; any shape). Default: the float
        ``pixel_values`` of that image."""
        return self.preprocess_images([path])[0].numpy()

    def image_batch(self, images: Sequence["torch.Tensor"]) -> dict[str, "torch.Tensor"]:
        """The model inputs of images loaded by :meth:`load_image` (as tensors, in order):
        equal to :meth:`image_inputs` of their files. Default: the float arrays stacked."""
        import torch

        return {"pixel_values": torch.stack(list(images))}

    def split_image_inputs(self, inputs: dict[str, "torch.Tensor"]) -> list[dict[str, "torch.Tensor"]]:
        """A batch's image inputs one image at a time, in order (concatenating the pieces along
        dim 0 gives ``inputs`` back): how sequence parallelism shares a row's images among its
        ranks. Default: one row of every input per image."""
        first = inputs[self.image_input_names[0]]
        return [{name: inputs[name][i:i + 1] for name in self.image_input_names} for i in range(int(first.shape[0]))]

    def pixel_settings(self) -> dict[str, Any]:
        """Everything that decides what :meth:`load_image` returns: the pixel cache's key, so
        a setting that changes the pixels always changes the cache. ``"uint8"`` says whether the
        cache holds pixels before normalisation. Default: the image processor's settings."""
        processor = getattr(self, "image_processor", None)
        settings = processor.to_dict() if hasattr(processor, "to_dict") else repr(processor)
        return {"settings": settings, "uint8": False}

    def token_inputs(self, input_ids: "torch.Tensor") -> dict[str, "torch.Tensor"]:
        """Model inputs aligned with the tokens, computed from ``input_ids`` (any shape, e.g. a
        batch [B, L], packed rows included) and passed beside them (Gemma 3's ``token_type_ids``,
        1 on image tokens). Default: none."""
        return {}

    #: whether encoding a dialogue's first turns gives the first turns of its encoding. False for a
    #: template rendered whole (Qwen3.5's writes the thinking block only after the last user turn):
    #: a dialogue cut at an exchange must then be encoded again, not cut from the encoding.
    prefix_stable: ClassVar[bool] = True

    # -- the batch: position ids -----------------------------------------------------------------
    #: rows of position ids per token: 1 (a running position) or M-RoPE's 3 (temporal, height, width)
    position_id_rows: ClassVar[int] = 1

    def position_ids(
        self, input_ids: "torch.Tensor", image_inputs: dict[str, "torch.Tensor"] | None = None
    ) -> "torch.Tensor":
        """Position ids ``[position_id_rows, L]`` (long) of ONE sample: ``input_ids`` [L] and the
        :meth:`image_inputs` of its own images, in order. A packed row concatenates the
        samples' results, each starting again at 0. Default: ``0 .. L-1``."""
        import torch

        return torch.arange(int(input_ids.shape[-1]), device=input_ids.device)[None]

    def prompt_positions(self, input_ids: "torch.Tensor", image_paths: Sequence[str]) -> tuple["torch.Tensor", int]:
        """:meth:`position_ids` of a generation prompt ``input_ids`` [L] whose images are the files
        ``image_paths`` (in order), and its offset ``delta``: the token appended at index
        ``i >= L`` (a generated one) has position ``i + delta`` in every row. Positions that
        depend on image sizes come from the files' headers (no pixel decode). Default: ``0 ..
        L-1`` and ``delta = 0``."""
        positions = self.position_ids(input_ids)
        length = int(positions.shape[-1])
        return positions, (int(positions.max()) + 1 - length if length else 0)

    def model_position_ids(self, rows: "torch.Tensor", text: "torch.Tensor") -> "torch.Tensor":
        """A batch's ``position_ids`` argument of the forward, from the rows of every token
        ``[position_id_rows, B, L]`` and the plain running position ``text`` [B, L] (restarting
        at every packed sample).

        One row: ``text`` ([B, L]). Several: ``[1 + rows, B, L]`` with ``text`` first, the layout
        transformers' M-RoPE models take: they read packed-sample boundaries from row 0 (the
        block-diagonal mask, flash-attention's ``cu_seqlens``) and rotate with the others; with
        only the M-RoPE rows and no attention mask, packed samples would attend to each other.
        """
        import torch

        if self.position_id_rows == 1:
            return text
        if self.packing_problem:  # the forward refuses the text row: the rows alone (padding batches)
            return rows
        return torch.cat([text[None].to(rows.dtype), rows])

    #: why packed rows cannot reach this model ("" when they can): a model whose forward refuses the
    #: running position as row 0 of its M-RoPE positions has no way to learn the samples' boundaries
    #: (transformers 5.25's HunYuan-VL reads them there, then refuses the shape); the collator refuses
    #: ``collator.batching=packing`` at start-up with it, and batches get the rows alone
    packing_problem: str = ""

    # -- quantization ----------------------------------------------------------------------------
    #: regex of the full module names outside the language model (vision tower, projector);
    #: peft's ``exclude_modules`` for LoRA, and what a 4-bit base model keeps in full precision
    lora_exclude_modules: ClassVar[str | None] = None
    #: module name of the output head, also kept in full precision under QLoRA
    output_head_name: ClassVar[str] = "lm_head"

    def quantization_skip_modules(self) -> list[str]:
        """Module-name patterns a 4-bit (QLoRA) base model keeps in full precision (bitsandbytes'
        ``llm_int8_skip_modules``: transformers matches each from the start of a module's full
        name or as its suffix): the vision tower and projector, and the output head."""
        return [p for p in (self.lora_exclude_modules, self.output_head_name) if p]

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
        step (engines that shard the weights hang otherwise) and vision parameters get zero, not
        ``None``, gradients.
        """
