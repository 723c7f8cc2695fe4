"""Model shapes in the Pallas kernels: program size under GQA/MQA, no padded copies of
odd lengths and head dims, and NaN propagation (interpret mode on the CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backward import flash_backward
from pallas_kernels.forward import flash_forward
from pallas_kernels.masking import MaskOperands
from pallas_kernels.tuning import default_block_sizes


def _eqns(jaxpr):
  """The equations of a jaxpr and of every jaxpr nested in it (loop bodies, conds)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):   # ClosedJaxpr
          yield from _eqns(sub.jaxpr)
        elif hasattr(sub, "eqns"):                              # Jaxpr
          yield from _eqns(sub)


def _count_eqns(jaxpr) -> int:
  return sum(1 for _ in _eqns(jaxpr))


def _kernel_sizes(N, K, T=16384, H=128, dkv_split=None):
  """{pallas_call name: equations of its kernel body} of the backward, traced only."""
  q = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, T, K, H), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, N, T), jnp.float32)
  bwd = lambda q, k, v, o, lse, do: flash_backward(q, k, v, o, lse, do, scale=0.1,
                                                   is_causal=True, interpret=False,
                                                   dkv_split=dkv_split)
  jaxpr = jax.make_jaxpr(bwd)(q, k, k, q, lse, q).jaxpr
  return {e.params["name"]: _count_eqns(e.params["jaxpr"])
          for e in jaxpr.eqns if e.primitive.name == "pallas_call"}


def test_dkv_kernel_size_does_not_grow_with_the_group():
  # Compile time follows the size of the kernel Triton is given: the query heads of a
  # group must be a loop of the program, not copies of its body. (Whole groups per
  # program: causal groups of four would otherwise run one head per program.)
  mha, gqa, mqa = (_kernel_sizes(16, K, dkv_split=1)["jflash_bwd_dkv"] for K in (16, 4, 1))
  assert gqa <= 1.5 * mha and mqa <= 1.5 * mha, (mha, gqa, mqa)


@pytest.mark.parametrize("H, pieces", [
    (128, [(0, 128)]), (96, [(0, 64), (64, 32)]), (80, [(0, 64), (64, 16)]),
    (192, [(0, 128), (128, 64)]), (72, [(0, 64), (64, 16)]),
    (59, [(0, 32), (32, 16), (48, 16)]), (8, [(0, 16)])])
def test_head_pieces_are_the_binary_digits_of_the_head_dim(H, pieces):
  from pallas_kernels.common import head_pieces
  assert list(head_pieces(H)) == pieces


def _dot_macs(jaxpr) -> int:
  """Multiply-adds of every dot_general in a jaxpr and its nested jaxprs."""
  n = 0
  for eqn in _eqns(jaxpr):
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
      n += int(np.prod(out)) * int(np.prod([lhs[d] for d in lhs_contract]))
  return n


def _kernel_macs(H, T=512, blocks=None):
  """{pallas_call name: multiply-adds of one pass of its body} of forward and backward."""
  q = jax.ShapeDtypeStruct((1, T, 2, H), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 2, T), jnp.float32)

  def fwd_bwd(q, k, v, o, lse, do):
    fwd = flash_forward(q, k, v, scale=0.1, block_sizes=blocks, interpret=False)
    return fwd, flash_backward(q, k, v, o, lse, do, scale=0.1, block_sizes=blocks,
                               interpret=False)
  jaxpr = jax.make_jaxpr(fwd_bwd)(q, q, q, q, lse, q).jaxpr
  return {e.params["name"]: _dot_macs(e.params["jaxpr"])
          for e in jaxpr.eqns if e.primitive.name == "pallas_call"}


@pytest.mark.parametrize("H", [96, 80])
def test_tensor_core_work_follows_the_head_dim_not_its_padded_width(H):
  # On the same tiles (the d = 128 row), split into power-of-two pieces, each tile's
  # products cost H / 128 of the 128-wide tile's, in every kernel.
  blocks = default_block_sizes(128)
  wide, narrow = _kernel_macs(128, blocks=blocks), _kernel_macs(H, blocks=blocks)
  assert wide.keys() == narrow.keys() and len(wide) == 3, (wide, narrow)
  for name in wide:
    assert narrow[name] * 128 == wide[name] * H, (name, narrow[name], wide[name])


