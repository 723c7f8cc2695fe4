"""The Mosaic GPU backward (pallas_kernels/mosaic_gpu/backward.py) on a CPU.

On the H200 it is checked by `python -m experiments.mosaic_check --backward`; here:
- lowering: both kernels (or the one, with `fused_dq`) lower to the Mosaic GPU dialect
  for CUDA (cross-platform lowering; nothing runs), for head_dim 64 and 128, causal and
  not, every mask path;
- interpretation: the kernels run by Mosaic GPU's own interpreter (simulated shared
  memory, bulk copies and barriers) against the float64 closed form, under the 2x rule.
  The interpreter has no in-register or transposed matrix-product operands and no layout
  casts, so there the four products are plain dots; the schedule, the loads, masks,
  tails, the GQA head loop and the NaN rules are the kernels' own;
- which backward runs (`MosaicGPUConfig(backward=...)`, "auto" by default) and the validation.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import api, mosaic_impl
from jflash.reference import error_floor, max_err
from pallas_kernels.masking import MaskOperands, MaskOptions
from pallas_kernels.mosaic_gpu import backward as mb
from pallas_kernels.mosaic_gpu import forward as mf
from tests.attention_test_base import random_qkv

HOPPER = dict(platform="gpu", capability="9.0")
MOSAIC_BWD = jflash.MosaicGPUConfig(backward="mosaic_gpu")


# -- configuration -------------------------------------------------------------------------

def test_backward_choice_and_validation():
  q, k, v = random_qkv((1, 16, 16, 2, 1, 64), jnp.bfloat16)[:3]
  kind = lambda q, k, v, **kw: mosaic_impl.backward_kind(q, k, *jflash.prepare(q, k, v, **kw))
  # "auto": the Mosaic GPU backward for grouped heads at head_dim 128, unless a causal
  # dK/dV grid is small; for one key head per query head from MHA_MIN_SEQ rows
  assert kind(q, k, v) == "pallas"                                   # head_dim 64
  q128, k128, v128 = random_qkv((1, 64, 64, 2, 1, 128), jnp.bfloat16)[:3]
  assert kind(q128, k128, v128) == "mosaic_gpu"
  assert kind(q128, k128, v128, is_causal=True) == "pallas"        # 2 programs, split
  assert kind(q128, q128, q128) == "pallas"                         # one key head per head
  # ... from MHA_MIN_SEQ rows on, the Mosaic GPU backward with two consumers, when its
  # causal grid (128 keys per program) is large enough; without a causal mask the dQ
  # kernel's three consumers (DQ_CONSUMERS_AT_128), with one their rows in registers
  n = mosaic_impl.MHA_MIN_SEQ
  mha = jax.ShapeDtypeStruct((1, n, 1, 128), jnp.bfloat16)
  assert mosaic_impl.backward_kind(mha, mha, *jflash.prepare(q128, q128, q128)) == "mosaic_gpu"
  assert mosaic_impl.backward_config(mha, mha, *jflash.prepare(q128, q128, q128)) == \
      mb.BackwardConfig(consumers=2, dq_consumers=mb.DQ_CONSUMERS_AT_128, persistent=True)
  assert mosaic_impl.backward_config(
      mha, mha, *jflash.prepare(q128, q128, q128, is_causal=True)) == \
      mb.BackwardConfig(consumers=2, dq_rows_in_registers=True)
  # Without a causal mask the default runs the persistent grids, from
  # MHA_PERSISTENT_MIN_SEQ rows; a causal call from MHA_MIN_SEQ, on the launched grids.
  causal = jflash.prepare(q128, q128, q128, is_causal=True)
  n_p = mosaic_impl.MHA_PERSISTENT_MIN_SEQ
  for rows, masks, chosen in ((n_p, jflash.prepare(q128, q128, q128), "mosaic_gpu"),
                              (n_p - 128, jflash.prepare(q128, q128, q128), "pallas"),
                              (n // 2, causal, "pallas")):
    short = jax.ShapeDtypeStruct((512, rows, 1, 128), jnp.bfloat16)  # a full causal grid
    assert mosaic_impl.backward_kind(short, short, *masks) == chosen, (rows, masks)
  assert not mosaic_impl.backward_config(mha, mha, *causal).persistent
  # The launched grids pinned by the caller: timed against Triton from MHA_MIN_SEQ
  pinned = jflash.prepare(q128, q128, q128,
                          config=jflash.MosaicGPUConfig(backward_persistent=False))
  assert not mosaic_impl.backward_config(mha, mha, *pinned).persistent   # the caller's
  assert mosaic_impl.backward_kind(mha, mha, *pinned) == "mosaic_gpu"
  short = jax.ShapeDtypeStruct((1, n // 2, 1, 128), jnp.bfloat16)
  assert mosaic_impl.backward_kind(short, short, *pinned) == "pallas"
  # ... the persistent grids pinned for a causal call: slower than the launched ones
  # there, not a timed config, so not auto
  causal_persistent = jflash.prepare(q128, q128, q128, is_causal=True,
                                     config=jflash.MosaicGPUConfig(backward_persistent=True))
  wide = jax.ShapeDtypeStruct((32, n, 1, 128), jnp.bfloat16)      # a full causal grid
  assert mosaic_impl.backward_kind(wide, wide, *causal) == "mosaic_gpu"
  assert mosaic_impl.backward_kind(wide, wide, *causal_persistent) == "pallas"
  ragged = jax.ShapeDtypeStruct((1, n + 1, 1, 128), jnp.bfloat16)   # tails in place
  assert mosaic_impl.backward_kind(ragged, mha, *jflash.prepare(q128, q128, q128)) == \
      "mosaic_gpu"
  for untimed in (dict(backward_consumers=1), dict(backward_fused_dq=True),
                  dict(backward_block_n=128)):   # "auto" takes only the timed MHA config
    own = jflash.prepare(q128, q128, q128, config=jflash.MosaicGPUConfig(**untimed))
    assert mosaic_impl.backward_kind(mha, mha, *own) == "pallas", untimed
  assert mosaic_impl.backward_kind(mha, mha, *causal) == "pallas"    # 16 programs
  for batch, chosen in ((32, "mosaic_gpu"), (31, "pallas")):        # 32 x 16 = 512
    wide = jax.ShapeDtypeStruct((batch, n, 1, 128), jnp.bfloat16)
    assert mosaic_impl.backward_kind(wide, wide, *causal) == chosen, batch
  # A causal grid of grouped heads too small unsplit takes the fewest group splits that
  # fill it, or the Triton backward when splitting every head does not.
  cfg = jflash.prepare(q128, k128, v128, is_causal=True)
  for programs, splits, chosen in ((mb.CAUSAL_MIN_PROGRAMS // 2, 2, "mosaic_gpu"),
                                   (mb.CAUSAL_MIN_PROGRAMS // 4, 2, "pallas"),
                                   (mb.CAUSAL_MIN_PROGRAMS, 1, "mosaic_gpu")):
    S = 128 * programs                       # key tiles of the two consumers' 128 rows
    big_q = jax.ShapeDtypeStruct((1, S, 2, 128), jnp.bfloat16)
    big_k = jax.ShapeDtypeStruct((1, S, 1, 128), jnp.bfloat16)
    assert mosaic_impl.backward_config(big_q, big_k, *cfg).group_splits == splits
    assert mosaic_impl.backward_kind(big_q, big_k, *cfg) == chosen, programs
  # head_dim 256 (split by role, 64 keys per dK/dV program): MHA and GQA from
  # BY_ROLE_MIN_SEQ rows, unless a causal grid stays small
  n256 = mosaic_impl.BY_ROLE_MIN_SEQ
  for shape, causal, chosen in (((16, n256, 8, 8), False, "mosaic_gpu"),
                                ((16, n256 - 64, 8, 8), False, "pallas"),   # shorter
                                ((16, n256 + 8, 8, 8), False, "mosaic_gpu"),  # ragged
                                ((2, 4096, 16, 4), True, "mosaic_gpu"),     # 2 x 4 x 64
                                ((1, 4096, 16, 4), True, "pallas")):        # 256 programs
    B, T, N, K = shape
    q256 = jax.ShapeDtypeStruct((B, T, N, 256), jnp.bfloat16)
    k256 = jax.ShapeDtypeStruct((B, T, K, 256), jnp.bfloat16)
    own = jflash.prepare(q128, q128, q128, is_causal=causal)
    assert mosaic_impl.backward_kind(q256, k256, *own) == chosen, (shape, causal)
  one = jflash.prepare(q128, q128, q128, config=jflash.MosaicGPUConfig(backward_consumers=1))
  assert mosaic_impl.backward_kind(q256, q256, *one) == "pallas"  # not runnable at 256
  # Head dims off the table follow the rule of the one whose tiles they take: 128's up
  # to 128 (MHA from MHA_PERSISTENT_MIN_SEQ, grouped heads), 256's above; below 64 the
  # Triton backward (d = 64's rule has run at 64 only).
  plain = jflash.prepare(q128, q128, q128)
  for H, (B, T, N, K), chosen in ((48, (1, n_p, 1, 1), "pallas"),
                                  (48, (1, mosaic_impl.D64_MIN_SEQ, 1, 1), "pallas"),
                                  (80, (1, n_p, 1, 1), "mosaic_gpu"),
                                  (96, (1, n_p - 128, 1, 1), "pallas"),
                                  (96, (1, 64, 2, 1), "mosaic_gpu"),
                                  (192, (16, n256, 8, 8), "mosaic_gpu"),
                                  (160, (16, n256 - 64, 8, 8), "pallas")):
    q_off = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    k_off = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
    assert mosaic_impl.backward_kind(q_off, k_off, *plain) == chosen, (H, B, T, N, K)
  # head_dim 64, with the default config (tiles of 128, persistent): one key head per
  # query head from D64_MIN_SEQ rows (D64_CAUSAL_MIN_SEQ causal), grouped heads from
  # D64_GROUPED_MIN_SEQ, unless a causal grid stays small
  n64, g64 = mosaic_impl.D64_MIN_SEQ, mosaic_impl.D64_GROUPED_MIN_SEQ
  c64 = mosaic_impl.D64_CAUSAL_MIN_SEQ
  for (B, T, N, K), causal, fields, chosen in (
      ((16, n64, 32, 32), False, {}, "mosaic_gpu"),
      ((4, c64, 32, 32), True, {}, "mosaic_gpu"),                 # 4096 programs
      ((8, c64 // 2, 32, 32), True, {}, "pallas"),                # causal, shorter
      ((1, c64, 2, 2), True, {}, "pallas"),                       # 64 programs
      ((4, c64, 32, 32), True, dict(backward_persistent=False), "mosaic_gpu"),  # launched
      ((16, n64 // 2, 32, 32), False, {}, "pallas"),              # shorter
      ((4, g64, 32, 8), False, {}, "mosaic_gpu"),                 # grouped
      ((4, g64, 32, 8), True, {}, "mosaic_gpu"),                  # 1024 programs
      ((1, g64, 32, 8), True, {}, "mosaic_gpu"),                  # 256 x 2 splits
      ((1, g64, 8, 2), True, {}, "pallas"),                       # 64 x 4 splits
      ((16, g64 // 2, 32, 8), False, {}, "pallas"),               # shorter, grouped
      ((4, c64, 32, 32), True, dict(backward_dkv_p_under_dp=False,   # the order timed
                                    backward_dq_p_under_dp=False), "mosaic_gpu"),
      ((4, c64, 32, 32), True, dict(backward_dq_p_under_dp=False), "pallas"),  # untimed
      ((4, g64, 32, 32), False, dict(backward_dq_block_n=64), "pallas")):  # untimed
    q64 = jax.ShapeDtypeStruct((B, T, N, 64), jnp.bfloat16)
    k64 = jax.ShapeDtypeStruct((B, T, K, 64), jnp.bfloat16)
    own = jflash.prepare(q128, q128, q128, is_causal=causal,
                         config=jflash.MosaicGPUConfig(**fields))
    assert mosaic_impl.backward_kind(q64, k64, *own) == chosen, (B, T, N, K, causal, fields)
  mqa_q = jax.ShapeDtypeStruct((1, 16384, 16, 128), jnp.bfloat16)   # MQA 16/1 16K causal:
  mqa_k = jax.ShapeDtypeStruct((1, 16384, 1, 128), jnp.bfloat16)    # 128 programs x 4
  assert mosaic_impl.backward_config(mqa_q, mqa_k, *cfg) == mb.BackwardConfig(
      consumers=2, group_splits=4, dq_rows_in_registers=True)
  assert mosaic_impl.backward_config(mqa_q, mqa_k, *jflash.prepare(q128, k128, v128)) == \
      mb.BackwardConfig(consumers=2, dq_consumers=mb.DQ_CONSUMERS_AT_128)  # never split
  # The split counts the caller's own consumers, stops where shared memory ends, and is
  # the caller's when set; "auto" runs the Triton backward for fields that do not fit.
  def causal_with(**fields):
    return jflash.prepare(q128, k128, v128, is_causal=True,
                          config=jflash.MosaicGPUConfig(**fields))
  assert mosaic_impl.backward_config(mqa_q, mqa_k, *causal_with(
      backward_consumers=1)).group_splits == 2                      # 256 programs x 2
  assert mosaic_impl.backward_config(mqa_q, mqa_k, *causal_with(
      backward_group_splits=2)).group_splits == 2
  for fields in (dict(backward_fused_dq=True), dict(backward_block_n=128)):
    config = mosaic_impl.backward_config(mqa_q, mqa_k, *causal_with(**fields))
    assert config.group_splits == 1, fields           # a split's float32 tile: no room
    assert mb.smem_bytes(128, 2, config) <= mf.SMEM_BYTES
  too_big = causal_with(backward_block_n=256)                      # 2 x 256-row slots
  assert mosaic_impl.backward_kind(mqa_q, mqa_k, *too_big) == "pallas"
  q4, k4, v4 = random_qkv((1, 16, 16, 4, 1, 128), jnp.bfloat16)[:3]
  mosaic_impl.check_call(q4, k4, v4, *jflash.prepare(
      q4, k4, v4, is_causal=True, config=jflash.MosaicGPUConfig(backward_fused_dq=True)),
      **HOPPER)
  assert kind(q128, k128, v128, config=jflash.MosaicGPUConfig(backward="pallas")) == "pallas"
  cfg, masks = jflash.prepare(q, k, v, config=MOSAIC_BWD)
  assert mosaic_impl.backward_kind(q, k, cfg, masks) == "mosaic_gpu"
  mosaic_impl.check_call(q, k, v, cfg, masks, **HOPPER)
  with pytest.raises(ValueError, match="backward='triton'"):
    jflash.MosaicGPUConfig(backward="triton")
  with pytest.raises(ValueError, match="block_n=96"):
    mb.BackwardConfig(block_n=96)
  tiled = jflash.prepare(q, k, v, config=jflash.MosaicGPUConfig(
      backward="mosaic_gpu", backward_block_n=128))[0]
  assert mosaic_impl.backward_config(q, k, tiled, masks) == mb.BackwardConfig(
      consumers=2, block_n=128, dq_rows_in_registers=True, persistent=True)   # d = 64
  assert mosaic_impl.kernel_config(q, tiled, masks) == mosaic_impl.kernel_config(q, cfg, masks)
  # each bad field named as the caller wrote it
  for record, fields, match in (
      (mb.BackwardConfig, dict(semantics="auto"), "semantics='auto'"),
      (mb.BackwardConfig, dict(consumers=3), "consumers=3"),
      (mb.BackwardConfig, dict(fused_dq=1), "fused_dq=1"),
      (mb.BackwardConfig, dict(dq_rows_in_registers=1), "dq_rows_in_registers=1"),
      (jflash.MosaicGPUConfig, dict(backward_consumers=3), "backward_consumers=3"),
      (jflash.MosaicGPUConfig, dict(backward_block_n=96), "backward_block_n=96"),
      (jflash.MosaicGPUConfig, dict(backward_dkv_rows_in_registers="yes"),
       "backward_dkv_rows_in_registers='yes'"),
      (jflash.MosaicGPUConfig, dict(backward_stages=1), "backward_stages=1"),
      (jflash.MosaicGPUConfig, dict(backward_dq_block_n=32), "backward_dq_block_n=32"),
      (mb.BackwardConfig, dict(persistent=True), "persistent=True runs programs of two"),
      (mb.BackwardConfig, dict(stats_streamed=True), "stats_streamed=True streams"),
      (mb.BackwardConfig, dict(stages=17), "34 \"loaded\" barriers"),
      (mb.BackwardConfig, dict(consumers=2, stats_streamed=True, stages=9),
       "36 \"loaded\" barriers \\(four per slot"),
      (mb.BackwardConfig, dict(consumers=2, dv_overlap=None), "dv_overlap=None"),
      (jflash.MosaicGPUConfig, dict(backward_stats_streamed=True, backward_consumers=1),
       "stats_streamed=True streams"),
      (jflash.MosaicGPUConfig, dict(backward_persistent=True, backward_consumers=1),
       "persistent=True runs programs of two")):
    with pytest.raises(ValueError, match=match):
      record(**fields)
  # the dQ kernel's rows in registers by default where it runs two consumers; a
  # caller's choice kept (at this head_dim, 64, tiles of 128 with lse and delta
  # streamed, P under dP in both kernels and the persistent grids by default, the dQ
  # kernel's tiles alone and the launched grids with one consumer)
  own = lambda **fields: mosaic_impl.backward_config(q, k, jflash.prepare(
      q, k, v, config=jflash.MosaicGPUConfig(backward="mosaic_gpu", **fields))[0], masks)
  d64 = dict(consumers=2, block_n=128, stats_streamed=True, dkv_p_under_dp=True,
             dq_p_under_dp=True)
  assert own(backward_dq_block_n=64) == mb.BackwardConfig(
      consumers=2, dq_block_n=64, dq_rows_in_registers=True, persistent=True)
  assert own(backward_dq_rows_in_registers=False) == mb.BackwardConfig(**d64, persistent=True)
  assert own(backward_persistent=False) == mb.BackwardConfig(**d64, dq_rows_in_registers=True)
  assert own(backward_dkv_p_under_dp=False) == mb.BackwardConfig(
      **dict(d64, dkv_p_under_dp=False), dq_rows_in_registers=True, persistent=True)
  assert own(backward_dq_p_under_dp=False) == mb.BackwardConfig(
      **dict(d64, dq_p_under_dp=False), dq_rows_in_registers=True, persistent=True)
  assert own(backward_consumers=1) == mb.BackwardConfig(consumers=1, dq_block_n=128)
  assert own(backward_fused_dq=True) == mb.BackwardConfig(consumers=2, fused_dq=True)
  for field in ("backward_dq_rows_in_registers", "backward_dq_p_under_dp"):
    with pytest.raises(ValueError, match=f"fused_dq=True runs no dQ kernel.*{field[9:]}=True"):
      jflash.MosaicGPUConfig(backward_fused_dq=True, **{field: True})
  # causal persistent grids at head_dim 64 of L2_GROUP_MIN_PAIRS (batch, key head) pairs
  # or more go out in groups of L2_GROUP tiles per head; fewer pairs, launched grids,
  # other head dims or the caller's l2_group keep theirs. "auto" picks the same backward
  # whatever the group (an order of the items; both timed orders won at d = 64).
  shapes = lambda B, N, K, H=64: (jax.ShapeDtypeStruct((B, 4096, N, H), jnp.bfloat16),
                                  jax.ShapeDtypeStruct((B, 4096, K, H), jnp.bfloat16))
  for (B, N, K, H), causal, fields, want in (
      ((4, 32, 32, 64), True, {}, mb.L2_GROUP), ((4, 32, 8, 64), True, {}, 1),
      ((4, 32, 32, 64), False, {}, 1), ((4, 32, 32, 64), True, dict(backward_l2_group=2), 2),
      ((4, 32, 32, 64), True, dict(backward_persistent=False), 1),
      ((8, 16, 16, 128), True, dict(backward_persistent=True), 1)):
    qs, ks = shapes(B, N, K, H)
    assert B * K >= mb.L2_GROUP_MIN_PAIRS or (B, K) == (4, 8)
    cfg_masks = jflash.prepare(qs, ks, ks, is_causal=causal,
                               config=jflash.MosaicGPUConfig(**fields))
    assert mosaic_impl.backward_config(qs, ks, *cfg_masks).l2_group == want, (B, K, fields)
  for H, causal in ((64, True), (128, True), (64, False)):
    qs, ks = shapes(4, 32, 32, H)
    kinds = {mosaic_impl.backward_kind(qs, ks, *jflash.prepare(
        qs, ks, ks, is_causal=causal, config=jflash.MosaicGPUConfig(**fields)))
        for fields in ({}, dict(backward_l2_group=1), dict(backward_l2_group=8))}
    assert kinds == {"mosaic_gpu"}, (H, causal, kinds)
  with pytest.raises(ValueError, match="backward_l2_group=0 must be a positive int"):
    jflash.MosaicGPUConfig(backward_l2_group=0)
  # the dQ kernel's slots count where they are wider than the dK/dV kernel's
  assert mb.smem_bytes(128, 2, mb.BackwardConfig(consumers=2, dq_block_n=128)) == \
      mb.smem_bytes(128, 2, mb.BackwardConfig(consumers=2)) + 2 * 2 * 64 * 128 * 2
  with pytest.raises(ValueError, match="backward_fused_dq=True needs backward_block_n=64 or "
                                      "backward_block_n=128, not backward_block_n=192"):
    jflash.MosaicGPUConfig(backward_fused_dq=True, backward_block_n=192)
  # the row split needs fused dQ on two consumers' 128-row query tiles
  for fields in (dict(fused_dq_row_split=True, block_n=128),
                 dict(fused_dq=True, fused_dq_row_split=True),
                 dict(fused_dq=True, fused_dq_row_split=True, block_n=128, consumers=1)):
    with pytest.raises(ValueError, match="fused_dq_row_split=True splits"):
      mb.two_consumer_config(**fields)
  # the fused dQ tile's float32 registers bound block_n x head_dim
  q4, k4, v4 = random_qkv((1, 16, 16, 2, 1, 128), jnp.bfloat16)[:3]
  with pytest.raises(NotImplementedError, match="block_n=128 at head_dim=128"):
    mb.check_supported(q4, k4, v4, mb.BackwardConfig(consumers=2, fused_dq=True, block_n=128))
  # A combination that overflows shared memory is refused before it is compiled.
  for H in mf.TABLE_HEAD_DIMS:
    for consumers in (1, 2):
      for fused_dq in (False, True):
        config = mb.BackwardConfig(consumers=consumers, fused_dq=fused_dq)
        assert mb.smem_bytes(H, 2, config) <= mf.SMEM_BYTES
  # d = 64's tiles with fused dQ, whole or split by rows: both consumers' dS'^T in two
  # slots take what the whole tile's float32 dQ of each took
  whole, split = (mb.BackwardConfig(consumers=2, block_n=128, stats_streamed=True, fused_dq=True,
                                    fused_dq_row_split=row_split) for row_split in (False, True))
  assert mb.smem_bytes(64, 2, split) == mb.smem_bytes(64, 2, whole) <= mf.SMEM_BYTES
  q128, k128, v128 = random_qkv((1, 16, 16, 2, 1, 128), jnp.bfloat16)[:3]
  big = jflash.prepare(q128, k128, v128, config=jflash.MosaicGPUConfig(
      backward="mosaic_gpu", backward_consumers=2, backward_block_n=256))
  with pytest.raises(NotImplementedError, match="shared memory"):
    mosaic_impl.check_call(q128, k128, v128, *big, **HOPPER)


def test_group_splits_validation_and_limits():
  for bad in (0, -1, True, 2.5):
    with pytest.raises(ValueError, match=f"^group_splits={bad!r} must be a positive int"):
      mb.BackwardConfig(group_splits=bad)
    with pytest.raises(ValueError, match=f"^backward_group_splits={bad!r} must be"):
      jflash.MosaicGPUConfig(backward_group_splits=bad)
  q, k, v = random_qkv((1, 16, 16, 4, 2, 128), jnp.bfloat16)[:3]      # a group of 2
  own = jflash.prepare(q, k, v, config=jflash.MosaicGPUConfig(
      backward="mosaic_gpu", backward_group_splits=2))
  assert mosaic_impl.backward_config(q, k, *own) == mb.BackwardConfig(
      consumers=2, group_splits=2, dq_consumers=mb.DQ_CONSUMERS_AT_128)  # not causal
  mosaic_impl.check_call(q, k, v, *own, **HOPPER)
  for splits in (3, 4):     # the config alone does not know the group: the call's check
    with pytest.raises(NotImplementedError, match=f"group_splits={splits} does not divide "
                       "the GQA group of 2"):
      mb.check_supported(q, k, v, mb.BackwardConfig(group_splits=splits))
  bad = jflash.prepare(q, k, v, config=jflash.MosaicGPUConfig(
      backward="mosaic_gpu", backward_group_splits=4))
  with pytest.raises(NotImplementedError, match="group_splits=4 does not divide"):
    mosaic_impl.check_call(q, k, v, *bad, **HOPPER)
  # Each consumer's float32 tile of partial dK / dV: it fits beside the default tiles,
  # but not beside fused_dq's with two consumers at head_dim 128.
  for H in (64, 128):
    for consumers in (1, 2):
      split = mb.BackwardConfig(consumers=consumers, group_splits=2)
      assert mb.smem_bytes(H, 2, split) == mb.smem_bytes(
          H, 2, mb.BackwardConfig(consumers=consumers)) + consumers * mb.ROWS * H * 4
      assert mb.smem_bytes(H, 2, split) <= mf.SMEM_BYTES
  # at head_dim 256 (split by role) the float32 tiles of 64 x 256 do not fit
  assert mb.smem_bytes(256, 2, mb.BackwardConfig(consumers=2)) <= mf.SMEM_BYTES
  assert mb.smem_bytes(256, 2, mb.BackwardConfig(consumers=2, group_splits=2)) > mf.SMEM_BYTES
  with pytest.raises(NotImplementedError, match="shared memory"):
    mb.check_supported(q, k, v, mb.BackwardConfig(consumers=2, fused_dq=True, group_splits=2))


def test_head_dim_256_runs_by_role_with_two_consumers_only():
  """At head_dim 256 dK and dV of a consumer's 64 keys would take 256 registers: the
  dK/dV kernel's two consumers hold one each (`by_role`), so one warpgroup, fused dQ,
  a group split (two float32 tiles of 64 x 256) and the other options of the tile
  loop are refused."""
  assert [mb.by_role(H) for H in (64, 96, 128, 160, 192, 256)] == [False] * 3 + [True] * 3
  q, k, v = random_qkv((1, 16, 16, 2, 1, 256), jnp.bfloat16)[:3]
  mosaic_impl.check_call(q, k, v, *jflash.prepare(q, k, v, config=MOSAIC_BWD), **HOPPER)
  for fields, why in ((dict(backward_consumers=1), "consumers=1"),
                      (dict(backward_fused_dq=True), "fused_dq=True"),
                      (dict(backward_group_splits=2), "group_splits=2"),
                      (dict(backward_dq_rows_in_registers=True), "dq_rows_in_registers=True"),
                      (dict(backward_dkv_rows_in_registers=True), "dkv_rows_in_registers=True"),
                      (dict(backward_persistent=True), "persistent=True"),
                      (dict(backward_consumers=2, backward_stats_streamed=True),
                       "stats_streamed=True"),
                      (dict(backward_dv_overlap=False), "dv_overlap=False"),
                      (dict(backward_dkv_p_under_dp=True), "dkv_p_under_dp=True"),
                      (dict(backward_edge_overlap=True), "edge_overlap=True")):
    own = jflash.prepare(q, k, v, config=jflash.MosaicGPUConfig(backward="mosaic_gpu", **fields))
    with pytest.raises(NotImplementedError, match=why):
      mosaic_impl.check_call(q, k, v, *own, **HOPPER)
  with pytest.raises(NotImplementedError, match="no dense mask"):
    mb.flash_backward(q, k, v, q, None, q, scale=1.0,
                      ops=MaskOperands(mask=jnp.ones((1, 1, 16, 16), bool)))


def test_two_dq_consumers_above_head_dim_128_where_they_fit():
  """`dq_consumers=2` at the head dims split by role runs the warp-specialised dQ kernel:
  two consumers' Q and dO beside the K/V slots fit shared memory up to d = 224 with key
  tiles of 64, not at d = 256. The per-call default takes it where it fits: the
  config checked and timed on the H200 (dq_consumers 2, key tiles of 64), one
  warpgroup at d = 256 and wherever the caller's stages leave no room."""
  two = dict(backward="mosaic_gpu", backward_dq_consumers=2, backward_dq_block_n=64)
  for H, fits in ((144, True), (160, True), (192, True), (224, True), (256, False)):
    q, k, v = random_qkv((1, 16, 16, 2, 1, H), jnp.bfloat16)[:3]
    cfg, masks = jflash.prepare(q, k, v, config=jflash.MosaicGPUConfig(**two))
    config = mosaic_impl.backward_config(q, k, cfg, masks)
    assert mb.dq_consumers_of(H, config) == 2
    assert mb.dq_consumers_of(H, mb.BackwardConfig(consumers=2)) == 1   # None's count
    default = mosaic_impl.backward_config(q, k, *jflash.prepare(q, k, v))
    assert mb.dq_consumers_of(H, default) == (2 if fits else 1)
    assert (default.dq_block_n or default.block_n) == 64 and not default.dq_rows_in_registers
    if fits:
      assert default == dataclasses.replace(config, dq_block_n=None)
      mosaic_impl.check_call(q, k, v, cfg, masks, **HOPPER)
    else:
      with pytest.raises(NotImplementedError, match="shared memory"):
        mosaic_impl.check_call(q, k, v, cfg, masks, **HOPPER)
    mb.check_supported(q, k, v, default)
  # Three slots leave room for two dQ consumers up to d = 176 only; the caller's own
  # count is kept wherever it fits.
  for H, stages, want in ((176, 3, 2), (192, 3, 1), (192, 2, 2)):
    shape = (1, 4096, 8, H)
    assert mb.dq_consumers_of(H, mb.call_config(shape, shape, 2, causal=True,
                                                stages=stages)) == want
  # The default's two consumers are the config run on the H200: key tiles of 64.
  for fields in (dict(dq_consumers=1), dict(dq_block_n=128), dict(block_n=128)):
    config = mb.call_config((1, 4096, 8, 144), (1, 4096, 8, 144), 2, causal=False, **fields)
    assert mb.dq_consumers_of(144, config) == 1, fields
  assert mb.dq_consumers_of(128, mb.BackwardConfig(consumers=2, dq_consumers=1)) == 1

  # The dQ kernel's slots follow its own consumers: two for one warpgroup, else stages.
  tile = mb.ROWS * 128 * 2
  for consumers, dq, slots in ((2, 1, 2), (1, 2, 3)):
    config = mb.BackwardConfig(consumers=consumers, dq_consumers=dq, stages=3, block_n=64)
    dq_bytes = dq * 2 * tile + slots * 2 * 64 * 128 * 2
    dkv_bytes = consumers * 2 * tile + (2 if consumers == 1 else 3) * 2 * 64 * 128 * 2
    assert mb.smem_bytes(128, 2, config) == max(dq_bytes, dkv_bytes) + mf.SMEM_SLACK
  # The per-call defaults keep to what the dQ kernel runs: no persistent grid and no
  # rows in registers with one dQ warpgroup, both with two.
  one = mb.call_config((1, 4096, 16, 128), (1, 4096, 16, 128), 2, causal=False, dq_consumers=1)
  assert not one.persistent and not one.dq_rows_in_registers
  two = mb.call_config((1, 4096, 16, 128), (1, 4096, 16, 128), 2, causal=False, consumers=1,
                       dq_consumers=2)
  assert two.dq_rows_in_registers and not two.persistent
  q, k, v = random_qkv((1, 4096, 4096, 2, 2, 128), jnp.bfloat16)[:3]
  mosaic_impl.check_call(q, k, v, *jflash.prepare(q, k, v, config=jflash.MosaicGPUConfig(
      backward="mosaic_gpu", backward_dq_consumers=1)), **HOPPER)
  # "auto" takes the default's own dQ count as the default (the timed config): three
  # at head_dim 128 without a causal mask (DQ_CONSUMERS_AT_128); and the two with
  # their rows in registers timed before them.
  same = jflash.prepare(q, k, v, config=jflash.MosaicGPUConfig(backward_dq_consumers=3))
  assert mosaic_impl.backward_kind(q, k, *same) == mosaic_impl.backward_kind(
      q, k, *jflash.prepare(q, k, v)) == "mosaic_gpu"
  for two in (dict(backward_dq_consumers=2), dict(backward_dq_rows_in_registers=True)):
    own = jflash.prepare(q, k, v, config=jflash.MosaicGPUConfig(**two))
    assert mosaic_impl.backward_config(q, k, *own).dq_rows_in_registers, two
    assert mosaic_impl.backward_kind(q, k, *own) == "mosaic_gpu", two
  untimed = jflash.prepare(q, k, v, config=jflash.MosaicGPUConfig(
      backward_dq_consumers=2, backward_dq_rows_in_registers=False))
  assert mosaic_impl.backward_kind(q, k, *untimed) == "pallas"
  for fields, why in ((dict(dq_consumers=4), "dq_consumers=4"),
                      (dict(dq_consumers=True), "dq_consumers=True"),
                      (dict(fused_dq=True, dq_consumers=2), "dq_consumers=2"),
                      (dict(consumers=2, persistent=True, dq_consumers=1), "dq_consumers=1")):
    with pytest.raises(ValueError, match=why):
      mb.BackwardConfig(**fields)


