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

from jflash.masks import MaskArrays, seed_from_key
from pallas_kernels.masking import MaskOptions
from pallas_kernels.tuning import BlockSizes

Array = jax.Array

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static (hashable) options of one attention call, after validation."""

  scale: float
  is_causal: bool
  block_sizes: BlockSizes | None = None
  window: tuple[int, int] | None = None      # (left, right), jax.nn semantics
  soft_cap: float | None = None
  dropout_rate: float = 0.0

  @property
  def mask_options(self) -> MaskOptions:
    return MaskOptions(is_causal=self.is_causal, window=self.window,
                       soft_cap=self.soft_cap, dropout_rate=self.dropout_rate)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way of computing attention.

  `forward`/`backward` for flash-type implementations (bound by the shared
  custom_vjp); `direct` for one differentiated by plain autodiff. `supports`
  raises `NotImplementedError` naming what is missing for a given call.

  Masked calls pass `extras=MaskArrays(...)` as a keyword to all three; `backward`
  then returns `(dq, dk, dv, dbias)` when `extras.bias` is set, else `(dq, dk, dv)`.
  """

  name: str
  forward: Callable[..., tuple[Array, Array]] | None = None
  backward: Callable[..., tuple[Array, Array, Array]] | None = None
  direct: Callable[..., tuple[Array, Array]] | None = None
  supports: Callable[..., None] = lambda q, k, v, cfg, extras=None: None


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
    from jflash.mosaic_impl import device_capability, is_hopper
    if is_hopper(device_capability()[1]):
      return ("mosaic_gpu", "pallas", "xla_chunked")   # Hopper: wgmma + TMA kernels
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


def _is_concrete(x):
  return not isinstance(x, jax.core.Tracer)


def _check_int_array(name, x, shape):
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got {getattr(x, 'dtype', type(x))}")
  if tuple(x.shape) != shape:
    raise ValueError(f"{name} must have shape {shape}, got {name}.shape={tuple(x.shape)}")


def _check_dense(name, x, B, N, T, S, kind):
  if not hasattr(x, "shape") or x.ndim != 4:
    raise ValueError(f"{name} must be a rank-4 [B|1, N|1, T, S] array, got "
                     f"{getattr(x, 'shape', type(x))}")
  b, n, t, s = x.shape
  if b not in (1, B) or n not in (1, N) or (t, s) != (T, S):
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be [B|1, N|1, T, S] = "
                     f"[{B}|1, {N}|1, {T}, {S}]")
  if kind == "mask" and x.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean (True = attend), got mask.dtype={x.dtype}")
  if kind == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"bias must be a float array, got bias.dtype={x.dtype}")


def _make_config(query, key, *, scale, is_causal, block_sizes, local_window_size=None,
                 logits_soft_cap=None, dropout_rate=0.0) -> AttentionConfig:
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
  window = None
  if local_window_size is not None:
    w = local_window_size
    if isinstance(w, (int, np.integer)) and not isinstance(w, bool):
      w = (int(w), int(w))
    if (not isinstance(w, (tuple, list)) or len(w) != 2 or
        not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0
                for x in w)):
      raise ValueError("local_window_size must be an int >= 0 or a (left, right) pair of "
                       f"ints >= 0, got {local_window_size!r}")
    window = (int(w[0]), int(w[1]))
  soft_cap = None
  if logits_soft_cap is not None:
    if (isinstance(logits_soft_cap, bool) or
        not isinstance(logits_soft_cap, (int, float, np.number)) or
        not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0)):
      raise ValueError(f"logits_soft_cap must be a positive finite number, got {logits_soft_cap!r}")
    soft_cap = float(logits_soft_cap)
  if (isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float, np.number))
      or not 0.0 <= dropout_rate < 1.0):
    raise ValueError(f"dropout_rate must be a number in [0, 1), got {dropout_rate!r}")
  return AttentionConfig(scale=scale, is_causal=bool(is_causal), block_sizes=block_sizes,
                         window=window, soft_cap=soft_cap, dropout_rate=float(dropout_rate))


