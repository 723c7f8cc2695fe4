"""Ring attention (`jflash.parallel`) against single-device `jflash.attention`.

Multi-device checks need `XLA_FLAGS=--xla_force_host_platform_device_count=8` before
jax initialises its backend, while the rest of the suite shares this pytest process
and its single CPU device. So one subprocess (this file run as a script with
`--worker`) computes every multi-device case once and prints their errors as JSON;
each test below reads its own case and asserts on it. Checks that need one device
run in this process.

Tolerance rule (float32, as in flash-attn's tests): against a float64 NumPy truth the
ring's error may be at most twice the error of single-device "xla_chunked" in the
same dtype, plus a floor of 4 float32 ulps of the largest true value (the ring adds
one more rounding per merged block, of that order); and the ring may differ from
"xla_chunked" by no more than the sum of their two error allowances.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
NUM_DEVICES = 8
RESULT_MARK = "RING_RESULTS_JSON="

# (id, devices P, is_causal, layout, N, K, extra ring_attention kwargs)
CASES = [
    ("p2-full-mha", 2, False, "zigzag", 4, 4, {}),
    ("p2-causal-zigzag-mha-blocks16", 2, True, "zigzag", 4, 4, {"block_k": 16}),
    ("p4-full-gqa", 4, False, "zigzag", 4, 2, {"scale": 0.3}),
    ("p4-causal-zigzag-gqa", 4, True, "zigzag", 4, 2, {}),
    ("p4-causal-contiguous-mha", 4, True, "contiguous", 4, 4, {}),
    ("p8-full-mqa", 8, False, "contiguous", 4, 1, {}),
    ("p8-causal-zigzag-gqa-lse", 8, True, "zigzag", 4, 2, {"return_residuals": True}),
    # Every "xla_chunked" case runs under check_vma=True, so it must type-check; this
    # one runs a materialising implementation with no scan, so the ring's own code
    # (switch branches, scan carries, custom_vjp) must.
    ("p4-causal-zigzag-gqa-checkvma", 4, True, "zigzag", 4, 2,
     {"implementation": "dense_test", "check_vma": True}),
    # packed documents: the key ids travel round the ring with their K/V block
    ("p4-causal-zigzag-gqa-segments", 4, True, "zigzag", 4, 2, {"segments": True}),
    ("p8-full-mha-segments", 8, False, "zigzag", 4, 4, {"segments": True}),
    # Gemma 2's soft cap on every block's logits, with packed documents
    ("p4-causal-zigzag-gqa-softcap-segments", 4, True, "zigzag", 4, 2,
     {"logits_soft_cap": 2.0, "segments": True}),
    # Padded batches (global lengths, NaN in the padding): lengths that end inside a
    # shard's first zigzag chunk (17: device 1's) and second (61: device 2's; chunks
    # of 12 tokens at P = 4), a query length of 0, with packed documents; every case
    # of the zigzag ring (DIAG, LOWER, UPPER and, non-causal, FULL) and of the
    # contiguous one (FULL, SKIP), with a key length of 0.
    ("p4-causal-zigzag-gqa-lengths-segments", 4, True, "zigzag", 4, 2,
     {"lengths": ([61, 0], [17, 83]), "segments": True}),
    ("p4-causal-contiguous-gqa-lengths", 4, True, "contiguous", 4, 2,
     {"lengths": ([40, 96], [0, 57])}),
    ("p2-full-zigzag-mha-lengths", 2, False, "zigzag", 4, 4,
     {"lengths": ([50, 96], [7, 33]), "lengths_as_args": True}),
    # The GPU default: the Pallas kernels (interpreted here) under
    # sharded_ring_attention's default check_vma (on). Whole tiles (zigzag chunks of 32
    # tokens, head_dim 32): JAX's Pallas interpreter reads a tile that overruns its
    # array through a pad whose constant shard_map's varying-axes check rejects (the
    # GPU lowering masks the load instead).
    ("p2-causal-zigzag-gqa-pallas", 2, True, "zigzag", 4, 2,
     {"implementation": "pallas", "check_vma": None, "seq": 128, "head_dim": 32}),
]
B, SEQ, HEAD_DIM = 2, 96, 24  # T = 96: local lengths 48/24/12, zigzag chunks 24/12/6


# -- the subprocess ------------------------------------------------------------------

def _truth(q, k, v, do, dl, scale, causal, ids=None, soft_cap=None):
  """float64 (out, lse, dq, dk, dv) of the loss sum(out * do) + sum(lse * dl)."""
  q, k, v, do, dl = (np.asarray(x, np.float64) for x in (q, k, v, do, dl))
  G = q.shape[2] // k.shape[2]
  kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, kr) * scale
  slope = 1.0  # d capped / d logit
  if soft_cap is not None:
    t = np.tanh(s / soft_cap)
    s, slope = soft_cap * t, 1 - t ** 2
  if causal:
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
  if ids is not None:  # every row sees at least itself, so no row is fully masked
    s = np.where((ids[:, :, None] == ids[:, None, :])[:, None], s, -np.inf)
  m = s.max(-1, keepdims=True)
  lse = m[..., 0] + np.log(np.exp(s - m).sum(-1))
  p = np.exp(s - lse[..., None])
  out = np.einsum("bnts,bsnh->btnh", p, vr)
  dp = np.einsum("btnh,bsnh->bnts", do, vr)
  # d lse_i / d s_ij = P_ij: the lse cotangent enters as -dlse in delta.
  ds = p * (dp - (np.einsum("btnh,btnh->bnt", do, out) - dl)[..., None]) * slope
  dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
  fold = lambda x: x.reshape(x.shape[:2] + (k.shape[2], G, x.shape[-1])).sum(3)
  dk = fold(np.einsum("bnts,btnh->bsnh", ds, q) * scale)
  dv = fold(np.einsum("bnts,btnh->bsnh", p, do))
  return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _register_dense_test_impl():
  """A materialising flash-type implementation with no scan carries (vma-clean) and no
  masks but causal (its `supports` refuses the rest), registered in the worker only."""
  import jax.numpy as jnp
  from jflash import api

  def logits(q, k, cfg, masks):
    B_, T_, N, H_ = q.shape
    S, K = k.shape[1], k.shape[2]
    qg = q.reshape(B_, T_, K, N // K, H_)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k) * cfg.scale
    if masks.is_causal:
      s = jnp.where(jnp.tril(jnp.ones((T_, S), bool)), s, -jnp.inf)
    return qg, s

  def supports(q, k, v, cfg, masks):
    lacking = [n for n in masks.in_use() if n != "is_causal"]
    if lacking:
      raise NotImplementedError(f"dense_test has no {lacking}")

  def forward(q, k, v, cfg, masks):
    B_, T_, N, H_ = q.shape
    _, s = logits(q, k, cfg, masks)
    lse = jnp.log(jnp.sum(jnp.exp(s - s.max(-1, keepdims=True)), -1)) + s.max(-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(q.shape)
    return out, lse.reshape(B_, N, T_)

  def backward(q, k, v, out, lse, dout, dlse, cfg, masks):
    qg, s = logits(q, k, cfg, masks)
    dog = dout.reshape(qg.shape)
    lse = lse.reshape(s.shape[:-1])
    p = jnp.exp(s - lse[..., None])
    delta = (jnp.einsum("btnh,btnh->bnt", dout, out) - dlse).reshape(lse.shape)
    ds = p * (jnp.einsum("btkgh,bskh->bkgts", dog, v) - delta[..., None]) * cfg.scale
    return (jnp.einsum("bkgts,bskh->btkgh", ds, k).reshape(q.shape),
            jnp.einsum("bkgts,btkgh->bskh", ds, qg),
            jnp.einsum("bkgts,btkgh->bskh", p, dog))

  api.register_implementation(
      "dense_test", lambda: api.Implementation("dense_test", forward=forward,
                                               backward=backward, supports=supports))


def _unsupported_message(**kw):
  """The error of segment ids (`kw` {}) or another option on an implementation that
  does not have them."""
  import jax.numpy as jnp
  from jflash import parallel

  x = jnp.zeros((1, 8, 2, 8))
  segments = not kw
  ring = parallel.sharded_ring_attention(parallel.make_mesh(2), is_causal=True,
                                         layout="zigzag", with_segment_ids=segments,
                                         implementation="dense_test", **kw)
  try:
    ring(x, x, x, *([jnp.zeros((1, 8), jnp.int32)] if segments else []))
  except NotImplementedError as e:
    return str(e)
  return "no error"


def _run_case(P, causal, layout, N, K, extra):
  import jax
  import jax.numpy as jnp
  import jflash
  from jflash import parallel

  extra = dict(extra)
  T = extra.pop("seq", SEQ)
  H = extra.pop("head_dim", HEAD_DIM)
  block_k = extra.pop("block_k", None)
  check_vma = extra.pop("check_vma", True)   # None: sharded_ring_attention's default
  residuals = extra.get("return_residuals", False)
  segments = extra.pop("segments", False)
  lengths = extra.pop("lengths", None)
  soft_cap = extra.get("logits_soft_cap")
  if block_k:
    extra["config"] = jflash.ChunkedConfig(block_k=block_k)
  extra.setdefault("implementation", "xla_chunked")
  rng = np.random.default_rng(P * 10 + N + K + causal)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, T, K, H)).astype(np.float32)
  v = rng.standard_normal((B, T, K, H)).astype(np.float32)
  do = rng.standard_normal((B, T, N, H)).astype(np.float32)
  dl = (rng.standard_normal((B, N, T)) if residuals else np.zeros((B, N, T))).astype(np.float32)
  # packed documents of random lengths (about 5 per row), ids increasing along T
  ids = np.cumsum(rng.random((B, T)) < 0.05, axis=1).astype(np.int32) if segments else None
  scale = extra.get("scale", 1 / np.sqrt(H))

  len_kw = {}   # global [B] lengths: the same arguments for the ring and the reference
  clean = (q, k, v)
  if lengths is not None:
    len_kw = dict(query_seq_lengths=np.asarray(lengths[0], np.int32),
                  key_value_seq_lengths=np.asarray(lengths[1], np.int32))
    # NaN in the padding, which must reach nothing; the truth sees zeros there
    past = lambda n: np.arange(T)[None, :, None, None] >= np.asarray(n)[:, None, None, None]
    q, k, v = (np.where(past(n), np.nan, x).astype(np.float32)
               for x, n in ((q, lengths[0]), (k, lengths[1]), (v, lengths[1])))
    clean = tuple(np.nan_to_num(x, nan=0.0) for x in (q, k, v))

  mesh = parallel.make_mesh(P)
  if check_vma is not None:
    extra["check_vma"] = check_vma
  # Lengths as closed-over keywords, or (`lengths_as_args`) as the wrapped function's
  # arguments, sharded over the (absent) batch axis.
  as_args = extra.pop("lengths_as_args", False)
  ring = parallel.sharded_ring_attention(mesh, "sp", is_causal=causal, layout=layout,
                                         with_segment_ids=segments, with_lengths=as_args,
                                         **extra, **({} if as_args else len_kw))
  len_args = tuple(jnp.asarray(x) for x in len_kw.values()) if as_args else ()
  zz = layout == "zigzag"
  seg_args = () if ids is None else (jnp.asarray(ids),)
  seg_kw = {} if ids is None else {"segment_ids": jnp.asarray(ids)}

  def ring_loss(q, k, v):
    args = (q, k, v, *seg_args)
    if zz:  # the user-facing flow: permute tokens (and ids), shard, un-permute
      args = tuple(parallel.zigzag_permute(x, P) for x in args)
    res = ring(*args, *len_args)
    out, lse = res if residuals else (res, jnp.zeros((B, N, T)))
    if zz:
      out, lse = parallel.zigzag_unpermute(out, P), parallel.zigzag_unpermute(lse, P, axis=2)
    return jnp.sum(out * do) + jnp.sum(lse * dl), (out, lse)

  def ref_loss(q, k, v):
    out, lse = jflash.attention(q, k, v, is_causal=causal, scale=scale,
                                implementation="xla_chunked", config=extra.get(
                                    "config"), logits_soft_cap=soft_cap,
                                return_residuals=True, **seg_kw, **len_kw)
    return jnp.sum(out * do) + jnp.sum(lse * dl), (out, lse)

  got = {}
  for name, fn in (("ring", ring_loss), ("ref", ref_loss)):
    grads, (out, lse) = jax.jit(jax.grad(fn, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    got[name] = dict(zip(("out", "lse", "dq", "dk", "dv"),
                         (np.asarray(x, np.float64) for x in (out, lse, *grads))))
  if lengths is None:
    truth = _truth(q, k, v, do, dl, scale, causal, ids, soft_cap)
  else:   # rows past a length are empty: the reference with every option
    assert not residuals
    import jflash
    truth = dict(zip(("out", "lse", "dq", "dk", "dv"), jflash.attention_numpy(
        *clean, scale=scale, is_causal=causal, logits_soft_cap=soft_cap, dout=do,
        **{n: np.asarray(x) for n, x in {**seg_kw, **len_kw}.items()})))
  quantities = ("out", "lse", "dq", "dk", "dv") if residuals else ("out", "dq", "dk", "dv")
  err = lambda a, b: float(np.max(np.abs(a - b)))
  return {n: {"ring_vs_truth": err(got["ring"][n], truth[n]),
              "ref_vs_truth": err(got["ref"][n], truth[n]),
              "ring_vs_ref": err(got["ring"][n], got["ref"][n]),
              "max_abs_truth": float(np.max(np.abs(truth[n])))} for n in quantities}


def _traced_work(P, layout):
  """Chunk pairs each device computes, from the traced rule the ring dispatches on."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jflash import parallel

  cost = jnp.asarray([len(parallel.CASE_PAIRS[c]) for c in sorted(parallel.CASE_PAIRS)])

  def count(x):
    i = lax.axis_index("sp")
    n = sum(cost[parallel.block_case(i, (i - s) % P, is_causal=True, layout=layout)]
            for s in range(P))
    return x + n

  fn = jax.shard_map(count, mesh=parallel.make_mesh(P),
                          in_specs=jax.sharding.PartitionSpec("sp"),
                          out_specs=jax.sharding.PartitionSpec("sp"))
  return [int(c) for c in jax.jit(fn)(jnp.zeros(P, jnp.int32))]


