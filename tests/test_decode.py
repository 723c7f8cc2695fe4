"""The split-KV decode kernel (pallas_kernels/decode.py, interpreted on the CPU) and the
KV caches (jflash.kv_cache): a decode step and a ragged chunked prefill over a cache
equal full causal attention's rows of the concatenated sequence (float64 NumPy truth,
tolerance rule of tests/attention_test_base.py with "xla" over the whole sequence as
the plain implementation); paged and contiguous caches give bit-identical results
through the same kernel; appending writes in place."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import decode_impl, kv_cache
from pallas_kernels import decode as dk
from tests.attention_test_base import cache_problem, floor, max_err

F32 = jnp.float32


def _check_rows(got, plain, ref, cache, new, name, length):
  for b, (L, n) in enumerate(zip(cache, new)):
    g = np.asarray(got[b, :n], np.float64)
    assert np.all(np.isfinite(g)), f"row {b} {name}: non-finite"
    want, p = ref[b, L:L + n], plain[b, L:L + n]
    err, err_plain = max_err(g, want), max_err(p, want)
    assert err <= 2 * err_plain + floor(F32, want, length), (b, name, err, err_plain)
    np.testing.assert_array_equal(np.asarray(got[b, n:]), 0)      # padded query rows


CASES = [((40, 3, 0), (1, 1, 1), 8, 2, 48),        # decode, GQA 4, head dim 48
         ((9, 31, 0), (16, 7, 1), 4, 2, 32),       # ragged chunked prefill
         ((50, 17), (1, 1), 4, 4, 16)]             # decode, MHA
CASE_IDS = ["decode_gqa", "chunked_prefill", "decode_mha"]


@pytest.mark.parametrize("cache,new,N,K,H", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_rows_equal_full_causal_attention(cache, new, N, K, H, num_splits):
  S = 64
  call, full = cache_problem(cache, new, S=S, N=N, K=K, H=H, seed=1)
  masks = jflash.prepare(call["q"], call["k"], call["v"], is_causal=True,
                         causal_alignment="bottom_right", query_seq_lengths=call["q_len"],
                         key_value_seq_lengths=call["kv_len"])[1]
  info = decode_impl.row_info(masks, len(cache), call["q"].shape[1], S)
  q = jnp.nan_to_num(call["q"])           # the kernel ignores rows past q_len
  out, lse = dk.decode_forward(q, call["k"], call["v"], info, scale=H ** -0.5, is_causal=True,
                               blocks=dk.DecodeBlocks(block_k=16, num_splits=num_splits))
  ref_out, ref_lse = jflash.attention_numpy(full["q"], full["k"], full["v"], is_causal=True,
                                            key_value_seq_lengths=full["kv_len"])
  plain, plain_lse = jflash.attention(full["q"], full["k"], full["v"], is_causal=True,
                                      key_value_seq_lengths=full["kv_len"],
                                      implementation="xla", return_residuals=True)
  _check_rows(out, plain, ref_out, cache, new, "out", S)
  for b, (L, n) in enumerate(zip(cache, new)):
    err = max_err(lse[b, :, :n], ref_lse[b, :, L:L + n])
    err_plain = max_err(plain_lse[b, :, L:L + n], ref_lse[b, :, L:L + n])
    assert err <= 2 * err_plain + floor(F32, ref_lse[b, :, L:L + n], S), (b, err, err_plain)
    assert np.all(np.asarray(lse[b, :, n:]) == -np.inf)


@pytest.mark.parametrize("implementation", ["pallas_decode", "pallas"])
@pytest.mark.parametrize("cache,new,N,K,H", CASES[:2], ids=CASE_IDS[:2])
def test_gradients_through_the_regular_backward(implementation, cache, new, N, K, H):
  # "pallas" without a PallasConfig runs the decode kernel for T <= 64; both take the
  # gradient from the regular backward kernels.
  S = 64
  call, full = cache_problem(cache, new, S=S, N=N, K=K, H=H, seed=2)

  def fwd_bwd(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))
  got = jax.jit(lambda q, k, v, do: fwd_bwd(lambda q, k, v: jflash.attention(
      q, k, v, is_causal=True, causal_alignment="bottom_right", query_seq_lengths=call["q_len"],
      key_value_seq_lengths=call["kv_len"], implementation=implementation), q, k, v, do))(
          call["q"], call["k"], call["v"], call["do"])
  plain = fwd_bwd(lambda q, k, v: jflash.attention(
      q, k, v, is_causal=True, key_value_seq_lengths=full["kv_len"], implementation="xla"),
      full["q"], full["k"], full["v"], full["do"])
  ref = jflash.attention_numpy(full["q"], full["k"], full["v"], is_causal=True,
                               key_value_seq_lengths=full["kv_len"], dout=full["do"])
  _check_rows(got[0], plain[0], ref[0], cache, new, "out", S)
  _check_rows(got[1], plain[1], ref[2], cache, new, "dq", S)
  T = call["q"].shape[1]
  for i, name in ((2, "dk"), (3, "dv")):
    for b, F in enumerate(full["kv_len"]):
      err, err_plain = max_err(got[i][b, :F], ref[i + 1][b, :F]), max_err(plain[i][b, :F],
                                                                          ref[i + 1][b, :F])
      bound = 2 * err_plain + floor(F32, ref[i + 1][b, :F], max(S, T * N // K))
      assert err <= bound, (b, name, err, err_plain)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_bfloat16_rows_in_one_split_and_merged(num_splits):
  # One split writes its rows in the input dtype with no merge pass; several merge in
  # float32. Either way within the rule of a bfloat16 plain implementation.
  B, S, N, K, H = 2, 64, 4, 2, 32
  r = np.random.default_rng(21)
  q, k, v = (jnp.asarray(r.standard_normal(s), jnp.bfloat16)
             for s in ((B, 1, N, H), (B, S, K, H), (B, S, K, H)))
  lengths = jnp.asarray([64, 37], jnp.int32)
  masks = jflash.prepare(q, k, v, key_value_seq_lengths=lengths)[1]
  info = decode_impl.row_info(masks, B, 1, S)
  out, lse = dk.decode_forward(q, k, v, info, scale=H ** -0.5,
                               blocks=dk.DecodeBlocks(block_k=16, num_splits=num_splits))
  assert out.dtype == jnp.bfloat16 and lse.dtype == F32
  f64 = lambda x: np.asarray(x, np.float64)
  want = jflash.attention_numpy(f64(q), f64(k), f64(v), key_value_seq_lengths=lengths)[0]
  plain = jflash.attention(q, k, v, key_value_seq_lengths=lengths, implementation="xla")
  err, err_plain = max_err(f64(out), want), max_err(f64(plain), want)
  assert err <= 2 * err_plain + floor(jnp.bfloat16, want, S), (err, err_plain)


def test_merge_equals_logsumexp_of_the_splits():
  # Partials [B, K, splits, M, H]: the merged lse is logsumexp over the splits and the
  # output the lse-weighted sum (float64 truth); a row no split saw gives 0 and -inf,
  # a NaN partial reaches its row only.
  B, K, splits, M, H = 2, 2, 5, 3, 48
  r = np.random.default_rng(22)
  out = r.standard_normal((B, K, splits, M, H)).astype(np.float32)
  lse = (4 * r.standard_normal((B, K, splits, M))).astype(np.float32)
  lse[0, 0, 1:, 0] = -np.inf                       # one split only
  lse[0, 1, :, 1] = -np.inf                        # no split: an empty row
  out[0, 1, :, 1] = 0.0
  lse[1, 0, 3, 2] = np.nan
  o, l = dk.merge_splits(jnp.asarray(out), jnp.asarray(lse))
  lse64 = lse.astype(np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    m = np.max(lse64, axis=2, keepdims=True)
    w = np.exp(lse64 - np.where(m == -np.inf, 0, m))
    total = w.sum(2)
    want_o = np.einsum("bksm,bksmh->bkmh", w, out) / total[..., None]
    want_l = np.log(total) + m[:, :, 0]
  o, l = np.asarray(o, np.float64), np.asarray(l, np.float64)
  assert np.isnan(l[1, 0, 2]) and np.all(np.isnan(o[1, 0, 2]))
  assert l[0, 1, 1] == -np.inf and np.all(o[0, 1, 1] == 0)
  ok = np.isfinite(want_l)
  assert ok.sum() == B * K * M - 2
  tol = 8 * np.finfo(np.float32).eps
  np.testing.assert_allclose(l[ok], want_l[ok], rtol=tol, atol=tol * np.abs(want_l[ok]).max())
  np.testing.assert_allclose(o[ok], want_o[ok], rtol=0, atol=tol * np.abs(want_o[ok]).max() * splits)


def test_pallas_picks_the_decode_kernel_for_small_T(monkeypatch):
  calls = []
  original = dk.decode_forward
  monkeypatch.setattr(dk, "decode_forward", lambda *a, **kw: calls.append(1) or original(*a, **kw))
  x = jnp.ones((1, 3, 2, 16), F32)
  k = jnp.ones((1, 40, 2, 16), F32)
  jflash.attention(x, k, k, implementation="pallas")
  assert calls, "T = 3 should run the split-KV kernel"
  calls.clear()
  jflash.attention(x, k, k, implementation="pallas",
                   config=jflash.PallasConfig(16, 16, 16, 16, 16, 16))
  assert not calls, "a PallasConfig asks for the regular kernels' tiles"


def test_unsupported_calls_raise():
  q = jnp.ones((1, 65, 2, 16), F32)
  with pytest.raises(NotImplementedError, match="T <= 64"):
    jflash.attention(q, q, q, implementation="pallas_decode")
  q = q[:, :2]
  with pytest.raises(NotImplementedError, match="window"):
    jflash.attention(q, q, q, local_window_size=3, implementation="pallas_decode")


def test_nan_in_a_visible_key_reaches_the_row_and_stale_entries_do_not():
  r = np.random.default_rng(3)
  q = jnp.asarray(r.standard_normal((2, 1, 2, 16)), F32)
  k = np.asarray(r.standard_normal((2, 40, 2, 16)), np.float32)
  v = np.asarray(r.standard_normal((2, 40, 2, 16)), np.float32)
  k[0, 5] = np.nan                       # visible in row 0
  v[1, 30:] = np.nan                     # stale in row 1 (length 30)
  info = jnp.asarray([[1, 40, 39, 0, 0, 0, 0, 0], [1, 30, 29, 1, 0, 0, 0, 0]], jnp.int32)
  out, _ = dk.decode_forward(q, jnp.asarray(k), jnp.asarray(v), info, scale=0.25, is_causal=True,
                             blocks=dk.DecodeBlocks(block_k=16, num_splits=2))
  assert np.all(np.isnan(np.asarray(out[0])))
  assert np.all(np.isfinite(np.asarray(out[1])))


# -- KV caches ----------------------------------------------------------------------------

def _paged(k, page_size, seed):
  """A paged copy of contiguous k [B, S, K, H] with pages in a shuffled order (and two
  spare pages of NaN): (pages, block_tables)."""
  B, S, K, H = k.shape
  per_row = S // page_size
  P = B * per_row + 2
  order = np.random.default_rng(seed).permutation(P)
  tables = order[:B * per_row].reshape(B, per_row).astype(np.int32)
  pages = np.full((P, page_size, K, H), np.nan, np.float32)
  pages[tables.reshape(-1)] = np.asarray(k).reshape(B * per_row, page_size, K, H)
  return jnp.asarray(pages), jnp.asarray(tables)


@pytest.mark.parametrize("T", [1, 5])
def test_paged_equals_contiguous_bit_for_bit(T):
  B, S, N, K, H, ps = 3, 64, 4, 2, 32, 16
  r = np.random.default_rng(4)
  q = jnp.asarray(r.standard_normal((B, T, N, H)), F32)
  k = jnp.asarray(r.standard_normal((B, S, K, H)), F32)
  v = jnp.asarray(r.standard_normal((B, S, K, H)), F32)
  lengths = jnp.asarray([64, 23, T], jnp.int32)
  kp, tables = _paged(k, ps, 5)
  vp, _ = _paged(v, ps, 5)
  info = jnp.stack([jnp.full((B,), T), lengths, lengths - T, jnp.arange(B)]
                   + [jnp.zeros((B,), int)] * 4, 1).astype(jnp.int32)
  blocks = dk.DecodeBlocks(block_k=ps, num_splits=2)
  contiguous = dk.decode_forward(q, k, v, info, scale=0.2, is_causal=True, blocks=blocks)
  paged = dk.decode_forward(q, kp, vp, info, scale=0.2, is_causal=True, block_tables=tables,
                            blocks=blocks)
  for a, b in zip(contiguous, paged):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(kv_cache.paged_view(kp, tables)), np.asarray(k))


def test_paged_attention_matches_jflash_attention_bit_for_bit():
  # Pages of 128 keys: the same tiles and splits as the contiguous cache of 256.
  B, S, N, K, H, ps = 2, 256, 4, 1, 16, 128
  r = np.random.default_rng(6)
  q = jnp.asarray(r.standard_normal((B, 1, N, H)), F32)
  k = jnp.asarray(r.standard_normal((B, S, K, H)), F32)
  v = jnp.asarray(r.standard_normal((B, S, K, H)), F32)
  lengths = jnp.asarray([200, 131], jnp.int32)
  kp, tables = _paged(k, ps, 7)
  vp, _ = _paged(v, ps, 7)
  paged = kv_cache.attention(q, kp, vp, lengths, block_tables=tables)
  contiguous = kv_cache.attention(q, k, v, lengths, implementation="pallas_decode")
  np.testing.assert_array_equal(np.asarray(paged), np.asarray(contiguous))
  with pytest.raises(NotImplementedError, match="paged split-KV"):
    jax.grad(lambda q: kv_cache.attention(q, kp, vp, lengths, block_tables=tables).sum())(q)


def test_append_writes_in_place_and_drops_what_does_not_fit():
  B, S, K, H, T = 3, 8, 1, 4, 3
  r = np.random.default_rng(8)
  cache = np.asarray(r.standard_normal((B, S, K, H)), np.float32)
  new = np.asarray(r.standard_normal((B, T, K, H)), np.float32)
  lengths = np.asarray([2, 6, 0])
  n = np.asarray([3, 3, 1])
  step = jax.jit(kv_cache.append, donate_argnums=(0, 1))
  kc, vc = jnp.asarray(cache), jnp.asarray(cache + 1)
  k2, v2, l2 = step(kc, vc, jnp.asarray(lengths), jnp.asarray(new), jnp.asarray(new + 1),
                    jnp.asarray(n))
  assert kc.is_deleted() and vc.is_deleted()           # the buffers were donated
  want = cache.copy()
  want[0, 2:5] = new[0]
  want[1, 6:8] = new[1, :2]                             # the third one is past S: dropped
  want[2, 0:1] = new[2, :1]
  np.testing.assert_array_equal(np.asarray(k2), want)
  np.testing.assert_array_equal(np.asarray(v2), want + 1)
  np.testing.assert_array_equal(np.asarray(l2), [5, 8, 1])


def test_append_to_one_layer_of_a_stack_leaves_the_others():
  L, B, S, K, H, T = 3, 2, 8, 1, 4, 2
  r = np.random.default_rng(9)
  k = jnp.asarray(r.standard_normal((L, B, S, K, H)), jnp.float32)
  new = jnp.asarray(r.standard_normal((B, T, K, H)), jnp.float32)
  lengths = jnp.asarray([[1, 2], [3, 6], [0, 5]])
  n = jnp.asarray([2, 1])
  got = kv_cache.KVCache(k, k + 1, lengths).append_layer(1, new, new + 1, n)
  want = kv_cache.KVCache(k[1], k[1] + 1, lengths[1]).append(new, new + 1, n)
  for i in range(L):
    mine = got.layer(i)
    expect = want if i == 1 else kv_cache.KVCache(k[i], k[i] + 1, lengths[i])
    for a, b in zip((mine.k, mine.v, mine.lengths), (expect.k, expect.v, expect.lengths)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="stack"):
    kv_cache.append(k[0], k[0], lengths[0], new, new, layer=0)
  with pytest.raises(ValueError, match="stack"):
    kv_cache.append(k, k, lengths[:2], new, new, layer=0)
  with pytest.raises(ValueError, match="layer=3"):
    kv_cache.append(k, k, lengths, new, new, layer=3)
  # A traced layer is written as x.at[i].set writes: negative from the end, and past
  # the stack dropped (no layer changes).
  step = jax.jit(lambda i: kv_cache.append(k, k + 1, lengths, new, new + 1, n, layer=i))
  for i, want in ((-2, got), (3, kv_cache.KVCache(k, k + 1, lengths))):
    for a, b in zip(step(i), (want.k, want.v, want.lengths)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"layer {i}")


def _stack_problem(seed, L=3, B=3, S=48, K=2, H=16, T=1, N=4):
  """A stack of caches [L, B, S, K, H] whose entries past each row's length are NaN
  (stale), lengths [L, B], and queries [B, T, N, H]."""
  r = np.random.default_rng(seed)
  lengths = np.asarray([[48, 20, 1], [7, 33, 48], [2, 2, 2]], np.int32)[:L, :B]
  past = np.arange(S)[None, None, :, None, None] >= lengths[:, :, None, None, None]
  k, v = (np.where(past, np.nan, r.standard_normal((L, B, S, K, H))).astype(np.float32)
          for _ in range(2))
  q = r.standard_normal((B, T, N, H)).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths)


@pytest.mark.parametrize("T", [1, 4])
def test_layer_of_a_stack_equals_its_own_cache_bit_for_bit(T):
  # The decode kernel reads layer i inside the stack; the same call on the layer's own
  # cache (a copy) runs the same tiles. Stale entries (NaN) past the lengths stay out.
  q, k, v, lengths = _stack_problem(12, T=T)
  attend = jax.jit(lambda q, k, v, n, i: kv_cache.attention(
      q, k, v, n, layer=i, implementation="pallas_decode"))
  for i in range(k.shape[0]):
    own = kv_cache.attention(q, k[i], v[i], lengths[i], implementation="pallas_decode")
    got = attend(q, k, v, lengths, i)                     # i traced
    np.testing.assert_array_equal(np.asarray(got), np.asarray(own))
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_array_equal(np.asarray(kv_cache.attention(
        q, k, v, lengths, layer=i, implementation="pallas_decode")), np.asarray(own))


def test_layer_of_a_stack_gradients_equal_its_own_caches():
  # The stale entries stay NaN: the backward zeroes the padding it reads, and padded
  # keys get no gradient.
  q, k, v, lengths = _stack_problem(13, T=2)
  do = jnp.asarray(np.random.default_rng(14).standard_normal(q.shape), F32)
  i = 1
  stacked = jax.grad(lambda q, k, v: jnp.sum(kv_cache.attention(
      q, k, v, lengths, layer=i, implementation="pallas_decode") * do), argnums=(0, 1, 2))(q, k, v)
  own = jax.grad(lambda q, k, v: jnp.sum(kv_cache.attention(
      q, k, v, lengths[i], implementation="pallas_decode") * do), argnums=(0, 1, 2))(q, k[i], v[i])
  np.testing.assert_array_equal(np.asarray(stacked[0]), np.asarray(own[0]))
  assert np.all(np.isfinite(np.asarray(stacked[0])))
  past = np.arange(k.shape[2])[None, :] >= np.asarray(lengths[i])[:, None]     # [B, S]
  for d_stack, d_own in zip(stacked[1:], own[1:]):
    d = np.asarray(d_stack)
    np.testing.assert_array_equal(d[i], np.asarray(d_own))
    assert np.all(np.isfinite(d)) and np.all(d[i][past] == 0)
    np.testing.assert_array_equal(np.delete(d, i, axis=0), 0)


def test_layer_of_a_stack_for_other_implementations_and_bad_layers():
  q, k, v, lengths = _stack_problem(15)
  k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
  own = kv_cache.attention(q, k[2], v[2], lengths[2], implementation="xla")
  got = kv_cache.attention(q, k, v, lengths, layer=2, implementation="xla")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(own))
  with pytest.raises(NotImplementedError, match="reverse-mode"):
    jax.jvp(lambda q: kv_cache.attention(q, k, v, lengths, layer=1,
                                         implementation="pallas_decode"), (q,), (q,))
  with pytest.raises(ValueError, match="layer=3"):
    kv_cache.attention(q, k, v, lengths, layer=3)
  with pytest.raises(ValueError, match="layer=-1"):
    kv_cache.attention(q, k, v, lengths, layer=jnp.asarray(-1))
  # A traced layer is read as x[i] reads: negative from the end, clamped into the stack
  # (never read past it).
  attend = jax.jit(lambda i: kv_cache.attention(q, k, v, lengths, layer=i,
                                                implementation="pallas_decode"))
  for i, want in ((7, 2), (-1, 2), (-7, 0)):
    own = kv_cache.attention(q, k[want], v[want], lengths[want], implementation="pallas_decode")
    np.testing.assert_array_equal(np.asarray(attend(i)), np.asarray(own), err_msg=f"layer {i}")
  with pytest.raises(ValueError, match="share one dtype"):
    kv_cache.attention(q, k, v.astype(jnp.bfloat16), lengths, layer=0)
  with pytest.raises(ValueError, match="v_cache.shape"):
    kv_cache.attention(q, k, v[:2], lengths, layer=0)
  with pytest.raises(ValueError, match="layer must be an int"):
    kv_cache.attention(q, k, v, lengths, layer=1.0)
  with pytest.raises(ValueError, match="stack"):
    kv_cache.attention(q, k[0], v[0], lengths[0], layer=0)
  with pytest.raises(NotImplementedError, match="paged"):
    kv_cache.attention(q, k[0], v[0], lengths[0], layer=0,
                       block_tables=jnp.zeros((3, 1), jnp.int32))


def test_paged_checks_and_an_empty_table():
  B, N, K, H, ps = 2, 4, 2, 16, 16
  q = jnp.ones((B, 1, N, H), F32)
  pages = jnp.ones((3, ps, K, H), F32)
  tables = jnp.zeros((B, 2), jnp.int32)
  lengths = jnp.asarray([5, 20], jnp.int32)
  with pytest.raises(ValueError, match="share one dtype"):
    kv_cache.attention(q, pages, pages.astype(jnp.bfloat16), lengths, block_tables=tables)
  # No pages to read: every row sees no key, so zeros (as a cache of S = 0).
  got = kv_cache.attention(q, pages, pages, jnp.zeros((B,), jnp.int32),
                           block_tables=jnp.zeros((B, 0), jnp.int32))
  np.testing.assert_array_equal(np.asarray(got), np.zeros(q.shape))


def test_default_splits():
  # (programs = batch rows x key heads x row blocks, S, block_k): the decode preset's
  # cells. One wave of 528 programs: 8 x 32K GQA (64 programs) 8 splits; 64 x 4K (512
  # programs) one; 1 x 8K (8 programs) one tile per split, a wave leaving splits of
  # under 4 tiles; 1 x 128K 66 splits of 32 tiles.
  assert dk.default_splits(64, 32768, 64) == 8
  assert dk.default_splits(512, 4096, 64) == 1
  assert dk.default_splits(8, 8192, 64) == 128
  assert dk.default_splits(8, 131072, 64) == 66
  assert dk.default_splits(8, 131072, 64, round_down=False) == 66
  assert dk.default_splits(60, 32768, 64, round_down=False) == 9
  assert dk.default_splits(0, 4096, 64) == dk.default_splits(8, 0, 64) == 1


def test_append_of_more_keys_than_the_cache_holds_raises():
  z = lambda *s: jnp.zeros(s, jnp.float32)
  with pytest.raises(ValueError, match="5 new keys .* S=4"):
    kv_cache.append(z(1, 4, 1, 8), z(1, 4, 1, 8), jnp.zeros(1, jnp.int32), z(1, 5, 1, 8),
                    z(1, 5, 1, 8))
  with pytest.raises(ValueError, match="5 new keys .* 2 pages x 2 = 4"):
    kv_cache.append_paged(z(3, 2, 1, 8), z(3, 2, 1, 8), jnp.zeros((1, 2), jnp.int32),
                          jnp.zeros(1, jnp.int32), z(1, 5, 1, 8), z(1, 5, 1, 8))


def test_append_paged_matches_append_on_the_view():
  B, S, K, H, T, ps = 2, 32, 2, 4, 5, 8
  r = np.random.default_rng(9)
  k = jnp.asarray(r.standard_normal((B, S, K, H)), F32)
  new = jnp.asarray(r.standard_normal((B, T, K, H)), F32)
  lengths = jnp.asarray([6, 27], jnp.int32)
  n = jnp.asarray([5, 5], jnp.int32)
  kp, tables = _paged(k, ps, 10)
  want, _, wl = kv_cache.append(k, k, lengths, new, new, n)
  kp2, _, l2 = jax.jit(kv_cache.append_paged, donate_argnums=(0, 1))(
      kp, kp + 0, tables, lengths, new, new, n)
  np.testing.assert_array_equal(np.asarray(kv_cache.paged_view(kp2, tables)), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(l2), np.asarray(wl))


@pytest.mark.parametrize("block_tables", [False, True], ids=["contiguous", "paged"])
def test_decode_steps_over_a_cache_equal_full_causal_attention(block_tables):
  # Prefill 5 tokens of row 0 and 2 of row 1, then decode 3 steps: every step's output
  # is full causal attention's row over the sequence so far.
  B, S, N, K, H, ps = 2, 32, 4, 2, 16, 16
  r = np.random.default_rng(11)
  qf, kf, vf = (jnp.asarray(r.standard_normal(s), F32)
                for s in ((B, S, N, H), (B, S, K, H), (B, S, K, H)))
  prompt = np.asarray([5, 2])
  kc = jnp.zeros((B, S, K, H), F32)
  vc = jnp.zeros((B, S, K, H), F32)
  tables = None
  if block_tables:
    kc, tables = _paged(kc, ps, 12)
    vc, _ = _paged(vc, ps, 12)
  append = kv_cache.append if tables is None else (
      lambda kc, vc, *a: kv_cache.append_paged(kc, vc, tables, *a))
  take = lambda x, start, n: jnp.stack([jax.lax.dynamic_slice_in_dim(x[b], start[b], n)
                                        for b in range(B)])
  lengths = jnp.zeros((B,), jnp.int32)
  T0 = int(prompt.max())
  kc, vc, lengths = append(kc, vc, lengths, kf[:, :T0], vf[:, :T0], jnp.asarray(prompt))
  out = kv_cache.attention(qf[:, :T0], kc, vc, lengths, query_seq_lengths=jnp.asarray(prompt),
                           block_tables=tables)
  ref = jflash.attention_numpy(qf, kf, vf, is_causal=True)[0]
  plain = jflash.attention(qf, kf, vf, is_causal=True, implementation="xla")

  def check(got, b, rows):
    err, err_plain = max_err(got, ref[b, rows]), max_err(plain[b, rows], ref[b, rows])
    assert err <= 2 * err_plain + floor(F32, ref[b, rows], S), (b, rows, err, err_plain)
  for b in range(B):
    check(out[b, :prompt[b]], b, slice(0, prompt[b]))
  for _ in range(3):
    pos = lengths
    kc, vc, lengths = append(kc, vc, lengths, take(kf, pos, 1), take(vf, pos, 1))
    out = kv_cache.attention(take(qf, pos, 1), kc, vc, lengths, block_tables=tables)
    for b in range(B):
      check(out[b, 0], b, int(pos[b]))


@pytest.mark.parametrize("T, layout", [(1, "contiguous"), (16, "contiguous"), (1, "stack"),
                                       (1, "paged")])
def test_lowers_through_triton(T, layout):
  # Interpret mode never runs the Triton lowering; lowering for CUDA does (no GPU needed).
  B, S, N, K, H = 2, 1024, 32, 8, 128
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  info = jax.ShapeDtypeStruct((B, 8), jnp.int32)
  if layout == "paged":
    kv = jax.ShapeDtypeStruct((64, 64, K, H), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((B, 16), jnp.int32)
    f = lambda q, k, v, info, t: dk.decode_forward(q, k, v, info, scale=0.1, is_causal=True,
                                                   block_tables=t, interpret=False)
    args = (q, kv, kv, info, tables)
  else:
    rows = 3 * B if layout == "stack" else B            # a stack of 3 layers' caches
    kv = jax.ShapeDtypeStruct((rows, S, K, H), jnp.bfloat16)
    f = lambda q, k, v, info: dk.decode_forward(q, k, v, info, scale=0.1, is_causal=True,
                                                interpret=False)
    args = (q, kv, kv, info)
  try:
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  except RuntimeError as e:
    if "No supported GPU devices found" not in str(e):
      raise
    pytest.skip("this JAX lowers Triton kernels only for a present (or abstract) GPU")
  assert "jflash_decode" in text