def test_tiles_of_128_at_head_dim_64():
  """At d = 64, unless the caller set block_n, dq_block_n or stats_streamed, both
  kernels' tiles are BLOCK_N_AT_64 with lse and delta streamed (the config timed on
  the H200), the dQ kernel's alone with one consumer (which cannot stream them);
  elsewhere block_n's (d 16-48 take d = 64's tiles but have not run with these)."""
  for H, want in ((16, False), (48, False), (64, True), (80, False), (128, False),
                  (192, False)):
    shape = (1, 4096, 8, H)
    for causal in (False, True):
      config = mb.call_config(shape, shape, 2, causal=causal)
      assert (config.block_n, config.dq_block_n, config.stats_streamed) == (
          (mb.BLOCK_N_AT_64, None, True) if want else (64, None, False)), (H, causal)
      assert config.dv_overlap
      assert mb.smem_bytes(H, 2, config) <= mf.SMEM_BYTES
  shape = (1, 4096, 8, 64)
  tiles = lambda **f: (lambda c: (c.block_n, c.dq_block_n, c.stats_streamed))(  # noqa: E731
      mb.call_config(shape, shape, 2, causal=False, **f))
  assert tiles(block_n=128) == (128, None, False)
  assert tiles(dq_block_n=64) == (64, 64, False)
  assert tiles(stats_streamed=False) == (64, None, False)
  assert tiles(stats_streamed=True) == (64, None, True)
  assert tiles(fused_dq=True) == (64, None, False)
  assert tiles(consumers=1) == (64, mb.BLOCK_N_AT_64, False)
  # a caller's stages beyond the streamed form's barriers (4 per slot, MAX_BARRIERS) or
  # shared memory keep it off, as a config the kernels run (and "auto" can judge)
  assert tiles(stages=3) == (mb.BLOCK_N_AT_64, None, True)
  for stages in (6, 9):
    assert tiles(stages=stages) == (64, mb.BLOCK_N_AT_64, False), stages
  q = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  for stages in (6, 9):
    own = jflash.prepare(q, q, q, config=jflash.MosaicGPUConfig(backward_stages=stages))
    assert mosaic_impl.backward_kind(q, q, *own) == "pallas"
  # a causal GQA call's group split (partial dK and dV tiles) still fits beside them
  split = mb.call_config((1, 4096, 32, 64), (1, 4096, 2, 64), 2, causal=True)
  assert split.group_splits > 1 and split.stats_streamed
  assert mb.smem_bytes(64, 2, split) <= mf.SMEM_BYTES


