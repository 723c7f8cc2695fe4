"""Context parallelism: ring attention over a sequence sharded across devices.

Shape legend as in `jflash.attention`: B batch, T query length, S key/value length,
N query heads, K key/value heads, H head dim; P devices on the ring axis. Inside
`shard_map` every array below is the local shard, `[B, T/P, N, H]` and `[B, S/P, K, H]`.

The algorithm (Liu et al., "Ring Attention with Blockwise Transformers", 2023; the
zigzag layout as in Megatron-LM context parallelism / zhuzilin's ring-flash-attention):

  forward   each device keeps its query shard; the key/value shards travel round the
            ring with `lax.ppermute` (device d sends to d+1), P-1 hops. On every step
            the local implementation's `forward` gives a partial `(out, lse)` for one
            key/value block and the partials merge through their lse (the online-softmax
            merge). The transfer of the next block is issued before the compute of the
            current one and does not depend on it, so XLA may overlap the two.
  backward  a second ring over the same blocks. With the GLOBAL `out` and `lse`,
            `impl.backward` on one (query shard, key/value block) pair is exactly that
            pair's term of dQ, dK, dV (P = exp(s - lse) is already normalised, and
            delta = rowsum(dO * O) - dlse is a per-row global). dQ accumulates at home;
            the dK/dV accumulators travel with their key/value blocks and take one last
            hop back to their owners (P hops), so no device ever holds the full sequence.
  causal    with `layout="zigzag"` the global sequence is cut into 2P chunks and device
            i holds chunks i and 2P-1-i (`zigzag_permute`). Any (query chunk, key chunk)
            pair is then fully visible, fully masked, or on the diagonal, where it is
            plain causal attention between equal-length chunks at equal offsets. Each
            device computes the three unmasked pairs of its own block and exactly two
            chunk pairs of every other block, so the work is equal on all devices
            (`chunk_pairs_per_device`). `layout="contiguous"` keeps the natural order;
            it skips the fully masked blocks too, but device i then does 4i+3 pairs.
  segments  packed-document ids: the query ids stay home, the key ids travel with their
            block (int32 [B, S/P], small next to K/V) and each block call gets both in
            its `Masks`; blocks that segments alone mask fully are not skipped.
  soft cap  logits -> cap tanh(logits / cap) (Gemma 2) acts on each logit alone, so
            every block call applies it and the lse merge is unchanged.
  lengths   global query and key lengths [B] (padded batches). The valid tokens of a
            shard are a prefix of it in both layouts (`shard_lengths`), so each block
            call gets its shard's counts as its own lengths; the key counts travel
            with their block ([B] int32).

Bytes one device sends per call, with kv = B * (S/P) * K * H * itemsize: forward
2(P-1) kv; backward 2(P-1) kv for the blocks plus 2P kv' for the dK/dV accumulators
(kv' in float32, the accumulation dtype), plus the int32 key ids and key counts when
given.

Memory per device is linear in the local sequence length: one query shard, two
key/value blocks in flight (the current one and the next), the float32 accumulators,
and whatever the local implementation needs for one block.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jflash import api
from jflash.config import BackendConfig
from jflash.masks import Masks
from jflash.reference import stat_dtype

Array = jax.Array

LAYOUTS = ("zigzag", "contiguous")
# The options of `jflash.attention` that `ring_attention` takes beside is_causal,
# scale, segment_ids and implementation (what `jflash.nn` may pass on to it).
RING_OPTIONS = ("query_seq_lengths", "key_value_seq_lengths", "logits_soft_cap", "config")


# -- mesh, specs and the token order ------------------------------------------------

def make_mesh(num_devices: int | None = None, axis_name: str = "sp", *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A one-axis mesh for the sequence ring, over the first `num_devices` devices.

  The axis is of type Auto, so `shard_map` (and so `ring_attention`) reshards
  unsharded inputs itself instead of rejecting them.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices) if num_devices is None else num_devices
  if not isinstance(n, int) or not 1 <= n <= len(devices):
    raise ValueError(f"num_devices={num_devices!r} must be an int in [1, {len(devices)}]")
  return Mesh(np.asarray(devices[:n]), (axis_name,), axis_types=(jax.sharding.AxisType.Auto,))


def sequence_spec(axis_name: str = "sp", batch_axis: str | None = None) -> PartitionSpec:
  """The spec of a `[B, T, heads, H]` array (q, k, v, out) with T over `axis_name`."""
  return PartitionSpec(batch_axis, axis_name, None, None)


def lse_spec(axis_name: str = "sp", batch_axis: str | None = None) -> PartitionSpec:
  """The spec of the `[B, N, T]` lse returned with `return_residuals=True`."""
  return PartitionSpec(batch_axis, None, axis_name)


def _zigzag_order(num_shards: int) -> np.ndarray:
  """Chunk order: device i holds chunks (i, 2P-1-i), so order = [0, 2P-1, 1, 2P-2, ...]."""
  return np.stack([np.arange(num_shards), 2 * num_shards - 1 - np.arange(num_shards)],
                  axis=1).reshape(-1)


def _check_two_chunks(local_len: int, what: str = "local_len", use: str = ""):
  """The zigzag layout's rule: a shard is two chunks of equal length (so the global
  length is a multiple of 2P)."""
  if local_len % 2:
    raise ValueError(f"the zigzag layout needs an even local length (two chunks)"
                     f"{' for ' + use if use else ''}, got {what}={local_len}")


def _check_zigzag(x, num_shards, axis):
  if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
    raise ValueError(f"num_shards={num_shards!r} must be a positive int")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis={axis} is out of range for an array of rank {x.ndim}")
  axis %= x.ndim
  if x.shape[axis] % (2 * num_shards):
    raise ValueError(
        f"sequence length {x.shape[axis]} (axis {axis}) must be a multiple of "
        f"2 * num_shards = {2 * num_shards} for the zigzag layout")
  return axis


def _permute_chunks(x, order, axis):
  n = len(order)
  shape = x.shape
  x = x.reshape(shape[:axis] + (n, shape[axis] // n) + shape[axis + 1:])
  x = jnp.take(x, jnp.asarray(order), axis=axis)
  return x.reshape(shape)


def zigzag_permute(x: Array, num_shards: int, axis: int = 1) -> Array:
  """Natural token order -> zigzag order, so contiguous sharding puts chunks i and
  2P-1-i on device i. Works for q/k/v `[B, T, ...]` (axis=1) and ids `[B, T]`."""
  axis = _check_zigzag(x, num_shards, axis)
  return _permute_chunks(x, _zigzag_order(num_shards), axis)


def zigzag_unpermute(x: Array, num_shards: int, axis: int = 1) -> Array:
  """The inverse of `zigzag_permute` (the lse of shape [B, N, T] takes axis=2)."""
  axis = _check_zigzag(x, num_shards, axis)
  return _permute_chunks(x, np.argsort(_zigzag_order(num_shards)), axis)


def shard_positions(local_len: int, axis_name: str, layout: str) -> Array:
  """Global token positions `[local_len]` (int32) of this device's shard; inside
  `shard_map`. What rotary embeddings need in place of `arange(local_len)`."""
  _check_layout(layout)
  i = lax.axis_index(axis_name)
  if layout == "contiguous":
    return (i * local_len + jnp.arange(local_len)).astype(jnp.int32)
  _check_two_chunks(local_len)
  c = local_len // 2
  size = lax.axis_size(axis_name)
  first, second = i * c, (2 * size - 1 - i) * c
  return jnp.concatenate([first + jnp.arange(c), second + jnp.arange(c)]).astype(jnp.int32)


def shard_lengths(lengths: Array, shard, local_len: int, num_shards: int,
                  layout: str) -> Array:
  """How many of shard `shard`'s `local_len` tokens lie below the global `lengths`
  ([B] int), [B] int32: works on Python ints and on traced ones (`lax.axis_index`).

  Those tokens are a prefix of the shard in both layouts, so the count is the shard's
  own length mask. Contiguous: the shard is one run of positions. Zigzag: it holds
  chunk j and then chunk 2P-1-j of c = local_len/2 tokens; a length reaching into the
  later chunk passes all of the earlier one, so the valid tokens of the two chunks are
  again a prefix of the shard.
  """
  _check_layout(layout)
  if layout == "zigzag":
    _check_two_chunks(local_len)
  lengths = jnp.asarray(lengths, jnp.int32)
  if layout == "contiguous":
    return jnp.clip(lengths - shard * local_len, 0, local_len)
  c = local_len // 2
  return (jnp.clip(lengths - shard * c, 0, c)
          + jnp.clip(lengths - (2 * num_shards - 1 - shard) * c, 0, c))


# -- which part of a (query shard, key/value block) pair is computed ----------------
# Each local shard is two chunks of c = T/(2P) tokens. A case names the chunk pairs
# (local query chunk, local key chunk) that one ring step computes; every other pair
# of that step is fully masked and skipped.

FULL, DIAG, LOWER, UPPER, SKIP = range(5)
CASE_NAMES = {FULL: "full", DIAG: "diag", LOWER: "lower", UPPER: "upper", SKIP: "skip"}
CASE_PAIRS = {
    FULL: ((0, 0), (0, 1), (1, 0), (1, 1)),  # no mask: the whole block
    DIAG: ((0, 0), (1, 0), (1, 1)),          # the own block: plain causal
    LOWER: ((0, 0), (1, 0)),                 # zigzag, source j < i: all queries, first key chunk
    UPPER: ((1, 0), (1, 1)),                 # zigzag, source j > i: last query chunk, all keys
    SKIP: (),                                # contiguous, source j > i: fully masked
}


def block_case(i, j, *, is_causal: bool, layout: str):
  """The case of device i's queries against the block that device j owns.

  Works on Python ints and on traced ones (`lax.axis_index` inside the ring), so the
  ring and `chunk_pairs_per_device` use one rule.
  """
  if not is_causal:
    return FULL
  if layout == "zigzag":
    # chunks (i, 2P-1-i) against (j, 2P-1-j): for j < i the first key chunk is below
    # both query chunks and the second above both; for j > i both key chunks are
    # above query chunk i and below query chunk 2P-1-i.
    return jnp.where(i == j, DIAG, jnp.where(j < i, LOWER, UPPER))
  return jnp.where(i == j, DIAG, jnp.where(j < i, FULL, SKIP))


def _step_cases(is_causal: bool, layout: str) -> tuple[int, ...]:
  """The cases a step other than the first can take (the first is always the own block)."""
  if not is_causal:
    return (FULL,)
  return (LOWER, UPPER) if layout == "zigzag" else (FULL, SKIP)


def chunk_pairs_per_device(num_shards: int, *, is_causal: bool, layout: str) -> list[int]:
  """Number of (query chunk, key chunk) pairs of c = T/(2P) tokens each device computes.

  Zigzag causal: 3 + 2(P-1) on every device; contiguous causal: 4i + 3 on device i.
  """
  _check_layout(layout)
  return [sum(len(CASE_PAIRS[int(block_case(i, (i - s) % num_shards, is_causal=is_causal,
                                             layout=layout))])
              for s in range(num_shards)) for i in range(num_shards)]


def _check_layout(layout):
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")


# -- the ring ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Ring:
  """Static description of one ring_attention call (hashable: a nondiff argument)."""

  axis_name: str
  size: int
  layout: str
  impl: api.Implementation
  cfg: api.AttentionConfig
  is_causal: bool  # the global mask; each block call gets its own (`_block_masks`)
  soft_cap: float | None  # every block's, as the global call's

  def perm(self):
    return [(d, (d + 1) % self.size) for d in range(self.size)]


def _merge(o1, l1, o2, l2):
  """Online-softmax merge of two normalised partials (out [B,T,N,H], lse [B,N,T]).

  out = (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2), lse = log(e^l1 + e^l2), computed against
  the larger lse. A row that no block has seen (both -inf) stays out = 0, lse = -inf;
  a NaN or inf lse (a NaN or inf logit in that block) makes the merged row NaN.
  """
  m = jnp.maximum(l1, l2)
  m_safe = jnp.where(m == -jnp.inf, 0, m)  # keeps exp() free of (-inf) - (-inf)
  w1, w2 = jnp.exp(l1 - m_safe), jnp.exp(l2 - m_safe)
  tot = w1 + w2
  has = tot != 0  # 0 only when both are -inf; NaN != 0, so a NaN reaches the output
  tot_safe = jnp.where(has, tot, 1)
  lse = jnp.where(has, m_safe + jnp.log(tot_safe), -jnp.inf)
  to_btn = lambda w: jnp.swapaxes(jnp.where(has, w / tot_safe, 0), 1, 2)[..., None]
  return o1 * to_btn(w1) + o2 * to_btn(w2), lse


# A shard's side of a block call, as a dict: the query side {"q", and "seg" / "len"
# when given} stays home; the key side {"k", "v", "seg" / "len"} travels as one.

def _head(side: dict, c: int) -> dict:
  """The first chunk (c tokens) of a shard's side; its valid tokens are a prefix."""
  return {n: jnp.minimum(x, c) if n == "len" else x[:, :c] for n, x in side.items()}


