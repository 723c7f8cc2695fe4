"""The Mosaic GPU backward (pallas_kernels/mosaic_gpu/backward.py, dkv.py, dq.py): its
records, the lowered default kernels, and the kernels run at their forms: interpreted
off a GPU, compiled on a Hopper GPU (tests/mosaic_support.py):

  python -m pytest -q tests/test_mosaic.py tests/test_mosaic_backward.py

The interpreter has no in-register or transposed matrix-product operands and no layout
casts, so there the products are plain dots; the schedule, the loads, the slots, masks,
tails, the GQA head loop and the NaN rules are the kernels' own. (Accuracy through
jflash.attention, with every structured mask, is tests/test_mosaic.py's shared bases.)
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import mosaic_impl
from jflash.reference import error_floor, max_err
from pallas_kernels.masking import MaskOperands, MaskOptions
from pallas_kernels.mosaic_gpu import common, configs, heuristics
from pallas_kernels.mosaic_gpu import backward as mb
from tests.attention_test_base import random_qkv
from tests.mosaic_support import on_hopper  # noqa: F401  (the fixture, used by name)
from tests.mosaic_support import (INTERPRET, check_grads, first_products_a, kernel_modules,
                                  launch_grid, lowered, register_counts, schedule,
                                  watch_races)

HOPPER = dict(platform="gpu", capability="9.0")
MOSAIC_BWD = jflash.MosaicGPUConfig(backward="mosaic_gpu")


def _call_config(H, T=200, S=330, N=4, K=2, causal=False, **fields):
  return heuristics.call_config((2, T, N, H), (2, S, K, H), 2, causal=causal, **fields)


# -- the records ------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, bad", [
    (dict(block_n=96), "block_n=96"), (dict(stages=1), "stages=1"),
    (dict(dq_block_n=32), "dq_block_n=32"), (dict(dq_consumers=4), "dq_consumers=4"),
    (dict(dq_consumers=True), "dq_consumers=True"),
    (dict(dq_rows_in_registers=1), "dq_rows_in_registers=1"),
    (dict(persistent=True, dq_consumers=1), "dq_consumers=1 needs persistent=False"),
    (dict(stages=17), "34 \"loaded\" barriers"),
    (dict(stats_streamed=True, stages=9), "36 \"loaded\" barriers \\(four per slot"),
    (dict(group_splits=0), "group_splits=0 must be a positive int"),
    (dict(l2_group=0), "l2_group=0 must be a positive int")])
def test_record_validation(fields, bad):
  with pytest.raises(ValueError, match=bad):
    configs.BackwardConfig(**fields)


def test_d64_tiles_stream_lse_and_delta_only_where_the_stages_barriers_fit():
  # Four "loaded" barriers per slot with lse and delta streamed: 9 of the caller's
  # stages would take 36 of the group's 32, so they keep the dQ kernel's tiles alone.
  default, over = _call_config(64), _call_config(64, stages=9)
  assert (default.stats_streamed, default.block_n) == (True, 128)
  assert not over.stats_streamed and over.dq_block_n == 128 and over.stages == 9


def test_what_the_kernels_cannot_run_is_refused():
  """A group split must divide the call's group; above head_dim 128 (split by role) no
  group split, persistent grid or the tile loop's options of d <= 128; three dQ
  consumers up to head_dim 128; what overflows shared memory."""
  q, k = jnp.zeros((1, 16, 4, 128), jnp.bfloat16), jnp.zeros((1, 16, 2, 128), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="group_splits=4 does not divide the GQA "
                     "group of 2"):
    configs.check_backward(q, k, k, configs.BackwardConfig(group_splits=4))
  q256 = jnp.zeros((1, 16, 2, 256), jnp.bfloat16)
  assert [configs.by_role(H) for H in (64, 96, 128, 160, 192, 256)] == [False] * 3 + [True] * 3
  for fields in (dict(group_splits=2), dict(persistent=True), dict(stats_streamed=True),
                 dict(dkv_p_under_dp=True), dict(dq_rows_in_registers=True)):
    with pytest.raises(NotImplementedError, match=f"{next(iter(fields))}=True|group_splits=2"):
      configs.check_backward(q256, q256, q256, configs.BackwardConfig(**fields))
  q144 = jnp.zeros((1, 16, 2, 144), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="dq_consumers=3 supports head_dim <= 128"):
    configs.check_backward(q144, q144, q144, configs.BackwardConfig(dq_consumers=3,
                                                                    dq_block_n=64))
  with pytest.raises(NotImplementedError, match="shared memory"):
    configs.check_backward(q, q, q, configs.BackwardConfig(block_n=256, stages=4))
  with pytest.raises(NotImplementedError, match="no dense mask"):
    mb.flash_backward(q, q, q, q, None, q, scale=1.0,
                      ops=MaskOperands(mask=jnp.ones((1, 1, 16, 16), bool)))


def test_shared_memory_model_counts_each_buffer():
  """The smem model (`backward_smem_bytes`) grows by exactly each buffer a field adds:
  the dQ kernel's wider slots, each consumer's float32 partial tile of a group split."""
  base = configs.BackwardConfig()
  tile = lambda rows, H=128: rows * H * 2
  assert configs.backward_smem_bytes(128, 2, configs.BackwardConfig(dq_block_n=128)) == \
      configs.backward_smem_bytes(128, 2, base) + 2 * 2 * tile(64)
  for H in (64, 128):
    assert configs.backward_smem_bytes(H, 2, configs.BackwardConfig(group_splits=2)) == \
        configs.backward_smem_bytes(H, 2, base) + 2 * common.ROWS * H * 4
  assert configs.backward_smem_bytes(256, 2, base) <= common.SMEM_BYTES
  assert configs.backward_smem_bytes(256, 2, configs.BackwardConfig(group_splits=2)) > \
      common.SMEM_BYTES


# -- lowering the defaults (no GPU needed) ---------------------------------------------------

def _lowered(H, opts, with_masks=False, config=None, T=200, S=330, N=4, K=2):
  """Both kernels at `config` (the heuristics' call config by default), lowered for CUDA
  on the persistent grids of 132 multiprocessors."""
  config = config or _call_config(H, T, S, N, K, causal=opts.is_causal)
  q, k = jax.ShapeDtypeStruct((2, T, N, H), jnp.bfloat16), jax.ShapeDtypeStruct(
      (2, S, K, H), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((2, N, T), jnp.float32)

  def f(q, k, v, out, lse, dout, *extra):
    ops = None
    if extra:
      ops = MaskOperands(q_segment_ids=extra[0], kv_segment_ids=extra[1], kv_lengths=extra[2])
    return mb.flash_backward(q, k, v, out, lse, dout, lse, scale=H ** -0.5, opts=opts,
                             ops=ops, config=config, num_sms=132)
  extra = []
  if with_masks:
    extra = [jax.ShapeDtypeStruct((2, T), jnp.int32), jax.ShapeDtypeStruct((2, S), jnp.int32),
             jax.ShapeDtypeStruct((2,), jnp.int32)]
  return lowered(f, q, k, k, q, lse, q, *extra)


@pytest.mark.parametrize("H, causal, K", [(64, True, 2), (64, False, 4), (96, False, 4),
                                          (128, True, 2), (128, False, 4), (160, True, 2),
                                          (256, False, 4)])
def test_default_kernels_lower_with_their_register_splits(H, causal, K):
  """Both default kernels of each tier, every mask path: the dK/dV kernel's two
  consumers at CONSUMER_REGISTERS[2] beside the producer's floor (3 x 168 = 2 x 240 +
  24); the dQ kernel's two at the same, three at CONSUMER_REGISTERS[3] (4 x 128 =
  3 x 160 + 32), or one warpgroup with no reallocation."""
  opts = MaskOptions(is_causal=causal, window=(40, 8), soft_cap=20.0)
  config = _call_config(H, K=K, causal=causal)
  dkv, dq = kernel_modules(_lowered(H, opts, with_masks=True, config=config, K=K))
  assert "wgmma" in dkv and "wgmma" in dq
  assert register_counts(dkv) == [24, configs.CONSUMER_REGISTERS[2]] == [24, 240]
  want = {1: [], 2: [24, 240], 3: [32, 160]}[configs.dq_consumers_of(H, config)]
  assert register_counts(dq) == want


@pytest.mark.parametrize("H, causal", [(64, True), (128, False), (128, True)])
def test_default_product_order(H, causal):
  """The defaults' order of products (FlashAttention-3's): at d = 64 (P under dP) every
  tile's exponentials run between the wait for the first of two score products and the
  wait for the second; at d = 128 after a wait for every product in flight. The dQ
  kernel's first products take Q and dO from registers where it runs two consumers,
  from shared memory with three."""
  config = _call_config(H, causal=causal)
  under = config.dkv_p_under_dp
  assert under == config.dq_p_under_dp == (H == 64)
  dkv, dq = kernel_modules(_lowered(H, MaskOptions(is_causal=causal), config=config))
  for module in (dkv, dq):
    s = schedule(module)
    assert s.count("e") > 0
    assert (s.count("W1eW0") if under else s.count("W0e")) == s.count("e"), s
  in_registers = configs.dq_consumers_of(H, config) == 2
  assert config.dq_rows_in_registers == in_registers
  first = first_products_a(dq, config.dq_block_n or config.block_n)
  assert ("registers" in first) == in_registers and ("shared" in first) != in_registers


@pytest.mark.parametrize("H, causal", [(64, True), (128, False)])
def test_default_persistent_kernels_hold_one_copy_of_the_item(H, causal):
  config = _call_config(H, K=4, causal=causal)
  assert config.persistent
  products = [[m.count("wgmma.mma_async") for m in kernel_modules(_lowered(
      H, MaskOptions(is_causal=causal), config=dataclasses.replace(config, persistent=p), K=4))]
      for p in (False, True)]
  assert products[0] == products[1] and min(products[0]) > 0, products


@pytest.mark.parametrize("num_sms, blocks", [(8, [8, 4, 2]), (132, [2, 4, 8])])
def test_causal_launch_order_lowered(num_sms, blocks):
  """Lowered for CUDA, 2 batches x 4 heads of 1K d128 causal on the launched grids (8 key
  tiles of 128 in the dK/dV kernel, 8 query blocks of 128 in the dQ kernel): on 8
  multiprocessors each kernel's tiles are the fastest axis, x (each pair's side by
  side), on 132 the batch (level by level)."""
  config = _call_config(128, 1024, 1024, 4, 4, causal=True)
  assert not config.persistent
  q = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((2, 4, 1024), jnp.float32)
  f = lambda q, k, v, out, lse, dout: mb.flash_backward(
      q, k, v, out, lse, dout, scale=0.125, opts=MaskOptions(is_causal=True), config=config,
      num_sms=num_sms)
  modules = kernel_modules(lowered(f, q, q, q, q, lse, q))
  assert [launch_grid(m) for m in modules] == [blocks, blocks]


def test_causal_grids_past_the_z_limit_launch_side_by_side():
  """Lowered for CUDA, one (batch, head) of 65,537 tiles of 128 (8.4M tokens, d128
  causal, the launched grids): level by level would put each kernel's tiles on z,
  past its 65,535; side by side they go on x."""
  T = 65537 * 128
  config = _call_config(128, T, T, 1, 1, causal=True)
  assert not config.persistent and config.group_splits == 1
  q = jax.ShapeDtypeStruct((1, T, 1, 128), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((1, 1, T), jnp.float32)
  f = lambda q, k, v, out, lse, dout: mb.flash_backward(
      q, k, v, out, lse, dout, scale=0.125, opts=MaskOptions(is_causal=True), config=config,
      num_sms=132)
  modules = kernel_modules(lowered(f, q, q, q, q, lse, q))
  assert [launch_grid(m) for m in modules] == [[65537, 1, 1]] * 2


# -- the kernels, interpreted off a GPU (compiled on one) --------------------------------------

def _run(q, k, v, do, config, causal=True, scale=None, num_sms=3):
  out, lse = jflash.attention(q, k, v, is_causal=causal, implementation="xla",
                              return_residuals=True)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  return mb.flash_backward(q, k, v, out, lse, do, scale=scale, config=config,
                           opts=MaskOptions(is_causal=causal), interpret=INTERPRET,
                           num_sms=num_sms)


@pytest.mark.parametrize("H", [128, 160])
def test_gqa_causal_with_tails_at_the_default(H):
  """The heuristics' config at d = 128 and d = 160 (split by role, two dQ consumers;
  d 64 and 96 run through the shared bases); two query heads per key head (the runtime
  head loop), T = 70 and S = 90 (partial last tiles on both sides), causal: tiles
  skipped from the transposed schedule in dK/dV and from the plain one in dQ."""
  q, k, v, do = random_qkv((1, 70, 90, 4, 2, H), jnp.bfloat16, seed=1)
  config = _call_config(H, 70, 90, causal=True, group_splits=1)
  got = _run(q, k, v, do, config)
  assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
  check_grads(got, q, k, v, do, is_causal=True)


def test_causal_grids_launched_side_by_side():
  """2 batches x 2 heads on 2 multiprocessors: both kernels' causal grids launched with
  each pair's tiles side by side (`launch_side_by_side`); T = 200 and S = 130
  (two query blocks, two key tiles, partial last ones). The reference."""
  q, k, v, do = random_qkv((2, 200, 130, 2, 2, 128), jnp.bfloat16, seed=7)
  config = _call_config(128, 200, 130, 2, 2, causal=True)
  assert not config.persistent
  got = _run(q, k, v, do, config, num_sms=2)
  check_grads(got, q, k, v, do, is_causal=True)


@pytest.mark.parametrize("H, causal, K, fields", [
    (64, True, 2, {}), (64, False, 4, {}), (32, False, 2, {}),
    (64, True, 1, dict(group_splits=2, persistent=False))])
def test_tails_off_the_tiling(H, causal, K, fields):
  """T = 197 and S = 203, off multiples of 8, at head dims whose rows are one swizzle
  row: compiled, both kernels' copies move plain rows over tensor maps of T and S rows
  (no padded copy of Q, K, V or dO, no cut of the gradients); interpreted, padded to
  whole tiles. The defaults' call config (persistent grids at d = 64 where they apply),
  and MQA's group split in two (float32 partials through their own tile)."""
  q, k, v, do = random_qkv((2, 197, 203, 4, K, H), jnp.bfloat16, seed=5)
  config = _call_config(H, 197, 203, 4, K, causal=causal, **fields)
  got = _run(q, k, v, do, config, causal=causal)
  assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
  check_grads(got, q, k, v, do, is_causal=causal)


