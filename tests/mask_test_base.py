"""One test base for the mask options of every implementation; each
implementation subclasses it in one line in tests/test_masks.py.

Every option and the main pairs of options run forward and backward (the bias
gradient included, at its three shapes [B,N,T,S], [1,N,T,S], [B,1,T,S]) against the
float64 NumPy truth `jflash.attention_numpy`. Every case has GQA (N=4, K=2) or MQA
(N=4, K=1) heads, so "GQA with each option" is covered by the same runs.

Tolerance, as in tests/attention_test_base.py: the error against float64 must be at
most twice the error of the same-dtype plain implementation ("xla", which
materialises the scores) plus a floor of a few roundings. "xla" itself is held to
that rule-based floor alone, with the longest reduction (max(T, S)) as its length.

Compile time of the Pallas kernels in interpret mode (seconds per distinct option
set) is what costs here: each case is one jitted forward + backward program, built
once per (implementation, case, dtype) and reused by every test that needs it.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash.masks import Masks, dense_keep_numpy, seed_from_key
from pallas_kernels.masking import dropout_keep_numpy
from tests.attention_test_base import floor, max_err, tile_config

# Tiles of 16 so that T, S of 40-100 span several tiles and clip the last one.
BLOCKS = (16, 16)
GRAD_NAMES = ("dq", "dk", "dv", "dbias")


# -- cases ----------------------------------------------------------------------------

def _docs(r, B, L, n):
  """[B, L] int32 ids of n contiguous documents of random lengths per row."""
  ids = np.zeros((B, L), np.int32)
  for b in range(B):
    cuts = np.sort(r.choice(np.arange(1, L), n - 1, replace=False))
    ids[b] = np.searchsorted(cuts, np.arange(L), side="right")
  return ids


def _bias(r, shape):
  return r.standard_normal(shape)


def _mask(r, shape, p=0.6):
  return r.random(shape) < p


@dataclasses.dataclass(frozen=True)
class Case:
  """One option set: static keyword options and a builder of the array options."""

  name: str
  shape: tuple[int, int, int, int, int, int]     # (B, T, S, N, K, H)
  static: tuple = ()                             # sorted (kwarg, value) pairs
  arrays: Callable | None = None                 # (rng, B, T, S, N) -> dict of numpy arrays
  q_scale: float = 1.0                           # larger logits where the soft cap must bite

  @property
  def kwargs(self) -> dict:
    return dict(self.static)


def _case(name, shape, arrays=None, q_scale=1.0, **static):
  return Case(name, shape, tuple(sorted(static.items())), arrays, q_scale)


def _mask_arrays(r, B, T, S, N):
  mask = _mask(r, (B, 1, T, S))
  mask[1, 0, 5] = False           # a row that sees no key
  return dict(mask=mask)


def _length_arrays(r, B, T, S, N):
  # Batch 0: query padding; batch 1: key padding; batch 2: a query length of 0.
  return dict(query_seq_lengths=np.array([T - 15, T, 0], np.int32),
              key_value_seq_lengths=np.array([S, 23, S - 30], np.int32))


def _segment_pair_arrays(r, B, T, S, N):
  q_ids, kv_ids = _docs(r, B, T, 3), _docs(r, B, S, 3)
  q_ids[0, -6:] = 7               # an id no key has: rows that see no key
  return dict(segment_ids=(q_ids, kv_ids))


def _bias_mask_arrays(r, B, T, S, N):
  mask = _mask(r, (1, N, T, S))
  mask[0, 2, 9] = False           # row 9 of head 2 sees no key, in every batch
  return dict(bias=_bias(r, (B, 1, T, S)), mask=mask)


def _lengths_segments_arrays(r, B, T, S, N):
  # Batch 0 has no keys at all (every row fully masked); batch 1 is padded both ways.
  return dict(query_seq_lengths=np.array([T, 45], np.int32),
              key_value_seq_lengths=np.array([0, 60], np.int32),
              segment_ids=_docs(r, B, T, 3))


CASES = {c.name: c for c in (
    # -- each option alone (GQA 4:2 throughout)
    _case("bias", (2, 56, 88, 4, 2, 16), lambda r, B, T, S, N: dict(bias=_bias(r, (B, N, T, S)))),
    _case("mask", (2, 72, 72, 4, 2, 16), _mask_arrays),
    _case("lengths", (3, 56, 88, 4, 2, 16), _length_arrays),
    _case("segments", (2, 56, 88, 4, 2, 16), _segment_pair_arrays),
    _case("window", (2, 56, 88, 4, 2, 16), local_window_size=(20, 3)),
    _case("softcap", (2, 72, 72, 4, 2, 16), q_scale=4.0, logits_soft_cap=2.0),
    # -- the main pairs
    _case("causal+window", (2, 72, 72, 4, 2, 16), is_causal=True, local_window_size=13),
    _case("causal+segments", (2, 72, 72, 4, 2, 16),
          lambda r, B, T, S, N: dict(segment_ids=_docs(r, B, T, 4)), is_causal=True),
    _case("lengths+segments", (2, 72, 72, 4, 2, 16), _lengths_segments_arrays),
    _case("bias+mask", (2, 72, 72, 4, 2, 16), _bias_mask_arrays),
    _case("softcap+bias", (2, 56, 88, 4, 1, 16),   # MQA
          lambda r, B, T, S, N: dict(bias=_bias(r, (1, N, T, S))), q_scale=3.0,
          logits_soft_cap=3.0),
    _case("dropout+causal", (2, 72, 72, 4, 2, 16),
          lambda r, B, T, S, N: dict(dropout_rng=jax.random.key(7)),
          is_causal=True, dropout_rate=0.3),
)}
FLOAT32_CASES = tuple(CASES)
BF16_CASES = ["bias+mask"]           # a spot check: half-precision bias and its gradient
PADDED_CASES = ["lengths", "lengths+segments"]
FULLY_MASKED_CASES = ("mask", "bias+mask", "lengths", "segments", "lengths+segments")


def pytest_generate_tests(metafunc):
  """Per-class case lists (pytest's documented per-class parametrization): a test
  module that subclasses MaskTestBase imports this hook. An empty list is one skipped
  case that says why (the class's `no_cases_reason`)."""
  for arg, attr in (("float32_case", "float32_cases"), ("masked_case", "fully_masked_cases"),
                    ("half_case", "half_cases")):
    if arg in metafunc.fixturenames:
      cases = getattr(metafunc.cls, attr)
      if not cases:
        reason = metafunc.cls.no_cases_reason.get(attr, f"no {attr}")
        cases = [pytest.param(None, marks=pytest.mark.skip(reason=reason))]
      metafunc.parametrize(arg, cases)


@functools.cache
def case_inputs(name: str, dtype_name: str):
  """(q, k, v, do, arrays) for a case, deterministic; float arrays in the case's dtype."""
  case = CASES[name]
  B, T, S, N, K, H = case.shape
  dtype = jnp.dtype(dtype_name)
  r = np.random.default_rng(sum(map(ord, name)))
  cast = lambda x: jnp.asarray(x, dtype)
  q = cast(r.standard_normal((B, T, N, H)) * case.q_scale)
  k, v = cast(r.standard_normal((B, S, K, H))), cast(r.standard_normal((B, S, K, H)))
  do = cast(r.standard_normal((B, T, N, H)))
  arrays = {}
  for key, x in (case.arrays(r, B, T, S, N) if case.arrays else {}).items():
    if key == "bias":
      x = cast(x)
    elif key == "mask":
      x = jnp.asarray(x, bool)
    elif key == "segment_ids":
      x = tuple(map(jnp.asarray, x)) if isinstance(x, tuple) else jnp.asarray(x)
    elif key != "dropout_rng":
      x = jnp.asarray(x)
    arrays[key] = x
  return q, k, v, do, arrays


def reference_kwargs(case: Case, arrays: dict) -> dict:
  """attention_numpy's keywords for a case (the dropout key becomes its hashed seed)."""
  kw = dict(case.kwargs)
  for key, x in arrays.items():
    if key == "dropout_rng":
      kw["dropout_seed"] = int(seed_from_key(x))
    elif key == "segment_ids":
      kw[key] = tuple(map(np.asarray, x)) if isinstance(x, tuple) else np.asarray(x)
    else:
      kw[key] = np.asarray(x, np.float64) if key == "bias" else np.asarray(x)
  return kw


@functools.cache
def reference(name: str, dtype_name: str):
  """float64 truth (out, lse, dq, dk, dv[, dbias]) on the (rounded) inputs of the case."""
  q, k, v, do, arrays = case_inputs(name, dtype_name)
  return jflash.attention_numpy(q, k, v, dout=do, **reference_kwargs(CASES[name], arrays))


def fully_masked_rows(name: str) -> np.ndarray:
  """[B, N, T] bool: rows that see no key under the case's masks."""
  case = CASES[name]
  B, T, S, N, K, H = case.shape
  _, _, _, _, a = case_inputs(name, "float32")
  kw = case.kwargs
  seg = a.get("segment_ids")
  q_seg = kv_seg = None
  if seg is not None:
    q_seg, kv_seg = seg if isinstance(seg, tuple) else (seg, seg)
  window = kw.get("local_window_size")
  window = (window, window) if isinstance(window, int) else window
  keep = dense_keep_numpy(
      B, N, T, S, Masks(is_causal=kw.get("is_causal", False), window=window,
                        mask=a.get("mask"), q_lengths=a.get("query_seq_lengths"),
                        kv_lengths=a.get("key_value_seq_lengths"), q_segment_ids=q_seg,
                        kv_segment_ids=kv_seg))
  return ~keep.any(-1)


_FNS: dict = {}


def case_fn(implementation: str, name: str, dtype_name: str, blocks=BLOCKS):
  """Jitted (q, k, v, do, arrays) -> (out, lse, dq, dk, dv, dbias), one per case."""
  key = (implementation, name, dtype_name)
  if key not in _FNS:
    kwargs = CASES[name].kwargs

    def run(q, k, v, do, arrays):
      arrays = dict(arrays)
      bias = arrays.pop("bias", None)

      def f(q, k, v, bias):
        return jflash.attention(q, k, v, bias, implementation=implementation,
                                config=tile_config(implementation, *blocks),
                                return_residuals=True, **kwargs, **arrays)
      (out, lse), vjp = jax.vjp(f, q, k, v, bias)
      return (out, lse, *vjp((do, jnp.zeros_like(lse))))
    _FNS[key] = jax.jit(run)
  return _FNS[key]


@functools.cache
def plain(name: str, dtype_name: str):
  """The same-dtype materialising implementation's results, for the 2x rule."""
  q, k, v, do, arrays = case_inputs(name, dtype_name)
  return jax.device_get(case_fn("xla", name, dtype_name)(q, k, v, do, arrays))


def with_nan_padding(q, k, v, arrays):
  """q rows past query_seq_lengths and k/v rows past key_value_seq_lengths set to NaN."""
  def fill(x, lengths):
    if lengths is None:
      return x
    pad = np.arange(x.shape[1])[None, :] >= np.asarray(lengths)[:, None]
    return jnp.where(pad[:, :, None, None], jnp.nan, x)
  return (fill(q, arrays.get("query_seq_lengths")),
          fill(k, arrays.get("key_value_seq_lengths")),
          fill(v, arrays.get("key_value_seq_lengths")))


def _f64(x):
  return np.asarray(x, np.float64)


class MaskTestBase:
  implementation: str = ""
  float32_cases: tuple[str, ...] = FLOAT32_CASES
  half_cases: tuple[str, ...] = tuple(BF16_CASES)
  fully_masked_cases: tuple[str, ...] = FULLY_MASKED_CASES
  padded_cases: tuple[str, ...] = tuple(PADDED_CASES)
  # The dtype of the fully-masked and NaN-padding cases (one the implementation takes).
  dtype_name: str = "float32"
  dropout: bool = True          # whether the implementation has dropout
  no_cases_reason: dict = {}    # why a case list is empty, by its attribute's name

  # -- the tolerance rule ------------------------------------------------------------

  def assert_within_rule(self, got, plain_val, ref, dtype, what, *, head_dim, length):
    got = _f64(got)
    assert got.shape == np.shape(ref), f"{what}: shape {got.shape} != {np.shape(ref)}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    err = max_err(got, ref)
    if self.implementation == "xla":
      # The plain implementation itself: a few roundings of the longest reduction.
      bound = floor(dtype, ref, length)
      assert err <= bound, f"{what}: error {err:.3g} > rule-based bound {bound:.3g}"
      return
    err_plain = max_err(plain_val, ref)
    bound = 2 * err_plain + floor(dtype, ref, head_dim)
    assert err <= bound, f"{what}: error {err:.3g} > 2 x plain {err_plain:.3g} + floor"

  def check_lse(self, got, plain_val, ref, dtype, what, **kw):
    got, ref = _f64(got), _f64(ref)
    assert np.array_equal(np.isneginf(got), np.isneginf(ref)), f"{what}: -inf rows differ"
    fin = np.isfinite(ref)
    self.assert_within_rule(got[fin], _f64(plain_val)[fin], ref[fin], dtype, what, **kw)

  def check_all(self, name, dtype_name, got, tag=""):
    """out, lse and every gradient of a case against the float64 truth."""
    case = CASES[name]
    B, T, S, N, K, H = case.shape
    dtype = jnp.dtype(dtype_name)
    ref = reference(name, dtype_name)
    pl = plain(name, dtype_name)
    kw = dict(head_dim=H, length=max(T, S))
    what = f"{self.implementation} {name} {dtype_name}{tag}"
    self.check_lse(got[1], pl[1], ref[1], dtype, f"{what} lse", **kw)
    refs = (ref[0], *ref[2:])
    gots = (got[0], *got[2:2 + len(refs) - 1])
    pls = (pl[0], *pl[2:2 + len(refs) - 1])
    for label, g, p, r in zip(("out", *GRAD_NAMES), gots, pls, refs):
      assert g.dtype == dtype, f"{what} {label}: dtype {g.dtype}"
      self.assert_within_rule(g, p, r, dtype, f"{what} {label}", **kw)
    has_bias = "bias" in case_inputs(name, dtype_name)[4]
    assert (got[5] is not None) == has_bias, f"{what}: dbias presence"

  def run_case(self, name, dtype_name=None, inputs=None):
    dtype_name = dtype_name or self.dtype_name
    q, k, v, do, arrays = inputs or case_inputs(name, dtype_name)
    return jax.device_get(case_fn(self.implementation, name, dtype_name)(q, k, v, do, arrays))

  # -- every option and the main pairs against float64 --------------------------------

  def test_matches_reference_float32(self, float32_case):
    self.check_all(float32_case, "float32", self.run_case(float32_case, "float32"))

  def test_matches_reference_bfloat16(self, half_case):
    self.check_all(half_case, "bfloat16", self.run_case(half_case, "bfloat16"))

  # -- fully masked rows and NaN padding ------------------------------------------------

  def test_fully_masked_rows_are_zero_with_finite_gradients(self, masked_case):
    name = masked_case
    rows = fully_masked_rows(name)           # [B, N, T]
    assert rows.any(), f"{name}: the case has no fully masked row"
    out, lse, dq, dk, dv, _ = self.run_case(name)
    out_rows = np.transpose(np.asarray(out), (0, 2, 1, 3))    # [B, N, T, H]
    dq_rows = np.transpose(np.asarray(dq), (0, 2, 1, 3))
    assert np.all(out_rows[rows] == 0), "fully masked rows must be exactly zero"
    assert np.all(dq_rows[rows] == 0), "a row that sees no key has no gradient"
    assert np.all(np.isneginf(np.asarray(lse)[rows]))
    assert np.all(np.isfinite(np.asarray(lse)[~rows]))
    for g in (out, dq, dk, dv):
      assert np.all(np.isfinite(np.asarray(g)))

  @pytest.mark.parametrize("which", range(len(PADDED_CASES)))
  def test_nan_in_padding_does_not_leak(self, which):
    # The truth does not depend on what padding holds, so NaN padding must give the
    # same results (valid rows, padded rows' zeros, zero gradients for padding).
    name = self.padded_cases[which]
    q, k, v, do, arrays = case_inputs(name, self.dtype_name)
    qn, kn, vn = with_nan_padding(q, k, v, arrays)
    assert np.isnan(np.asarray(qn)).any() and np.isnan(np.asarray(kn)).any()
    got = self.run_case(name, inputs=(qn, kn, vn, do, arrays))
    self.check_all(name, self.dtype_name, got, tag=" (NaN padding)")
    for x, lengths, g in ((q, arrays["query_seq_lengths"], got[2]),
                          (k, arrays["key_value_seq_lengths"], got[3]),
                          (v, arrays["key_value_seq_lengths"], got[4])):
      pad = np.arange(x.shape[1])[None, :] >= np.asarray(lengths)[:, None]
      assert np.all(np.asarray(g)[pad] == 0), "padding must get exactly zero gradient"

  # -- dropout ---------------------------------------------------------------------------

  def require_dropout(self):
    if not self.dropout:
      pytest.skip(f"{self.implementation} has no dropout (NotImplementedError, tested "
                  "with its refusals)")

  def test_dropout_same_key_bit_identical_different_key_differs(self):
    self.require_dropout()
    name = "dropout+causal"
    q, k, v, do, arrays = case_inputs(name, "float32")
    first = self.run_case(name)
    again = self.run_case(name, inputs=(q, k, v, do, dict(arrays)))
    for label, a, b in zip(("out", "lse", *GRAD_NAMES), first, again):
      if a is not None:
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"{label} not bit-identical"
    other = dict(arrays, dropout_rng=jax.random.key(8))
    diff = self.run_case(name, inputs=(q, k, v, do, other))
    for label, a, b in zip(("out", "dq", "dk", "dv"), (first[0], *first[2:5]),
                           (diff[0], *diff[2:5])):
      assert not np.array_equal(np.asarray(a), np.asarray(b)), f"{label}: key ignored"
    np.testing.assert_array_equal(first[1], diff[1])  # lse: dropout acts after the softmax
    B, T, S, N, K, H = CASES[name].shape
    s1, s2 = (int(seed_from_key(x)) for x in (arrays["dropout_rng"], other["dropout_rng"]))
    m1, m2 = (dropout_keep_numpy(s, B, N, T, S, 0.3) for s in (s1, s2))
    # Independent masks disagree on a fraction 2 r (1 - r) = 0.42 of the entries.
    assert 0.38 < np.mean(m1 != m2) < 0.46

  def test_dropout_rate_zero_is_no_dropout(self):
    # The same program, forward and backward, equation for equation: so bit-identical
    # results, without compiling both (seconds per kernel in interpret mode).
    self.require_dropout()
    q, k, v, do = (x[:1, :40, :2] for x in case_inputs("dropout+causal", "float32")[:4])
    k, v = k[:, :, :1], v[:, :, :1]

    def program(**kw):
      def run(q, k, v, do, rng):
        f = lambda q, k, v: jflash.attention(
            q, k, v, is_causal=True, config=tile_config(self.implementation, *BLOCKS),
            implementation=self.implementation,
            **{key: (rng if val == "rng" else val) for key, val in kw.items()})
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(do))
      return str(jax.make_jaxpr(run)(q, k, v, do, jax.random.key(3)))
    without = program()
    assert program(dropout_rate=0.0, dropout_rng="rng") == without
    assert program(dropout_rate=0.0) == without
    assert program(dropout_rate=0.1, dropout_rng="rng") != without  # the comparison can fail

  @pytest.mark.parametrize("rate", [0.1, 0.3, 0.9])
  def test_dropout_keep_rate_of_the_hash(self, rate):
    # 4M draws: the standard error of the mean is <= 2.5e-4, far inside 1% of 1 - rate.
    keep = dropout_keep_numpy(1234567, 2, 8, 512, 512, rate)
    assert abs(keep.mean() - (1 - rate)) <= 0.01 * (1 - rate)

  def test_dropout_mask_in_the_kernel(self):
    # q = 0 makes every probability exactly 1/S, and one-hot values (v[j] = e_j, H = S)
    # make out[b, i, n, j] = Z[b, n, i, j] / (S (1 - rate)): the kernel's own keep mask,
    # read back exactly and compared with the explicit one of the same hash.
    self.require_dropout()
    B, T, S, N, K, rate = 2, 256, 64, 4, 2, 0.3
    q = jnp.zeros((B, T, N, S), jnp.float32)
    k = jnp.zeros((B, S, K, S), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, K, S))
    rng = jax.random.key(11)
    f = jax.jit(lambda q, k, v, rng: jflash.attention(
        q, k, v, dropout_rate=rate, dropout_rng=rng, implementation=self.implementation,
        config=tile_config(self.implementation, *BLOCKS)))
    scaled = np.asarray(f(q, k, v, rng), np.float64) * S * (1 - rate)   # [B, T, N, S]
    z = np.rint(scaled)
    np.testing.assert_allclose(scaled, z, rtol=0, atol=1e-4)
    z = np.transpose(z, (0, 2, 1, 3)).astype(bool)                      # [B, N, T, S]
    want = dropout_keep_numpy(int(seed_from_key(rng)), B, N, T, S, rate)
    np.testing.assert_array_equal(z, want)
    assert abs(z.mean() - (1 - rate)) <= 0.01 * (1 - rate)   # 131k draws: 4 standard errors

  # -- bad input --------------------------------------------------------------------------

  @pytest.mark.parametrize("what", [
      "mask_shape", "mask_rank", "mask_dtype", "bias_shape", "bias_heads", "bias_dtype",
      "q_length_high", "kv_length_negative", "length_shape", "length_dtype",
      "segments_shape", "segments_single_t_ne_s", "segments_triple", "rate_one",
      "rate_negative", "rate_bool", "dropout_without_key", "window_negative",
      "window_triple", "window_float", "softcap_zero", "softcap_inf"])
  def test_bad_input_raises_value_error(self, what):
    B, T, S, N, K, H = 2, 24, 40, 4, 2, 16
    q = jnp.zeros((B, T, N, H), jnp.float32)
    k = v = jnp.zeros((B, S, K, H), jnp.float32)
    i32 = lambda *x: jnp.asarray(x, jnp.int32)
    kw, msg = {
        "mask_shape": (dict(mask=jnp.ones((B, N, T, S + 1), bool)),
                       f"mask.shape=({B}, {N}, {T}, {S + 1})"),
        "mask_rank": (dict(mask=jnp.ones((1, B, N, T, S), bool)),
                      f"mask.shape=(1, {B}, {N}, {T}, {S}) must broadcast"),
        "mask_dtype": (dict(mask=jnp.ones((B, N, T, S), jnp.float32)), "mask.dtype=float32"),
        "bias_shape": (dict(bias=jnp.zeros((3, N, T, S))), f"bias.shape=(3, {N}, {T}, {S})"),
        "bias_heads": (dict(bias=jnp.zeros((1, K, T, S))), f"bias.shape=(1, {K}, {T}, {S})"),
        "bias_dtype": (dict(bias=jnp.zeros((1, 1, T, S), jnp.int32)), "bias.dtype=int32"),
        "q_length_high": (dict(query_seq_lengths=i32(T + 1, 3)),
                          f"query_seq_lengths must lie in [0, {T}], got [{T + 1}, 3]"),
        "kv_length_negative": (dict(key_value_seq_lengths=i32(-1, 3)),
                               f"key_value_seq_lengths must lie in [0, {S}], got [-1, 3]"),
        "length_shape": (dict(key_value_seq_lengths=i32(1, 2, 3)),
                         "key_value_seq_lengths.shape=(3,)"),
        "length_dtype": (dict(query_seq_lengths=jnp.asarray([1.0, 2.0])),
                         "query_seq_lengths must be an integer array, got float32"),
        "segments_shape": (dict(segment_ids=(jnp.zeros((B, T + 1), jnp.int32),
                                             jnp.zeros((B, S), jnp.int32))),
                           f"q segment_ids.shape=({B}, {T + 1})"),
        "segments_single_t_ne_s": (dict(segment_ids=jnp.zeros((B, T), jnp.int32)),
                                   f"T == S (got T={T}, S={S})"),
        "segments_triple": (dict(segment_ids=(jnp.zeros((B, T), jnp.int32),) * 3),
                            "got a sequence of 3"),
        "rate_one": (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), "got 1.0"),
        "rate_negative": (dict(dropout_rate=-0.1, dropout_rng=jax.random.key(0)), "got -0.1"),
        "rate_bool": (dict(dropout_rate=True, dropout_rng=jax.random.key(0)), "got True"),
        "dropout_without_key": (dict(dropout_rate=0.25), "dropout_rate=0.25 needs a dropout_rng"),
        "window_negative": (dict(local_window_size=-1), "got -1"),
        "window_triple": (dict(local_window_size=(1, 2, 3)), "got (1, 2, 3)"),
        "window_float": (dict(local_window_size=(2.5, 1)), "got (2.5, 1)"),
        "softcap_zero": (dict(logits_soft_cap=0.0), "got 0.0"),
        "softcap_inf": (dict(logits_soft_cap=float("inf")), "got inf"),
    }[what]
    with pytest.raises(ValueError, match=re.escape(msg)):
      jflash.attention(q, k, v, implementation=self.implementation,
                       config=tile_config(self.implementation, *BLOCKS), **kw)