def _decoder_check():
  """jflash.nn.DecoderLM, loss and gradients: sequence sharded (one config flag) vs not.

  Returns the largest differences of the sharded model from the unsharded one, and of
  the unsharded one on standard "xla" attention from it: the yardstick of float32
  rounding differences between two correct computations of the same model.
  """
  import dataclasses
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from jflash import parallel
  from jflash.nn import DecoderLM, LMConfig

  P, T_lm = 4, 64
  cfg = LMConfig(vocab_size=64, num_layers=1, hidden=32, num_heads=4, num_kv_heads=2,
                 seq_len=T_lm, attention_implementation="xla_chunked", scan_layers=False)
  rng = np.random.default_rng(1)
  stream = rng.integers(0, 64, size=(2, T_lm + 1)).astype(np.int32)
  tokens, targets = jnp.asarray(stream[:, :-1]), jnp.asarray(stream[:, 1:])

  def loss_and_grads(cfg, tokens, targets, axis=None):
    graphdef, params = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)

    def local(params, tokens, targets):
      def loss(p):  # the mean over all tokens of the global batch
        logits = nnx.merge(graphdef, p)(tokens)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(nll) / targets.size / (P if axis else 1)
      val, grads = jax.value_and_grad(loss)(params)
      if axis is not None:  # replicated parameters: sum the shards' parts
        val, grads = jax.lax.psum((val, grads), axis)
      return val, grads

    if axis is None:
      return jax.jit(local)(params, tokens, targets)
    seq = jax.sharding.PartitionSpec(None, axis)
    rep = jax.sharding.PartitionSpec()
    fn = jax.shard_map(local, mesh=parallel.make_mesh(P, axis), in_specs=(rep, seq, seq),
                       out_specs=(rep, rep), check_vma=False)
    return jax.jit(fn)(params, parallel.zigzag_permute(tokens, P),
                       parallel.zigzag_permute(targets, P))

  base = loss_and_grads(cfg, tokens, targets)
  ring = loss_and_grads(dataclasses.replace(cfg, context_parallel_axis="sp"), tokens,
                        targets, axis="sp")
  xla = loss_and_grads(dataclasses.replace(cfg, attention_implementation="xla"), tokens,
                       targets)
  leaves = lambda r: [r[0], *jax.tree_util.tree_leaves(r[1])]  # loss, then each grad
  diff = lambda a, b: max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(leaves(a),
                                                                         leaves(b)))
  return {"ring_vs_base": diff(ring, base), "xla_vs_base": diff(xla, base),
          "max_abs": max(float(jnp.max(jnp.abs(x))) for x in leaves(base))}


