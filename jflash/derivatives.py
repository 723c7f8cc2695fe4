"""Which derivatives a kernel-backed implementation has: the first-order guard shared
by the backend adapters (kept apart from jflash.api so no adapter imports it)."""
from __future__ import annotations

from collections.abc import Callable

import jax


def first_order_only(fn: Callable, what: str) -> Callable:
  """Wraps an array function whose kernels have no derivative of their own.

  jflash.attention's custom_vjp never differentiates an implementation's
  `forward`/`backward` for a first-order gradient; a second-order one (grad of grad)
  would, and gets a clear error instead of a failure deep inside the kernel lowering.
  """
  @jax.custom_jvp
  def wrapped(*args):
    return fn(*args)

  @wrapped.defjvp
  def _jvp(primals, tangents):
    raise NotImplementedError(
        f"{what} has no derivative of its own, so second-order gradients (grad of "
        "grad, hessians) are not implemented for it; use implementation='xla_chunked'"
        " or 'xla' for higher-order derivatives")

  return wrapped