# -- lowering to Mosaic GPU (no GPU needed) -------------------------------------------------

def _lowered(H, opts, with_masks=False, config=None, T=200, S=330, N=4, K=2,
             dtype=jnp.bfloat16, num_sms=None):
  q = jax.ShapeDtypeStruct((2, T, N, H), dtype)
  k = jax.ShapeDtypeStruct((2, S, K, H), dtype)
  lse = jax.ShapeDtypeStruct((2, N, T), jnp.float32)

  def f(q, k, v, out, lse, dout, *extra):
    ops = None
    if extra:
      ops = MaskOperands(q_segment_ids=extra[0], kv_segment_ids=extra[1], kv_lengths=extra[2])
    return mb.flash_backward(q, k, v, out, lse, dout, lse, scale=H ** -0.5, opts=opts,
                             ops=ops, config=config, num_sms=num_sms)
  extra = []
  if with_masks:
    extra = [jax.ShapeDtypeStruct((2, T), jnp.int32), jax.ShapeDtypeStruct((2, S), jnp.int32),
             jax.ShapeDtypeStruct((2,), jnp.int32)]
  try:
    lowered = jax.jit(f).trace(q, k, k, q, lse, q, *extra).lower(lowering_platforms=("cuda",))
  except ImportError as e:  # pragma: no cover - jaxlib without the Mosaic GPU bindings
    pytest.skip(f"this jaxlib cannot lower Mosaic GPU kernels: {e}")
  return lowered.as_text()


