"""The public attention op: the one validation (`prepare`), the implementation
registry, the custom_vjp.

Shape legend (as in `jax.nn.dot_product_attention`):
  B batch, T query length, S key/value length, N query heads, K key/value heads
  (N a multiple of K: GQA/MQA), H head dim.

Every flash-type implementation ("pallas", "xla_chunked", "hip") provides
`forward(q, k, v, cfg, masks) -> (out, lse)` and
`backward(q, k, v, out, lse, dout, dlse, cfg, masks) -> (dq, dk, dv)`, with `cfg` an
`AttentionConfig` (scale, backend configs) and `masks` the `jflash.masks.Masks` record
(every mask option and mask array). They are bound here by one
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

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jflash import platforms, sharding
from jflash.config import BackendConfig
from jflash.masks import CAUSAL_ALIGNMENTS, Masks, check_key, seed_from_key
from jflash.reference import stat_dtype

Array = jax.Array

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static (hashable) options of one attention call beyond its masks, after validation:
  the logits scale and the backend configs the caller passed (`config=`)."""

  scale: float
  backend_configs: tuple[BackendConfig, ...] = ()

  def backend_config(self, config_type: type[BackendConfig]) -> BackendConfig | None:
    """The caller's config of this type, or None (the implementation's defaults)."""
    for c in self.backend_configs:
      if isinstance(c, config_type):
        return c
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way of computing attention.

  `forward(q, k, v, cfg, masks) -> (out, lse)` and
  `backward(q, k, v, out, lse, dout, dlse, cfg, masks) -> (dq, dk, dv[, dbias])` for
  flash-type implementations (bound by the shared custom_vjp); `direct(q, k, v, cfg,
  masks) -> (out, lse)` for one differentiated by plain autodiff.
  `supports(q, k, v, cfg, masks)` raises `NotImplementedError` naming what is missing
  for a given call. `cfg` is an `AttentionConfig`, `masks` a `jflash.masks.Masks`
  (always given, passed positionally); `backward` returns dbias when `masks.bias` is set.
  `config_type` is the `jflash.config` class this implementation reads from
  `cfg.backend_config(...)`, or None when it takes no config. `preferred_on` names the
  device kinds (`jflash.platforms.device_kinds`) where `implementation=None` tries it.
  `returns_lse` is False for one whose lse is not returned (or not differentiated):
  it cannot serve `return_residuals=True`. `broadcast_axes` names the axes of
  `[B, N, T, S]` along which it reads a size-one bias or mask as it is; along the
  others `jflash.attention` broadcasts (copies) it to full size first.
  `masks_padding` is True for one whose forward keeps every entry past the sequence
  lengths out of its results (NaN included), so `jflash.attention` passes it the
  inputs as they are instead of zeroing the padding first (a pass over K and V, a
  KV cache's size at every decode step); its backward gets them zeroed.
  `forward_stacked(q, k_stack, v_stack, layer, cfg, masks)`, where given, is `forward`
  over layer `layer` (int32 scalar) of a stack of KV caches [L, B, S, K, H], read in
  place (`jflash.kv_cache.attention(layer=...)`); only with `masks_padding`, since
  nothing zeroes the stack's padding first.
  """

  name: str
  forward: Callable[..., tuple[Array, Array]] | None = None
  backward: Callable[..., tuple[Array, Array, Array]] | None = None
  direct: Callable[..., tuple[Array, Array]] | None = None
  supports: Callable[..., None] = lambda q, k, v, cfg, masks: None
  config_type: type[BackendConfig] | None = None
  preferred_on: tuple[str, ...] = ()
  returns_lse: bool = True
  broadcast_axes: str = "BN"
  masks_padding: bool = False
  forward_stacked: Callable[..., tuple[Array, Array]] | None = None

  def __post_init__(self):
    if self.forward_stacked is not None and not self.masks_padding:
      raise ValueError(f"implementation {self.name!r}: forward_stacked needs masks_padding "
                       "(nothing zeroes a stack's padding before the forward reads it)")


_REGISTRY: dict[str, Callable[[], Implementation]] = {}


def register_implementation(name: str, loader: Callable[[], Implementation]):
  """Registers a lazily-built implementation (so `import jflash` loads nothing heavy)."""
  _REGISTRY[name] = loader
  get_implementation.cache_clear()   # a name registered again is built by its new loader


def unregister_implementation(name: str):
  """Removes a registered implementation; ValueError for a name not registered."""
  if name not in _REGISTRY:
    raise ValueError(f"implementation={name!r} is not registered; registered: "
                     f"{sorted(_REGISTRY)}")
  del _REGISTRY[name]
  get_implementation.cache_clear()


def available_implementations() -> tuple[str, ...]:
  return tuple(_REGISTRY)


@functools.cache
def get_implementation(name: str) -> Implementation:
  check_implementation(name)
  return _REGISTRY[name]()


def default_implementation(device=None) -> tuple[str, ...]:
  """What `implementation=None` tries on `device` (default: the default device), in
  order: every implementation preferred on one of the device's kinds, those preferred on
  a more specific kind first (Hopper before any GPU before any device), ties in
  registration order."""
  kinds = platforms.device_kinds(device)
  ranked = []
  for i, name in enumerate(_REGISTRY):
    hits = [kinds.index(k) for k in get_implementation(name).preferred_on if k in kinds]
    if hits:
      ranked.append((min(hits), i, name))
  return tuple(name for _, _, name in sorted(ranked))


# -- input checks ---------------------------------------------------------------

def _check_inputs(query, key, value):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(
          f"{name} must have rank 4 [batch, seq, heads, head_dim] (jflash.attention also "
          f"takes all three of rank 3 [seq, heads, head_dim]), got "
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
  # Empty batches and sequences are valid (jflash.attention returns empty arrays, or
  # zeros for S = 0, as jax.nn does); empty heads or head_dim are not.
  for name, n in (("head_dim", H), ("heads", N), ("key heads", K)):
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


def check_lengths(name: str, x, B: int, n: int) -> Array:
  """Sequence lengths `x` as int32 [B]: ValueError unless an integer array of shape
  (B,) whose values, where concrete, lie in [0, n]."""
  _check_int_array(name, x, (B,))
  if _is_concrete(x):
    bad = np.asarray(x)
    if bad.size and (bad.min() < 0 or bad.max() > n):
      raise ValueError(f"{name} must lie in [0, {n}], got {bad.tolist()}")
  return jnp.asarray(x, jnp.int32)


def _check_dense(name, x, B, N, T, S, kind) -> Array:
  """A bias or mask of any shape that broadcasts to [B, N, T, S] (as in jax.nn), as a
  rank-4 array [B|1, N|1, T|1, S|1]: size-one axes added in front, nothing copied."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  full = (B, N, T, S)
  if x.ndim > 4 or any(d not in (1, f) for d, f in zip(x.shape[::-1], full[::-1])):
    raise ValueError(f"{name}.shape={tuple(x.shape)} must broadcast to [B, N, T, S] = "
                     f"{list(full)} (each axis 1 or full, at most rank 4)")
  if kind == "mask" and x.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean (True = attend), got mask.dtype={x.dtype}")
  if kind == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"bias must be a float array, got bias.dtype={x.dtype}")
  return jnp.reshape(x, (1,) * (4 - x.ndim) + tuple(x.shape))