def _worker():
  import jax
  assert jax.device_count() == NUM_DEVICES, jax.devices()  # the flag took effect
  _register_dense_test_impl()
  results = {}
  for cid, P, causal, layout, N, K, extra in CASES:
    try:
      results[cid] = {"ok": True, "errors": _run_case(P, causal, layout, N, K, extra)}
    except Exception:  # reported by that case's test, the others still run
      results[cid] = {"ok": False, "traceback": traceback.format_exc()}
  for P in (2, 4, 8):
    for layout in ("zigzag", "contiguous"):
      results[f"work-{layout}-p{P}"] = _traced_work(P, layout)
  results["segments-unsupported"] = _unsupported_message()
  results["soft-cap-unsupported"] = _unsupported_message(logits_soft_cap=5.0)
  try:
    results["decoder"] = {"ok": True, **_decoder_check()}
  except Exception:
    results["decoder"] = {"ok": False, "traceback": traceback.format_exc()}
  print(RESULT_MARK + json.dumps(results))


# -- the tests -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ring_results():
  env = dict(os.environ)
  # The device count must be set before jax starts, last (XLA takes a flag's last
  # value), beside conftest's compile-time flags.
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={NUM_DEVICES}").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_MARK)]
  if proc.returncode or not lines:
    pytest.fail(f"ring worker failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
  return json.loads(lines[-1][len(RESULT_MARK):])


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_ring_matches_single_device(ring_results, case):
  res = ring_results[case]
  assert res["ok"], f"{case} raised:\n{res.get('traceback')}"
  eps = float(np.finfo(np.float32).eps)
  failures = []
  for name, e in res["errors"].items():
    floor = 4 * eps * e["max_abs_truth"]
    allow = 2 * e["ref_vs_truth"] + floor
    # (written as "not <=" so that a NaN error fails)
    if not e["ring_vs_truth"] <= allow:
      failures.append(f"{name}: |ring - f64| = {e['ring_vs_truth']:.3g} > "
                      f"2 * |xla_chunked - f64| + floor = {allow:.3g}")
    if not e["ring_vs_ref"] <= allow + e["ref_vs_truth"]:
      failures.append(f"{name}: |ring - xla_chunked| = {e['ring_vs_ref']:.3g} > "
                      f"{allow + e['ref_vs_truth']:.3g}")
  assert not failures, f"{case}:\n" + "\n".join(failures)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_zigzag_work_is_balanced_on_devices(ring_results, P):
  zigzag = ring_results[f"work-zigzag-p{P}"]
  contiguous = ring_results[f"work-contiguous-p{P}"]
  assert zigzag == [2 * P + 1] * P, f"zigzag chunk pairs per device: {zigzag}"
  # The same count without the zigzag order is unbalanced: the check has teeth.
  assert contiguous == [4 * i + 3 for i in range(P)], contiguous


def test_decoder_with_sequence_sharded_matches_unsharded(ring_results):
  res = ring_results["decoder"]
  assert res["ok"], f"decoder check raised:\n{res.get('traceback')}"
  eps = float(np.finfo(np.float32).eps)
  allow = 2 * res["xla_vs_base"] + 4 * eps * res["max_abs"]
  assert res["ring_vs_base"] <= allow, (
      f"DecoderLM(context_parallel_axis='sp') on 4 devices differs from the unsharded "
      f"model by {res['ring_vs_base']:.3g} (loss, grads) > 2 x the xla-vs-xla_chunked "
      f"difference + floor = {allow:.3g}")


def test_segment_ids_need_an_implementation_with_mask_arrays(ring_results):
  msg = ring_results["segments-unsupported"]
  assert "segment_ids" in msg and "dense_test" in msg, msg


def test_soft_cap_needs_an_implementation_with_it(ring_results):
  msg = ring_results["soft-cap-unsupported"]
  assert "soft_cap" in msg and "dense_test" in msg, msg


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_computed_chunk_pairs_are_exactly_the_visible_ones(P, layout):
  from jflash import parallel

  # global chunk (of 2P) held as local chunk 0/1 by device i
  def chunk(i, local):
    if layout == "zigzag":
      return i if local == 0 else 2 * P - 1 - i
    return 2 * i + local

  for i in range(P):
    for s in range(P):
      j = (i - s) % P
      case = int(parallel.block_case(i, j, is_causal=True, layout=layout))
      computed = {(chunk(i, a), chunk(j, b)) for a, b in parallel.CASE_PAIRS[case]}
      # causal: query chunk a sees key chunk b (at least partly) iff a >= b
      visible = {(chunk(i, a), chunk(j, b)) for a in (0, 1) for b in (0, 1)
                 if chunk(i, a) >= chunk(j, b)}
      assert computed == visible, (f"device {i}, block of device {j}: case "
                                   f"{parallel.CASE_NAMES[case]} computes {computed}, "
                                   f"visible {visible}")
  work = parallel.chunk_pairs_per_device(P, is_causal=True, layout=layout)
  if layout == "zigzag":
    assert len(set(work)) == 1, work
  assert sum(work) == 2 * P * (2 * P + 1) // 2, work  # every chunk pair a >= b, once
  assert parallel.chunk_pairs_per_device(P, is_causal=False, layout=layout) == [4 * P] * P


@pytest.mark.parametrize("P", [1, 2, 3, 8])
@pytest.mark.parametrize("axis", [1, 2])
def test_zigzag_permute_round_trip(P, axis):
  import jax.numpy as jnp
  from jflash import parallel

  x = jnp.arange(3 * 2 * P * 5 * 4).reshape(3, 2 * P * 5, 4)
  if axis == 2:
    x = x.swapaxes(1, 2)
  y = parallel.zigzag_permute(x, P, axis=axis)
  np.testing.assert_array_equal(parallel.zigzag_unpermute(y, P, axis=axis), x)
  # device i's shard (the i-th of P equal slices) is chunks i and 2P-1-i
  tokens = np.arange(2 * P * 5)
  order = np.asarray(parallel.zigzag_permute(jnp.asarray(tokens)[None], P))[0]
  chunks = tokens.reshape(2 * P, 5)
  for i, shard in enumerate(order.reshape(P, 10)):
    np.testing.assert_array_equal(shard, np.concatenate([chunks[i], chunks[2 * P - 1 - i]]))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_shard_lengths_count_a_prefix_of_each_shard(P, layout):
  """A shard's tokens below a global length are its first `shard_lengths` tokens."""
  import jax.numpy as jnp
  from jflash import parallel

  L = 10                                   # local length: zigzag chunks of 5
  tokens = np.arange(P * L)[None]
  if layout == "zigzag":
    tokens = np.asarray(parallel.zigzag_permute(jnp.asarray(tokens), P))
  lengths = np.arange(P * L + 1)           # every length, one per row
  for i in range(P):
    shard = tokens[0, i * L:(i + 1) * L]
    count = np.asarray(parallel.shard_lengths(lengths, i, L, P, layout))
    valid = shard[None, :] < lengths[:, None]
    np.testing.assert_array_equal(valid, np.arange(L)[None, :] < count[:, None])


@pytest.mark.parametrize("soft_cap, lengths", [(None, False), (2.0, False), (None, True)])
def test_one_device_ring_is_attention(soft_cap, lengths):
  import jax
  import jax.numpy as jnp
  import jflash
  from jflash import parallel

  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 12, 4, 8)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((1, 12, 2, 8)), jnp.float32)
  len_kw = {}
  if lengths:
    len_kw = dict(query_seq_lengths=jnp.asarray([9], jnp.int32),
                  key_value_seq_lengths=jnp.asarray([5], jnp.int32))
  ring = parallel.sharded_ring_attention(parallel.make_mesh(1), is_causal=True,
                                         layout="zigzag", check_vma=False,
                                         implementation="xla_chunked",
                                         logits_soft_cap=soft_cap, **len_kw)
  want = jflash.attention(q, kv, kv, is_causal=True, implementation="xla_chunked",
                          logits_soft_cap=soft_cap, **len_kw)
  np.testing.assert_allclose(jax.jit(ring)(q, kv, kv), want, rtol=0, atol=1e-6)