@pytest.mark.parametrize("H, padded", [(64, False), (128, True)])
def test_tails_are_padded_in_hbm_only_where_rows_are_not_swizzle_rows(H, padded):
  text = _lowered(H, MaskOptions(is_causal=True), T=197, S=203)
  operand_pads = re.findall(r"stablehlo\.pad.*-> tensor<\d+x\d+x\d+x\d+x(?:bf16|f16)>", text)
  assert bool(operand_pads) == padded, operand_pads


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's race detector")
def test_by_role_gqa_causal_with_tails_has_no_race(monkeypatch, capsys):
  """head_dim 256 (`by_role`): one consumer computes S^T and accumulates dK, the other
  dP^T and dV, P^T (two slots) and float32 dP^T (one) passing between them through
  shared memory; GQA 4/2, causal with T = 70 < S = 150, so the last key tile sees no
  query (dK = dV = 0); the dQ kernel one warpgroup. No race in either kernel."""
  watch_races(monkeypatch)
  q, k, v, do = random_qkv((1, 70, 150, 4, 2, 256), jnp.bfloat16, seed=1)
  got = _run(q, k, v, do, _call_config(256, 70, 150, causal=True))
  jax.block_until_ready(got)
  assert "RACE DETECTED" not in capsys.readouterr().out
  assert (np.asarray(got[1], np.float32)[:, 70:] == 0).all()
  check_grads(got, q, k, v, do, is_causal=True)


