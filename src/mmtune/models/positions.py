"""M-RoPE position ids of one sample, from the model class's own ``get_rope_index``.

Qwen-VL language models rotate queries and keys by three position rows (temporal, height,
width). Text tokens get the same running position in all three rows; an image's ``h x w``
merged tokens get ``(start, start + row, start + column)``, and the text after the image
continues at ``start + max(h, w)``. transformers computes this in
``Qwen2VLModel.get_rope_index`` (and the Qwen2.5-VL / Qwen3-VL equivalents), which reads
nothing but the model config. :class:`RopeIndex` calls it on an instance of the class that
holds only the config (no submodule built: nothing allocated, nothing for ZeRO-3
to partition), so the positions are transformers' own, never a re-implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["RopeIndex", "RopePositions", "packed_layout_problem", "rope_index_for"]


#: parameters of a ``get_rope_index`` that are not image inputs of the sample
_NOT_IMAGE_INPUTS = frozenset({"self", "input_ids", "mm_token_type_ids", "attention_mask", "downsample_mode"})


def rope_image_params(model_class: type) -> tuple[str, ...]:
    """The image inputs the class's ``get_rope_index`` reads, by its signature: ``image_grid_thw`` for
    the Qwen-VL line and GLM-V, ``target_sizes`` for MiniCPM-V 4.7 (video inputs left out: no videos)."""
    import inspect

    parameters = inspect.signature(model_class.get_rope_index).parameters.values()
    return tuple(p.name for p in parameters if p.name not in _NOT_IMAGE_INPUTS and "video" not in p.name
                 and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


class RopeIndex:
    """``position_ids`` [rows, L] of one sample (``input_ids`` [L] + its images' inputs that the
    class's ``get_rope_index`` reads: :attr:`image_params`).

    Args:
        model_config: the full model config (the rope index reads its vision config).
        model_class: the family's inner model class (``Qwen2VLModel`` ...), which owns
            ``get_rope_index``.
        image_token_id: the ``<|image_pad|>`` id.
        merge_size: the vision tower's spatial merge size (tokens per image = t*h*w / merge**2).
        marked_ids: the token ids the processor marks 1 in ``mm_token_type_ids`` (the ``auto`` family:
            each class has its own run length, HunYuan-VL's ``h * (w + 1) + 2`` tokens, and its rope
            index returns 4 rows): then only the number of image runs is checked against the grid.
    """

    def __init__(self, model_config: Any, model_class: type, image_token_id: int, merge_size: int,
                 marked_ids: "Sequence[int] | None" = None):
        self.model_config = model_config
        self.model_class = model_class
        self.image_token_id = int(image_token_id)
        self.merge_size = int(merge_size)
        self.marked_ids = None if marked_ids is None else tuple(int(i) for i in marked_ids)
        self.image_params = rope_image_params(model_class)
        self._model = None

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers rebuild the config-only instance instead of unpickling it
        return {**self.__dict__, "_model": None}

    @property
    def model(self):
        """An instance of the model class holding the config alone: ``get_rope_index`` reads the
        config and the class's own helpers, no weight. No submodule is built, so nothing is
        allocated or initialised, and ZeRO-3's construction hooks (which partition
        and initialise every module ``_from_config`` builds) never run on it. The tests check
        its positions give the logits of the full model computing them itself."""
        if self._model is None:
            import copy

            from torch import nn

            host = self.model_class.__new__(self.model_class)
            nn.Module.__init__(host)
            host.config = copy.deepcopy(self.model_config)
            self._model = host
        return self._model

    def _marks(self, input_ids: "torch.Tensor") -> "torch.Tensor":
        import torch

        if self.marked_ids is None:
            return input_ids == self.image_token_id
        return torch.isin(input_ids, torch.tensor(self.marked_ids, dtype=input_ids.dtype, device=input_ids.device))

    @property
    def rows(self) -> int:
        """The number of position rows the model's rope index returns (3 for M-RoPE, 4 for HunYuan-VL)."""
        import torch

        return int(self.model.get_rope_index(torch.zeros(1, 1, dtype=torch.long) - 1,
                                             mm_token_type_ids=torch.zeros(1, 1, dtype=torch.int))[0].shape[0])

    def _check(self, input_ids: "torch.Tensor", image_grid_thw: "torch.Tensor | None") -> None:
        """Each run of image tokens must be one image of the grid, in order, with its token count."""
        import torch

        is_image = self._marks(input_ids).to(torch.int8)
        edges = torch.diff(is_image, prepend=is_image.new_zeros(1), append=is_image.new_zeros(1))
        starts = torch.nonzero(edges == 1).flatten()
        ends = torch.nonzero(edges == -1).flatten()
        runs = (ends - starts).tolist()
        grids = [] if image_grid_thw is None else image_grid_thw.tolist()
        want = [t * h * w // self.merge_size**2 for t, h, w in grids]
        if self.marked_ids is not None:  # runs of the processor's own marks: their lengths are the class's rule
            want = runs if len(runs) == len(grids) else want
        if runs != want:
            raise ValueError(
                f"the sample has {len(runs)} image-token run(s) of lengths {runs} but image_grid_thw has {len(grids)} "
                f"image(s) of {want} tokens; pass the image inputs of exactly this sample's images, in order"
            )

    def __call__(self, input_ids: "torch.Tensor", image_inputs: "dict[str, torch.Tensor] | None" = None
                 ) -> "torch.Tensor":
        """``position_ids`` [rows, L] (long) for ``input_ids`` [L] and the sample's image inputs.

        Raises:
            ValueError: ``input_ids`` is not 1-D, or its image-token runs do not match
                ``image_grid_thw`` (both counts named).
        """
        return self.with_delta(input_ids, image_inputs)[0]

    def with_delta(
        self, input_ids: "torch.Tensor", image_inputs: "dict[str, torch.Tensor] | None" = None
    ) -> tuple["torch.Tensor", int]:
        """``position_ids`` [rows, L] and the rope delta ``get_rope_index`` returns with them
        (``positions.max() + 1 - L``: a token appended at index ``i`` has position ``i + delta``).
        Raises as :meth:`__call__`."""
        import torch

        if input_ids.ndim != 1:
            raise ValueError(f"input_ids must be one sample [L], got shape {tuple(input_ids.shape)}")
        input_ids = input_ids.long()
        given = {name: value.long().to(input_ids.device) for name, value in (image_inputs or {}).items()
                 if name in self.image_params and value is not None and len(value)}
        if "image_grid_thw" in self.image_params:
            grid = given.get("image_grid_thw")
            self._check(input_ids.cpu(), None if grid is None else grid.cpu())
        if input_ids.numel() == 0:
            return torch.zeros(self.rows, 0, dtype=torch.long, device=input_ids.device), 0
        mm_token_type_ids = self._marks(input_ids).int()[None]  # 1 = image, as the processor marks it
        positions, deltas = self.model.get_rope_index(input_ids[None], mm_token_type_ids=mm_token_type_ids, **given)
        return positions[:, 0], int(deltas.reshape(-1)[0])


def rope_index_for(model_config: Any, image_token_id: int, marked_ids: "Sequence[int] | None" = None
                   ) -> "RopeIndex | None":
    """The :class:`RopeIndex` of the model class transformers pairs with ``model_config`` (its
    ``MODEL_MAPPING`` entry) where that class has its own ``get_rope_index`` (M-RoPE: the Qwen-VL
    line, GLM-4.1V, ...); ``None`` for a model that counts one running position."""
    from transformers import MODEL_MAPPING

    try:
        model_class = MODEL_MAPPING[type(model_config)]
    except KeyError:
        return None
    if not hasattr(model_class, "get_rope_index"):
        return None
    vision = getattr(model_config, "vision_config", None)
    return RopeIndex(model_config, model_class, image_token_id, int(getattr(vision, "spatial_merge_size", 1)),
                     marked_ids)


def packed_layout_problem(text_config: Any, rows: int) -> str:
    """Why the language model of ``text_config`` refuses a running-position row before its ``rows``
    position rows (``[1 + rows, B, L]``, where transformers' M-RoPE models read packed boundaries),
    "" when it takes it. Asked of the model class itself: one layer of it built on the meta device
    (no memory, no weights) runs a 4-token forward in that layout; a ``ValueError`` is its refusal
    of the shape (an error on reading a meta value means the layout check passed)."""
    import copy

    import torch
    from transformers import MODEL_MAPPING

    text_config = copy.deepcopy(text_config)
    try:
        model_class = MODEL_MAPPING[type(text_config)]
    except KeyError:
        return ""
    text_config.num_hidden_layers = 1
    if getattr(text_config, "layer_types", None):
        text_config.layer_types = list(text_config.layer_types)[:1]
    try:
        with torch.device("meta"):
            model_class(text_config)(input_ids=torch.zeros(1, 4, dtype=torch.long),
                                     position_ids=torch.zeros(1 + rows, 1, 4, dtype=torch.long), use_cache=False)
    except ValueError as err:
        return (f"{model_class.__name__} refuses position ids laid out [1 + {rows}, B, L], the running "
                f"position first, from which transformers' M-RoPE models read where packed samples start "
                f"({err}), so packed samples would attend to each other")
    except Exception:  # noqa: BLE001 - past the layout check (a meta tensor has no values to read)
        return ""
    return ""


class RopePositions:
    """The positions stage of the one encoder (:class:`~mmtune.models.encoder.Encoder`): an adapter
    mixin over a :class:`RopeIndex` in ``_rope`` (``None``: the model counts one running position,
    the base class's default). A family differs only in :meth:`_prompt_inputs`, where a generation
    prompt's image inputs come from."""

    _rope: "RopeIndex | None"

    def position_ids(
        self, input_ids: "torch.Tensor", image_inputs: "dict[str, torch.Tensor] | None" = None
    ) -> "torch.Tensor":
        """``position_ids`` [rows, L] of one sample: the model's own ``get_rope_index`` on
        ``input_ids`` [L] and that sample's ``image_inputs`` (its images only, in order). A packed
        row concatenates the per-sample results, each starting again at 0."""
        if self._rope is None:
            return super().position_ids(input_ids, image_inputs)
        return self._rope(input_ids, image_inputs)

    def prompt_positions(self, input_ids: "torch.Tensor", image_paths: Sequence[str]) -> tuple["torch.Tensor", int]:
        """:meth:`position_ids` of a generation prompt and the rope delta ``get_rope_index`` returns
        with them (what transformers' ``generate`` keeps in ``model.rope_deltas``): a generated token
        at index ``i`` has position ``i + delta`` in every row."""
        if self._rope is None:
            return super().prompt_positions(input_ids, image_paths)
        return self._rope.with_delta(input_ids, self._prompt_inputs(image_paths))

    def _prompt_inputs(self, image_paths: Sequence[str]) -> "dict[str, torch.Tensor]":
        """The image inputs of a prompt's images that the rope index reads: the processor's own, from
        :meth:`image_inputs`."""
        return self.image_inputs(image_paths) if image_paths else {}