def _scale(scale, H) -> float:
  """The logits scale as a Python float: None means 1/sqrt(H); a number or a concrete
  scalar array (`jnp.float32(0.5)`) is taken by value. It is compiled into the
  kernels, so a traced scale (an argument of a jitted function) is a ValueError."""
  if scale is None:
    return 1.0 / math.sqrt(H)
  if isinstance(scale, jax.core.Tracer):
    raise ValueError(
        f"scale must be a concrete number (it is compiled into the kernels), got the "
        f"traced {scale.aval}; pass it as a Python number or a static argument")
  if hasattr(scale, "dtype") and hasattr(scale, "shape") and scale.shape == () and (
      jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
    scale = float(np.asarray(scale).astype(np.float64))
  if isinstance(scale, (bool, str)) or not isinstance(scale, (int, float, np.number)):
    raise ValueError(f"scale must be a Python number, a scalar array or None, got {scale!r}")
  scale = float(scale)
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale=}")
  return scale


INT32_MAX = 2**31 - 1


def _window(local_window_size) -> tuple[int, int] | None:
  if local_window_size is None:
    return None
  w = local_window_size
  if isinstance(w, (int, np.integer)) and not isinstance(w, bool):
    w = (int(w), int(w))
  if (not isinstance(w, (tuple, list)) or len(w) != 2 or
      not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0
              for x in w)):
    raise ValueError("local_window_size must be an int >= 0 or a (left, right) pair of "
                     f"ints >= 0, got {local_window_size!r}")
  if max(w) > INT32_MAX:  # the kernels compare positions in int32
    raise ValueError(f"local_window_size={local_window_size!r} must be <= {INT32_MAX} "
                     "(any width >= the sequence length hides nothing)")
  return int(w[0]), int(w[1])


