"""KV caches for decoding: appending new keys in place, and attention over a cache,
contiguous or paged.

Layouts (shapes as in `jflash.attention`):
  contiguous  k, v [B, S, K, H], per-row lengths [B]: row b's keys are k[b, :lengths[b]].
  paged       k_pages, v_pages [pages, page_size, K, H], block_tables [B, max_pages]
              int32, lengths [B]: key c of row b lies in page block_tables[b, c //
              page_size] at c % page_size (vLLM's PagedAttention, flash-attn's
              `flash_attn_with_kvcache(block_table=...)`).

`append` and `append_paged` write the new keys with one scatter into the cache arrays:
under `jax.jit` with the cache donated (`donate_argnums`), XLA updates the buffers in
place, so a decode step never copies the cache. Positions past the cache are dropped,
never clamped onto valid entries.

`attention` is the query side: the new queries sit after the cache (bottom-right
causal alignment, `jflash.attention(causal_alignment="bottom_right")`), so with the new
keys appended first it computes exactly the rows of full causal attention over the
concatenated sequence. The contiguous cache goes through `jflash.attention` (any
implementation, differentiable), or, for a layer of a stack of caches, through the
split-KV decode kernel's read of the stack where that kernel runs; the paged one
through the split-KV decode kernel (pallas_kernels/decode.py), forward only.

`layer` (a stack of layers' caches) is an int in [0, L), or a traced integer scalar
taken as JAX indexing takes one: negative counts from the end, and past the stack the
read is clamped (as `x[layer]` is) and `append`'s write is dropped (as
`x.at[layer].set` is).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jflash import api, sharding

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class KVCache:
  """One contiguous cache (or a stack of them, one per layer, along a leading axis):
  k, v [..., B, S, K, H] and lengths [..., B] int32, the keys held per row."""

  k: Array
  v: Array
  lengths: Array

  @classmethod
  def empty(cls, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype,
            layers: int | None = None) -> KVCache:
    lead = () if layers is None else (layers,)
    zeros = jnp.zeros((*lead, batch, max_len, kv_heads, head_dim), dtype)
    return cls(zeros, zeros, jnp.zeros((*lead, batch), jnp.int32))

  def append(self, k_new, v_new, new_lengths=None) -> KVCache:
    """`append` of one layer's new keys and values."""
    return KVCache(*append(self.k, self.v, self.lengths, k_new, v_new, new_lengths))

  def layer(self, i) -> KVCache:
    """Layer i's cache of a stack (int or traced index)."""
    return KVCache(self.k[i], self.v[i], self.lengths[i])

  def append_layer(self, i, k_new, v_new, new_lengths=None) -> KVCache:
    """The stack with layer i's new keys and values appended (`append(..., layer=i)`):
    one scatter into the stacked arrays, so a stack carried through a decode loop is
    written in place, where appending to `layer(i)` and stacking the layers again
    would copy every layer's cache at every step."""
    return KVCache(*append(self.k, self.v, self.lengths, k_new, v_new, new_lengths, layer=i))


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "lengths"], meta_fields=[])


def _new_lengths(new_lengths, B, T):
  if new_lengths is None:
    return jnp.full((B,), T, jnp.int32)
  return api.check_lengths("new_lengths", new_lengths, B, T)


def _check_pair(k, v, what):
  """K and V of one cache (`what`: "cache" or "pages") have one shape."""
  if v.shape != k.shape:
    raise ValueError(f"v_{what}.shape={tuple(v.shape)} must equal "
                     f"k_{what}.shape={tuple(k.shape)}")


def _check_new(k_new, v_new, B, K, H, where):
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.ndim != 4 or x.shape[0] != B or x.shape[2:] != (K, H):
      raise ValueError(f"{name}.shape={tuple(x.shape)} must be [B, T, K, H] = "
                       f"[{B}, T, {K}, {H}] to match the {where}")
  if k_new.shape != v_new.shape:
    raise ValueError(f"k_new.shape={tuple(k_new.shape)} and v_new.shape="
                     f"{tuple(v_new.shape)} must be equal")


