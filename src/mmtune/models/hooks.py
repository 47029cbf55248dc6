"""Model hooks of a family on transformers' own image-text classes: load, module groups, loss
modules, the dummy vision pass. Mixed into an adapter that sets ``config`` (``model.path``) and
``_dummy_image_inputs`` (the model inputs of one blank image)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from mmtune.models._utils import load_dtype_and_attention
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


class TransformersModelHooks:
    """The contract's model hooks through ``AutoModelForImageTextToText`` and transformers' look-ups."""

    def load_model(self, **kwargs: Any) -> "nn.Module":
        from transformers import AutoModelForImageTextToText

        dtype, attn = load_dtype_and_attention(kwargs, self.config)
        kwargs.pop("seed", None)
        model = AutoModelForImageTextToText.from_pretrained(
            self.config.path,
            dtype=dtype,
            attn_implementation=attn,
            trust_remote_code=self.config.trust_remote_code,
            **kwargs,
        )
        install_packed_guards(model, self.text_config(model.config))
        names = tuple(getattr(self, "image_input_names", ()))
        for module in (model, getattr(model, "model", None)) if names else ():  # the loss may call the body
            if module is not None:
                module.register_forward_pre_hook(functools.partial(_image_inputs_in_model_dtype, names=names),
                                                 with_kwargs=True)
        return model

    def module_groups(self, model: "nn.Module") -> ModuleGroups:
        """Found from the model's structure (:func:`~mmtune.models.base.find_module_groups`):
        transformers' vision encoder and decoder look-ups, the rest (and parameters outside any
        child module, LLaVA-OneVision's ``image_newline``) the projector, less the modules an
        image-generating model does not run when it reads an image (``frozen``)."""
        return find_module_groups(model)

    def loss_modules(self, model: "nn.Module") -> tuple["nn.Module", "nn.Module"]:
        """transformers' ``model`` attribute (the multimodal body) and the output embeddings."""
        top = unwrap_model(model)
        body = getattr(top, "model", None)
        head = top.get_output_embeddings()
        if body is None or head is None:
            raise NotImplementedError(f"{type(top).__name__} has no `model` body or no output embeddings")
        return body, head

    def text_config(self, config: Any) -> Any:
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def vision_dummy_loss(self, model: "nn.Module") -> "torch.Tensor":
        """0 x the model's ``get_image_features`` (its body's, for Janus) on a blank image (see the base class)."""
        import torch

        top = unwrap_model(model)
        param = next(p for p in top.parameters() if p.is_floating_point())
        inputs = {
            k: (v.to(device=param.device, dtype=param.dtype) if v.is_floating_point() else v.to(param.device))
            for k, v in self._dummy_image_inputs.items()
            if isinstance(v, torch.Tensor)
        }
        features = image_features_method(top)(**inputs)
        total = param.new_zeros(())
        stack = [features]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                total = total + item.float().sum()
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif hasattr(item, "pooler_output"):
                stack.append(item.pooler_output)
        return total * 0.0