@pytest.mark.parametrize("H", mf.TABLE_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_lowers_to_mosaic_gpu(H, causal):
  config = mb.BackwardConfig(consumers=2) if mb.by_role(H) else None
  assert _lowered(H, MaskOptions(is_causal=causal), config=config).count("@mosaic_gpu") == 2


@pytest.mark.parametrize("H", [32, 80, 96, 160, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_lowers_off_table_head_dims(H, causal):
  """Head dims between the table's (each swizzle width, both sides of `by_role`), at
  the adapter's config, down to the matrix-product instructions of both kernels."""
  config = mb.call_config((2, 200, 4, H), (2, 330, 2, H), 2, causal=causal)
  text = _lowered(H, MaskOptions(is_causal=causal), config=config)
  assert text.count("@mosaic_gpu") == 2 and "wgmma" in text


@pytest.mark.parametrize("H", [144, 192, 224])
@pytest.mark.parametrize("causal", [False, True])
def test_lowers_two_dq_consumers_above_head_dim_128(H, causal):
  """The default warp-specialised dQ kernel at head dims split by role, from the
  narrowest to the widest that fit: three warpgroups, the consumers at the backward's
  register split."""
  from tests.test_mosaic import _kernel_modules, _register_counts
  config = mb.call_config((2, 200, 4, H), (2, 330, 2, H), 2, causal=causal)
  assert mb.dq_consumers_of(H, config) == 2
  modules = _kernel_modules(_lowered(H, MaskOptions(is_causal=causal), config=config))
  assert len(modules) == 2 and all("wgmma" in m for m in modules)
  counts = _register_counts(modules[1])
  assert counts == [24, mb.CONSUMER_REGISTERS[2]]


@pytest.mark.parametrize("H", [160, 192])
def test_lowers_one_dq_warpgroup_above_head_dim_128(H):
  """The one-warpgroup dQ kernel (no producer, no register split) where a caller asks
  for it above head_dim 128, as d 240-256 run it by default."""
  from tests.test_mosaic import _kernel_modules
  config = mb.call_config((2, 200, 4, H), (2, 330, 2, H), 2, causal=True, dq_consumers=1)
  modules = _kernel_modules(_lowered(H, MaskOptions(is_causal=True), config=config))
  assert len(modules) == 2 and all("wgmma" in m for m in modules)
  assert "setmaxregister" not in modules[1]


@pytest.mark.parametrize("H, fields", [(80, dict(fused_dq=True)), (96, dict(group_splits=2)),
                                       (80, dict(dkv_rows_in_registers=True))])
def test_lowers_off_table_head_dims_with_float32_tiles(H, fields):
  """The float32 tiles (fused dQ's, the group split's partial sums) in their own
  swizzle (80 x 4 bytes fill 64-byte rows), the [64, 64] dS' tile of fused dQ in the
  head dim's, beside K in its product; K and V from registers."""
  config = mb.BackwardConfig(consumers=2, **fields)
  assert "wgmma" in _lowered(H, MaskOptions(is_causal=True), config=config)


@pytest.mark.parametrize("T, S, padded, statistics", [
    (1000, 1000, [], ["2x4x1024xf32"]),
    (200, 330, ["2x336x2x128xbf16"], ["2x4x256xf32"]),
    (131, 1000, ["2x136x4x128xbf16"], ["2x4x192xf32", "2x4x256xf32"])])
def test_tails_are_padded_in_hbm_only_off_the_tensor_map_rows(T, S, padded, statistics):
  """As in the forward, q, k, v and dO of lengths that are multiples of mf.TMA_ROWS
  reach the kernels as they are (the copy engine zero-fills the rows past the end of a
  tile and drops the gradient rows past it); others are padded to the next multiple.
  lse2 and delta, read by plain loads, are padded to whole tiles of each kernel's
  query rows (64 in dK/dV, 128 in dQ): their +inf / 0 rows are what make the rows past
  T contribute nothing."""
  text = _lowered(128, MaskOptions(is_causal=True), T=T, S=S,
                  config=mb.BackwardConfig(consumers=2))
  results = " ".join(line.split("->")[-1] for line in text.splitlines()
                     if "stablehlo.pad" in line)
  shapes = set(re.findall(r"tensor<([^>]*)>", results))
  assert sorted(x for x in shapes if x.endswith("bf16")) == padded
  assert sorted(x for x in shapes if x.endswith("f32")) == statistics


@pytest.mark.parametrize("H, dtype", [(128, jnp.float16), (64, jnp.bfloat16)])
def test_lowers_with_every_mask_path(H, dtype):
  opts = MaskOptions(is_causal=True, window=(40, 8), soft_cap=20.0)
  assert "mosaic_gpu" in _lowered(H, opts, with_masks=True, dtype=dtype)


@pytest.mark.parametrize("H", [64, 128])
def test_lowers_with_streamed_statistics_without_the_dv_overlap(H):
  """JAX's Mosaic GPU form of the dK/dV tile (`stats_streamed`, `dv_overlap` False) on
  128-row query tiles, through Mosaic GPU's checks of the 1-D copies and loads: its
  dK/dV kernel differs from the same tiles' without it, its dQ kernel does not."""
  from tests.test_mosaic import _kernel_modules
  plain = dict(block_n=128, persistent=False)    # the launched grids: no num_sms here
  fields = dict(plain, stats_streamed=True, dv_overlap=False)
  modules = [_kernel_modules(_lowered(H, MaskOptions(is_causal=True), with_masks=True,
                                      config=mb.call_config((2, 200, 4, H), (2, 330, 2, H),
                                                            2, causal=True, **f)))
             for f in (fields, plain)]
  assert len(modules[0]) == 2 and all("wgmma" in m for m in modules[0])
  assert modules[0][0] != modules[1][0] and modules[0][1] == modules[1][1]


def test_lowers_with_wider_tiles_mqa_and_warpgroup_semantics():
  config = mb.BackwardConfig(block_n=128)
  assert "mosaic_gpu" in _lowered(128, MaskOptions(is_causal=True), config=config)
  assert "mosaic_gpu" in _lowered(64, MaskOptions(), N=8, K=1)
  assert "mosaic_gpu" in _lowered(128, MaskOptions(is_causal=True),
                                  config=mb.BackwardConfig(semantics="warpgroup"))


@pytest.mark.parametrize("H", mf.TABLE_HEAD_DIMS)
def test_lowers_warp_specialised(H):
  """Two consumer warpgroups and a producer, every mask path, both kernels."""
  opts = MaskOptions(is_causal=True, window=(40, 8), soft_cap=20.0)
  config = mb.BackwardConfig(consumers=2)
  assert _lowered(H, opts, with_masks=True, config=config).count("@mosaic_gpu") == 2


def test_head_dim_256_kernels():
  """The dK/dV kernel split by role runs two consumers at CONSUMER_REGISTERS[2] and a
  producer; the dQ kernel one warpgroup (no register reallocation)."""
  from tests.test_mosaic import _kernel_modules, _register_counts
  dkv, dq = _kernel_modules(_lowered(256, MaskOptions(is_causal=True),
                                     config=mb.BackwardConfig(consumers=2)))
  assert _register_counts(dkv) == [24, 240] and _register_counts(dq) == []


def test_warp_specialised_kernels_take_the_backward_register_split():
  """Both kernels' consumers get CONSUMER_REGISTERS[2] and the producer the rest of the
  launch's pool of three warpgroups (3 x 168 = 2 x 240 + 24)."""
  from tests.test_mosaic import _kernel_modules, _register_counts
  lowered = _lowered(128, MaskOptions(is_causal=True), config=mb.BackwardConfig(consumers=2))
  modules = _kernel_modules(lowered)
  assert len(modules) == 2                                       # dK/dV, dQ
  for text in modules:
    counts = _register_counts(text)
    assert counts == [24, mb.CONSUMER_REGISTERS[2]] == [24, 240]


@pytest.mark.parametrize("H", [64, 128])
def test_three_dq_consumers_lower_at_their_register_split(H):
  """`dq_consumers=3`: the dQ kernel launches four warpgroups, the consumers at
  CONSUMER_REGISTERS[3] and the producer the rest of the launch's pool (4 x 128 = 3 x
  160 + 32); the dK/dV kernel keeps two consumers' split. Above head_dim 128 refused."""
  from tests.test_mosaic import _kernel_modules, _register_counts
  config = mb.call_config((2, 200, 4, H), (2, 330, 2, H), 2, causal=True, dq_consumers=3)
  assert config.persistent == (H == 64)      # the default grids with three, as with two
  dkv, dq = _kernel_modules(_lowered(H, MaskOptions(is_causal=True), config=config,
                                     num_sms=132))
  assert _register_counts(dkv) == [24, 240]
  assert _register_counts(dq) == [32, mb.CONSUMER_REGISTERS[3]] == [32, 160]
  q = jnp.zeros((1, 64, 2, 144), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="dq_consumers=3 supports head_dim <= 128"):
    mb.check_supported(q, q, q, mb.BackwardConfig(consumers=2, dq_consumers=3, dq_block_n=64))


def test_three_dq_consumers_by_default_at_128s_tiles_without_a_mask():
  """call_config: at head_dim 128 and those that take its tiles, without a causal mask,
  the dQ kernel's DQ_CONSUMERS_AT_128 (rows in shared memory, the persistent grid with
  one key head per query head); causal calls, other head dims and a caller's
  dq_consumers, dq_rows_in_registers or fused_dq keep their own."""
  def config(H, causal=False, K=4, **fields):
    return mb.call_config((2, 4096, 4, H), (2, 4096, K, H), 2, causal=causal, **fields)
  for H in (80, 96, 128):
    three = config(H)
    assert (three.dq_consumers, three.dq_rows_in_registers, three.persistent) == (
        mb.DQ_CONSUMERS_AT_128, False, True), H
    assert config(H, K=1).dq_consumers == mb.DQ_CONSUMERS_AT_128          # MQA
    assert not config(H, K=1).persistent                                   # as with two
    assert config(H, causal=True).dq_consumers is None, H
    assert mb.smem_bytes(H, 2, three) <= mf.SMEM_BYTES
  assert config(64).dq_consumers is None
  assert config(192).dq_consumers == mb.DQ_CONSUMERS_ABOVE_128
  # Where three consumers' Q and dO beside the caller's K/V slots exceed shared memory,
  # two with their rows in registers, as the kernels run them.
  many = config(128, stages=5)
  assert mb.smem_bytes(128, 2, dataclasses.replace(many, dq_consumers=3)) > mf.SMEM_BYTES
  assert (many.dq_consumers, many.dq_rows_in_registers) == (None, True)
  assert mb.smem_bytes(128, 2, many) <= mf.SMEM_BYTES
  kept = config(128, dq_rows_in_registers=True)
  assert (kept.dq_consumers, kept.dq_rows_in_registers) == (None, True)
  assert config(128, dq_consumers=2).dq_rows_in_registers
  assert config(128, fused_dq=True).dq_consumers is None


@pytest.mark.parametrize("H", [96, 128])
def test_lowers_the_default_three_dq_consumers(H):
  """The default at head_dim 80-128 without a causal mask (DQ_CONSUMERS_AT_128), one
  key head per query head: both kernels persistent, the dQ kernel's four warpgroups at
  CONSUMER_REGISTERS[3] with Q and dO read from shared memory."""
  from tests.test_mosaic import _kernel_modules, _register_counts
  config = mb.call_config((2, 200, 4, H), (2, 330, 4, H), 2, causal=False)
  assert (config.dq_consumers, config.persistent) == (3, True)
  dkv, dq = _kernel_modules(_lowered(H, MaskOptions(), config=config, num_sms=132, K=4))
  counts = _register_counts(dq)
  assert counts == [32, mb.CONSUMER_REGISTERS[3]]
  assert _first_products_a(dq, 64) == {"shared"}


def _first_products_a(module: str, n: int) -> set[str]:
  """How the A operand of a module's m64 x n products is passed: "registers" (a
  brace list of registers) or "shared" (a shared-memory matrix descriptor)."""
  found = re.findall(rf"m64n{n}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, (\{{|\$)", module)
  return {"registers" if a == "{" else "shared" for a in found}


@pytest.mark.parametrize("H", [64, 128])
def test_lowers_with_rows_in_registers(H):
  """dq_rows_in_registers / dkv_rows_in_registers: the first two products of that
  kernel (N = block_n = 64) take A from registers, every mask path, tails on both
  sides; the other kernel's stay in shared memory. At H = 128 these are each kernel's
  only N = 64 products; at H = 64 the last products (dQ, or dV and dK, N = H) are too,
  and take A (dS', P^T, dS'^T) from registers either way."""
  from tests.test_mosaic import _kernel_modules
  opts = MaskOptions(is_causal=True, window=(40, 8), soft_cap=20.0)
  for dq, dkv in ((True, False), (False, True)):
    config = mb.BackwardConfig(consumers=2, dq_rows_in_registers=dq, dkv_rows_in_registers=dkv)
    modules = _kernel_modules(_lowered(H, opts, with_masks=True, config=config))
    for module, in_registers in zip(modules, (dkv, dq)):      # dK/dV, dQ
      a = _first_products_a(module, 64)
      assert ("shared" in a) == (not in_registers)
      assert ("registers" in a) == (in_registers or H == 64)


@pytest.mark.parametrize("H,causal", [(64, True), (128, True), (128, False)])
def test_lowers_persistent(H, causal):
  """`persistent`: both kernels on a grid of 132 programs (the H200's multiprocessors)
  looping over their items (causal: in the snake order), every mask path, tails on
  both sides, with and without a group split; off a GPU the program count must be
  given."""
  opts = MaskOptions(is_causal=causal, window=(40, 8), soft_cap=20.0)
  config = mb.BackwardConfig(consumers=2, persistent=True, group_splits=1 + (H == 64))
  lowered = _lowered(H, opts, with_masks=True, config=config, num_sms=132)
  assert lowered.count("@mosaic_gpu") == 2
  with pytest.raises(ValueError, match="num_sms is needed"):
    _lowered(H, opts, config=config)
  with pytest.raises(ValueError, match="num_sms=0"):
    _lowered(H, opts, config=config, num_sms=0)


D64_TILES = dict(block_n=128, stats_streamed=True)     # BLOCK_N_AT_64's form


@pytest.mark.parametrize("H,consumers,fields", [
    (64, 2, {}), (128, 1, {}), (128, 2, {}), (64, 2, D64_TILES),
    (64, 2, dict(D64_TILES, fused_dq_row_split=True))])
def test_lowers_with_dq_in_the_dkv_kernel(H, consumers, fields):
  """fused_dq: one kernel (dK/dV, adding dQ with the copy engine's reduce-add), every
  mask path, tails on both sides; at H = 64 also on d = 64's tiles (128 query rows,
  lse and delta streamed: the dQ product's M is 128), whole or split by rows between
  the consumers (two products of [64, 64] transposed dS'^T tiles each)."""
  opts = MaskOptions(is_causal=True, window=(40, 8), soft_cap=20.0)
  config = mb.BackwardConfig(consumers=consumers, fused_dq=True, **fields)
  assert _lowered(H, opts, with_masks=True, config=config).count("@mosaic_gpu") == 1


@pytest.mark.parametrize("H,causal", [(64, True), (128, False)])
def test_lowers_with_item_edges_overlapped(H, causal):
  """`edge_overlap` at the defaults' grids (persistent at d = 64, and at d = 128 without
  a causal mask; one program per key tile, whose dK and dV go out together), every mask
  path: in each kernel the full waits for its stores (cp.async.bulk.wait_group, two in
  the dK/dV kernel, one in the dQ kernel) become one wait for the copy engine's reads
  (`.read`)."""
  from experiments.tools.lowered import mosaic_modules
  opts = MaskOptions(is_causal=causal, window=(40, 8), soft_cap=20.0)
  config = mb.call_config((2, 200, 4, H), (2, 330, 2, H), 2, causal=causal, group_splits=1)
  waits = lambda module: [line.split("{")[1].split("}")[0] for line in module.splitlines()
                          if "cp.async.bulk.wait_group" in line]
  for c, expected in ((config, [["group = 0 : i32"] * 2, ["group = 0 : i32"]]),
                      (dataclasses.replace(config, edge_overlap=True),
                       [["group = 0 : i32, read"]] * 2)):
    modules = mosaic_modules(_lowered(H, opts, with_masks=True, config=c, num_sms=132))
    assert [waits(m) for m in modules] == expected


def _schedule(module: str) -> str:
  """A Mosaic GPU module's matrix products and waits in program order: "M" per issued
  product, "W0" / "W1" per wait for all / all but one group in flight, "e" per run of
  exponentials (ex2.approx)."""
  ops = re.findall(r"(wgmma\.mma_async)|wgmma\.wait\.group\.sync\.aligned\"\(\) \{group = (\d)"
                   r"|(ex2\.approx)", module)
  return re.sub("e+", "e", "".join("M" if m else f"W{n}" if n else "e" for m, n, _ in ops))


@pytest.mark.parametrize("H,causal", [(64, True), (128, False)])
def test_lowers_with_p_under_dp(H, causal):
  """`dkv_p_under_dp`, `dq_p_under_dp` on the defaults' grids and tiles, every mask path:
  in both kernels every tile's exponentials run between a wait for the first of two
  products in flight and the wait for the second (P under dP), where without them they
  follow a wait for every product. Each flag changes its own kernel alone."""
  from experiments.tools.lowered import mosaic_modules
  opts = MaskOptions(is_causal=causal, window=(40, 8), soft_cap=20.0)
  config = dataclasses.replace(
      mb.call_config((2, 200, 4, H), (2, 330, 2, H), 2, causal=causal, group_splits=1),
      dkv_p_under_dp=False, dq_p_under_dp=False)
  schedules = lambda **fields: [_schedule(m) for m in mosaic_modules(_lowered(
      H, opts, with_masks=True, config=dataclasses.replace(config, **fields), num_sms=132))]
  after = schedules()
  under = schedules(dkv_p_under_dp=True, dq_p_under_dp=True)
  for a, u in zip(after, under):
    assert a.count("e") == u.count("e") > 0
    assert u.count("W1eW0") == u.count("e") and a.count("W0e") == a.count("e")
  assert schedules(dkv_p_under_dp=True) == [under[0], after[1]]
  assert schedules(dq_p_under_dp=True) == [after[0], under[1]]


@pytest.mark.parametrize("H,fields", [(64, dict(D64_TILES, fused_dq_row_split=True)),
                                      (128, {})])
def test_lowers_persistent_with_dq_in_the_dkv_kernel(H, fields, monkeypatch):
  """fused_dq on the persistent grid (at d = 64 on its tiles with dQ split by rows; at
  d = 128 on 64-row tiles): one kernel whose programs (at most 132) loop over the dK/dV
  items, every mask path. Under jax.vmap the in-place launch folds the mapped axis
  into the batch and rebuilds the persistent grid over it: one grid over every
  problem's items (2 key tiles x 4 heads x 3 x 2 batch entries), not each problem's."""
  opts = MaskOptions(is_causal=True, window=(40, 8), soft_cap=20.0)
  config = mb.BackwardConfig(consumers=2, fused_dq=True, persistent=True, **fields)
  assert _lowered(H, opts, with_masks=True, config=config, num_sms=132).count(
      "@mosaic_gpu") == 1
  built, grid = [], mb._PersistentGrid
  monkeypatch.setattr(mb, "_PersistentGrid", lambda *a: built.append(grid(*a)) or built[-1])
  q = jax.ShapeDtypeStruct((3, 2, 200, 4, H), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((3, 2, 4, 200), jnp.float32)
  f = jax.vmap(lambda q, k, v, out, lse, do: mb.flash_backward(
      q, k, v, out, lse, do, scale=0.125, opts=opts, config=config, num_sms=132))
  text = jax.jit(f).trace(q, q, q, q, lse, q).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("@mosaic_gpu") == 1
  assert f"tensor<6x256x4x{H}xf32>" in text      # dQ of 3 x 2 problems, T padded to 256
  tiles = -(-200 // mb.dkv_keys(H, config))
  assert grid(tiles * 4 * 6, tiles * 4 * 6, (tiles, 4, 6), 1) in built, built


@pytest.mark.parametrize("H,consumers,fused_dq", [(128, 1, False), (128, 2, False),
                                                   (64, 2, True)])
def test_lowers_with_group_splits(H, consumers, fused_dq):
  """group_splits = 2 with GQA 8/2: a key tile's two programs (the grid's split axis) run
  two query heads each and store float32 partial dK and dV ([B, 2, Sp, K, H]) from a
  float32 shared-memory tile; every mask path."""
  opts = MaskOptions(is_causal=True, window=(40, 8), soft_cap=20.0)
  config = mb.BackwardConfig(consumers=consumers, fused_dq=fused_dq, group_splits=2)
  text = _lowered(H, opts, with_masks=True, config=config, N=8, K=2)
  assert text.count("@mosaic_gpu") == (1 if fused_dq else 2)
  assert f"tensor<2x2x384x2x{H}xf32>" in text      # B = 2, S = 330 padded to 384


def test_dq_in_the_dkv_kernel_lowers_inside_a_differentiated_program(monkeypatch):
  """fused_dq updates dQ in place through `pl.run_state`, local to the kernel call: the
  whole jitted vjp through jflash.attention, whose own guard is a custom_jvp (a mutable
  array visible to that program would need a state rule for it), lowers for CUDA, and
  so does its vmap (`pl.run_state` has no batching rule; the launch brings its own)."""
  monkeypatch.setattr(mosaic_impl, "device_capability", lambda device=None: ("gpu", "9.0"))
  monkeypatch.setattr(mosaic_impl.jax, "default_backend", lambda: "gpu")
  q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
  config = jflash.MosaicGPUConfig(backward="mosaic_gpu", backward_fused_dq=True)
  f = lambda q, k, v: jflash.attention(q, k, v, is_causal=True, implementation="mosaic_gpu",
                                       config=config)
  grads = lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)
  stacked = jax.ShapeDtypeStruct((3, *q.shape), q.dtype)
  try:
    text = jax.jit(grads).trace(q, q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    # vmapped: the in-place launch's batching rule folds the mapped axis into the batch
    mapped = jax.jit(jax.vmap(grads)).trace(stacked, stacked, stacked, stacked).lower(
        lowering_platforms=("cuda",)).as_text()
  except ImportError as e:  # pragma: no cover - jaxlib without the Mosaic GPU bindings
    pytest.skip(f"this jaxlib cannot lower Mosaic GPU kernels: {e}")
  assert text.count("@mosaic_gpu") == 2         # the forward, and dK/dV with dQ
  assert mapped.count("@mosaic_gpu") == 2


# -- the kernels under Mosaic GPU's interpreter ----------------------------------------------

def _check_grads(got, q, k, v, do, **kw):
  """The 2x rule per gradient: error against the float64 closed form <= 2x that of the
  plain "xla" implementation at the same dtype, plus the rounding floor of its longest
  sum (S for dQ, T x group for dK and dV)."""
  f64 = lambda x: np.asarray(x, np.float64) if hasattr(x, "shape") else x
  ref_kw = {a: (tuple(f64(x) for x in b) if isinstance(b, tuple) else f64(b))
            for a, b in kw.items()}
  ref = jflash.attention_numpy(*(f64(x) for x in (q, k, v)), dout=f64(do), **ref_kw)[2:5]
  plain = jax.vjp(lambda q, k, v: jflash.attention(q, k, v, implementation="xla", **kw),
                  q, k, v)[1](do)
  T, S, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
  for name, g, p, t, n in zip(("dq", "dk", "dv"), got, plain, ref, (S, T * group, T * group)):
    err, err_plain = max_err(g, t), max_err(p, t)
    assert err <= 2 * err_plain + error_floor(q.dtype, t, n), (name, err, err_plain)


@pytest.mark.parametrize("consumers,fused_dq,H", [(1, False, 64), (2, False, 64), (1, True, 64),
                                                  (2, True, 64), (2, True, 128), (2, False, 96),
                                                  (2, False, 160)])
def test_interpreted_gqa_causal_with_tails(consumers, fused_dq, H):
  """Two query heads per key head (the runtime head loop), T = 70 and S = 90 (partial
  last tiles on both sides, padded in the wrapper), causal: tiles skipped from the
  transposed schedule in dK/dV and from the plain one in dQ. Two consumers: each owns
  64 of a program's 128 keys (dK/dV) or query rows (dQ), a producer warpgroup streams
  the shared tiles through 3 slots (2 above H = 64), and every barrier phase is observed.
  fused_dq: dQ added tile by tile in the dK/dV kernel, the dQ kernel not run (at H = 64
  and 128). H = 96: a head dim off the table; H = 160: split by role, with two dQ
  consumers (`dq_consumers`)."""
  q, k, v, do = random_qkv((1, 70, 90, 4, 2, H), jnp.bfloat16, seed=1)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  # three slots fit shared memory beside fused_dq's tiles at H = 64 only
  config = mb.BackwardConfig(consumers=consumers, stages=3 if H == 64 else 2, fused_dq=fused_dq,
                             **(dict(dq_consumers=2, dq_block_n=64) if mb.by_role(H) else {}))
  got = mb.flash_backward(q, k, v, out, lse, do, scale=H ** -0.5, config=config,
                          opts=MaskOptions(is_causal=True), interpret=True)
  assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
  _check_grads(got, q, k, v, do, is_causal=True, scale=H ** -0.5)


@pytest.mark.parametrize("row_split,persistent", [(False, False), (True, False), (False, True),
                                                   (True, True)])
def test_interpreted_dq_in_the_dkv_kernel_on_d64_tiles(row_split, persistent, monkeypatch,
                                                       capsys):
  """fused_dq on d = 64's tiles (128 query rows, lse and delta streamed), the whole
  tile's dQ added by each consumer or its 64 rows over both consumers' keys
  (`fused_dq_row_split`: dS'^T through two slots and their "ready" barriers, which
  alternate over a program's tiles, those of its two query heads in turn; on the
  persistent grid of two programs, on from one item to the next): GQA causal, T = 200
  and S = 150 (partial last tiles on both sides)."""
  q, k, v, do = random_qkv((1, 200, 150, 4, 2, 64), jnp.bfloat16, seed=1)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  config = mb.BackwardConfig(consumers=2, fused_dq=True, fused_dq_row_split=row_split,
                             persistent=persistent, **D64_TILES)
  _watch_races(monkeypatch)
  got = mb.flash_backward(q, k, v, out, lse, do, scale=0.125, config=config,
                          opts=MaskOptions(is_causal=True), interpret=True)
  jax.block_until_ready(got)
  assert "RACE DETECTED" not in capsys.readouterr().out
  _check_grads(got, q, k, v, do, is_causal=True, scale=0.125)


def _watch_races(monkeypatch):
  """The interpreter's race detector (happens-before over the simulated shared memory
  and barriers) on for the kernels interpreted next; races are printed."""
  import dataclasses
  from jax._src.pallas.mosaic_gpu.interpret import params

  @dataclasses.dataclass(frozen=True)
  class Racing(params.InterpretGPUParams):
    detect_races: bool = True
  monkeypatch.setattr(params, "InterpretGPUParams", Racing)


@pytest.mark.parametrize("H,persistent", [(64, True), (128, False)])
def test_interpreted_item_edges_overlapped(H, persistent):
  """`edge_overlap`: at each work item's edges both fixed tiles' loads are issued
  before either is waited for, and the outputs' stores waited for only until the copy
  engine has read shared memory. GQA causal with tails (T = 200, S = 150): at d = 64 on
  its default tiles and the persistent grids of two programs, each looping over
  several items of both kernels (the loads' barriers in phase from item to item); at
  d = 128 on the launched grids. Gradients within the 2x rule and equal to the
  default's to the bit. The interpreter runs every copy at once and its waits for
  stores do nothing, so the waits themselves are not checked here (the lowering test
  counts them)."""
  q, k, v, do = random_qkv((1, 200, 150, 4, 2, H), jnp.bfloat16, seed=4)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  config = mb.call_config(q.shape, k.shape, 2, causal=True, persistent=persistent,
                          group_splits=1)      # dK and dV stored together
  assert (config.persistent, config.block_n) == (persistent, 128 if H == 64 else 64)
  got, default = (mb.flash_backward(q, k, v, out, lse, do, scale=H ** -0.5, config=c,
                                    opts=MaskOptions(is_causal=True), interpret=True)
                  for c in (dataclasses.replace(config, edge_overlap=True), config))
  for g, d in zip(got, default):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(d, np.float32))
  _check_grads(got, q, k, v, do, is_causal=True, scale=H ** -0.5)


@pytest.mark.parametrize("H,persistent", [(64, True), (128, False)])
def test_interpreted_p_under_dp(H, persistent):
  """`dkv_p_under_dp`, `dq_p_under_dp` (the default at d = 64): P computed between the
  two score products' waits, dV's product issued after it. GQA causal with tails (T =
  200, S = 150) at d = 64 on its default tiles and persistent grids (lse and delta
  streamed) and at d = 128 on the launched grids: within the 2x rule and equal to the
  other order's gradients to the bit (the same products and elementwise steps, in
  another order of issue)."""
  q, k, v, do = random_qkv((1, 200, 150, 4, 2, H), jnp.bfloat16, seed=6)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  config = mb.call_config(q.shape, k.shape, 2, causal=True, persistent=persistent,
                          group_splits=1)
  assert (config.persistent, config.stats_streamed) == (persistent, H == 64)
  assert (config.dkv_p_under_dp, config.dq_p_under_dp) == (H == 64,) * 2
  got, after = (mb.flash_backward(q, k, v, out, lse, do, scale=H ** -0.5, config=c,
                                  opts=MaskOptions(is_causal=True), interpret=True)
                for c in (dataclasses.replace(config, dkv_p_under_dp=True, dq_p_under_dp=True),
                          dataclasses.replace(config, dkv_p_under_dp=False,
                                              dq_p_under_dp=False)))
  for g, d in zip(got, after):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(d, np.float32))
  _check_grads(got, q, k, v, do, is_causal=True, scale=H ** -0.5)


@pytest.mark.parametrize("consumers", [1, 2])
def test_interpreted_kernel_options(consumers):
  """Both kernels' fixed rows read into registers as their first products' A operands
  (`dq_rows_in_registers`, `dkv_rows_in_registers`), the dQ kernel on key tiles of
  128 while the dK/dV kernel keeps query tiles of 64 (`dq_block_n`), and with two
  consumers three slots: GQA (the dK/dV program's tiles run on across its two query
  heads), causal, T = 70 and S = 150 (a partial last tile on each side, two key tiles
  in dQ)."""
  q, k, v, do = random_qkv((1, 70, 150, 4, 2, 64), jnp.bfloat16, seed=5)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  config = mb.BackwardConfig(consumers=consumers, dq_block_n=128, dq_rows_in_registers=True,
                             dkv_rows_in_registers=True, stages=1 + consumers)
  got = mb.flash_backward(q, k, v, out, lse, do, scale=0.125, config=config,
                          opts=MaskOptions(is_causal=True), interpret=True)
  _check_grads(got, q, k, v, do, is_causal=True, scale=0.125)


@pytest.mark.parametrize("block_n,persistent,dv_overlap", [(64, False, False),
                                                           (128, True, True)])
def test_interpreted_streamed_statistics(block_n, persistent, dv_overlap):
  """`stats_streamed`: each query tile's lse and delta come through the producer's
  slots (four copies per slot, each slot's four "loaded" barriers in phase as the
  slots are refilled) and are read after the products that need them. GQA causal with
  tails (S = 150): on launched grids with 64-row query tiles through three slots (T =
  70) with `dv_overlap` False (dP^T and the dV product waited for together); and with
  d = 64's default tile form (BLOCK_N_AT_64 rows, dv_overlap True) on the persistent
  grids through two slots (T = 300: items of up to three tiles per head, two heads, so
  a program refills its slots within and across items)."""
  T = 300 if persistent else 70
  q, k, v, do = random_qkv((1, T, 150, 4, 2, 64), jnp.bfloat16, seed=8)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  config = mb.BackwardConfig(consumers=2, block_n=block_n, stages=2 if persistent else 3,
                             persistent=persistent,
                             stats_streamed=True, dv_overlap=dv_overlap,
                             dq_rows_in_registers=persistent)
  got = mb.flash_backward(q, k, v, out, lse, do, scale=0.125, config=config,
                          opts=MaskOptions(is_causal=True), interpret=True, num_sms=3)
  _check_grads(got, q, k, v, do, is_causal=True, scale=0.125)


@pytest.mark.parametrize("H,group_splits,causal,l2_group", [(64, 2, True, 1),
                                                            (128, 1, True, 2),
                                                            (64, 1, False, 1)])
def test_interpreted_persistent_grids(H, group_splits, causal, l2_group):
  """`persistent`: both kernels as three programs looping over the work items of their
  grids (dK/dV: 2 key tiles x 2 key heads x the group splits; dQ: 4 heads), in the
  causal order (with `l2_group` 2: both tiles of a head before the next head) or the
  plain one, the streamed-tile count going on from item to item through three slots
  (items of 2, 3 or 4 tiles, and of none where a causal key tile sees no query: counts
  that cross the slots' cycle, every slot's barriers in phase), GQA with tails."""
  q, k, v, do = random_qkv((1, 70, 150, 4, 2, H), jnp.bfloat16, seed=7)
  out, lse = jflash.attention(q, k, v, is_causal=causal, implementation="xla",
                              return_residuals=True)
  config = mb.BackwardConfig(consumers=2, persistent=True, group_splits=group_splits,
                             dq_rows_in_registers=True, stages=3, l2_group=l2_group)
  # Three programs: a partial last round (backwards in the causal snake order), so the
  # programs run different numbers of items.
  got = mb.flash_backward(q, k, v, out, lse, do, scale=H ** -0.5, config=config,
                          opts=MaskOptions(is_causal=causal), interpret=True, num_sms=3)
  _check_grads(got, q, k, v, do, is_causal=causal, scale=H ** -0.5)


@pytest.mark.parametrize("causal,persistent,dq_block_n", [(True, False, 64),
                                                          (True, True, 128),
                                                          (False, True, 64)])
def test_interpreted_three_dq_consumers(causal, persistent, dq_block_n):
  """`dq_consumers=3`: a producer streams K and V to three consumers of 64 query rows
  (programs of 192), GQA 4/2 with tails (T = 300: a whole block and one of 108 rows,
  padded in the wrapper; S = 150), on launched grids and on two persistent programs
  (items of different lengths under a causal mask, the slots' count going on across
  them), beside d = 64's dK/dV tiles of 128 with lse and delta streamed: all three
  gradients within the 2x rule. (dQ is not the two-consumer kernel's to the bit: a
  row's tile may be FULL in one block layout and masked element-wise in the other,
  and the compiler may contract the two forms' exponent arithmetic differently.)"""
  q, k, v, do = random_qkv((1, 300, 150, 4, 2, 64), jnp.bfloat16, seed=11)
  out, lse = jflash.attention(q, k, v, is_causal=causal, implementation="xla",
                              return_residuals=True)
  base = dict(consumers=2, block_n=128, stats_streamed=True, dq_block_n=dq_block_n,
              persistent=persistent)
  got = mb.flash_backward(q, k, v, out, lse, do, scale=0.125,
                          config=mb.BackwardConfig(**base, dq_consumers=3),
                          opts=MaskOptions(is_causal=causal), interpret=True, num_sms=2)
  _check_grads(got, q, k, v, do, is_causal=causal, scale=0.125)


def test_interpreted_default_three_dq_consumers_at_128():
  """The default without a causal mask at head_dim 128 (DQ_CONSUMERS_AT_128, the
  persistent grids), T = 200 (one program of 192 rows and a padded one) against S =
  330, on two persistent programs: all three gradients within the 2x rule."""
  q, k, v, do = random_qkv((1, 200, 330, 2, 2, 128), jnp.bfloat16, seed=12)
  out, lse = jflash.attention(q, k, v, implementation="xla", return_residuals=True)
  config = mb.call_config(q.shape, k.shape, 2, causal=False)
  assert (config.dq_consumers, config.persistent) == (mb.DQ_CONSUMERS_AT_128, True)
  got = mb.flash_backward(q, k, v, out, lse, do, scale=128 ** -0.5, config=config,
                          opts=MaskOptions(), interpret=True, num_sms=2)
  _check_grads(got, q, k, v, do, is_causal=False, scale=128 ** -0.5)


def test_interpreted_causal_dq_over_several_query_blocks():
  """T = S = 260 with two consumers: three dQ programs of 128 query rows, launched from
  the heaviest (`query_block_order`), each consumer's rows taken from the remapped
  block; the last block is padded in the wrapper."""
  q, k, v, do = random_qkv((1, 260, 260, 2, 1, 64), jnp.bfloat16, seed=3)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  got = mb.flash_backward(q, k, v, out, lse, do, scale=0.125,
                          config=mb.BackwardConfig(consumers=2),
                          opts=MaskOptions(is_causal=True), interpret=True)
  _check_grads(got, q, k, v, do, is_causal=True, scale=0.125)


def test_interpreted_by_role_gqa_causal_with_tails(monkeypatch, capsys):
  """head_dim 256 (`by_role`): one consumer computes S^T and accumulates dK, the other
  dP^T and dV, P^T (two slots) and float32 dP^T (one) passing between them through
  shared memory; GQA 4/2 (the head loop), causal with T = 70 < S = 150, so the last key
  tile sees no query (dK = dV = 0, each consumer storing zeros with no tile visited);
  the dQ kernel one warpgroup. The interpreter's race detector (happens-before over
  the simulated shared memory and barriers) watches both kernels."""
  _watch_races(monkeypatch)
  q, k, v, do = random_qkv((1, 70, 150, 4, 2, 256), jnp.bfloat16, seed=1)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  got = mb.flash_backward(q, k, v, out, lse, do, scale=256 ** -0.5,
                          config=mb.BackwardConfig(consumers=2),
                          opts=MaskOptions(is_causal=True), interpret=True)
  jax.block_until_ready(got)
  assert "RACE DETECTED" not in capsys.readouterr().out
  assert (np.asarray(got[1], np.float32)[:, 70:] == 0).all()
  _check_grads(got, q, k, v, do, is_causal=True, scale=256 ** -0.5)


@pytest.mark.parametrize("consumers,group_splits,fused_dq", [(1, 2, False), (1, 4, False),
                                                             (2, 2, True)])
def test_interpreted_mqa_causal_group_splits(consumers, group_splits, fused_dq):
  """MQA (four query heads, one key head), causal, T = 130 and S = 100 (rows past S see
  every key; partial last tiles on both sides): each key tile's 2 or 4 programs run
  their own query heads (the stream's and the producer's head order restricted to
  them) and store float32 partial dK, dV, summed after the kernel. Two consumers with
  dQ in the dK/dV kernel, whose adds the split leaves as they are (and one dQ kernel
  the fewer: the interpreter runs warp-specialised programs slowly)."""
  q, k, v, do = random_qkv((1, 130, 100, 4, 1, 64), jnp.bfloat16, seed=9)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  config = mb.BackwardConfig(consumers=consumers, fused_dq=fused_dq, group_splits=group_splits)
  got = mb.flash_backward(q, k, v, out, lse, do, scale=0.125, config=config,
                          opts=MaskOptions(is_causal=True), interpret=True)
  assert [(g.shape, g.dtype) for g in got] == [(x.shape, x.dtype) for x in (q, k, v)]
  _check_grads(got, q, k, v, do, is_causal=True, scale=0.125)


def test_interpreted_default_backward_splits_a_small_causal_group():
  """The adapter's default for a causal MQA call too small to fill the GPU: two
  consumers, a producer, the group split over every head (2 programs per key tile),
  and d = 64's tiles of 128 in both kernels with lse and delta streamed and P under dP,
  on the persistent grids (T = 64, S = 72: one tile each, its tail masked; two programs
  under the interpreter); gradients through jflash's custom_vjp within the rule."""
  q, k, v, do = random_qkv((1, 64, 72, 2, 1, 64), jnp.bfloat16, seed=10)
  impl = api.get_implementation("mosaic_gpu")
  cfg, masks = jflash.prepare(q, k, v, is_causal=True,
                              config=jflash.MosaicGPUConfig(backward="mosaic_gpu"))
  assert mosaic_impl.backward_config(q, k, cfg, masks) == mb.BackwardConfig(
      consumers=2, group_splits=2, block_n=128, stats_streamed=True,
      dq_rows_in_registers=True, persistent=True, dkv_p_under_dp=True, dq_p_under_dp=True)
  got = jax.vjp(lambda q, k, v: api._flash(q, k, v, masks, impl, cfg)[0], q, k, v)[1](do)
  _check_grads(got, q, k, v, do, is_causal=True)


def test_interpreted_group_splits_add_up_to_one_program():
  """dK, dV of two programs per key tile (float32 partial sums added after the kernel)
  against one program's (the same float32 sums in another order): equal within the
  rounding floor of the 2x rule; dQ, from the same dQ kernel, to the bit. Causal with
  T = 100 < S = 130: no query sees the last key tile, whose programs store zeros."""
  q, k, v, do = random_qkv((1, 100, 130, 4, 1, 64), jnp.bfloat16, seed=10)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  one, split = ([np.asarray(g, np.float32) for g in mb.flash_backward(
      q, k, v, out, lse, do, scale=0.125, opts=MaskOptions(is_causal=True), interpret=True,
      config=mb.BackwardConfig(group_splits=splits))] for splits in (1, 2))
  assert (split[0] == one[0]).all()
  for a, b in zip(split[1:], one[1:]):
    assert max_err(a, b) <= error_floor(q.dtype, b, 100 * 4), max_err(a, b)
    assert (a[:, 100:] == 0).all()


@pytest.mark.parametrize("consumers,fused_dq,H", [(None, None, 64), (1, None, 64),
                                                  (None, True, 64), (None, None, 256)])
def test_interpreted_masks_through_the_adapter(monkeypatch, consumers, fused_dq, H):
  """The Mosaic GPU backward through jflash's custom_vjp (forward and backward, both
  interpreted): window, segments (one query segment sees no key), soft cap, key and
  query lengths including 0; T != S; fp16; one consumer warpgroup or two, or dQ in the
  dK/dV kernel; at head_dim 256, the dK/dV kernel split by role."""
  B, T, S = 2, 70, 80
  q, k, v, do = random_qkv((B, T, S, 1, 1, H), jnp.float16, seed=2)
  q_seg = np.zeros((B, T), np.int32)
  q_seg[:, 30:60] = 1
  q_seg[:, 60:] = 7                                    # no key has segment 7
  kv_seg = np.zeros((B, S), np.int32)
  kv_seg[:, 40:] = 1
  kw = dict(is_causal=True, local_window_size=(40, 0), logits_soft_cap=5.0,
            segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)),
            query_seq_lengths=jnp.asarray([70, 0], jnp.int32),
            key_value_seq_lengths=jnp.asarray([50, 80], jnp.int32))
  impl = api.get_implementation("mosaic_gpu")
  config = jflash.MosaicGPUConfig(backward="mosaic_gpu", backward_consumers=consumers,
                                  backward_fused_dq=fused_dq)
  cfg, masks = jflash.prepare(q, k, v, config=config, **kw)
  # one key head per query head: two consumers unless the caller says otherwise
  assert mosaic_impl.backward_config(q, k, cfg, masks).consumers == (consumers or 2)
  assert mosaic_impl.backward_config(q, k, cfg, masks).fused_dq == bool(fused_dq)
  calls = []
  kernel = mb.flash_backward
  monkeypatch.setattr(mb, "flash_backward", lambda *a, **k: calls.append(1) or kernel(*a, **k))
  got = jax.vjp(lambda q, k, v: api._flash(q, k, v, masks, impl, cfg)[0], q, k, v)[1](do)
  assert calls, "backward='mosaic_gpu' must run the Mosaic GPU backward"
  for g in got:
    assert np.isfinite(np.asarray(g, np.float32)).all()
  assert (np.asarray(got[0], np.float32)[1] == 0).all()           # query length 0
  _check_grads(got, q, k, v, do, **kw)


@pytest.mark.parametrize("fused_dq", [False, True])
def test_interpreted_nan_in_a_query_reaches_its_row_and_the_keys_it_sees(fused_dq):
  q, k, v, do = random_qkv((1, 64, 64, 1, 1, 64), jnp.bfloat16, seed=3)
  q = q.at[0, 3, 0, 0].set(jnp.nan)           # row 3 sees keys 0..3 (causal)
  out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                              return_residuals=True)
  dq, dk, dv = (np.asarray(g, np.float32) for g in mb.flash_backward(
      q, k, v, out, lse, do, scale=0.125, opts=MaskOptions(is_causal=True), interpret=True,
      config=mb.BackwardConfig(fused_dq=fused_dq)))
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