def _pallas_operands(B=1, T=97, S=113, N=4, K=2, H=80):
  fwd = lambda q, k, v: flash_forward(q, k, v, scale=H ** -0.5, is_causal=True,
                                      interpret=True)
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)

  def fwd_bwd(q, k, v):
    out, lse = fwd(q, k, v)
    return flash_backward(q, k, v, out, lse, out, scale=H ** -0.5, is_causal=True,
                          interpret=True)
  return jax.make_jaxpr(fwd_bwd)(q, kv, kv).jaxpr


def test_odd_lengths_and_head_dims_are_not_padded_in_memory():
  # T, S and H that are not whole tiles: the kernels read and write the caller's arrays
  # as they are (masked tail tiles), so no padded copy of q, k, v, dO or the results
  # exists outside the kernels.
  jaxpr = _pallas_operands()
  prims = {e.primitive.name for e in jaxpr.eqns}
  assert "pad" not in prims and "slice" not in prims, sorted(prims)
  for e in jaxpr.eqns:
    if e.primitive.name == "pallas_call":
      shapes = {tuple(v.aval.shape) for v in (*e.invars, *e.outvars)}
      assert not any(s[-1] == 128 for s in shapes if len(s) == 4), (e.params["name"], shapes)


def _run(q, k, v, mask=None):
  """(out, lse, dq, dk, dv) of the kernels, causal, with an all-ones output cotangent."""
  H = q.shape[-1]
  ops = MaskOperands(mask=mask)
  out, lse = flash_forward(q, k, v, scale=H ** -0.5, is_causal=True, ops=ops, interpret=True)
  grads = flash_backward(q, k, v, out, lse, jnp.ones_like(out), scale=H ** -0.5,
                         is_causal=True, ops=ops, interpret=True)
  return [np.asarray(x) for x in (out, lse, *grads)]


def _qkv(T=40, N=1, H=16):
  r = np.random.default_rng(0)
  return [r.standard_normal((1, T, N, H)).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_nan_in_a_visible_query_reaches_its_row_and_gradients(bad):
  q, k, v = _qkv()
  q[0, 3, 0, 0] = bad   # row 3 sees keys 0..3 (causal)
  out, lse, dq, dk, dv = _run(q, k, v)
  row_nan = lambda x: np.isnan(x).any(axis=-1)[0, :, 0]
  assert row_nan(out).tolist() == [i == 3 for i in range(40)]   # not a zero row
  assert np.isnan(lse[0, 0, 3]) and np.isfinite(np.delete(lse[0, 0], 3)).all()
  assert row_nan(dq)[3] and not np.delete(row_nan(dq), 3).any()
  # dV_j = sum_i P_ij dO_i: only keys row 3 sees (an infinite logit of -inf is a zero
  # weight too); a hidden key keeps P = 0 although the row's lse is NaN.
  assert row_nan(dv)[:4].any() and not row_nan(dv)[4:].any()
  assert np.isnan(dk).any()


def test_nan_in_a_visible_key_reaches_every_row_that_sees_it():
  q, k, v = _qkv()
  k[0, 5, 0, 0] = np.nan
  out, lse, dq, dk, dv = _run(q, k, v)
  assert np.isnan(out).any(axis=-1)[0, :, 0].tolist() == [i >= 5 for i in range(40)]
  assert np.isfinite(lse[0, 0, :5]).all() and np.isnan(lse[0, 0, 5:]).all()
  # (dQ of rows 0..4 is NaN too, as in any matmul dS K with a NaN row of K: 0 * NaN.)
  assert np.isnan(dq[0, 5:]).any(axis=-1).all() and np.isnan(dk).any() and np.isnan(dv).any()


def test_a_row_the_mask_empties_is_zero_even_with_nan_in_its_query():
  q, k, v = _qkv()
  q[0, 7, 0, :] = np.nan
  mask = np.ones((1, 1, 40, 40), bool)
  mask[0, 0, 7, :] = False          # row 7 sees nothing: a zero row, lse = -inf
  out, lse, dq, dk, dv = _run(q, k, v, mask=jnp.asarray(mask))
  assert (out[0, 7] == 0).all() and lse[0, 0, 7] == -np.inf
  for x in (out, dq, dv):   # (dK = dS^T Q meets the NaN row of Q as 0 * NaN, as any matmul)
    assert np.isfinite(x).all()
  assert (dq[0, 7] == 0).all()


def test_split_group_matches_the_reference_like_the_whole_group():
  # A GQA group split over several dK/dV programs sums the same terms in another order
  # (float32 partial sums added afterwards): the 2x rule against the float64 truth.
  import jflash
  r = np.random.default_rng(3)
  B, T, S, N, K, H = 1, 97, 113, 4, 1, 80
  q, do = (r.standard_normal((B, T, N, H)).astype(np.float32) for _ in range(2))
  k, v = (r.standard_normal((B, S, K, H)).astype(np.float32) for _ in range(2))
  ref = jflash.attention_numpy(q, k, v, is_causal=True, dout=do)[2:5]
  out, lse = flash_forward(q, k, v, scale=H ** -0.5, is_causal=True, interpret=True)
  grads = {p: flash_backward(q, k, v, out, lse, do, scale=H ** -0.5, is_causal=True,
                             interpret=True, dkv_split=p) for p in (1, 2, 4)}
  eps = float(np.finfo(np.float32).eps)
  for p in (2, 4):
    for name, g, g1, t in zip(("dq", "dk", "dv"), grads[p], grads[1], ref):
      err, err1 = (float(np.max(np.abs(np.asarray(x, np.float64) - t))) for x in (g, g1))
      assert err <= 2 * err1 + 4 * eps * np.sqrt(H) * max(1.0, np.abs(t).max()), (p, name)
  with pytest.raises(ValueError, match="dkv_split=3"):
    flash_backward(q, k, v, out, lse, do, scale=H ** -0.5, interpret=True, dkv_split=3)


def test_query_tail_in_the_dkv_loop_with_windows_that_end_early():
  # T = 72 in dK/dV query blocks of 16: blocks 0-3 are whole, block 4 overruns T and is
  # the only one with masked query loads. A window of 13 keys makes most key blocks'
  # query ranges end before block 4 (hi < T // 16) or start at it (lo = T // 16), so
  # each range case of `visit_query_blocks` runs; gradients within the 2x rule of the
  # plain float32 implementation's against the float64 truth.
  import jflash
  r = np.random.default_rng(5)
  B, T, N, H = 1, 72, 2, 32
  q, k, v, do = (r.standard_normal((B, T, N, H)).astype(np.float32) for _ in range(4))
  kw = dict(is_causal=True, local_window_size=(13, 0))
  ref = jflash.attention_numpy(q, k, v, dout=do, **kw)[2:5]
  config = jflash.PallasConfig(block_q_dkv=16, block_k_dkv=16)

  def grads(impl, config=None):
    f = lambda q, k, v: jnp.vdot(jflash.attention(q, k, v, implementation=impl,  # noqa: E731
                                                  config=config, **kw), do)
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)
  got, plain = grads("pallas", config), grads("xla")
  eps = float(np.finfo(np.float32).eps)
  for name, g, p, t in zip(("dq", "dk", "dv"), got, plain, ref):
    err, err_plain = (float(np.max(np.abs(np.asarray(x, np.float64) - t))) for x in (g, p))
    assert err <= 2 * err_plain + 4 * eps * np.sqrt(H) * max(1.0, np.abs(t).max()), name