def _tail(side: dict, c: int) -> dict:
  """The second chunk of a shard's side."""
  return {n: jnp.maximum(x - c, 0) if n == "len" else x[:, c:] for n, x in side.items()}


def _block_call(case: int, qs: dict, kv: dict):
  """(query side, key side, causal) of the one implementation call of a case (not SKIP)."""
  c = qs["q"].shape[1] // 2
  if case in (FULL, DIAG):
    return qs, kv, case == DIAG
  if case == LOWER:  # all queries, the first key chunk
    return qs, _head(kv, c), False
  return _tail(qs, c), kv, False  # UPPER: the first query chunk sees nothing of it


def _block_masks(ring: _Ring, causal: bool, qs: dict, kv: dict) -> Masks:
  """The masks of one block call: its own causal flag, the call's soft cap, and the
  sides' segment ids and lengths, if any."""
  return Masks(is_causal=causal, soft_cap=ring.soft_cap, q_segment_ids=qs.get("seg"),
               kv_segment_ids=kv.get("seg"), q_lengths=qs.get("len"),
               kv_lengths=kv.get("len"))


def _block_forward(ring: _Ring, case: int, qs: dict, kv: dict, o, l):
  """The running (out, lse) (float32, the local query shape) merged with one block's
  partial. A case that covers only some query rows merges into those rows in place,
  so no step holds a padded copy of the whole output."""
  if case == SKIP:
    return o, l
  qc, kc, causal = _block_call(case, qs, kv)
  out, lse = ring.impl.forward(qc["q"], kc["k"], kc["v"], ring.cfg,
                               _block_masks(ring, causal, qc, kc))
  acc = o.dtype
  if case != UPPER:
    return _merge(o, l, out.astype(acc), lse.astype(acc))
  c = o.shape[1] // 2  # UPPER: the last query chunk only
  o2, l2 = _merge(o[:, c:], l[..., c:], out.astype(acc), lse.astype(acc))
  return (lax.dynamic_update_slice_in_dim(o, o2, c, axis=1),
          lax.dynamic_update_slice_in_dim(l, l2, c, axis=2))


