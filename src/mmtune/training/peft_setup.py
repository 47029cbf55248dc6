"""LoRA / QLoRA set-up with peft, restricted to the language model.

Adapters name LoRA targets by module name (``q_proj``, ``v_proj`` ...). Those names
also occur in CLIP's vision tower, so a bare name list would put LoRA there too;
LLaVA's own training script filters the vision tower and projector out by hand. Here
the targets are resolved to full module names inside the adapter's language-model
group and handed to peft as an explicit list.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Optional, Sequence

from torch import nn

from mmtune.models.base import ModuleGroups

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.training.config import PeftConfig

__all__ = ["lora_target_names", "apply_lora", "qlora_load_kwargs", "is_peft_model", "merged_model"]


def lora_target_names(model: nn.Module, groups: ModuleGroups, targets: list[str]) -> list[str]:
    """Full names of the ``nn.Linear`` modules in the language model whose last name is in ``targets``.

    Raises:
        ValueError: no module matched (names the targets and a few candidate names).
    """
    lm_modules = {id(m) for root in groups.language_model for m in root.modules()}
    wanted = set(targets)
    names = [
        name for name, module in model.named_modules()
        if id(module) in lm_modules and isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in wanted
    ]
    if not names:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if id(m) in lm_modules and isinstance(m, nn.Linear)})
        raise ValueError(
            f"peft.target_modules={sorted(wanted)} matched no linear layer of the language model; "
            f"its linear layers are named {linear}"
        )
    return names


def qlora_load_kwargs(peft_cfg: "PeftConfig", compute_dtype: Any, *,
                      skip_modules: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """``load_model`` keyword arguments for a 4-bit (NF4) base model.

    ``skip_modules`` (the adapter's ``quantization_skip_modules()``: its vision tower,
    projector and output head) stay in full precision, as in QLoRA for VLMs.

    Raises:
        ImportError: bitsandbytes is not installed (QLoRA needs it and a CUDA GPU).
        ValueError: ``skip_modules`` not given.
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(
            "peft.method=qlora needs bitsandbytes (and a CUDA GPU): `pip install bitsandbytes`, "
            "or use peft.method=lora"
        )
    if skip_modules is None:
        raise ValueError("qlora_load_kwargs needs skip_modules=adapter.quantization_skip_modules() (the modules "
                         "that stay in full precision)")
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=list(skip_modules),
    )}


def apply_lora(model: nn.Module, groups: ModuleGroups, peft_cfg: "PeftConfig", default_targets: list[str], *,
               gradient_checkpointing: bool = False) -> nn.Module:
    """Wrap ``model`` with LoRA adapters on the language model (returns the peft model)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    targets = list(peft_cfg.target_modules) if peft_cfg.target_modules else list(default_targets)
    if not targets:
        raise ValueError("peft.target_modules is empty and the adapter has no default_lora_targets: list module names")
    names = lora_target_names(model, groups, targets)
    if peft_cfg.method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    config = LoraConfig(r=peft_cfg.r, lora_alpha=peft_cfg.alpha, lora_dropout=peft_cfg.dropout,
                        target_modules=names, bias="none")
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        if "lora_dropout != 0" not in str(err):
            raise
        # peft also puts LoRA on the fused expert weights of the MoE classes it knows (GLM-4.5V's
        # experts hold them as parameters), and its ParamWrapper takes no dropout
        raise ValueError(f"peft.dropout={peft_cfg.dropout}: peft puts LoRA on this model's fused expert weights too "
                         f"(parameters, not linear layers), which take no dropout ({err}); "
                         "set peft.dropout=0.0") from err


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


def merged_model(model: nn.Module) -> nn.Module:
    """A plain transformers model with the LoRA updates folded into the base weights.

    Works on a deep copy so the training model keeps its adapters.
    """
    import copy

    return copy.deepcopy(model).merge_and_unload()