def segment_id_arrays(segment_ids, B, T, S):
  """(q_ids [B, T], kv_ids [B, S]) int32 from an array (when T == S) or a pair; or
  (None, None). ValueError names what is wrong."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be an array [B, T] (when T == S) or a pair "
                       f"(q_ids [B, T], kv_ids [B, S]), got a sequence of {len(segment_ids)}")
    q_seg, kv_seg = segment_ids
  else:
    if T != S:
      raise ValueError(f"a single segment_ids array needs T == S (got T={T}, S={S}); "
                       "pass (q_segment_ids, kv_segment_ids)")
    q_seg = kv_seg = segment_ids
  _check_int_array("q segment_ids", q_seg, (B, T))
  _check_int_array("kv segment_ids", kv_seg, (B, S))
  return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


def _make_extras(query, key, *, bias, mask, query_seq_lengths, key_value_seq_lengths,
                 segment_ids, dropout_rate, dropout_rng) -> MaskArrays | None:
  B, T, N, _ = query.shape
  S = key.shape[1]
  if bias is not None:
    _check_dense("bias", bias, B, N, T, S, "bias")
  if mask is not None:
    _check_dense("mask", mask, B, N, T, S, "mask")
    mask = jnp.asarray(mask)
  q_lens = kv_lens = None
  for name, x, n in (("query_seq_lengths", query_seq_lengths, T),
                     ("key_value_seq_lengths", key_value_seq_lengths, S)):
    if x is None:
      continue
    _check_int_array(name, x, (B,))
    if _is_concrete(x):
      bad = np.asarray(x)
      if bad.min() < 0 or bad.max() > n:
        raise ValueError(f"{name} must lie in [0, {n}], got {bad.tolist()}")
    if name.startswith("query"):
      q_lens = jnp.asarray(x, jnp.int32)
    else:
      kv_lens = jnp.asarray(x, jnp.int32)
  q_seg, kv_seg = segment_id_arrays(segment_ids, B, T, S)
  seed = None
  if dropout_rate > 0:
    if dropout_rng is None:
      raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng key")
    seed = seed_from_key(dropout_rng)
  extras = MaskArrays(bias=bias, mask=mask, q_lengths=q_lens, kv_lengths=kv_lens,
                      q_segment_ids=q_seg, kv_segment_ids=kv_seg, dropout_seed=seed)
  return None if all(x is None for x in jax.tree_util.tree_leaves(
      extras, is_leaf=lambda x: x is None)) else extras


def _zero_padding(query, key, value, extras: MaskArrays):
  """Zeroes rows past the sequence lengths: padding may hold anything (even NaN), and
  0 * NaN in P @ V would leak it into valid rows. One fused elementwise pass; the
  gradient of padded positions is zero, as it should be."""
  def clear(x, lengths):
    keep = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
    return jnp.where(keep[:, :, None, None], x, jnp.zeros((), x.dtype))
  if extras.q_lengths is not None:
    query = clear(query, extras.q_lengths)
  if extras.kv_lengths is not None:
    key, value = clear(key, extras.kv_lengths), clear(value, extras.kv_lengths)
  return query, key, value


def resolve_implementation(implementation, check: Callable[[Implementation], None],
                           what: str = "this call") -> Implementation:
  """The first of `implementation` (None, a name, or a sequence of names) for which
  `check(impl)` does not raise `NotImplementedError`; the next name is tried only on
  that error, and unknown names fail before any is tried."""
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
  impls = [get_implementation(n) for n in names]
  reasons = []
  for impl in impls:
    try:
      check(impl)
      return impl
    except NotImplementedError as e:  # the only exception that moves on to the next one
      reasons.append(f"{impl.name}: {e}")
  raise NotImplementedError(f"no implementation can run {what}: " + "; ".join(reasons))


# -- the custom_vjp ---------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, extras, impl: Implementation, cfg: AttentionConfig):
  return impl.forward(q, k, v, cfg, extras=extras)


def _flash_fwd(q, k, v, extras, impl, cfg):
  out, lse = impl.forward(q, k, v, cfg, extras=extras)
  return (out, lse), (q, k, v, extras, out, lse)


def _flash_bwd(impl, cfg, res, cotangents):
  q, k, v, extras, out, lse = res
  dout, dlse = cotangents
  # d lse_i / d s_ij = P_ij, so a cotangent on lse folds into delta:
  # dS = P * (dP - (rowsum(dO * O) - dlse)). Without return_residuals dlse is zero.
  grads = impl.backward(q, k, v, out, lse, dout, dlse, cfg, extras=extras)
  dextras = None
  if extras is not None:
    # Only the bias has a gradient; masks, lengths, ids and the seed are not
    # differentiable (None stands for their zero cotangent).
    dextras = dataclasses.replace(
        jax.tree_util.tree_map(lambda _: None, extras),
        bias=grads[3] if extras.bias is not None else None)
  return (*grads[:3], dextras)


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
    bias: Array | None = None,
    mask: Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: Array | tuple[Array, Array] | None = None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    implementation: str | Sequence[str] | None = None,
    block_sizes: BlockSizes | None = None,
    return_residuals: bool = False,
) -> Array | tuple[Array, Array]:
  """Exact scaled dot-product attention in linear memory.

  Shapes: B batch, T query length, S key/value length, N query heads, K key/value
  heads (N a multiple of K: GQA/MQA when K < N), H head dim.

  Args:
    query: `[B, T, N, H]`.
    key: `[B, S, K, H]`.
    value: `[B, S, K, H]`.
    bias: optional `[B|1, N|1, T, S]` float added to the scaled logits (after the
      soft cap), differentiable.
    mask: optional `[B|1, N|1, T, S]` bool, True = attend (as Flax and jax.nn pass it).
    scale: logits scale; None means `1/sqrt(H)`.
    is_causal: query i sees keys j <= i (as `jax.nn.dot_product_attention`; the
      mask is aligned at the top-left also when T != S).
    query_seq_lengths, key_value_seq_lengths: `[B]` int, right padding: rows
      i >= length return zeros, keys j >= length are hidden (jax.nn semantics).
      Checked against [0, T] / [0, S] when not traced.
    local_window_size: int w (means (w, w)) or (left, right): query i sees keys
      i - left <= j <= i + right (jax.nn semantics).
    segment_ids: `[B, T]` int (when T == S) or a pair (`[B, T]`, `[B, S]`): packed
      documents, a query sees only keys with the same id.
    logits_soft_cap: cap c: logits -> c * tanh(logits / c) before the bias and the softmax.
    dropout_rate: attention dropout probability in [0, 1); needs `dropout_rng`. The
      keep mask is a counter-based hash of (seed, batch, head, row, col), regenerated
      in the backward pass, never stored.
    dropout_rng: a PRNG key.
    implementation: "pallas", "xla_chunked", "xla", "hip", a sequence of these
      (the next is tried only when one raises `NotImplementedError`), or None for
      the best on the default backend (GPU: pallas; CPU: xla_chunked).
    block_sizes: tile sizes for the pallas kernels; None picks per-head_dim defaults.
    return_residuals: also return `lse` `[B, N, T]` (natural log, float32; float64
      for float64 inputs; -inf for a row that sees no key).

  Returns:
    `[B, T, N, H]` in the input dtype, or `(out, lse)`. A query row that sees no key
    returns zeros (and finite gradients), never NaN.
  """
  _check_inputs(query, key, value)
  cfg = _make_config(query, key, scale=scale, is_causal=is_causal, block_sizes=block_sizes,
                     local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                     dropout_rate=dropout_rate)
  extras = _make_extras(query, key, bias=bias, mask=mask,
                        query_seq_lengths=query_seq_lengths,
                        key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
                        dropout_rate=cfg.dropout_rate, dropout_rng=dropout_rng)
  impl = resolve_implementation(
      implementation, lambda impl: impl.supports(query, key, value, cfg, extras=extras))
  if extras is not None:
    query, key, value = _zero_padding(query, key, value, extras)
  if impl.direct is not None:
    out, lse = impl.direct(query, key, value, cfg, extras=extras)
  else:
    out, lse = _flash(query, key, value, extras, impl, cfg)
  return (out, lse) if return_residuals else out