def test_interpreted_negative_scale_and_lse_cotangent():
  """A scale < 0 (applied to the logits before the exponent) and a cotangent on lse
  (folded into delta), against the float64 closed form under the 2x rule."""
  q, k, v, do = random_qkv((1, 64, 64, 1, 1, 64), jnp.bfloat16, seed=6)
  dlse = jnp.asarray(np.random.default_rng(7).standard_normal((1, 1, 64)), jnp.float32)
  scale = -0.2
  (out, lse), vjp = jax.vjp(lambda q, k, v: jflash.attention(
      q, k, v, scale=scale, implementation="xla", return_residuals=True), q, k, v)
  plain = vjp((do, dlse))
  got = mb.flash_backward(q, k, v, out, lse, do, dlse, scale=scale, interpret=True)
  ref = _closed_form_with_dlse(q, k, v, do, dlse, scale)
  for name, g, p, t in zip(("dq", "dk", "dv"), got, plain, ref):
    err, err_plain = max_err(g, t), max_err(p, t)
    assert err <= 2 * err_plain + error_floor(q.dtype, t, 64), (name, err, err_plain)


def test_second_order_gradients_are_refused():
  q, k, v = random_qkv((1, 16, 16, 1, 1, 64), jnp.bfloat16, seed=8)[:3]
  impl = api.get_implementation("mosaic_gpu")
  cfg, masks = jflash.prepare(q, k, v, config=MOSAIC_BWD)
  loss = lambda q: api._flash(q, k, v, masks, impl, cfg)[0].astype(jnp.float32).sum()
  with pytest.raises(NotImplementedError, match="mosaic_gpu .* has no derivative of its own"):
    jax.grad(lambda q: jax.grad(loss)(q).sum())(q)


