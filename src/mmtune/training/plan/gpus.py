"""The GPU types ``mmtune plan --gpu`` knows, and the byte sizes its memory estimates use."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuType", "GPU_TYPES", "DTYPE_BYTES", "OVERHEAD_GIB"]


@dataclass(frozen=True)
class GpuType:
    name: str
    peak_tflops: float
    """Dense bf16 tensor-core peak (no sparsity), TFLOP/s."""
    memory_gib: float
    hbm_tbps: float
    """Memory bandwidth, TB/s (bounds greedy decoding speed)."""


# Vendor datasheet numbers (dense bf16, without the 2:4 sparsity doubling).
GPU_TYPES: dict[str, GpuType] = {
    "a100-40g": GpuType("A100-SXM4-40GB", 312.0, 40.0, 1.555),
    "a100-80g": GpuType("A100-SXM4-80GB", 312.0, 80.0, 2.039),
    "h100": GpuType("H100-SXM5-80GB", 989.0, 80.0, 3.35),
    "h200": GpuType("H200-SXM-141GB", 989.0, 141.0, 4.8),
    "l40s": GpuType("L40S-48GB", 362.0, 48.0, 0.864),
    "a10g": GpuType("A10G-24GB", 70.0, 24.0, 0.6),
    "rtx4090": GpuType("RTX 4090-24GB", 165.0, 24.0, 1.008),
}


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per parameter of each ``model.torch_dtype``."""
OVERHEAD_GIB = 1.5
"""CUDA context and allocator slack, per GPU."""
