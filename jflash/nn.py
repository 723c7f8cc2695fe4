"""Flax integration: an `attention_fn` adapter for Flax's own attention modules, and
NNX modules of our own (GQA attention with rotary embeddings, a pre-norm Transformer
block, a decoder-only language model).

Two ways in:
  * `make_attention_fn(**options)` plugs `jflash.attention` into
    `flax.nnx.MultiHeadAttention(attention_fn=...)` or
    `flax.linen.MultiHeadDotProductAttention(attention_fn=...)`.
  * `DecoderLM(LMConfig(...), rngs=...)` is a small GPT-style model whose attention
    implementation is a config field, so one model runs on standard and flash attention.

Nothing jflash cannot honour is dropped quietly. Flax's dense `mask`/`bias` and
dropout are forwarded to `jflash.attention`, which validates them (`jflash.prepare`);
sown attention weights and Flax's batch-broadcast dropout raise `NotImplementedError`
(flash attention never forms the weights; jflash draws one dropout mask per batch and
head).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jflash import api, kv_cache
from jflash.kv_cache import KVCache

Array = jax.Array

def _check_option_names(names, what: str = "jflash.attention"):
  unknown = sorted(set(names) - api.OPTIONS)
  if unknown:
    raise NotImplementedError(
        f"{what} has no option {', '.join(map(repr, unknown))} (it accepts "
        f"{sorted(api.OPTIONS)}), so it cannot be honoured (it is not ignored)")


def _flatten_batch(x, nb):
  """[batch..., T, N, H] -> [prod(batch), T, N, H] (adds a batch axis when there is none)."""
  return x.reshape((math.prod(x.shape[:nb]),) + x.shape[nb:])


def _flatten_mask_batch(m, batch_shape, T, S):
  """A mask/bias broadcastable to [batch..., N, T, S] -> [B|1, N|1, T, S], batch merged.

  jflash reads dense masks as [B|1, N|1, T, S]: size-one batch and head axes stay size
  one (no copy); the T and S axes are broadcast to full size (Flax allows [.., 1, S]
  padding masks); batch axes that are not all one are broadcast and merged like the
  query's.
  """
  nb = len(batch_shape)
  m = jnp.asarray(m)
  m = m.reshape((1,) * (nb + 3 - m.ndim) + m.shape)
  m = jnp.broadcast_to(m, m.shape[:-2] + (T, S))
  if all(d == 1 for d in m.shape[:nb]):
    return m.reshape((1,) + m.shape[nb:])
  m = jnp.broadcast_to(m, tuple(batch_shape) + m.shape[nb:])
  return m.reshape((math.prod(batch_shape),) + m.shape[nb:])


# Extra keywords some Flax versions pass to attention_fn. Each is honoured when its value
# is the neutral one; anything else raises. `force_fp32_for_softmax` is always honoured:
# jflash keeps softmax statistics in float32 whatever the input dtype.
_NEUTRAL_EXTRAS = {
    "force_fp32_for_softmax": (True, False),
    "qk_attn_weights_einsum": (None,),
    "attn_weights_value_einsum": (None,),
    "einsum_dot_general": (None,),
}


def make_attention_fn(**attention_options) -> Callable[..., Array]:
  """Returns a Flax-compatible `attention_fn` computing with `jflash.attention`.

  Args:
    **attention_options: keywords for `jflash.attention` applied to every call
      (`implementation=`, `is_causal=`, `config=`, `scale=`, and the masking options).
      A name it does not accept raises `NotImplementedError` here, not at the first
      call, and so does an unknown `implementation=` (ValueError); other values are
      checked by `jflash.attention` at the call.

  Returns:
    `attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
    dropout_rng=None, dropout_rate=0., deterministic=False, dtype=None,
    precision=None, module=None, is_causal=False, **extras)` with Flax's layout
    `[batch..., length, heads, head_dim]`; GQA when key/value have fewer heads.

  Causal self-attention: pass `is_causal=True` (here or to
  `nnx.MultiHeadAttention.__call__`) rather than `mask=nnx.make_causal_mask(...)`.
  The causal mask is aligned bottom-right here (`causal_alignment="bottom_right"`
  unless given: the last query sits at the last key), which is jax.nn's top-left one
  when T == S and what Flax's `decode=True` needs: there one new query meets the whole
  cache, whose unwritten tail Flax's own mask hides.
  A dense mask's contents are unknown at trace time, so it cannot be recognised as
  causal: it is read as data ([T, S] per batch/head, the memory Flax already spent),
  and no causal tile skipping happens.

  One difference from Flax remains by design: a query row whose mask hides every key
  returns zeros here (jflash's rule), where Flax's default returns the mean of the
  values (a softmax over equal -big logits).
  """
  for name in attention_options:
    if name in ("query", "key", "value"):
      raise ValueError(f"{name} is the adapter's positional input, not an option")
    if name == "return_residuals":
      raise ValueError("return_residuals: Flax expects the attention output alone")
  _check_option_names(attention_options)
  api.check_implementation(attention_options.get("implementation"))
  static = dict(attention_options)
  static.setdefault("causal_alignment", "bottom_right")
  base_causal = bool(static.pop("is_causal", False))

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, is_causal=False, promote_dtype=None,
                   **extras):
    for name, val in extras.items():
      # A future Flax keyword left at None means "not used"; anything else we do not
      # know how to honour.
      if name in _NEUTRAL_EXTRAS and any(val is n for n in _NEUTRAL_EXTRAS[name]):
        continue
      if val is None:
        continue
      raise NotImplementedError(f"attention_fn got {name}={val!r}, which jflash cannot honour")
    if module is not None:
      raise NotImplementedError(
          "sow_weights: flash attention never forms the attention weights, so there "
          "are none to sow")
    if precision is not None and precision not in (jax.lax.Precision.DEFAULT, "default"):
      raise NotImplementedError(
          f"precision={precision!r}: jflash picks its own matmul precision (inputs in "
          "their dtype, float32 accumulation)")

    # Flax promotes q, k, v to one dtype (`dtype` if given) before attending.
    if promote_dtype is not None:
      query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
      dt = dtype if dtype is not None else jnp.result_type(query, key, value)
      query, key, value = (x.astype(dt) for x in (query, key, value))

    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
      raise ValueError(
          "query, key, value must be [batch..., length, heads, head_dim] of one rank, got "
          f"{query.shape=}, {key.shape=}, {value.shape=}")
    batch_shape = query.shape[:-3]
    nb = len(batch_shape)
    q, k, v = (_flatten_batch(x, nb) for x in (query, key, value))

    kwargs = dict(static)
    kwargs["is_causal"] = base_causal or bool(is_causal)
    for name, arr in (("mask", mask), ("bias", bias)):
      if arr is None:
        continue
      if name in kwargs:
        raise ValueError(f"{name} given both to make_attention_fn and at call time")
      arr = _flatten_mask_batch(arr, batch_shape, q.shape[1], k.shape[1])
      kwargs[name] = arr.astype(jnp.bool_) if name == "mask" else arr
    if not deterministic and dropout_rate > 0.0:
      if broadcast_dropout:
        # Flax's default draws one mask shared across batch and heads; jflash's keep
        # mask hashes (batch, head, row, col), a different distribution.
        raise NotImplementedError(
            "broadcast_dropout=True: jflash draws one dropout mask per batch and head; "
            "set broadcast_dropout=False for that (it is not ignored)")
      if dropout_rng is None:
        raise ValueError("dropout_rate > 0 and not deterministic needs a dropout_rng")
      kwargs["dropout_rate"] = float(dropout_rate)
      kwargs["dropout_rng"] = dropout_rng

    out = api.attention(q, k, v, **kwargs)
    return out.reshape(batch_shape + out.shape[1:])

  return attention_fn


# -- our own modules ------------------------------------------------------------------

def apply_rope(x: Array, positions: Array, base: float = 10000.0) -> Array:
  """Rotary position embedding (RoFormer, Su et al. 2021), half-split layout.

  x: [B, T, N, H] with H even; positions: [B, T] or [T] integer positions. Angles are
  computed in float32: in bfloat16, positions past 256 would collide.
  """
  H = x.shape[-1]
  if H % 2:
    raise ValueError(f"rotary embeddings need an even head_dim, got {H}")
  half = H // 2
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  positions = jnp.asarray(positions)
  if positions.ndim == 1:
    positions = positions[None]
  ang = positions[..., None].astype(jnp.float32) * inv_freq   # [B, T, H/2]
  sin, cos = jnp.sin(ang)[:, :, None], jnp.cos(ang)[:, :, None]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def core_attention(q, k, v, *, implementation=None, is_causal=False, scale=None,
                   segment_ids=None, context_parallel_axis=None, **options):
  """[B, T, N, H] attention through jflash ("cudnn" is jax.nn's cuDNN kernel there).

  Options other than is_causal/scale/implementation (e.g. `local_window_size`,
  `config`) and `segment_ids` are forwarded to `jflash.attention`; a name it does not
  accept raises `NotImplementedError`.

  With `context_parallel_axis`, q/k/v are local shards of a sequence sharded over that
  mesh axis in zigzag order (inside `shard_map`) and attention is
  `jflash.parallel.ring_attention`.
  """
  if context_parallel_axis is not None:
    from jflash import parallel
    unsupported = sorted(set(options) - set(parallel.RING_OPTIONS))
    if unsupported:
      raise NotImplementedError(
          f"context_parallel_axis: ring attention runs jflash implementations with "
          f"the options {sorted(parallel.RING_OPTIONS)} only, got {implementation=} "
          f"and options {unsupported}")
    return parallel.ring_attention(q, k, v, axis_name=context_parallel_axis,
                                   layout="zigzag", is_causal=is_causal, scale=scale,
                                   implementation=implementation,
                                   segment_ids=segment_ids, **options)
  _check_option_names(options)
  if segment_ids is not None:
    options = dict(options, segment_ids=segment_ids)
  return api.attention(q, k, v, scale=scale, is_causal=is_causal,
                       implementation=implementation, **options)


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """Size and options of `DecoderLM`. Plain values only, so it serialises to JSON.

  Attributes:
    vocab_size: tokens (256 for bytes).
    num_layers, hidden: depth and model width.
    num_heads, num_kv_heads: query heads and key/value heads (GQA when fewer; None
      means num_heads).
    head_dim: per-head width; None means hidden // num_heads.
    seq_len: the training context (data and benchmarks use it; RoPE needs no maximum).
    mlp_hidden: width of the MLP; None means 4 * hidden.
    attention_implementation: passed to `jflash.attention` ("xla" is standard
      attention, "xla_chunked"/"pallas"/"mosaic_gpu" flash, "cudnn" jax.nn's cuDNN
      kernel, a sequence of these, or None for the platform default); an unknown name
      is a ValueError here.
    local_window_size: sliding-window attention, forwarded to jflash when supported.
    remat: recompute each block in the backward pass (jax.checkpoint via nnx.remat).
    scan_layers: run the blocks as one `nnx.scan` over stacked weights: one block is
      compiled instead of num_layers, which keeps 12+-layer compiles short.
    dtype: compute dtype of activations; parameters stay in `param_dtype`.
    rope_base: rotary base frequency.
    context_parallel_axis: a mesh axis the sequence is sharded over (zigzag order,
      `jflash.parallel.zigzag_permute`); the model then runs inside `shard_map` and
      attention is ring attention over that axis. None: no sequence sharding.
  """

  vocab_size: int = 256
  num_layers: int = 2
  hidden: int = 128
  num_heads: int = 4
  num_kv_heads: int | None = None
  head_dim: int | None = None
  seq_len: int = 256
  mlp_hidden: int | None = None
  attention_implementation: str | None = None
  local_window_size: tuple[int, int] | None = None
  remat: bool = False
  scan_layers: bool = True
  dtype: str = "float32"
  param_dtype: str = "float32"
  rope_base: float = 10000.0
  context_parallel_axis: str | None = None

  def __post_init__(self):
    api.check_implementation(self.attention_implementation)
    kv = self.kv_heads
    if self.num_heads % kv:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={kv}")
    if self.head_dim is None and self.hidden % self.num_heads:
      raise ValueError(
          f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
          "set head_dim explicitly")
    for name in ("vocab_size", "num_layers", "hidden", "num_heads", "seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.hidden // self.num_heads

  @property
  def mlp_width(self) -> int:
    return self.mlp_hidden or 4 * self.hidden


class Attention(nnx.Module):
  """Multi-head self-attention with GQA and rotary embeddings on jflash.

  `is_causal`, `local_window_size`, `config` and `segment_ids` are forwarded to
  `jflash.attention`. The options are validated at construction (`jflash.prepare` on
  the head shapes: a bad window or a config for another implementation is a
  ValueError there), segment ids at the call.
  """

  def __init__(self, hidden: int, num_heads: int, num_kv_heads: int | None = None,
               head_dim: int | None = None, *, is_causal: bool = True,
               local_window_size: tuple[int, int] | None = None, use_rope: bool = True,
               rope_base: float = 10000.0, implementation: str | None = None,
               config=None, dtype=None, param_dtype=jnp.float32,
               context_parallel_axis: str | None = None, rngs: nnx.Rngs):
    num_kv_heads = num_kv_heads or num_heads
    if num_heads % num_kv_heads:
      raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    head_dim = head_dim or hidden // num_heads
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.is_causal, self.use_rope, self.rope_base = is_causal, use_rope, rope_base
    self.implementation = implementation
    self.context_parallel_axis = context_parallel_axis
    options = {}
    if local_window_size is not None:
      options["local_window_size"] = tuple(local_window_size)
    if config is not None:
      options["config"] = config
    head = lambda n: jax.ShapeDtypeStruct((1, 1, n, head_dim), jnp.float32)
    api.prepare(head(num_heads), head(num_kv_heads), head(num_kv_heads),
                is_causal=is_causal, implementation=implementation, **options)
    self.options = tuple(sorted(options.items()))  # hashable: part of the graphdef
    lin = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.query = nnx.LinearGeneral(hidden, (num_heads, head_dim), **lin)
    self.key = nnx.LinearGeneral(hidden, (num_kv_heads, head_dim), **lin)
    self.value = nnx.LinearGeneral(hidden, (num_kv_heads, head_dim), **lin)
    self.out = nnx.LinearGeneral((num_heads, head_dim), hidden, axis=(-2, -1), **lin)

  def __call__(self, x: Array, *, positions: Array | None = None,
               segment_ids: Array | None = None, cache: KVCache | None = None,
               new_lengths: Array | None = None, layer=None):
    """[B, T, hidden] -> [B, T, hidden]; with `cache` (this layer's `KVCache`), the
    tokens' keys are appended to it first (`new_lengths` [B] of the T per row, default
    all) and the result is (output, updated cache); `positions` are then the tokens'
    own (the cache's lengths onwards). With `layer` (an int or traced index), `cache` is
    the stack of every layer's caches (`DecoderLM.init_cache`), whose entry `layer` is
    this layer's, and the stack comes back with that entry written in place
    (`KVCache.append_layer`); the split-KV decode kernel ("pallas_decode") reads it
    there too (`jflash.kv_cache.attention(layer=...)`)."""
    q, k, v = self.query(x), self.key(x), self.value(x)
    if self.use_rope:
      if positions is None and self.context_parallel_axis is not None:
        from jflash import parallel
        positions = parallel.shard_positions(x.shape[1], self.context_parallel_axis,
                                            layout="zigzag")
      elif positions is None:
        positions = jnp.arange(x.shape[1])
      q = apply_rope(q, positions, self.rope_base)
      k = apply_rope(k, positions, self.rope_base)
    if cache is not None:
      return self._attend_cache(q, k, v, cache, new_lengths, segment_ids, layer)
    o = core_attention(q, k, v, implementation=self.implementation,
                       is_causal=self.is_causal, segment_ids=segment_ids,
                       context_parallel_axis=self.context_parallel_axis,
                       **dict(self.options))
    return self.out(o)

  def _attend_cache(self, q, k, v, cache, new_lengths, segment_ids, layer):
    """Appends k, v to the cache, then attends from q over it (the new queries after
    the cached keys: `jflash.kv_cache.attention`)."""
    lacking = [name for name, on in (
        ("segment_ids", segment_ids is not None),
        ("context_parallel_axis", self.context_parallel_axis is not None),
        *((name, True) for name, _ in self.options)) if on]
    if lacking:
      raise NotImplementedError(f"attention over a KV cache has no {', '.join(lacking)}")
    if layer is None:
      cache = cache.append(k, v, new_lengths)
    else:
      cache = cache.append_layer(layer, k, v, new_lengths)
    o = kv_cache.attention(q, cache.k, cache.v, cache.lengths, layer=layer,
                           query_seq_lengths=new_lengths, is_causal=self.is_causal,
                           implementation=self.implementation)
    return self.out(o), cache


class Block(nnx.Module):
  """Pre-norm Transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    self.attn_norm = nnx.RMSNorm(cfg.hidden, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.attn = Attention(cfg.hidden, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head,
                          is_causal=True, local_window_size=cfg.local_window_size,
                          rope_base=cfg.rope_base,
                          implementation=cfg.attention_implementation, dtype=dt,
                          param_dtype=pdt, context_parallel_axis=cfg.context_parallel_axis,
                          rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(cfg.hidden, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.up = nnx.Linear(cfg.hidden, cfg.mlp_width, use_bias=False, dtype=dt,
                         param_dtype=pdt, rngs=rngs)
    self.down = nnx.Linear(cfg.mlp_width, cfg.hidden, use_bias=False, dtype=dt,
                           param_dtype=pdt, rngs=rngs)

  def __call__(self, x, positions=None, segment_ids=None, cache=None, new_lengths=None,
               layer=None):
    a = self.attn(self.attn_norm(x), positions=positions, segment_ids=segment_ids,
                  cache=cache, new_lengths=new_lengths, layer=layer)
    if cache is not None:
      a, cache = a
    x = x + a
    x = x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))
    return x if cache is None else (x, cache)


class DecoderLM(nnx.Module):
  """Decoder-only language model: token embedding, `num_layers` blocks, tied output.

  `__call__(tokens [B, T] int) -> logits [B, T, vocab]` in float32; with `cache`
  (`init_cache`), `(logits, cache)` after appending the tokens' keys to it (see
  `Attention`). `generate` samples with the cache (`jflash.generate`).
  """

  def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdt = jnp.dtype(cfg.param_dtype)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, dtype=jnp.dtype(cfg.dtype),
                           param_dtype=pdt, rngs=rngs)
    if cfg.scan_layers:
      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make_blocks(rngs):
        return Block(cfg, rngs=rngs)
      self.blocks = make_blocks(rngs)
    else:
      self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = nnx.RMSNorm(cfg.hidden, dtype=jnp.dtype(cfg.dtype), param_dtype=pdt,
                            rngs=rngs)

  def __call__(self, tokens: Array, *, positions: Array | None = None,
               segment_ids: Array | None = None, cache: KVCache | None = None,
               new_lengths: Array | None = None):
    cfg = self.cfg
    x = self.embed(tokens)

    def run_block(block, h):
      return block(h, positions, segment_ids)

    def run_cached(block, carry, i):
      return block(carry[0], positions, segment_ids, carry[1], new_lengths, i)
    if cfg.remat:
      # Keep only each block's input; its activations are recomputed in the backward.
      run_block, run_cached = nnx.remat(run_block), nnx.remat(run_cached)
    if cache is not None:
      # One layer's cache per block, stacked on axis 0; the stack rides along and each
      # block writes its own entry in place (`KVCache.append_layer`).
      if cfg.scan_layers:
        x, cache = nnx.scan(run_cached, in_axes=(0, nnx.Carry, 0), out_axes=nnx.Carry)(
            self.blocks, (x, cache), jnp.arange(cfg.num_layers))
      else:
        for i, block in enumerate(self.blocks):
          x, cache = run_cached(block, (x, cache), i)
    elif cfg.scan_layers:
      x = nnx.scan(run_block, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, x)
    else:
      for block in self.blocks:
        x = run_block(block, x)
    logits = self.embed.attend(self.norm(x)).astype(jnp.float32)
    return logits if cache is None else (logits, cache)

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    """An empty KV cache of `max_len` positions per row for every layer."""
    cfg = self.cfg
    return KVCache.empty(batch, max_len, cfg.kv_heads, cfg.dim_per_head, jnp.dtype(cfg.dtype),
                         layers=cfg.num_layers)

  def generate(self, tokens: Array, max_new_tokens: int, *, prompt_lengths: Array | None = None,
               temperature: float = 0.0, top_k: int | None = None, rng=None) -> Array:
    """[B, T0] prompts (right-padded, `prompt_lengths` [B], default T0) ->
    [B, T0 + max_new_tokens]: each row's prompt, its `max_new_tokens` new tokens, then
    zeros. Greedy at temperature 0, else sampled (top_k largest logits when given; `rng`
    a PRNG key). One prefill with the flash kernels, then one cached decode step per
    token, the whole loop one jitted program (`jflash.generate`)."""
    from jflash import generate
    return generate.generate(self, tokens, max_new_tokens, prompt_lengths=prompt_lengths,
                             temperature=temperature, top_k=top_k, rng=rng)


def count_params(module: nnx.Module) -> int:
  return sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(module, nnx.Param)))


def lm_flops_per_token(cfg: LMConfig, seq_len: int | None = None) -> float:
  """Training FLOPs per token: 6 x (non-embedding params + tied output matmul) plus the
  attention matmuls (causal: half of 4 T H per head per layer, x3 for fwd + bwd;
  PaLM appendix B counting)."""
  T = seq_len or cfg.seq_len
  H, N, K, D = cfg.dim_per_head, cfg.num_heads, cfg.kv_heads, cfg.hidden
  per_layer = D * (N + 2 * K) * H + N * H * D + 2 * D * cfg.mlp_width
  dense = cfg.num_layers * per_layer + D * cfg.vocab_size
  attn = cfg.num_layers * 6 * N * H * T  # 12 N H T x 0.5 for causal
  return 6.0 * dense + attn