def _soft_cap(logits_soft_cap) -> float | None:
  if logits_soft_cap is None:
    return None
  if (isinstance(logits_soft_cap, bool) or
      not isinstance(logits_soft_cap, (int, float, np.number)) or
      not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0)):
    raise ValueError(f"logits_soft_cap must be a positive finite number, got {logits_soft_cap!r}")
  return float(logits_soft_cap)


def check_implementation(implementation) -> None:
  """ValueError unless `implementation=` is None, a registered name or a non-empty
  sequence of them: what jflash.prepare, jflash.nn's modules and configs check where
  the name is given."""
  if implementation is None:
    return
  if isinstance(implementation, str):
    names = (implementation,)
  elif isinstance(implementation, Sequence) and implementation and all(
      isinstance(n, str) for n in implementation):
    names = tuple(implementation)
  else:
    raise ValueError(
        f"implementation must be None, a name or a sequence of names, got {implementation!r}")
  for name in names:
    if name not in _REGISTRY:
      raise ValueError(f"implementation={name!r} is unknown; choose one of "
                       f"{sorted(_REGISTRY)} or None")


def _names(implementation) -> tuple[str, ...]:
  """The candidate names of `implementation=` (None, a name or a sequence of names)."""
  check_implementation(implementation)
  if implementation is None:
    return default_implementation()
  return (implementation,) if isinstance(implementation, str) else tuple(implementation)


def _backend_configs(config, implementation) -> tuple[BackendConfig, ...]:
  """`config=` (None, one backend config or a sequence of them, one per backend), each
  for one of the candidate implementations."""
  if config is None:
    return ()
  configs = tuple(config) if isinstance(config, (tuple, list)) else (config,)
  # With implementation=None the candidates depend on the device, so a config for any
  # registered implementation is accepted (the same call must be valid everywhere); an
  # explicit list must name the config's implementation.
  names = available_implementations() if implementation is None else _names(implementation)
  seen = set()
  for c in configs:
    if not isinstance(c, BackendConfig):
      raise ValueError(f"config must be a jflash.config backend config (e.g. "
                       f"jflash.PallasConfig) or a sequence of them, got {c!r}")
    if c.backend in seen:
      raise ValueError(f"config: two configs for backend {c.backend!r}")
    seen.add(c.backend)
    if c.backend not in names:
      raise ValueError(
          f"config={c!r} is for implementation {c.backend!r}, which is not among the "
          f"candidate implementations {names}")
  return configs


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


