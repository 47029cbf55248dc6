"""Model hooks of a family on transformers' own image-text classes: load, module groups, loss
modules, the dummy vision pass. Mixed into an adapter that sets ``config`` (``model.path``),
``model_config`` (the checkpoint's config, or the tiny one of ``model.path=null``) and
``_dummy_image_inputs`` (the model inputs of one blank image).

A family differs only in data or one small method: :meth:`TransformersModelHooks.generation_class`
(the class it loads and unwraps to; default ``AutoModelForImageTextToText`` / the first
transformers model) and :attr:`~TransformersModelHooks.vision_projector_children` (children of
the vision tower that are the projector, Qwen-VL's ``merger``). A family whose model is not in
transformers (InternLM-XComposer2) keeps its own :meth:`load_model` and shares the rest."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from mmtune.models._utils import build_random_model, load_dtype_and_attention
from mmtune.models.base import ModuleGroups, find_module_groups, image_features_method, unwrap_model
from mmtune.models.masks import install_packed_guards

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

__all__ = ["TransformersModelHooks"]


def _image_inputs_in_model_dtype(module, args, kwargs, *, names: tuple[str, ...]):
    """Forward pre-hook: floating image inputs in the model's dtype where the processor made another
    (Llama 4's image processor returns bfloat16; a float32 model computes in float32), as
    transformers' examples move processor outputs with ``.to(model.dtype)``. The batch keeps the
    processor's values; an exact conversion for a model in the processor's dtype is no conversion."""
    dtype = getattr(module, "dtype", None)
    changed = {name: kwargs[name].to(dtype) for name in names
               if hasattr(kwargs.get(name), "is_floating_point") and kwargs[name].is_floating_point()
               and dtype is not None and kwargs[name].dtype != dtype}
    return (args, {**kwargs, **changed}) if changed else None


#: the fields of ``get_image_features``' output that reach the language model: the projected
#: features and Qwen3-VL's DeepStack features (not ``last_hidden_state``: a tower read at an
#: earlier layer, LLaVA's ``vision_feature_layer=-2``, leaves its last layers out of the real
#: image path, and the dummy pass must use exactly the parameters the real one uses, as DDP expects)
_IMAGE_FEATURE_FIELDS = ("pooler_output", "deepstack_features")


class TransformersModelHooks:
    """The contract's model hooks through transformers' classes and look-ups."""

    #: children of the vision tower that are the projector, not vision (Qwen-VL's ``merger``, the
    #: module the official ``tune_mm_mlp`` switch trains); empty: the whole tower is vision
    vision_projector_children: ClassVar[tuple[str, ...]] = ()

    def generation_class(self) -> type | None:
        """The class :meth:`load_model` builds and the hooks unwrap a wrapped model to; ``None``:
        ``AutoModelForImageTextToText`` picks it from the checkpoint (unwrapping stops at the
        first transformers model)."""
        return None

    def _top(self, model: "nn.Module") -> "nn.Module":
        """The transformers model inside peft / distributed-engine wrappers."""
        return unwrap_model(model, self.generation_class())

    def load_model(self, **kwargs: Any) -> "nn.Module":
        """Load the checkpoint (or build the random-weight model when ``path`` is None).

        Keyword arguments: ``torch_dtype`` / ``attn_implementation`` (default from the
        ModelConfig), ``seed`` (random-weight model only), anything else goes to
        ``from_pretrained``. The decoder gets the packed-row guards its layers need
        (:func:`~mmtune.models.masks.install_packed_guards`)."""
        dtype, attn = load_dtype_and_attention(kwargs, self.config)
        seed = kwargs.pop("seed", 0)
        model_class = self.generation_class()
        if model_class is None:
            from transformers import AutoModelForImageTextToText as model_class
        if self.config.path is None:
            model = build_random_model(model_class, self.model_config, seed=seed, attn_implementation=attn,
                                       dtype=dtype)
        else:
            model = model_class.from_pretrained(
                self.config.path, dtype=dtype, attn_implementation=attn,
                trust_remote_code=self.config.trust_remote_code, **kwargs,
            )  # fmt: skip
        self._install_input_hooks(model)
        return model

    def _install_input_hooks(self, model: "nn.Module") -> None:
        """The packed-row guards of the decoder, and image inputs cast to the model's dtype."""
        install_packed_guards(model, self.text_config(model.config))
        names = tuple(getattr(self, "image_input_names", ()))
        for module in (model, getattr(model, "model", None)) if names else ():  # the loss may call the body
            if module is not None:
                module.register_forward_pre_hook(functools.partial(_image_inputs_in_model_dtype, names=names),
                                                 with_kwargs=True)

    def module_groups(self, model: "nn.Module") -> ModuleGroups:
        """:meth:`group_modules` of the model."""
        return self.group_modules(model)

    @classmethod
    def group_modules(cls, model: "nn.Module") -> ModuleGroups:
        """Found from the model's structure (:func:`~mmtune.models.base.find_module_groups`):
        transformers' vision encoder and decoder look-ups, the rest (and parameters outside any
        child module, LLaVA-OneVision's ``image_newline``) the projector, less the modules an
        image-generating model does not run when it reads an image (``frozen``); the vision
        tower's children named in :attr:`vision_projector_children` are moved to the projector."""
        groups = find_module_groups(model)
        names = cls.vision_projector_children
        if not names:
            return groups
        (tower,) = groups.vision
        children = dict(tower.named_children())
        missing = [name for name in names if name not in children]
        if missing:
            raise ValueError(f"the vision tower {type(tower).__name__} has no child {missing} (vision_projector_children "
                             f"of {cls.__name__}); its children are {list(children)}")
        return ModuleGroups(vision=[m for name, m in children.items() if name not in names],
                            projector=[children[name] for name in names] + list(groups.projector),
                            language_model=groups.language_model, frozen=groups.frozen)

    def loss_modules(self, model: "nn.Module") -> tuple["nn.Module", "nn.Module"]:
        """transformers' ``model`` attribute (the multimodal body, or the decoder; its
        ``last_hidden_state`` is the normed decoder output) and the output embeddings."""
        top = self._top(model)
        body = getattr(top, "model", None)
        head = top.get_output_embeddings()
        if body is None or head is None:
            raise NotImplementedError(f"{type(top).__name__} has no `model` body or no output embeddings")
        return body, head

    def text_config(self, config: Any) -> Any:
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def vision_dummy_loss(self, model: "nn.Module") -> "torch.Tensor":
        """0 x the image features the model's ``get_image_features`` gives for a blank image (see
        the base class): the value is exactly zero, but autograd reaches every vision / projector
        parameter the image path uses (Qwen3-VL's DeepStack mergers too), so they get zero, not
        missing, gradients, and every rank calls the same modules (ZeRO-3)."""
        import torch

        top = self._top(model)
        param = next(p for p in top.parameters() if p.is_floating_point())
        inputs = {
            k: (v.to(device=param.device, dtype=param.dtype) if v.is_floating_point() else v.to(param.device))
            for k, v in self._dummy_image_inputs.items()
            if isinstance(v, torch.Tensor)
        }
        # a plain tensor: under FSDP2 a parameter outside its unit's forward is a DTensor, and a DTensor
        # zero would make the step's whole loss one (its gradient then meets plain tensors in backward)
        total = torch.zeros((), dtype=torch.float32, device=param.device)
        stack = [image_features_method(top)(**inputs)]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                total = total + item.float().sum()
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, Mapping):  # a ModelOutput: the fields the image path feeds the model
                stack.extend(item[name] for name in _IMAGE_FEATURE_FIELDS if item.get(name) is not None)
        return total * 0.0
