"""Partitioning of the attention op over sharded batch and heads.

Attention is independent across batch rows and across GQA groups (a group's query
heads and their key/value heads), so a device holding a shard of the batch and of the
heads computes its part of the output, the lse and every gradient from its own shards
alone. This module says so to JAX, for the `forward` and `backward` of every flash-type
implementation (`jflash.api` applies it around both inside its custom_vjp):

  * Auto mesh axes: `jax.experimental.custom_partitioning` (as jax.nn's cuDNN attention
    does). Shardy propagates shardings through one rule (`_sdy_rule`: the batch and
    head factors shared by every operand and result), and `_partition` gives each
    device the implementation on its local shapes.
  * Explicit mesh axes: the shardings are part of the types at trace time, so the call
    is a `shard_map` over those axes with the same specs (`_plan`).
  * Manual axes (inside the caller's `shard_map`): the call is already per device.

Either way the specs come from one rule (`_plan`): batch axes as the query's, head
axes as the query's, key/value heads with their query heads (a GQA group on one
device: the head axes' size must divide K, or K == 1 and every device keeps the one
key/value head). A sharded sequence axis is ring attention's job (`jflash.parallel`),
a sharded head_dim no attention's: both raise `NotImplementedError` instead of
gathering.

Dropout's keep mask hashes global (batch, head) indices (`pallas_kernels.masking`),
which a shard does not know, so dropout with batch or heads sharded raises.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax import lax
from jax.experimental.custom_partitioning import (
    ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning)
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jflash.masks import Masks

# The role of each dimension of an operand or result:
#   b batch, t query sequence, s key sequence, n query heads (= K key heads x G),
#   k key/value heads, h head_dim, l layers (a stack of KV caches), 1 a broadcast
#   dimension of size 1.
_Q, _KV, _LSE, _KV_STACK = "btnh", "bskh", "bnt", "lbskh"


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static description of one call: the role string of every operand (flattened, in
  pytree order) and result, the key/value heads K and group size G, dropout."""

  operands: tuple[str, ...]
  results: tuple[str, ...]
  K: int
  G: int
  dropout: bool


def _dense_roles(shape, full) -> str:
  """The roles of a [B|1, N|1, T|1, S|1] bias or mask (or its gradient)."""
  return "".join(r if n == f else "1" for r, n, f in zip("bnts", shape, full))


def _mask_roles(masks: Masks, full: tuple[int, int, int, int]) -> Masks:
  """`masks` with each array replaced by its role string (for pytree-order flattening)."""
  def dense(x):
    return None if x is None else _Roles(_dense_roles(x.shape, full))
  def given(x, roles):
    return None if x is None else _Roles(roles)
  return dataclasses.replace(
      masks, bias=dense(masks.bias), mask=dense(masks.mask),
      q_lengths=given(masks.q_lengths, "b"), kv_lengths=given(masks.kv_lengths, "b"),
      q_segment_ids=given(masks.q_segment_ids, "bt"),
      kv_segment_ids=given(masks.kv_segment_ids, "bs"),
      dropout_seed=given(masks.dropout_seed, ""))


@dataclasses.dataclass(frozen=True)
class _Roles:
  """A role string as one pytree leaf."""
  roles: str