@pytest.mark.parametrize("num_items,num_ctas,heads", [(2048, 132, 16), (7, 3, 1),
                                                      (5, 5, 1), (6, 4, 1), (11, 4, 1)])
def test_persistent_schedule_covers_items_once_and_snake_balances(num_items, num_ctas,
                                                                  heads):
  """`item_schedule`: each work item goes to exactly one program, in either order
  (partial last rounds forwards and backwards); with items in falling cost (a causal
  grid: heads fastest, key tiles slowest, each tile seeing 2 query tiles fewer), the
  snake order keeps every program's sum within one item of the others, and at 16K
  d128 causal on 132 multiprocessors (the docstring's case) within 0.3% of the mean
  where the plain order puts the busiest program 6% over it."""
  cost = np.array([256 - 2 * (w // heads) for w in range(num_items)])
  totals = {}
  for snake in (False, True):
    owned = []
    for cta in range(num_ctas):
      steps, item = mf.item_schedule(jnp.int32(cta), num_items, num_ctas, snake)
      owned.append([int(item(jnp.int32(k))) for k in range(int(steps))])
    assert sorted(sum(owned, [])) == list(range(num_items))
    totals[snake] = np.array([cost[o].sum() for o in owned])
  plain, snake = totals[False], totals[True]
  assert snake.max() - snake.min() <= cost.max()
  if num_items == 2048:
    assert plain.max() / plain.mean() > 1.06 and snake.max() / snake.mean() < 1.003