def prepare(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: Array | tuple[Array, Array] | None = None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    implementation: str | Sequence[str] | None = None,
    config: BackendConfig | Sequence[BackendConfig] | None = None,
) -> tuple[AttentionConfig, Masks]:
  """Checks one attention call's inputs and options; returns `(cfg, masks)`.

  The one validation of `jflash.attention`'s arguments (same names and meanings),
  shared by `jflash.attention`, `jflash.parallel.ring_attention` and `jflash.nn`. Bad
  input raises `ValueError` naming the value. `implementation` is only checked here
  (known names, and that every `config` belongs to one of them); which implementation
  runs is decided by `supports` at the call.
  """
  _check_inputs(query, key, value)
  check_implementation(implementation)
  B, T, N, H = query.shape
  S = key.shape[1]
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
  if not isinstance(causal_alignment, str) or causal_alignment not in CAUSAL_ALIGNMENTS:
    raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got "
                     f"{causal_alignment!r}")
  if (isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float, np.number))
      or not 0.0 <= dropout_rate < 1.0):
    raise ValueError(f"dropout_rate must be a number in [0, 1), got {dropout_rate!r}")
  cfg = AttentionConfig(scale=_scale(scale, H),
                        backend_configs=_backend_configs(config, implementation))
  if bias is not None:
    bias = _check_dense("bias", bias, B, N, T, S, "bias")
  if mask is not None:
    mask = _check_dense("mask", mask, B, N, T, S, "mask")
  lengths = {name: check_lengths(name, x, B, n) for name, x, n in (
      ("query_seq_lengths", query_seq_lengths, T),
      ("key_value_seq_lengths", key_value_seq_lengths, S)) if x is not None}
  q_seg, kv_seg = segment_id_arrays(segment_ids, B, T, S)
  seed = None
  if dropout_rng is not None:
    check_key(dropout_rng)
  if dropout_rate > 0:
    if dropout_rng is None:
      raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng key")
    seed = seed_from_key(dropout_rng)
  window = _window(local_window_size)
  # Both alignments are one where nothing moves: no positional rule, or an offset of
  # S - T = 0 in every row (no lengths). Recorded as top-left, so the implementations
  # without bottom-right alignment (mosaic_gpu) run such calls.
  if (not is_causal and window is None) or (T == S and not lengths):
    causal_alignment = "top_left"
  masks = Masks(is_causal=bool(is_causal), window=window, causal_alignment=causal_alignment,
                soft_cap=_soft_cap(logits_soft_cap), dropout_rate=float(dropout_rate),
                bias=bias, mask=mask, q_lengths=lengths.get("query_seq_lengths"),
                kv_lengths=lengths.get("key_value_seq_lengths"), q_segment_ids=q_seg,
                kv_segment_ids=kv_seg, dropout_seed=seed)
  return cfg, masks


# The keyword options of `jflash.attention` (and `prepare`): what adapters such as
# jflash.nn accept and forward.
OPTIONS = frozenset({
    "bias", "mask", "scale", "is_causal", "causal_alignment", "query_seq_lengths",
    "key_value_seq_lengths", "local_window_size", "segment_ids", "logits_soft_cap",
    "dropout_rate", "dropout_rng", "implementation", "config", "return_residuals"})


def zero_padding(query, key, value, masks: Masks):
  """Zeroes rows past the sequence lengths: padding may hold anything (even NaN), and
  0 * NaN in P @ V would leak it into valid rows. One fused elementwise pass; the
  gradient of padded positions is zero, as it should be."""
  def clear(x, lengths):
    keep = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
    return jnp.where(keep[:, :, None, None], x, jnp.zeros((), x.dtype))
  if masks.q_lengths is not None:
    query = clear(query, masks.q_lengths)
  if masks.kv_lengths is not None:
    key, value = clear(key, masks.kv_lengths), clear(value, masks.kv_lengths)
  return query, key, value


def broadcast_dense(masks: Masks, axes: str, full: tuple[int, int, int, int]) -> Masks:
  """`masks` with its bias and mask broadcast to full size along the axes of
  [B, N, T, S] not in `axes` (those an implementation cannot read at size one). A
  broadcast outside the custom_vjp, so the bias gradient is summed back by autodiff."""
  def widen(x):
    if x is None:
      return None
    shape = tuple(f if name not in axes else d for name, d, f in zip("BNTS", x.shape, full))
    return x if shape == x.shape else jnp.broadcast_to(x, shape)
  return dataclasses.replace(masks, bias=widen(masks.bias), mask=widen(masks.mask))


def resolve_implementation(implementation, check: Callable[[Implementation], None],
                           what: str = "this call") -> Implementation:
  """The first of `implementation` (None, a name, or a sequence of names) for which
  `check(impl)` does not raise `NotImplementedError`; the next name is tried only on
  that error, and unknown names fail before any is tried."""
  impls = [get_implementation(n) for n in _names(implementation)]
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
def _flash(q, k, v, masks, impl: Implementation, cfg: AttentionConfig):
  return sharding.forward(impl, q, k, v, cfg, masks)