@pytest.mark.parametrize("H, persistent", [(64, True)])
def test_p_under_dp_equals_the_other_order(H, persistent):
  """`dkv_p_under_dp`, `dq_p_under_dp` (the default at d = 64): the same products and
  elementwise steps in another order of issue, so the gradients equal the other
  order's to the bit, within the 2x rule; GQA causal with tails (T = 200, S = 150)."""
  q, k, v, do = random_qkv((1, 200, 150, 4, 2, H), jnp.bfloat16, seed=6)
  config = _call_config(H, 200, 150, causal=True, persistent=persistent, group_splits=1)
  got, after = (_run(q, k, v, do, dataclasses.replace(
      config, dkv_p_under_dp=flag, dq_p_under_dp=flag)) for flag in (True, False))
  for g, d in zip(got, after):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(d, np.float32))
  check_grads(got, q, k, v, do, is_causal=True)


@pytest.mark.parametrize("block_n, persistent", [(64, False)])
def test_streamed_statistics(block_n, persistent):
  """`stats_streamed`: each query tile's lse and delta come through the producer's
  slots (four copies per slot) and are read after the products that need them. GQA
  causal with tails (S = 150): launched grids with 64-row query tiles through three
  slots (T = 70). (d = 64's default form, persistent with 128-row tiles, runs through
  the shared bases and `test_p_under_dp_equals_the_other_order`.)"""
  T = 300 if persistent else 70
  q, k, v, do = random_qkv((1, T, 150, 4, 2, 64), jnp.bfloat16, seed=8)
  config = configs.BackwardConfig(block_n=block_n, stages=2 if persistent else 3,
                                  persistent=persistent, stats_streamed=True,
                                  dq_rows_in_registers=persistent)
  check_grads(_run(q, k, v, do, config), q, k, v, do, is_causal=True)


