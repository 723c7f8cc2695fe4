"""Pallas FlashAttention kernels: pure array functions, no autodiff, no jflash imports.

`forward.flash_forward` -> (out, lse); `backward.flash_backward` -> (dq, dk, dv).
On a GPU they compile through Pallas' Triton backend; elsewhere they run in
interpret mode (how CI tests them).
"""
from pallas_kernels.tuning import BlockSizes

__all__ = ["BlockSizes"]