def _block_backward(ring: _Ring, case: int, qs: dict, kv: dict, res, grads):
  """The accumulators (dq, dk, dv) (float32) plus one block's terms, from the global
  out/lse. A case that touches only one chunk adds into that chunk in place."""
  if case == SKIP:
    return grads
  out, lse, dout, dlse = res
  dq, dk, dv = grads
  qc, kc, causal = _block_call(case, qs, kv)
  c = qs["q"].shape[1] // 2
  if case == UPPER:  # the residuals of the queries it takes
    out, lse, dout, dlse = out[:, c:], lse[..., c:], dout[:, c:], dlse[..., c:]
  dq_s, dk_s, dv_s = ring.impl.backward(qc["q"], kc["k"], kc["v"], out, lse, dout, dlse,
                                        ring.cfg, _block_masks(ring, causal, qc, kc))[:3]
  add = lambda acc, x, start: lax.dynamic_update_slice_in_dim(
      acc, lax.dynamic_slice_in_dim(acc, start, x.shape[1], axis=1) + x.astype(acc.dtype),
      start, axis=1)
  if case == LOWER:  # the first key chunk only
    return dq + dq_s.astype(dq.dtype), add(dk, dk_s, 0), add(dv, dv_s, 0)
  if case == UPPER:  # the last query chunk only
    return add(dq, dq_s, c), dk + dk_s.astype(dk.dtype), dv + dv_s.astype(dv.dtype)
  return dq + dq_s.astype(dq.dtype), dk + dk_s.astype(dk.dtype), dv + dv_s.astype(dv.dtype)