@pytest.mark.parametrize("H, group_splits, causal, l2_group", [(64, 2, True, 1),
                                                               (128, 1, True, 2),
                                                               (64, 1, False, 1)])
def test_persistent_grids(H, group_splits, causal, l2_group):
  """`persistent`: both kernels as three programs looping over their grids' items (a
  partial last round, backwards in the causal snake order), in groups of `l2_group`
  tiles per head, the streamed-tile count going on from item to item through three
  slots (items of 2-4 tiles, and of none where a causal key tile sees no query), GQA
  with tails."""
  q, k, v, do = random_qkv((1, 70, 150, 4, 2, H), jnp.bfloat16, seed=7)
  config = configs.BackwardConfig(persistent=True, group_splits=group_splits,
                                  dq_rows_in_registers=True, stages=3, l2_group=l2_group)
  check_grads(_run(q, k, v, do, config, causal=causal), q, k, v, do, is_causal=causal)


@pytest.mark.parametrize("causal, persistent, dq_block_n", [(True, False, 64),
                                                            (False, True, 128)])
def test_three_dq_consumers(causal, persistent, dq_block_n):
  """`dq_consumers=3` (the default at the 128 tier without a causal mask): a producer
  streams K and V to three consumers of 64 query rows, GQA 4/2 with tails (T = 300: a
  whole block of 192 and a padded one; S = 150), on launched grids and on two
  persistent programs, beside d = 64's dK/dV tiles."""
  q, k, v, do = random_qkv((1, 300, 150, 4, 2, 64), jnp.bfloat16, seed=11)
  config = configs.BackwardConfig(block_n=128, stats_streamed=True, dq_block_n=dq_block_n,
                                  persistent=persistent, dq_consumers=3)
  check_grads(_run(q, k, v, do, config, causal=causal, scale=0.125, num_sms=2),
              q, k, v, do, is_causal=causal, scale=0.125)


