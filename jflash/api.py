"""The public attention op: input checks, the implementation registry, the custom_vjp.

Shape legend (as in `jax.nn.dot_product_attention`):
  B batch, T query length, S key/value length, N query heads, K key/value heads
  (N a multiple of K: GQA/MQA), H head dim.

Every flash-type implementation ("pallas", "xla_chunked", "hip") provides
`forward(q, k, v, cfg) -> (out, lse)` and
`backward(q, k, v, out, lse, dout, dlse, cfg) -> (dq, dk, dv)`. They are bound here by one
`jax.custom_vjp` whose residuals are exactly `(q, k, v, out, lse)`: the backward pass
recomputes the attention tiles from `lse` instead of storing the T x S probabilities
(FlashAttention-2, section 3.1.2). The "xla" implementation is the standard
materialising baseline and is differentiated by plain autodiff.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tuning import BlockSizes

Array = jax.Array

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static (hashable) options of one attention call, after validation."""

  scale: float
  is_causal: bool
  block_sizes: BlockSizes | None = None


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way of computing attention.

  `forward`/`backward` for flash-type implementations (bound by the shared
  custom_vjp); `direct` for one differentiated by plain autodiff. `supports`
  raises `NotImplementedError` naming what is missing for a given call.
  """

  name: str
  forward: Callable[..., tuple[Array, Array]] | None = None
  backward: Callable[..., tuple[Array, Array, Array]] | None = None
  direct: Callable[..., tuple[Array, Array]] | None = None
  supports: Callable[..., None] = lambda q, k, v, cfg: None


_REGISTRY: dict[str, Callable[[], Implementation]] = {}


def register_implementation(name: str, loader: Callable[[], Implementation]):
  """Registers a lazily-built implementation (so `import jflash` loads nothing heavy)."""
  _REGISTRY[name] = loader


def available_implementations() -> tuple[str, ...]:
  return tuple(_REGISTRY)


@functools.cache
def get_implementation(name: str) -> Implementation:
  if name not in _REGISTRY:
    raise ValueError(
        f"implementation={name!r} is unknown; choose one of {sorted(_REGISTRY)}"
        " or None")
  return _REGISTRY[name]()


def default_implementation() -> tuple[str, ...]:
  """The best implementation for the default backend, then its fallbacks."""
  if jax.default_backend() == "gpu":
    return ("pallas", "xla_chunked")
  return ("xla_chunked",)


# -- input checks ---------------------------------------------------------------

def _check_inputs(query, key, value):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(
          f"{name} must have rank 4 [batch, seq, heads, head_dim], got "
          f"{name}.shape={tuple(x.shape)} (rank {x.ndim})")
    if not any(x.dtype == d for d in SUPPORTED_DTYPES):
      raise ValueError(
          f"{name}.dtype={x.dtype} is not supported; use float16, bfloat16, "
          "float32 or float64")
  if not (query.dtype == key.dtype == value.dtype):
    raise ValueError(
        "query, key and value must share one dtype, got "
        f"query.dtype={query.dtype}, key.dtype={key.dtype}, value.dtype={value.dtype}")
  B, T, N, H = query.shape
  Bk, S, K, Hk = key.shape
  if key.shape != value.shape:
    raise ValueError(
        f"key and value must have the same shape, got key.shape={tuple(key.shape)}"
        f" and value.shape={tuple(value.shape)}")
  if Bk != B:
    raise ValueError(f"batch mismatch: query has {B}, key/value have {Bk}")
  if Hk != H:
    raise ValueError(f"head_dim mismatch: query has {H}, key/value have {Hk}")
  for name, n in (("query seq", T), ("key seq", S), ("head_dim", H), ("heads", N),
                  ("key heads", K), ("batch", B)):
    if n < 1:
      raise ValueError(f"{name} length must be >= 1, got {n}")
  if N % K:
    raise ValueError(
        f"query heads N={N} must be a multiple of key/value heads K={K} (GQA/MQA)")


def _make_config(query, *, scale, is_causal, block_sizes) -> AttentionConfig:
  H = query.shape[-1]
  if scale is None:
    scale = 1.0 / math.sqrt(H)
  else:
    if isinstance(scale, (bool, str)) or not isinstance(scale, (int, float, np.number)):
      raise ValueError(f"scale must be a Python number or None, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
      raise ValueError(f"scale must be finite, got {scale=}")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a jflash.BlockSizes, got {block_sizes!r}")
  return AttentionConfig(scale=scale, is_causal=bool(is_causal), block_sizes=block_sizes)


def _resolve(implementation, q, k, v, cfg) -> Implementation:
  if implementation is None:
    names = default_implementation()
  elif isinstance(implementation, str):
    names = (implementation,)
  elif isinstance(implementation, Sequence) and implementation and all(
      isinstance(n, str) for n in implementation):
    names = tuple(implementation)
  else:
    raise ValueError(
        f"implementation must be None, a name or a sequence of names, got {implementation!r}")
  impls = [get_implementation(n) for n in names]  # unknown names fail before any try
  reasons = []
  for impl in impls:
    try:
      impl.supports(q, k, v, cfg)
      return impl
    except NotImplementedError as e:  # the only exception that moves on to the next one
      reasons.append(f"{impl.name}: {e}")
  raise NotImplementedError("no implementation can run this call: " + "; ".join(reasons))


# -- the custom_vjp ---------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q, k, v, impl: Implementation, cfg: AttentionConfig):
  return impl.forward(q, k, v, cfg)


def _flash_fwd(q, k, v, impl, cfg):
  out, lse = impl.forward(q, k, v, cfg)
  return (out, lse), (q, k, v, out, lse)


def _flash_bwd(impl, cfg, res, cotangents):
  q, k, v, out, lse = res
  dout, dlse = cotangents
  # d lse_i / d s_ij = P_ij, so a cotangent on lse folds into delta:
  # dS = P * (dP - (rowsum(dO * O) - dlse)). Without return_residuals dlse is zero.
  return impl.backward(q, k, v, out, lse, dout, dlse, cfg)


_flash.defvjp(_flash_fwd, _flash_bwd)


def first_order_only(fn: Callable, what: str) -> Callable:
  """Wraps an array function whose kernels have no derivative of their own.

  The custom_vjp above never differentiates `forward`/`backward` for a first-order
  gradient; a second-order one (grad of grad) would, and gets a clear error instead of
  a failure deep inside the kernel lowering.
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


def attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    implementation: str | Sequence[str] | None = None,
    block_sizes: BlockSizes | None = None,
    return_residuals: bool = False,
) -> Array | tuple[Array, Array]:
  """Exact scaled dot-product attention in linear memory.

  Args:
    query: `[B, T, N, H]`.
    key: `[B, S, K, H]`, N a multiple of K (GQA/MQA when K < N).
    value: `[B, S, K, H]`.
    scale: logits scale; None means `1/sqrt(H)`.
    is_causal: query i sees keys j <= i (as `jax.nn.dot_product_attention`; the
      mask is aligned at the top-left also when T != S).
    implementation: "pallas", "xla_chunked", "xla", "hip", a sequence of these
      (the next is tried only when one raises `NotImplementedError`), or None for
      the best on the default backend (GPU: pallas; CPU: xla_chunked).
    block_sizes: tile sizes for the pallas kernels; None picks per-head_dim defaults.
    return_residuals: also return `lse` `[B, N, T]` (natural log, float32; float64
      for float64 inputs).

  Returns:
    `[B, T, N, H]` in the input dtype, or `(out, lse)`.
  """
  _check_inputs(query, key, value)
  cfg = _make_config(query, scale=scale, is_causal=is_causal, block_sizes=block_sizes)
  impl = _resolve(implementation, query, key, value, cfg)
  if impl.direct is not None:
    out, lse = impl.direct(query, key, value, cfg)
  else:
    out, lse = _flash(query, key, value, impl, cfg)
  return (out, lse) if return_residuals else out