def _dispatch(ring: _Ring, fn, cases, case, *args):
  """`fn(ring, case, *args)` for a traced case drawn from the static tuple `cases`."""
  if len(cases) == 1:
    return fn(ring, cases[0], *args)
  index = jnp.argmax(jnp.asarray(cases) == case)
  return lax.switch(index, [functools.partial(fn, ring, c) for c in cases], *args)


def _case_at(ring: _Ring, step):
  """The case of this device's queries against the block it holds at ring step `step`."""
  i = lax.axis_index(ring.axis_name)
  j = (i - step) % ring.size  # blocks move d -> d+1, so step s holds device i-s's block
  return block_case(i, j, is_causal=ring.is_causal, layout=ring.layout)


def _sides(q, k, v, q_seg, kv_seg, q_len, kv_len):
  """The query side and this device's key side (`_block_call`), without absent fields."""
  given = lambda **side: {n: x for n, x in side.items() if x is not None}
  return given(q=q, seg=q_seg, len=q_len), given(k=k, v=v, seg=kv_seg, len=kv_len)


def _ring_forward(ring: _Ring, q, k, v, q_seg, kv_seg, q_len, kv_len):
  cases = _step_cases(ring.is_causal, ring.layout)
  ppermute = lambda x: lax.ppermute(x, ring.axis_name, ring.perm())
  qs, kv = _sides(q, k, v, q_seg, kv_seg, q_len, kv_len)
  # Step 0 is the own block (the diagonal when causal). Its send is issued first.
  nxt = ppermute(kv) if ring.size > 1 else kv
  own = DIAG if ring.is_causal else FULL
  qc, kc, causal = _block_call(own, qs, kv)
  o, l = ring.impl.forward(qc["q"], kc["k"], kc["v"], ring.cfg,
                           _block_masks(ring, causal, qc, kc))
  acc = stat_dtype(q.dtype)
  o, l = o.astype(acc), l.astype(acc)

  def step(carry, s):
    o, l, kv = carry
    nxt = ppermute(kv)  # the next block's transfer, independent of this step's compute
    o, l = _dispatch(ring, _block_forward, cases, _case_at(ring, s), qs, kv, o, l)
    return (o, l, nxt), None

  if ring.size > 2:
    (o, l, nxt), _ = lax.scan(step, (o, l, nxt), jnp.arange(1, ring.size - 1))
  if ring.size > 1:  # the last block: nothing left to send
    o, l = _dispatch(ring, _block_forward, cases, _case_at(ring, ring.size - 1), qs, nxt,
                     o, l)
  return o.astype(q.dtype), l