def test_split_rule():
  # Compiled (interpret=False): causal groups of up to four heads run one head per
  # program; larger groups and non-causal calls split only to reach the program count.
  from pallas_kernels.backward import CAUSAL_FULL_SPLIT_MAX_GROUP, DKV_MIN_PROGRAMS, dkv_splits
  many = DKV_MIN_PROGRAMS
  assert CAUSAL_FULL_SPLIT_MAX_GROUP == 4
  assert dkv_splits(4, many, False, causal=True) == 4
  assert dkv_splits(2, many, False, causal=True) == 2
  assert dkv_splits(4, many, False, causal=False) == 1
  assert dkv_splits(16, many // 4, False, causal=True) == 4      # the program rule
  assert dkv_splits(16, many // 4, False, causal=False) == 4
  assert dkv_splits(4, many, True, causal=True) == 1             # interpreted: whole groups


@pytest.mark.parametrize("causal, parts", [(True, 4), (False, 1)])
def test_causal_calls_reach_the_split_rule(causal, parts):
  # GQA-4, batch 8 x 2048 keys x 2 key heads: 512 dK/dV programs unsplit (enough), so
  # only the causal rule splits; the split kernel writes one float32 partial per part.
  B, T, N, K, H = 8, 2048, 8, 2, 64
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
  bwd = lambda q, k, v, o, lse, do: flash_backward(q, k, v, o, lse, do, scale=0.1,
                                                   is_causal=causal, interpret=False)
  jaxpr = jax.make_jaxpr(bwd)(q, k, k, q, lse, q).jaxpr
  dkv = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"
         and e.params["name"] == "jflash_bwd_dkv"][0]
  shapes = {tuple(v.aval.shape) for v in dkv.outvars}
  assert shapes == ({(parts, B, T, K, H)} if parts > 1 else {(B, T, K, H)}), shapes