def test_one_dq_warpgroup_over_several_query_blocks():
  """The dQ kernel as one warpgroup streaming its own key tiles (double buffering), T =
  S = 260: five causal programs of 64 query rows, launched from the heaviest
  (`query_block_order`); the last block padded in the wrapper."""
  q, k, v, do = random_qkv((1, 260, 260, 2, 1, 64), jnp.bfloat16, seed=3)
  config = configs.BackwardConfig(dq_consumers=1)
  check_grads(_run(q, k, v, do, config, scale=0.125), q, k, v, do, is_causal=True,
              scale=0.125)


@pytest.mark.parametrize("group_splits", [2, 4])
def test_mqa_causal_group_splits(group_splits):
  """MQA (four query heads, one key head), causal, T = 130 and S = 100: each key tile's
  2 or 4 programs run their own query heads and store float32 partial dK, dV, summed
  after the kernel; query rows past S see every key."""
  q, k, v, do = random_qkv((1, 130, 100, 4, 1, 64), jnp.bfloat16, seed=9)
  got = _run(q, k, v, do, configs.BackwardConfig(group_splits=group_splits), scale=0.125)
  assert [(g.shape, g.dtype) for g in got] == [(x.shape, x.dtype) for x in (q, k, v)]
  check_grads(got, q, k, v, do, is_causal=True, scale=0.125)