def _ring_backward(ring: _Ring, q, k, v, q_seg, kv_seg, q_len, kv_len, out, lse, dout,
                   dlse):
  cases = _step_cases(ring.is_causal, ring.layout)
  ppermute = lambda x: lax.ppermute(x, ring.axis_name, ring.perm())
  res = (out, lse, dout, dlse)
  qs, kv = _sides(q, k, v, q_seg, kv_seg, q_len, kv_len)
  nxt = ppermute(kv) if ring.size > 1 else kv
  acc = stat_dtype(q.dtype)
  # The own block's terms start the accumulators (built from the inputs, so they carry
  # their varying mesh axes).
  zeros = tuple(jnp.zeros_like(x, acc) for x in (q, k, v))
  dq, dk, dv = _block_backward(ring, DIAG if ring.is_causal else FULL, qs, kv, res, zeros)

  def contrib(s, kv, grads):
    return _dispatch(ring, _block_backward, cases, _case_at(ring, s), qs, kv, res, grads)

  def step(carry, s):
    dq, kv, dkv = carry
    nxt = ppermute(kv)
    # The accumulator of the block now held arrives from the previous holder; it is
    # needed only after this step's compute, so its transfer can overlap it too.
    dk, dv = ppermute(dkv)
    dq, dk, dv = contrib(s, kv, (dq, dk, dv))
    return (dq, nxt, (dk, dv)), None

  if ring.size > 2:
    (dq, nxt, (dk, dv)), _ = lax.scan(step, (dq, nxt, (dk, dv)),
                                       jnp.arange(1, ring.size - 1))
  if ring.size > 1:
    dk, dv = ppermute((dk, dv))
    dq, dk, dv = contrib(ring.size - 1, nxt, (dq, dk, dv))
    # The holder of block j after the last step is device j-1: one hop home.
    dk, dv = ppermute((dk, dv))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ring(q, k, v, q_seg, kv_seg, q_len, kv_len, ring: _Ring):
  return _ring_forward(ring, q, k, v, q_seg, kv_seg, q_len, kv_len)


