"""Mask options of every implementation through tests/mask_test_base.py, the
proof that the Pallas kernels skip masked tiles, and the CPU smoke run of
experiments/bench_masks.py.
"""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from jflash.masks import Masks, tile_classes, visited_tiles
from pallas_kernels.masking import (MaskOperands, MaskOptions, build_ranges, classes_static,
                                    ranges_from_classes, ranges_static, static_range)
from pallas_kernels.tuning import default_block_sizes
from tests.attention_test_base import floor, max_err
from tests.mask_test_base import FLOAT32_CASES, FULLY_MASKED_CASES, MaskTestBase
from tests.mask_test_base import pytest_generate_tests  # noqa: F401  (per-class case lists)

ROOT = Path(__file__).resolve().parent.parent


class TestMasksPallas(MaskTestBase):
  implementation = "pallas"
  # "mask" and "softcap" alone run in the other two implementations; here they are
  # covered by "bias+mask" and "softcap+bias" (the same kernel code paths, plus the
  # bias), since every case costs seconds of interpret-mode compilation.
  float32_cases = tuple(c for c in FLOAT32_CASES if c not in ("mask", "softcap"))
  fully_masked_cases = tuple(c for c in FULLY_MASKED_CASES if c != "mask")


class TestMasksXlaChunked(MaskTestBase):
  implementation = "xla_chunked"


class TestMasksXla(MaskTestBase):
  implementation = "xla"   # held to the rule-based bound (the 2x rule would compare it with itself)


# -- block skipping ----------------------------------------------------------------------

def _per_block(T, opts, bq, bk, masks=None, transpose=False):
  """Tiles visited per block row, as the kernels' `build_ranges` gives them, checked
  equal to `tile_classes`/`visited_tiles` (what jflash reports)."""
  B = 1 if masks is None else masks.q_segment_ids.shape[0]
  ops = MaskOperands() if masks is None else MaskOperands(
      schedule=lambda block_q, block_k: tile_classes(
          B=B, T=T, S=T, block_q=block_q, block_k=block_k, masks=masks),
      q_segment_ids=masks.q_segment_ids, kv_segment_ids=masks.kv_segment_ids)
  r = np.asarray(build_ranges(ops, opts, B=B, T=T, S=T, block_q=bq, block_k=bk,
                              transpose=transpose))
  per_block = r[..., 3] - r[..., 0]  # hi - lo of (lo, full_lo, full_hi, hi, q_len, kv_len, ...)
  if not transpose:
    static = Masks(is_causal=opts.is_causal, window=opts.window)
    classes = tile_classes(B=B, T=T, S=T, block_q=bq, block_k=bk,
                           masks=static if masks is None else dataclasses.replace(
                               masks, is_causal=opts.is_causal, window=opts.window))
    assert int(visited_tiles(classes)) == per_block.sum()
  return per_block