def _layout(arrays: tuple, masks: Masks, results: tuple[str, ...],
            roles: tuple[str, ...] | None = None) -> _Layout:
  """`roles` of `arrays` (default: q, k, v, then out and lse residuals, as the
  forward and backward take them)."""
  if roles is None:
    roles = tuple(_LSE if x.ndim == 3 else (_KV if i in (1, 2) else _Q)
                  for i, x in enumerate(arrays))
  q, k = arrays[0], arrays[1]
  B, T, N, _ = q.shape
  S, K = k.shape[roles[1].index("s")], k.shape[roles[1].index("k")]
  mask_roles = tuple(r.roles for r in jax.tree.leaves(_mask_roles(masks, (B, N, T, S))))
  return _Layout(tuple(roles) + mask_roles, results, K, N // K, masks.dropout_rate > 0)


# -- the one rule: which mesh axes each dimension is sharded over -------------------

def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _padded(spec, ndim) -> tuple:
  spec = tuple(spec) if spec is not None else ()
  return spec + (None,) * (ndim - len(spec))


_SEQUENCE_ERROR = (
    "jflash.attention under jax.jit partitions batch and heads only; {what} is sharded "
    "along its sequence axis over mesh axes {axes}. Sequence (context) parallelism is "
    "ring attention: jflash.parallel.ring_attention inside shard_map (or "
    "jflash.parallel.sharded_ring_attention); or shard the batch or heads instead.")


@dataclasses.dataclass(frozen=True)
class _Plan:
  operand_specs: tuple[PartitionSpec, ...]
  result_specs: tuple[PartitionSpec, ...]
  batch: tuple[str, ...]
  heads: tuple[str, ...]


_OPERAND_NAMES = ("query", "key", "value")


def _plan(layout: _Layout, specs, axis_sizes: dict[str, int]) -> _Plan:
  """The specs every operand and result gets, from the operands' current `specs`;
  NotImplementedError where that would need a gather."""
  specs = [tuple(_axes(e) for e in _padded(s, len(r)))
           for s, r in zip(specs, layout.operands)]
  names = lambda i: _OPERAND_NAMES[i] if i < 3 else f"operand {i} (a mask array or residual)"
  for i, (spec, roles) in enumerate(zip(specs, layout.operands)):
    for axes, role in zip(spec, roles):
      if axes and role in "ts":
        raise NotImplementedError(_SEQUENCE_ERROR.format(what=names(i), axes=axes))
      if axes and role == "l":
        raise NotImplementedError(
            f"{names(i)} is sharded along the KV cache stack's layer axis over mesh axes "
            f"{axes}; a call reads one layer of the stack, whose batch and heads may be "
            "sharded: keep the layer axis unsharded")
      if axes and role == "h":
        raise NotImplementedError(
            f"{names(i)} is sharded along head_dim over mesh axes {axes}; jflash.attention "
            "partitions batch and heads only (each head needs its whole head_dim): "
            "shard the heads instead")
  batch = specs[0][0]
  heads = specs[0][2]
  d = math.prod(axis_sizes[a] for a in heads)
  if layout.K % d == 0:
    kv_heads = heads
  elif layout.K == 1:
    kv_heads = ()  # MQA: every device keeps the one key/value head
  else:
    raise NotImplementedError(
        f"query heads are sharded over mesh axes {heads} ({d} devices), which do not "
        f"divide the K={layout.K} key/value heads: a GQA group's key/value heads must "
        "stay on the device of its query heads, so shard the heads over a number of "
        "devices that divides K")
  if (batch or heads) and layout.dropout:
    raise NotImplementedError(
        "dropout with batch or heads sharded: the keep mask hashes global batch and "
        "head indices, which a shard does not know; keep batch and heads unsharded "
        "for attention dropout, or train without it")
  want = {"b": batch, "n": heads, "k": kv_heads}
  for i, (spec, roles) in enumerate(zip(specs, layout.operands)):
    for axes, role in zip(spec, roles):
      if role in want and axes and axes != want[role]:
        raise NotImplementedError(
            f"{names(i)} is sharded over mesh axes {axes} along its "
            f"{'batch' if role == 'b' else 'heads'} axis, the query over "
            f"{want[role] or 'none'}: shard query, key, value and the mask arrays alike "
            "along batch and heads")
  spec_of = lambda roles: PartitionSpec(*(_entry(want.get(r, ())) for r in roles))
  return _Plan(tuple(spec_of(r) for r in layout.operands),
               tuple(spec_of(r) for r in layout.results), batch, heads)


def _reduce_dbias(plan: _Plan, layout: _Layout, grads):
  """A bias broadcast over batch (or heads) gets its gradient summed over the devices
  that split that axis: the one cross-device sum the op needs (none on q, k or v)."""
  if len(grads) < 4:
    return grads
  roles = layout.results[3]
  axes = (plan.batch if roles[0] == "1" else ()) + (plan.heads if roles[1] == "1" else ())
  dbias = lax.psum(grads[3], axes) if axes else grads[3]
  return (*grads[:3], dbias)


# -- Auto axes: custom_partitioning -----------------------------------------------------

def _body(call, layout, tree):
  # Under jit, the kernels' constant tables stay inside the call's own jaxpr:
  # custom_partitioning takes a function with no closed-over constants.
  return tuple(jax.jit(call)(*tree))


def _sdy_rule(call, layout: _Layout, mesh, value_types, result_types):
  del call, mesh, value_types, result_types
  # Query heads are (key head, group member), key head major, so sharding one shards
  # the other alike. Shardy takes no size-1 factor in a compound: MHA (G = 1) shares
  # one factor, MQA (K = 1) keeps the two apart (the one key head is on every device).
  n = "k" if layout.G == 1 else "n" if layout.K == 1 else CompoundFactor("k", "g")
  dims = {"b": "b", "t": "t", "s": "s", "h": "h", "k": "k", "n": n, "l": "l"}
  ones = iter(range(1 << 16))
  def mapping(roles):
    return ArrayMapping(*(dims[r] if r != "1" else f"one{next(ones)}" for r in roles))
  return SdyShardingRule(tuple(mapping(r) for r in layout.operands),
                         tuple(mapping(r) for r in layout.results),
                         **({"g": layout.G} if isinstance(n, CompoundFactor) else {}))


def _partition(call, layout: _Layout, mesh, arg_shapes, result_shape):
  leaves, tree = jax.tree.flatten(arg_shapes)
  plan = _plan(layout, [getattr(s.sharding, "spec", None) for s in leaves],
               dict(mesh.shape))
  arg_shardings = jax.tree.unflatten(tree, [NamedSharding(mesh, p)
                                            for p in plan.operand_specs])
  result_shardings = tuple(NamedSharding(mesh, p) for p in plan.result_specs)

  def lower_fn(args):
    return _reduce_dbias(plan, layout, tuple(call(*args)))
  return mesh, lower_fn, result_shardings, arg_shardings


_partitioned = custom_partitioning(_body, static_argnums=(0, 1))
_partitioned.def_partition(partition=_partition, sharding_rule=_sdy_rule)


# -- Explicit axes: shard_map ---------------------------------------------------------

def _shard_map(call, layout: _Layout, mesh, tree):
  leaves, treedef = jax.tree.flatten(tree)
  explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
  plan = _plan(layout, [jax.typeof(x).sharding.spec for x in leaves], dict(mesh.shape))
  # Only ever adds sharding (the plan raises where an operand would lose some): a
  # replicated mask array or key/value head is sliced, never gathered.
  leaves = [x if tuple(_padded(jax.typeof(x).sharding.spec, x.ndim)) == tuple(_padded(p, x.ndim))
            else jax.sharding.reshard(x, NamedSharding(mesh, p))
            for x, p in zip(leaves, plan.operand_specs)]

  def local(*leaves):
    return _reduce_dbias(plan, layout, tuple(call(*jax.tree.unflatten(treedef, leaves))))
  # check_vma off: the specs are the plan's by construction, and JAX 0.10's Pallas
  # interpreter (the kernels on CPU) fails its own varying-axes checks on masked loads.
  return jax.shard_map(local, mesh=mesh, in_specs=tuple(plan.operand_specs),
                       out_specs=plan.result_specs, axis_names=explicit,
                       check_vma=False)(*leaves)


# -- dispatch ---------------------------------------------------------------------------

def _mesh(leaves):
  """The mesh the arrays live on (from their types), else the context's abstract mesh."""
  for x in leaves:
    s = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(s, "mesh", None)
    if mesh is not None and not mesh.empty:
      return mesh
  return jax.sharding.get_abstract_mesh()


def _run(call: Callable, tree: tuple, masks: Masks, results: tuple[str, ...],
         roles: tuple[str, ...] | None = None):
  """`call(*tree)` partitioned over the non-manual axes of the arrays' mesh (`roles`:
  those of the arrays before `masks`, as `_layout` takes them)."""
  leaves = jax.tree.leaves(tree)
  mesh = _mesh(leaves)
  types = dict(zip(mesh.axis_names, mesh.axis_types)) if not mesh.empty else {}
  shared = {a: t for a, t in types.items() if t != AxisType.Manual and mesh.shape[a] > 1}
  if not shared:
    return tuple(call(*tree))
  layout = _layout(tree[:-1], masks, results, roles)
  if AxisType.Explicit in shared.values():
    return _shard_map(call, layout, mesh, tree)
  return _partitioned(call, layout, tree)


def forward(impl, q, k, v, cfg, masks: Masks):
  """`impl.forward(q, k, v, cfg, masks)`, each device on its batch and head shard."""
  call = lambda q, k, v, masks: impl.forward(q, k, v, cfg, masks)
  return _run(call, (q, k, v, masks), masks, (_Q, _LSE))


def forward_stacked(impl, q, k_stack, v_stack, layer, cfg, masks: Masks):
  """`impl.forward_stacked(q, k_stack, v_stack, layer, cfg, masks)` over layer `layer`
  (an int32 scalar) of a stack of KV caches [L, B, S, K, H], each device on its batch
  and head shard of the stack (the layer axis stays whole)."""
  call = lambda q, k, v, layer, masks: impl.forward_stacked(q, k, v, layer, cfg, masks)
  return _run(call, (q, k_stack, v_stack, layer, masks), masks, (_Q, _LSE),
              roles=(_Q, _KV_STACK, _KV_STACK, ""))


def backward(impl, q, k, v, out, lse, dout, dlse, cfg, masks: Masks):
  """`impl.backward(...)`, each device on its batch and head shard; the one sum across
  devices is a broadcast bias's gradient (`_reduce_dbias`)."""
  call = lambda q, k, v, out, lse, dout, dlse, masks: impl.backward(
      q, k, v, out, lse, dout, dlse, cfg, masks)
  results = (_Q, _KV, _KV)
  if masks.bias is not None:
    B, T, N, _ = q.shape
    results += (_dense_roles(masks.bias.shape, (B, N, T, k.shape[1])),)
  return _run(call, (q, k, v, out, lse, dout, dlse, masks), masks, results)