def append(k_cache, v_cache, lengths, k_new, v_new, new_lengths=None, *, layer=None):
  """Writes row b's first new_lengths[b] (default T) new keys/values at positions
  lengths[b] .. of a contiguous cache; returns (k_cache, v_cache, lengths +
  new_lengths). Positions at or past S are dropped (the caller sizes the cache).
  With `layer` (module docstring), the cache is a stack of layers' caches ([L, B, S,
  K, H], lengths [L, B]) and only layer `layer`'s is written."""
  stacked = layer is not None
  if stacked:
    layer = _check_stack(k_cache, v_cache, lengths, layer)
  else:
    _check_pair(k_cache, v_cache, "cache")
  B, S, K, H = k_cache.shape[1:] if stacked else k_cache.shape
  _check_new(k_new, v_new, B, K, H, "cache")
  T = k_new.shape[1]
  if T > S:
    raise ValueError(f"{T} new keys (k_new.shape[1]) cannot fit a cache of S={S} positions")
  held = api.check_lengths("lengths", lengths[layer] if stacked else lengths, B, S)
  n = _new_lengths(new_lengths, B, T)
  t = jnp.arange(T)[None, :]
  # Padding of a ragged chunk goes out of bounds and is dropped by the scatter.
  pos = jnp.where(t < n[:, None], held[:, None] + t, S)              # [B, T]
  rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  at = (layer, rows, pos) if stacked else (rows, pos)
  k_cache = k_cache.at[at].set(k_new.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[at].set(v_new.astype(v_cache.dtype), mode="drop")
  held = jnp.minimum(held + n, S)
  return k_cache, v_cache, lengths.at[layer].set(held) if stacked else held


def append_paged(k_pages, v_pages, block_tables, lengths, k_new, v_new, new_lengths=None):
  """`append` for a paged cache: new key t of row b goes to page block_tables[b, (lengths[b]
  + t) // page_size]. Returns (k_pages, v_pages, lengths + new_lengths); positions past
  the row's table are dropped."""
  P, page_size, K, H = k_pages.shape
  _check_pair(k_pages, v_pages, "pages")
  B, max_pages = _check_table(block_tables)
  _check_new(k_new, v_new, B, K, H, "pages")
  T = k_new.shape[1]
  capacity = max_pages * page_size
  if T > capacity:
    raise ValueError(f"{T} new keys (k_new.shape[1]) cannot fit a row's "
                     f"{max_pages} pages x {page_size} = {capacity} positions")
  lengths = api.check_lengths("lengths", lengths, B, capacity)
  n = _new_lengths(new_lengths, B, T)
  pos = lengths[:, None] + jnp.arange(T)[None, :]                     # [B, T]
  live = (jnp.arange(T)[None, :] < n[:, None]) & (pos < capacity)
  page = jnp.take_along_axis(block_tables.astype(jnp.int32),
                             jnp.minimum(pos // page_size, max_pages - 1), axis=1)
  page = jnp.where(live, page, P)                                     # dropped
  off = pos % page_size
  k_pages = k_pages.at[page, off].set(k_new.astype(k_pages.dtype), mode="drop")
  v_pages = v_pages.at[page, off].set(v_new.astype(v_pages.dtype), mode="drop")
  return k_pages, v_pages, jnp.minimum(lengths + n, capacity)


def _check_table(block_tables):
  if (not hasattr(block_tables, "dtype") or not jnp.issubdtype(block_tables.dtype, jnp.integer)
      or block_tables.ndim != 2):
    raise ValueError("block_tables must be an integer [B, max_pages] array, got "
                     f"{getattr(block_tables, 'dtype', type(block_tables))} "
                     f"{tuple(getattr(block_tables, 'shape', ()))}")
  return block_tables.shape


def attention(q, k_cache, v_cache, lengths, *, layer=None, query_seq_lengths=None,
              block_tables=None, scale=None, is_causal=True, logits_soft_cap=None,
              implementation=None):
  """Attention of new queries q [B, T, N, H] over a cache holding lengths[b] keys per
  row, the queries' own keys included (append them first): query t of row b sits at
  position lengths[b] - q_len[b] + t (bottom-right alignment; q_len = query_seq_lengths,
  default T).

  Contiguous (`block_tables` None): `jflash.attention` with `implementation`. With
  `layer` (module docstring), k_cache, v_cache and lengths are a stack of
  layers' caches ([L, B, S, K, H], [L, B]: `KVCache.empty(layers=L)`) and the call
  attends over layer `layer`'s: where the resolved implementation is the split-KV
  decode kernel ("pallas_decode", first on Hopper for T <= 64) it reads the layer inside
  the stack, without copying it out; any other (a prefill's flash kernels, or "pallas"
  first on other GPUs) gets the layer as its own array, a copy. Paged: k_cache, v_cache are [pages,
  page_size, K, H] pages read through `block_tables` [B, max_pages] by the split-KV
  decode kernel (T <= 64; no gradient: its backward raises NotImplementedError).
  """
  if layer is not None:
    if block_tables is not None:
      raise NotImplementedError("a paged cache is one layer's: layer= reads a stack of "
                                "contiguous caches")
    return _layer_attention(q, k_cache, v_cache, lengths, layer,
                            query_seq_lengths=query_seq_lengths, scale=scale,
                            is_causal=is_causal, logits_soft_cap=logits_soft_cap,
                            implementation=implementation)
  if block_tables is None:
    return api.attention(q, k_cache, v_cache, scale=scale, is_causal=is_causal,
                         causal_alignment="bottom_right", query_seq_lengths=query_seq_lengths,
                         key_value_seq_lengths=lengths, logits_soft_cap=logits_soft_cap,
                         implementation=implementation)
  if implementation not in (None, "pallas_decode"):
    raise NotImplementedError(
        f"a paged cache is read by the split-KV decode kernel ('pallas_decode') only, "
        f"got implementation={implementation!r}")
  return _paged_attention(q, k_cache, v_cache, block_tables, lengths,
                          query_seq_lengths=query_seq_lengths, scale=scale, is_causal=is_causal,
                          logits_soft_cap=logits_soft_cap)


def _layer_attention(q, k_stack, v_stack, lengths, layer, *, query_seq_lengths, scale,
                     is_causal, logits_soft_cap, implementation):
  """`attention` over layer `layer` of a stack of caches (see `attention`)."""
  layer = _check_stack(k_stack, v_stack, lengths, layer)
  L = k_stack.shape[0]
  # The read of a traced layer, as `x[layer]` reads: negative from the end, clamped,
  # so the kernel's block of the whole stack is never left.
  layer = jnp.clip(jnp.where(layer < 0, layer + L, layer), 0, L - 1)
  options = dict(scale=scale, is_causal=is_causal, causal_alignment="bottom_right",
                 query_seq_lengths=query_seq_lengths, key_value_seq_lengths=lengths[layer],
                 logits_soft_cap=logits_soft_cap)
  # The layer's shapes and dtypes, for the checks (nothing is materialised).
  k_view, v_view = (jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in (k_stack, v_stack))
  cfg, masks = api.prepare(q, k_view, v_view, implementation=implementation, **options)
  impl = api.resolve_implementation(
      implementation, lambda impl: impl.supports(q, k_view, v_view, cfg, masks))
  if impl.forward_stacked is None or 0 in (*q.shape[:2], k_view.shape[1]):
    return api.attention(q, k_stack[layer], v_stack[layer], implementation=impl.name,
                         **options)
  return api.call_reverse_mode_only(_stacked, (q, k_stack, v_stack), layer, masks, impl, cfg)


def _check_stack(k_stack, v_stack, lengths, layer):
  """A stack of layers' caches, k and v [L, B, S, K, H] and lengths [L, B], and `layer`
  as an int32 scalar: an int or a concrete integer scalar in [0, L) (else ValueError),
  or a traced one, as it is (module docstring)."""
  if k_stack.ndim != 5 or tuple(lengths.shape) != k_stack.shape[:2]:
    raise ValueError(f"with layer, the cache is a stack: k_cache [L, B, S, K, H] and "
                     f"lengths [L, B], got {tuple(k_stack.shape)} and {tuple(lengths.shape)}")
  _check_pair(k_stack, v_stack, "cache")
  L = k_stack.shape[0]
  integer = (isinstance(layer, (int, np.integer)) or (
      getattr(layer, "ndim", None) == 0 and jnp.issubdtype(getattr(layer, "dtype", None),
                                                          jnp.integer)))
  if isinstance(layer, bool) or not integer:
    raise ValueError(f"layer must be an int or an integer scalar array, got {layer!r}")
  if isinstance(layer, jax.core.Tracer):
    return layer.astype(jnp.int32)
  if not 0 <= int(layer) < L:
    raise ValueError(f"layer={int(layer)} must be in [0, {L}) (the stack's layers)")
  return jnp.asarray(int(layer), jnp.int32)


# The stack read in place by the implementation's `forward_stacked`; its backward is
# the implementation's own on the layer (as jflash.attention's custom_vjp runs it), the
# gradient of the stack being zero outside that layer.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _stacked(q, k_stack, v_stack, layer, masks, impl, cfg):
  return sharding.forward_stacked(impl, q, k_stack, v_stack, layer, cfg,
                                  masks)[0]


def _stacked_fwd(q, k_stack, v_stack, layer, masks, impl, cfg):
  out, lse = sharding.forward_stacked(impl, q, k_stack, v_stack, layer, cfg,
                                      masks)
  return out, (q, k_stack, v_stack, layer, masks, out, lse)


def _stacked_bwd(impl, cfg, res, dout):
  q, k_stack, v_stack, layer, masks, out, lse = res
  dq, dk, dv = api.flash_backward(impl, q, k_stack[layer], v_stack[layer], out, lse, dout,
                                  jnp.zeros_like(lse), cfg, masks)[:3]
  # A select, not a scatter into zeros: the stack's gradient takes the sharding of the
  # layer's (batch and heads), which a scatter into a new array leaves unresolved.
  at_layer = (jnp.arange(k_stack.shape[0]) == layer).reshape(-1, 1, 1, 1, 1)
  into_stack = lambda stack, d: jnp.where(at_layer, d[None], jnp.zeros((), d.dtype)).astype(
      stack.dtype)
  return (dq, into_stack(k_stack, dk), into_stack(v_stack, dv), None,
          jax.tree_util.tree_map(lambda _: None, masks))


_stacked.defvjp(_stacked_fwd, _stacked_bwd)


def _paged_attention(q, k_pages, v_pages, block_tables, lengths, *, query_seq_lengths, scale,
                     is_causal, logits_soft_cap):
  from jflash import decode_impl
  from pallas_kernels import decode as _decode
  P, page_size, K, H = k_pages.shape
  B, max_pages = _check_table(block_tables)
  capacity = max_pages * page_size
  # The one validation of the query side: prepare checks q against a stand-in key of
  # the cache's logical shape (nothing is materialised: only shapes are read).
  k_view, v_view = (jax.ShapeDtypeStruct((B, capacity, K, H), x.dtype)
                    for x in (k_pages, v_pages))
  cfg, masks = api.prepare(q, k_view, v_view, scale=scale, is_causal=is_causal,
                           causal_alignment="bottom_right", query_seq_lengths=query_seq_lengths,
                           key_value_seq_lengths=lengths, logits_soft_cap=logits_soft_cap)
  decode_impl.supports(q, k_view, v_view, cfg, masks)
  _check_pair(k_pages, v_pages, "pages")
  if 0 in (B, q.shape[1], capacity):
    return api.nothing_to_attend(q)[0]
  info = decode_impl.row_info(masks, B, q.shape[1], capacity)

  @jax.custom_vjp
  def run(q, k_pages, v_pages):
    return _decode.decode_forward(q, k_pages, v_pages, info, scale=cfg.scale,
                                  is_causal=masks.is_causal, soft_cap=masks.soft_cap,
                                  block_tables=block_tables)[0]

  def fwd(q, k_pages, v_pages):
    return run(q, k_pages, v_pages), None

  def bwd(_, __):
    raise NotImplementedError(
        "gradients through the paged split-KV decode kernel are not implemented; "
        "differentiate a contiguous cache (block_tables=None), which runs jflash.attention")

  run.defvjp(fwd, bwd)
  return run(q, k_pages, v_pages)


def paged_view(k_pages, block_tables):
  """The contiguous [B, max_pages * page_size, K, H] cache a paged one stands for (a
  gather: for tests and references, not for the decode path)."""
  P, page_size, K, H = k_pages.shape
  B, max_pages = _check_table(block_tables)
  return k_pages[block_tables].reshape(B, max_pages * page_size, K, H)