def _flash_fwd(q, k, v, masks, impl, cfg):
  out, lse = sharding.forward(impl, q, k, v, cfg, masks)
  return (out, lse), (q, k, v, masks, out, lse)


def flash_backward(impl, q, k, v, out, lse, dout, dlse, cfg, masks):
  """`impl.backward` on each device's shard (`jflash.sharding.backward`), for the saved
  (q, k, v, out, lse). For an implementation whose forward read the padding as it was
  (`masks_padding`), the backward kernels get it zeroed, and padded rows and keys get
  no gradient (as through `zero_padding`'s select)."""
  if impl.masks_padding:
    q, k, v = zero_padding(q, k, v, masks)
  grads = sharding.backward(impl, q, k, v, out, lse, dout, dlse, cfg, masks)
  if impl.masks_padding:
    grads = (*zero_padding(*grads[:3], masks), *grads[3:])
  return grads


def _flash_bwd(impl, cfg, res, cotangents):
  q, k, v, masks, out, lse = res
  dout, dlse = cotangents
  # d lse_i / d s_ij = P_ij, so a cotangent on lse folds into delta:
  # dS = P * (dP - (rowsum(dO * O) - dlse)). Without return_residuals dlse is zero.
  grads = flash_backward(impl, q, k, v, out, lse, dout, dlse, cfg, masks)
  # Only the bias has a gradient; masks, lengths, ids and the seed are not
  # differentiable (None stands for their zero cotangent).
  dmasks = dataclasses.replace(jax.tree_util.tree_map(lambda _: None, masks),
                               bias=grads[3] if masks.bias is not None else None)
  return (*grads[:3], dmasks)


_flash.defvjp(_flash_fwd, _flash_bwd)

# -- forward-mode autodiff --------------------------------------------------------------
# The custom_vjp defines reverse mode only (the recompute backward). JAX's own error for
# a jvp of a custom_vjp names neither jflash nor the way out, so every differentiable
# input first passes an identity whose tangent goes through `_no_forward_mode_p`: a
# linear primitive that transposes to the identity (reverse mode never evaluates it)
# and raises the error below when forward mode evaluates it (eagerly, or when a jitted
# jvp is compiled).

def _forward_mode_error(*_, **__):
  raise NotImplementedError(
      "jflash.attention defines reverse-mode gradients only (jax.grad, jax.vjp) for its "
      "flash implementations (every one but 'xla'); forward-mode autodiff "
      "(jax.jvp, jax.jacfwd, jax.linearize, check_grads(modes=['fwd'])) is not "
      "implemented for them: use implementation='xla', which JAX differentiates in "
      "both modes")


_no_forward_mode_p = Primitive("jflash_no_forward_mode")
_no_forward_mode_p.def_impl(_forward_mode_error)
_no_forward_mode_p.def_abstract_eval(lambda t: t)
ad.deflinear2(_no_forward_mode_p, lambda ct, t: [ct])
batching.primitive_batchers[_no_forward_mode_p] = (
    lambda args, dims: (_no_forward_mode_p.bind(*args), dims[0]))
mlir.register_lowering(_no_forward_mode_p, _forward_mode_error)


@jax.custom_jvp
def _no_forward_mode(x):
  return x


@_no_forward_mode.defjvp
def _no_forward_mode_jvp(primals, tangents):
  return primals[0], _no_forward_mode_p.bind(tangents[0])


# What JAX raises when a batched forward-mode tangent (jax.jacfwd under jit) reaches the
# custom_vjp before the primitive above is evaluated (jax/_src/interpreters/ad.py).
_JAX_FORWARD_MODE_ERROR = "can't apply forward-mode autodiff (jvp) to a custom_vjp"


def call_reverse_mode_only(call: Callable, arrays: tuple, *rest):
  """`call(*arrays, *rest)`, a custom_vjp of differentiable `arrays`, with forward-mode
  autodiff turned into jflash's NotImplementedError."""
  try:
    return call(*(_no_forward_mode(x) for x in arrays), *rest)
  except TypeError as e:
    if _JAX_FORWARD_MODE_ERROR not in str(e):
      raise
    _forward_mode_error()


