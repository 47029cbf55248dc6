"""Several dialogues' KV caches held in one batched cache, with padding kept invisible.

Each row of the batch belongs to one dialogue. The rows grow at different rates (turns
of different lengths, answers that stop at different steps), but a batched cache has
one length for all rows, so a row's cached tokens are scattered over the cache's
columns with holes between them. Two things make the holes invisible:

- the 2-D attention mask is 0 at every column that is not one of the row's cached
  tokens, so no query ever attends to a hole (transformers turns it into the 4-D causal
  mask; causality by column is right because every row appends in column order);
- position ids count the row's own tokens only, so RoPE sees the positions a batch-1
  run would see.

Within a step, new tokens are right-padded: a row's real tokens come first, so every
query, padding included, has at least one visible key (a query that sees nothing gives
NaN under SDPA, and a NaN key or value poisons later steps even when masked). The logit
of each row's last real token is picked with a per-row ``logits_to_keep``.

Holes cost memory and attention time, not correctness. When too much of the cache is
holes (a dialogue's slot was refilled, the cache was rolled back to a common prefix,
short rows waited for long ones), :meth:`BatchedKVCache.compact` gathers each row's
tokens into as few columns as the longest row needs.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["BatchedKVCache"]


class BatchedKVCache:
    """A transformers cache for ``batch`` rows plus, per row, which columns hold which token.

    Args:
        make_cache: builds an empty transformers cache (``DynamicCache``) for the model.
        batch: number of rows (dialogue slots).
        device: where the attention mask and position ids live (the model's device).
    """

    def __init__(self, make_cache: Callable[[], Any], batch: int, device: Any):
        import torch

        self.cache = make_cache()
        self.device = device
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        """Per row: the token ids it has cached, in the row's own order (position i = ids[i])."""
        self.columns: list[list[int]] = [[] for _ in range(batch)]
        """Per row: the cache column of each cached token."""

    @property
    def batch_size(self) -> int:
        return len(self.ids)

    @property
    def length(self) -> int:
        """Columns of the cache (the longest row plus every hole)."""
        return int(self.mask.shape[1])

    def holes(self) -> float:
        """Fraction of the cache's cells that hold no token of their row."""
        cells = self.batch_size * self.length
        return 1.0 - sum(len(c) for c in self.columns) / cells if cells else 0.0

    # ------------------------------------------------------------------ per-row edits
    def keep(self, row: int, n: int) -> None:
        """Keep only the first ``n`` cached tokens of ``row`` (0 = forget the row: a new dialogue)."""
        dropped = self.columns[row][n:]
        if dropped:
            self.mask[row, dropped] = 0
        del self.ids[row][n:], self.columns[row][n:]

    def extend(self, tokens: list[list[int]], width: int) -> tuple[Any, Any]:
        """Append ``width`` columns; row ``b``'s ``tokens[b]`` fill its first ones, the rest are padding.

        Call it right before the forward pass that writes those columns into the cache.

        Returns:
            ``position_ids`` [B, width] (a row's own positions; padding repeats the row's
            last position, so a position-dependent RoPE never sees a larger one) and
            ``last`` [B, 1], the column within the step of each row's last real token.
        """
        import torch

        start = self.length
        new = torch.zeros(self.batch_size, width, dtype=torch.long)
        positions = torch.zeros(self.batch_size, width, dtype=torch.long)
        last = torch.zeros(self.batch_size, 1, dtype=torch.long)
        for b, row in enumerate(tokens):
            if len(row) > width:
                raise ValueError(f"row {b} feeds {len(row)} tokens into a step of width {width}")
            n, past = len(row), len(self.ids[b])
            new[b, :n] = 1
            positions[b, :n] = torch.arange(past, past + n)
            positions[b, n:] = max(past + n - 1, 0)
            last[b, 0] = max(n - 1, 0)
            self.ids[b].extend(row)
            self.columns[b].extend(range(start, start + n))
        self.mask = torch.cat([self.mask, new.to(self.device)], dim=1)
        return positions.to(self.device), last.to(self.device)

    # ------------------------------------------------------------------ whole-batch edits
    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in this order): slots whose dialogues are done leave the batch."""
        import torch

        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.length:
            self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.ids = [self.ids[r] for r in rows]
        self.columns = [self.columns[r] for r in rows]

    def compact(self) -> None:
        """Move each row's tokens into the last ``max(row length)`` columns, in order; drop the rest.

        Keys are stored after RoPE, so moving them between columns changes nothing a query sees.
        """
        import torch

        width = max((len(c) for c in self.columns), default=0)
        if width == self.length:
            return
        index = torch.zeros(self.batch_size, width, dtype=torch.long)
        mask = torch.zeros(self.batch_size, width, dtype=torch.long)
        for b, cols in enumerate(self.columns):
            n = len(cols)
            if n:
                index[b, width - n :] = torch.tensor(cols, dtype=torch.long)
                mask[b, width - n :] = 1
            self.columns[b] = list(range(width - n, width))
        index = index.to(self.device)
        for layer in _layers(self.cache):
            keys, values = layer.keys, layer.values
            gather = index[:, None, :, None].expand(keys.shape[0], keys.shape[1], width, keys.shape[3])
            layer.keys = keys.gather(2, gather)
            gather = index[:, None, :, None].expand(values.shape[0], values.shape[1], width, values.shape[3])
            layer.values = values.gather(2, gather)
        self.mask = mask.to(self.device)


def _layers(cache: Any) -> list[Any]:
    """The per-layer key/value holders of a transformers 5.x cache, checked to be plain ones."""
    layers = list(getattr(cache, "layers", []))
    for i, layer in enumerate(layers):
        if not getattr(layer, "is_initialized", False):
            continue
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise TypeError(
                f"cache layer {i} is a {type(layer).__name__}; batched KV generation compacts only full-attention "
                "DynamicCache layers: the generator builds them for windowed and chunked layers (their masks keep the "
                "window) and re-encodes models with recurrent layers, so this model's layer type is new to it: "
                "please report it with this message"
            )
    return [layer for layer in layers if getattr(layer, "is_initialized", False) and layer.keys.numel()]