def test_sliding_window_visits_tiles_in_proportion_to_the_window():
  # Window 256 over 8K and 16K tokens with the H200 tiles of head_dim 64: each query
  # block visits the same few key tiles at both lengths (the window's, not the
  # sequence's), so doubling the sequence doubles the tiles instead of quadrupling them.
  bs = default_block_sizes(64)
  for opts in (MaskOptions(window=(256, 256)), MaskOptions(is_causal=True, window=(256, 0))):
    left, right = opts.window
    for bq, bk, transpose in ((bs.block_q, bs.block_k, False),          # forward
                              (bs.block_q_dq, bs.block_k_dq, False),    # dQ
                              (bs.block_q_dkv, bs.block_k_dkv, True)):  # dK/dV: per key block
      counts = {T: _per_block(T, opts, bq, bk, transpose=transpose)[0] for T in (8192, 16384)}
      rows_per_block = bk if transpose else bq
      cols_per_tile = bq if transpose else bk
      most = -(-(rows_per_block - 1 + left + right) // cols_per_tile) + 1
      for T, c in counts.items():
        assert c.max() <= most, (opts, T, c.max(), most)
        n_tiles = (T // bq) * (T // bk)
        assert c.sum() <= 0.1 * n_tiles, (opts, T, c.sum(), n_tiles)
      # The same counts for the interior blocks (those whose window does not reach
      # past either end) at both lengths...
      edge = -(-max(left, right) // rows_per_block) + 1
      interior = {T: set(c[edge:-edge].tolist()) for T, c in counts.items()}
      assert interior[8192] == interior[16384], (opts, interior)
      assert max(interior[8192]) - min(interior[8192]) <= 1, (opts, interior)  # tile alignment
      # ...so the total is linear in T (edges only ever visit fewer).
      ratio = counts[16384].sum() / counts[8192].sum()
      assert 1.95 <= ratio <= 2.05, (opts, ratio)


def test_packed_documents_skip_tiles_across_documents():
  # 8 documents of 1K in 8K tokens, causal: about 1/8 of the causal tiles.
  bs = default_block_sizes(64)
  T = 8192
  ids = jnp.asarray(np.repeat(np.arange(8), T // 8)[None], jnp.int32)
  masks = Masks(q_segment_ids=ids, kv_segment_ids=ids)
  causal = MaskOptions(is_causal=True)
  docs = _per_block(T, causal, bs.block_q, bs.block_k, masks=masks).sum()
  full = _per_block(T, causal, bs.block_q, bs.block_k).sum()
  assert docs <= full / 7, (docs, full)


def test_pallas_skips_tiles_outside_the_window():
  # Window 256 with the default tiles, T=320 queries over S=1024 keys: keys past
  # 319 + 256 are seen by no query. They hold NaN from 640 on (whole tiles of every
  # kernel's tiling): a kernel that loaded one of those tiles would spread the NaN
  # (0 * NaN in P @ V and in dP), so finite results that match the float64 truth
  # show that the kernels skip them.
  B, T, S, N, K, H, W = 1, 320, 1024, 2, 1, 64, 256
  r = np.random.default_rng(21)
  q = jnp.asarray(r.standard_normal((B, T, N, H)), jnp.float32)
  k = jnp.asarray(r.standard_normal((B, S, K, H)), jnp.float32)
  v = jnp.asarray(r.standard_normal((B, S, K, H)), jnp.float32)
  do = jnp.asarray(r.standard_normal((B, T, N, H)), jnp.float32)
  far = 640
  assert far > T - 1 + W and far % 128 == 0
  kn, vn = (x.at[:, far:].set(jnp.nan) for x in (k, v))

  def run(impl):
    def fwd_bwd(q, k, v, do):
      f = lambda q, k, v: jflash.attention(q, k, v, local_window_size=W, implementation=impl)
      out, vjp = jax.vjp(f, q, k, v)
      return (out, *vjp(do))
    return jax.jit(fwd_bwd)
  got = run("pallas")(q, kn, vn, do)
  plain = run("xla")(q, k, v, do)            # the materialising one reads every key
  ref = jflash.attention_numpy(q, k, v, local_window_size=W, dout=do)
  for name, g, p, want in zip(("out", "dq", "dk", "dv"), got, plain, (ref[0], *ref[2:])):
    g = np.asarray(g, np.float64)
    assert np.all(np.isfinite(g)), f"{name}: NaN from a tile outside the window"
    err, err_plain = max_err(g, want), max_err(p, want)
    assert err <= 2 * err_plain + floor(jnp.float32, want, H), (name, err, err_plain)
  assert np.all(np.asarray(got[2])[:, far:] == 0) and np.all(np.asarray(got[3])[:, far:] == 0)


def test_static_ranges_closed_form_equal_the_class_table():
  """`ranges_static` (what `build_ranges` returns for the static rules) equals the
  ranges of the [nq, nk] class table, for both orientations, over seeded draws of
  lengths off the tiles, tile sizes, causal or not, windows up to INT32_MAX on either
  side and query offsets from -T - 100 to S + 100 (bottom-right alignment with S < T or
  S > T, and past either end);
  and so does `static_range` on int32 block indices (a kernel's), whose division
  truncates, with the row past the end empty."""
  rng = np.random.default_rng(0)
  for draw in range(3000):
    T, S = (int(x) for x in rng.choice([1, 7, 64, 65, 197, 300, 513], 2))
    bq, bk = int(rng.choice([16, 64, 192])), int(rng.choice([16, 64, 128]))
    sides = [0, 1, 7, 64, 100, 1000, 2 ** 31 - 1]
    window = None if rng.random() < 0.4 else tuple(int(x) for x in rng.choice(sides, 2))
    offset = int(rng.choice([0, S - T, -T, S, int(rng.integers(-T, S + 1)), S + 100, -T - 100]))
    opts = MaskOptions(is_causal=bool(rng.random() < 0.5), window=window)
    table = classes_static(T, S, bq, bk, opts, offset)
    for transpose in (False, True):
      want = ranges_from_classes(table.T if transpose else table, xp=np)
      got = ranges_static(T, S, bq, bk, opts, offset, transpose)
      assert np.array_equal(got, want), (T, S, bq, bk, opts, offset, transpose)
      if draw % 20 == 0:   # a kernel's form: int32 block indices, one past the end too
        i = jnp.arange(len(want) + 1, dtype=jnp.int32)
        kernel = np.stack(static_range(i, T=T, S=S, block_q=bq, block_k=bk, opts=opts,
                                       offset=offset, transpose=transpose), -1)
        assert np.array_equal(kernel[:-1], want), (T, S, bq, bk, opts, offset, transpose)
        assert kernel[-1].tolist() == [0, 0, 0, 0]


def test_static_ranges_at_a_million_tokens():
  """Causal at 2^20 tokens in tiles of 128 (8,192 x 8,192 tiles; the class table would
  hold 67M): query block i visits key tiles [0, i + 1), unmasked [0, i); key tile j is
  visited by query blocks [j, 8192), unmasked from j + 1 (the last none: an empty run
  sits at lo)."""
  n = 2 ** 20 // 128
  i = np.arange(n)
  opts = MaskOptions(is_causal=True)
  rows = ranges_static(2 ** 20, 2 ** 20, 128, 128, opts)
  np.testing.assert_array_equal(rows, np.stack([0 * i, 0 * i, i, i + 1], -1))
  cols = ranges_static(2 ** 20, 2 ** 20, 128, 128, opts, transpose=True)
  np.testing.assert_array_equal(cols[:-1], np.stack([i, i + 1, 0 * i + n, 0 * i + n], -1)[:-1])
  assert cols[-1].tolist() == [n - 1, n - 1, n - 1, n]


# -- the benchmark script ------------------------------------------------------------------

def test_bench_masks_tiny(tmp_path):
  # Machinery only (correctness gate, timing loop, JSON), never the numbers.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench_masks", "--tiny",
       "--out-dir", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads((tmp_path / "bench_masks_cpu_tiny.json").read_text())
  rows = data["rows"]
  assert {r["kind"] for r in rows} == {"causal", "window", "docs"}
  assert {r["impl"] for r in rows} == {"jflash", "xla"}
  assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
  for r in rows:
    assert r["status"] == "ok", r
    assert r["ms"] > 0 and r["tflops"] > 0
    assert r["ref"] == "xla" and r["rel_err"] <= 2e-2, r
  assert data["environment"]["backend"] == "cpu"
  assert data["ratios"] and all(x["peer"] == "xla" for x in data["ratios"])