def nothing_to_attend(query):
  """(out, lse) of a call with an empty batch, query or key axis: empty arrays, or for S
  = 0 rows that see no key (zeros, lse -inf), as jax.nn returns; no implementation
  runs. The output does not depend on the inputs, so their gradients are zeros."""
  B, T, N, _ = query.shape
  return (jnp.zeros(query.shape, query.dtype),
          jnp.full((B, N, T), -jnp.inf, stat_dtype(query.dtype)))


def _flash_call(q, k, v, masks, impl, cfg):
  if masks.bias is not None:
    masks = dataclasses.replace(masks, bias=_no_forward_mode(masks.bias))
  return call_reverse_mode_only(_flash, (q, k, v), masks, impl, cfg)


def attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: Array | tuple[Array, Array] | None = None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    implementation: str | Sequence[str] | None = None,
    config: BackendConfig | Sequence[BackendConfig] | None = None,
    return_residuals: bool = False,
) -> Array | tuple[Array, Array]:
  """Exact scaled dot-product attention in linear memory.

  Shapes: B batch, T query length, S key/value length, N query heads, K key/value
  heads (N a multiple of K: GQA/MQA when K < N), H head dim.

  Args:
    query: `[B, T, N, H]`, or `[T, N, H]` with key and value unbatched too (then the
      output is `[T, N, H]`, lse `[N, T]`, and lengths and segment ids are given
      without their batch axis, or with a batch of one). B, T or S may be 0.
    key: `[B, S, K, H]`.
    value: `[B, S, K, H]`.
    bias: optional float of any shape that broadcasts to `[B, N, T, S]` (`[T, S]`,
      `[N, T, S]`, `[B, 1, 1, S]`, ...), added to the scaled logits (after the soft
      cap), differentiable. "xla" and "xla_chunked" read size-one axes as they are;
      for the kernels, size-one T and S axes are broadcast (copied) to full size first.
    mask: optional bool of any shape that broadcasts to `[B, N, T, S]`, True = attend
      (as Flax and jax.nn pass it); broadcast like the bias.
    scale: logits scale; None means `1/sqrt(H)`. A number or a concrete scalar array;
      it is compiled into the kernels, so a traced scale is a ValueError.
    is_causal: query i sees keys j <= i (as `jax.nn.dot_product_attention`; the
      mask is aligned at the top-left also when T != S, unless `causal_alignment`
      says otherwise).
    causal_alignment: where query i sits for `is_causal` and `local_window_size`:
      "top_left" (the default, jax.nn) at position i; "bottom_right" at
      i + kv_len_b - q_len_b, the query rows being the last q_len_b of the kv_len_b
      positions of batch row b (`key_value_seq_lengths`, default S;
      `query_seq_lengths`, default T), as flash-attn aligns them. That is a KV
      cache: with a cache of L_b keys and the q_len_b new tokens appended after it
      (kv_len_b = L_b + q_len_b), causal query i sees keys j <= L_b + i, which is full
      causal attention's row L_b + i, for decoding (T = 1) and chunked prefill alike.
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
    dropout_rng: one PRNG key (`jax.random.key(seed)`, or the uint32[2] of
      `jax.random.PRNGKey(seed)`).
    implementation: "mosaic_gpu", "pallas", "pallas_decode" (the split-KV decode
      kernel: T <= 64, forward; "pallas" runs it too for such calls), "xla_chunked",
      "xla", "hip", "cudnn" (`jax.nn.dot_product_attention(implementation="cudnn")`,
      CUDA GPUs), a sequence of these (the next is tried only when one raises
      `NotImplementedError`), or None for what `jflash.default_implementation()` lists
      for the default device (Hopper: pallas_decode, mosaic_gpu, pallas, xla_chunked;
      other GPUs: pallas, xla_chunked; else xla_chunked). An unknown name is a
      ValueError.
    config: a backend config (`jflash.PallasConfig`, `jflash.MosaicGPUConfig`,
      `jflash.ChunkedConfig`, `jflash.HipConfig`) or a sequence of them, one per
      backend; each tunes only its own implementation ("mosaic_gpu" runs the Pallas
      backward, which a PallasConfig tunes). With an explicit `implementation=`, a
      config for none of its candidates is a ValueError. None: the defaults.
    return_residuals: also return `lse` `[B, N, T]` (natural log, float32; float64
      for float64 inputs; -inf for a row that sees no key).

  Returns:
    `[B, T, N, H]` in the input dtype, or `(out, lse)`. A query row that the masks
    leave without a visible key returns zeros (and finite gradients), never NaN, with
    or without a bias; `jax.nn.dot_product_attention` returns the mean of the values
    for such a row (it masks with a large finite negative logit, so the row's softmax
    is uniform). A NaN or inf in a visible logit reaches the output and the gradients.

  Forward-mode autodiff (`jax.jvp`, `jax.jacfwd`) is implemented only by "xla"; the
  others define reverse mode (`jax.grad`) and raise `NotImplementedError`.

  Differences from `jax.nn.dot_product_attention` (docs/jax_nn.md):
  - a query row that the masks leave without a key returns zeros (jax.nn: the mean
    of the values), and its lse is -inf, which `jax.debug_infs` reports (query rows
    past `query_seq_lengths` are such rows);
  - `return_residuals=True` (jax.nn: `return_residual`) returns lse as `[B, N, T]`
    float32 (jax.nn: `[B, T, N]` in the input dtype), and it is differentiated (jax.nn
    stops its gradient);
  - `scale` must be concrete (jax.nn also takes a traced one);
  - `implementation=None` picks the device's best (jax.nn: "xla"), and a sequence of
    names falls back on `NotImplementedError`; "cudnn" is jax.nn's own kernel;
  - lengths take any integer dtype (jax.nn: int32); more options (segment ids, soft
    cap, dropout, backend configs).
  """
  if all(getattr(x, "ndim", None) == 3 for x in (query, key, value)):
    # Unbatched [T, N, H] (as jax.nn takes it, and what jax.vmap over the batch
    # passes): one batch of one, with the per-batch options given without their batch
    # axis ([] lengths, [T] segment ids) or with it ([1], [1, T]).
    one = lambda x: x if x is None or getattr(x, "ndim", None) != 0 else jnp.reshape(x, (1,))
    ids = segment_ids
    if ids is not None:
      ids = tuple(x[None] if getattr(x, "ndim", None) == 1 else x for x in (
          ids if isinstance(ids, (tuple, list)) else (ids,)))
      ids = ids if isinstance(segment_ids, (tuple, list)) else ids[0]
    result = attention(
        query[None], key[None], value[None], bias, mask, scale=scale, is_causal=is_causal,
        causal_alignment=causal_alignment, query_seq_lengths=one(query_seq_lengths),
        key_value_seq_lengths=one(key_value_seq_lengths),
        local_window_size=local_window_size, segment_ids=ids,
        logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, implementation=implementation, config=config,
        return_residuals=return_residuals)
    return (result[0][0], result[1][0]) if return_residuals else result[0]
  cfg, masks = prepare(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      causal_alignment=causal_alignment, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, segment_ids=segment_ids,
      logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      implementation=implementation, config=config)
  B, T, N, _ = query.shape
  S = key.shape[1]
  if B == 0 or T == 0 or S == 0:
    out, lse = nothing_to_attend(query)
    return (out, lse) if return_residuals else out

  def check(impl):
    if return_residuals and not impl.returns_lse:
      raise NotImplementedError("it returns no differentiable lse (return_residuals=True)")
    impl.supports(query, key, value, cfg, masks)
  impl = resolve_implementation(implementation, check)
  masks = broadcast_dense(masks, impl.broadcast_axes, (B, N, T, S))
  if not impl.masks_padding:
    query, key, value = zero_padding(query, key, value, masks)
  if impl.direct is not None:
    out, lse = impl.direct(query, key, value, cfg, masks)
  else:
    out, lse = _flash_call(query, key, value, masks, impl, cfg)
  return (out, lse) if return_residuals else out