def _ring_fwd(q, k, v, q_seg, kv_seg, q_len, kv_len, ring):
  out, lse = _ring_forward(ring, q, k, v, q_seg, kv_seg, q_len, kv_len)
  return (out, lse), (q, k, v, q_seg, kv_seg, q_len, kv_len, out, lse)


def _ring_bwd(ring, res, cotangents):
  dq, dk, dv = _ring_backward(ring, *res, *cotangents)
  return dq, dk, dv, None, None, None, None  # ids and lengths are integers: no cotangent


_ring.defvjp(_ring_fwd, _ring_bwd)


# -- the public op ----------------------------------------------------------------

def _resolve(implementation, q, k, v, cfg, masks: Masks) -> api.Implementation:
  """The first implementation that can run every block of this ring (api's
  `implementation=` rule: the next name is tried only on NotImplementedError)."""
  return api.resolve_implementation(
      implementation, lambda impl: _check_implementation(impl, q, k, v, cfg, masks),
      what="this ring")


def _check_implementation(impl, q, k, v, cfg, masks: Masks):
  if impl.forward is None or impl.backward is None:
    raise NotImplementedError(
        f"implementation={impl.name!r} has no forward/backward split with an lse; ring "
        "attention merges blocks through their lse: use a flash-type implementation "
        "such as 'xla_chunked'")
  # The blocks run non-causal (and the zigzag halves) and causal on the own block.
  for causal in {False, masks.is_causal}:
    impl.supports(q, k, v, cfg, dataclasses.replace(masks, is_causal=causal))