def test_errors():
  import jax.numpy as jnp
  from jflash import parallel

  mesh = parallel.make_mesh(1)
  x = jnp.zeros((1, 6, 2, 8))
  run = lambda q, k, **kw: parallel.sharded_ring_attention(
      mesh, check_vma=False, **{"layout": "zigzag", **kw})(q, k, k)
  with pytest.raises(ValueError, match="layout='ring'"):
    run(x, x, layout="ring")
  # The layout is stated, never assumed: contiguous shards read as zigzag ones give
  # wrong values that nothing could detect.
  with pytest.raises(TypeError, match="layout"):
    parallel.sharded_ring_attention(mesh, check_vma=False)(x, x, x)
  with pytest.raises(ValueError, match="T/P=5"):
    run(x[:, :5], x[:, :5], is_causal=True)
  with pytest.raises(ValueError, match="S/P=4"):
    run(x, x[:, :4], is_causal=True)
  with pytest.raises(ValueError, match="axis_name='sp' is not a bound mesh axis"):
    parallel.ring_attention(x, x, x, axis_name="sp", layout="zigzag")
  with pytest.raises(ValueError, match="multiple of 2"):
    parallel.zigzag_permute(x, 2)
  with pytest.raises(ValueError, match="num_devices=2"):
    parallel.make_mesh(2, devices=mesh.devices.ravel())
  with pytest.raises(NotImplementedError, match="'xla' has no forward/backward"):
    run(x, x, implementation="xla")
  with pytest.raises(ValueError, match=r"q segment_ids.shape=\(1, 5\)"):
    run(x, x, segment_ids=jnp.zeros((1, 5), jnp.int32))
  with pytest.raises(ValueError, match="kv segment_ids must be an integer array"):
    run(x, x, segment_ids=(jnp.zeros((1, 6), jnp.int32), jnp.zeros((1, 6))))
  with pytest.raises(ValueError, match="logits_soft_cap must be a positive finite number, got -1.0"):
    run(x, x, logits_soft_cap=-1.0)
  # lengths are global: [B] ints in [0, P * local length]
  with pytest.raises(ValueError, match=r"query_seq_lengths must lie in \[0, 6\], got \[7\]"):
    run(x, x, query_seq_lengths=jnp.asarray([7], jnp.int32))
  with pytest.raises(ValueError, match=r"key_value_seq_lengths.shape=\(2,\)"):
    run(x, x, key_value_seq_lengths=jnp.asarray([3, 3], jnp.int32))
  with pytest.raises(ValueError, match="key_value_seq_lengths must be an integer array"):
    run(x, x, key_value_seq_lengths=jnp.asarray([3.0]))
  with pytest.raises(ValueError, match=r"\(two chunks\) for key_value_seq_lengths, got S/P=5"):
    run(x, x[:, :5], key_value_seq_lengths=jnp.asarray([3], jnp.int32))
  # The models' attention under context parallelism: the ring's options only.
  from jflash.nn import core_attention
  with pytest.raises(NotImplementedError, match=r"options \['local_window_size'\]"):
    core_attention(x, x, x, context_parallel_axis="sp", local_window_size=2)
  run(x[:, :5], x[:, :3])  # non-causal attention takes any local lengths


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
  _worker()