def test_group_splits_add_up_to_one_program():
  """dK, dV of two programs per key tile (float32 partial sums added after the kernel)
  against one program's: equal within the rounding floor of the 2x rule; dQ, from the
  same dQ kernel, to the bit. Causal with T = 100 < S = 130: no query sees the last key
  tile, whose programs store zeros."""
  q, k, v, do = random_qkv((1, 100, 130, 4, 1, 64), jnp.bfloat16, seed=10)
  one, split = ([np.asarray(g, np.float32) for g in _run(
      q, k, v, do, configs.BackwardConfig(group_splits=splits), scale=0.125)]
      for splits in (1, 2))
  assert (split[0] == one[0]).all()
  for a, b in zip(split[1:], one[1:]):
    assert max_err(a, b) <= error_floor(q.dtype, b, 100 * 4), max_err(a, b)
    assert (a[:, 100:] == 0).all()


@pytest.mark.usefixtures("on_hopper")
def test_default_backward_splits_a_small_causal_group():
  """The adapter's default for a causal MQA call too small to fill the GPU: the group
  split over every head (2 programs per key tile), d = 64's tiles with lse and delta
  streamed and P under dP, on the persistent grids; gradients through jflash.attention
  within the rule."""
  q, k, v, do = random_qkv((1, 64, 72, 2, 1, 64), jnp.bfloat16, seed=10)
  cfg, masks = jflash.prepare(q, k, v, is_causal=True, config=MOSAIC_BWD)
  assert mosaic_impl.backward_config(q, k, cfg, masks) == configs.BackwardConfig(
      group_splits=2, block_n=128, stats_streamed=True, dq_rows_in_registers=True,
      persistent=True, dkv_p_under_dp=True, dq_p_under_dp=True)
  got = jax.vjp(lambda q, k, v: jflash.attention(
      q, k, v, is_causal=True, implementation="mosaic_gpu", config=MOSAIC_BWD), q, k, v)[1](do)
  check_grads(got, q, k, v, do, is_causal=True)


def test_nan_in_a_query_reaches_its_row_and_the_keys_it_sees():
  q, k, v, do = random_qkv((1, 64, 64, 1, 1, 64), jnp.bfloat16, seed=3)
  q = q.at[0, 3, 0, 0].set(jnp.nan)           # row 3 sees keys 0..3 (causal)
  dq, dk, dv = (np.asarray(g, np.float32) for g in _run(
      q, k, v, do, configs.BackwardConfig(), scale=0.125))
  row_nan = lambda x: np.isnan(x).any(axis=-1)[0, :, 0]
  assert row_nan(dq).tolist() == [i == 3 for i in range(64)]
  # dV_j = sum_i P_ij dO_i: a hidden key keeps P = 0 although row 3's lse is NaN. (dK =
  # dS^T Q meets the NaN row of Q as 0 * NaN, as any matrix product.)
  assert row_nan(dv)[:4].all() and not row_nan(dv)[4:].any()
  assert np.isnan(dk).any()


def _closed_form_with_dlse(q, k, v, do, dlse, scale):
  """float64 gradients of (out, lse) with cotangents (dO, dlse), one head:
  dS = P * (dP - (rowsum(dO * O) - dlse))."""
  q, k, v, do = (np.asarray(x, np.float64)[0, :, 0] for x in (q, k, v, do))
  dlse = np.asarray(dlse, np.float64)[0, 0]
  s = scale * q @ k.T
  p = np.exp(s - s.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  out = p @ v
  ds = p * (do @ v.T - ((do * out).sum(1) - dlse)[:, None])
  return [x[None, :, None] for x in (scale * ds @ k, scale * ds.T @ q, p.T @ do)]


def test_negative_scale_and_lse_cotangent():
  """A scale < 0 (applied to the logits before the exponent) and a cotangent on lse
  (folded into delta), against the float64 closed form under the 2x rule."""
  q, k, v, do = random_qkv((1, 64, 64, 1, 1, 64), jnp.bfloat16, seed=6)
  dlse = jnp.asarray(np.random.default_rng(7).standard_normal((1, 1, 64)), jnp.float32)
  scale = -0.2
  (out, lse), vjp = jax.vjp(lambda q, k, v: jflash.attention(
      q, k, v, scale=scale, implementation="xla", return_residuals=True), q, k, v)
  plain = vjp((do, dlse))
  got = mb.flash_backward(q, k, v, out, lse, do, dlse, scale=scale, interpret=INTERPRET)
  ref = _closed_form_with_dlse(q, k, v, do, dlse, scale)
  for name, g, p, t in zip(("dq", "dk", "dv"), got, plain, ref):
    err, err_plain = max_err(g, t), max_err(p, t)
    assert err <= 2 * err_plain + error_floor(q.dtype, t, 64), (name, err, err_plain)