def ring_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    axis_name: str,
    layout: str,
    is_causal: bool = False,
    scale: float | None = None,
    implementation: str | Sequence[str] | None = None,
    segment_ids: Array | tuple[Array, Array] | None = None,
    query_seq_lengths: Array | None = None,
    key_value_seq_lengths: Array | None = None,
    logits_soft_cap: float | None = None,
    config: BackendConfig | Sequence[BackendConfig] | None = None,
    return_residuals: bool = False,
) -> Array | tuple[Array, Array]:
  """Exact attention over a sequence sharded on `axis_name`; call inside `shard_map`.

  Args:
    query: the local shard `[B, T/P, N, H]` of a sequence sharded contiguously over
      `axis_name` (spec `sequence_spec(axis_name)`).
    key, value: local shards `[B, S/P, K, H]`, N a multiple of K (GQA/MQA).
    axis_name: the mesh axis the sequence is sharded over (the ring).
    is_causal: query i sees keys j <= i in the GLOBAL natural order (top-left
      aligned, as `jflash.attention`); needs T == S.
    scale: logits scale; None means `1/sqrt(H)`.
    implementation: the local block implementation, as in `jflash.attention`; it must
      be a flash-type one (forward/backward with an lse), so not "xla".
    layout: how the global sequence was laid out before sharding, always stated (the
      wrong one gives wrong values, which nothing could detect). "zigzag": it was
      permuted with `zigzag_permute(x, P)` (device i holds chunks i and 2P-1-i), which
      balances causal work; "contiguous": natural order. For non-causal attention
      without lengths the two are the same computation; lengths are read in the
      layout's token order.
    segment_ids: local shards of packed-document ids, `[B, T/P]` int (T == S) or a
      pair (`[B, T/P]`, `[B, S/P]`), in the same token order as q/k/v (permute them
      with `zigzag_permute` too). The key ids travel round the ring with their block.
      Needs a local implementation whose `supports` accepts segment ids.
    query_seq_lengths, key_value_seq_lengths: GLOBAL lengths `[B]` int, the same on
      every device (replicated): query rows at or past the length output zeros and
      keys at or past it are masked, in the natural token order, as in
      `jflash.attention`. With the zigzag layout each local length must be even.
    logits_soft_cap: logits -> cap * tanh(logits / cap) before the softmax, as in
      `jflash.attention`; None: no cap. Needs a local implementation that has it.
    config: backend config(s) of the local implementation, as in `jflash.attention`.
    return_residuals: also return the local lse `[B, N, T/P]` (spec `lse_spec`).

  Returns:
    The local output shard `[B, T/P, N, H]` in the same token order as the inputs,
    or `(out, lse)`.
  """
  # Shard-local shapes and ids: T and S here are the local lengths T/P and S/P.
  cfg, masks = api.prepare(query, key, value, scale=scale, is_causal=is_causal,
                           segment_ids=segment_ids, logits_soft_cap=logits_soft_cap,
                           implementation=implementation, config=config)
  _check_layout(layout)
  if not isinstance(axis_name, str):
    raise ValueError(f"axis_name={axis_name!r} must be the name (str) of one mesh axis")
  try:
    size = lax.axis_size(axis_name)
  except (NameError, KeyError):  # how jax reports an axis name no mesh binds
    raise ValueError(
        f"axis_name={axis_name!r} is not a bound mesh axis: call ring_attention "
        "inside shard_map over a mesh with that axis") from None
  T, S = query.shape[1], key.shape[1]
  if is_causal:
    if T != S:
      raise ValueError(
          f"causal ring attention needs equal local query and key lengths, got "
          f"T/P={T} and S/P={S}")
    if layout == "zigzag":
      _check_two_chunks(T, "T/P", "a causal mask")
  # Lengths are global: each shard's count is its own lengths (`shard_lengths`).
  local = {}
  for name, x, n, what in (("query_seq_lengths", query_seq_lengths, T, "T/P"),
                           ("key_value_seq_lengths", key_value_seq_lengths, S, "S/P")):
    if x is None:
      continue
    if layout == "zigzag":
      _check_two_chunks(n, what, name)
    x = api.check_lengths(name, x, query.shape[0], size * n)
    local[name] = shard_lengths(x, lax.axis_index(axis_name), n, size, layout)
  masks = dataclasses.replace(masks, q_lengths=local.get("query_seq_lengths"),
                              kv_lengths=local.get("key_value_seq_lengths"))
  # As in jflash.attention: padding may hold anything (even NaN); a shard's padding is
  # the rest of it after its count.
  query, key, value = api.zero_padding(query, key, value, masks)
  impl = _resolve(implementation, query, key, value, cfg, masks)
  out, lse = _ring(query, key, value, masks.q_segment_ids, masks.kv_segment_ids,
                   masks.q_lengths, masks.kv_lengths,
                   _Ring(axis_name, size, layout, impl, cfg, masks.is_causal,
                         masks.soft_cap))
  return (out, lse) if return_residuals else out


def sharded_ring_attention(mesh: Mesh, axis_name: str = "sp", *,
                           batch_axis: str | None = None, check_vma: bool = True,
                           with_segment_ids: bool = False, with_lengths: bool = False,
                           **kwargs):
  """`ring_attention` wrapped in `shard_map` for global `[B, T, N, H]` arrays.

  Returns `fn(q, k, v)`, with `with_segment_ids` one more argument, the ids `[B, T]`
  (self-attention), and with `with_lengths` two more, `query_seq_lengths` and
  `key_value_seq_lengths` `[B]` (sharded over `batch_axis` only). The sequence order
  of the arrays is the one `ring_attention` expects for `layout` (apply
  `zigzag_permute` first for "zigzag"). `kwargs` go to `ring_attention` (`layout` among
  them: it has no default).

  `check_vma` is shard_map's varying-manual-axes type check, on as in `jax.shard_map`:
  every implementation's outputs state the mesh axes they vary over (the kernels' output
  types carry their operands' varying axes).
  """
  spec = sequence_spec(axis_name, batch_axis)
  out_specs = (spec, lse_spec(axis_name, batch_axis)) if kwargs.get(
      "return_residuals") else spec
  in_specs = (spec, spec, spec)
  names = []      # the extra arguments, in order
  if with_segment_ids:
    in_specs += (PartitionSpec(batch_axis, axis_name),)
    names.append("segment_ids")
  if with_lengths:
    in_specs += (PartitionSpec(batch_axis),) * 2
    names += ["query_seq_lengths", "key_value_seq_lengths"]

  def fn(q, k, v, *extra):
    return ring_attention(q, k, v, axis_name=axis_name, **dict(zip(names, extra)), **kwargs)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=check_vma)
