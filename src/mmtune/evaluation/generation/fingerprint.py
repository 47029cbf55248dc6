"""Cheap identities of what a generation file's answers depend on: weights, data files.

A resumed generation file must hold answers of the same model on the same questions;
these fingerprints make that checkable without hashing gigabytes:

* :func:`weights_fingerprint` hashes, per parameter, its name, shape, dtype, its sum
  and a strided sample of its values (a few hundred numbers each). Any training step
  changes sums and samples; the cost is one reduction per tensor, on its device.
* :func:`file_identity` is a data file's absolute path, size and modification time.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

__all__ = ["weights_fingerprint", "file_identity"]

_SAMPLES = 256


def weights_fingerprint(model: Any) -> str:
    """Hex digest of a model's parameters and buffers (see the module docstring)."""
    import torch

    digest = hashlib.sha256()
    sums, samples = [], []
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            flat = tensor.detach().reshape(-1)
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            if flat.numel() == 0:
                continue
            step = max(1, flat.numel() // _SAMPLES)
            if flat.is_floating_point() or flat.is_complex():
                sums.append(flat.sum(dtype=torch.float64).reshape(1))
                samples.append(flat[::step][:_SAMPLES].to(torch.float64))
            else:
                sums.append(flat.sum(dtype=torch.int64).to(torch.float64).reshape(1))
                samples.append(flat[::step][:_SAMPLES].to(torch.float64))
        if sums:
            values = torch.cat([torch.cat(sums).cpu()] + [s.cpu() for s in samples])
            digest.update(values.numpy().tobytes())
    return digest.hexdigest()[:24]


def file_identity(path: Optional[str]) -> Optional[dict[str, Any]]:
    """``{"path", "size", "mtime_ns"}`` of a file, or None without a path."""
    if not path:
        return None
    absolute = os.path.abspath(path)
    try:
        st = os.stat(absolute)
    except OSError:
        return {"path": absolute, "size": None, "mtime_ns": None}
    return {"path": absolute, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
