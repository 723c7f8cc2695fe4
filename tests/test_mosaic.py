"""The "mosaic_gpu" implementation (Hopper kernels on Pallas Mosaic GPU): the shared test
bases, the config and its dispatch, the heuristics as properties, the forward kernel.

Off a GPU the kernels run under Mosaic GPU's own interpreter, on a Hopper GPU compiled:
the same tests, one command (tests/mosaic_support.py):

  python -m pytest -q tests/test_mosaic.py tests/test_mosaic_backward.py

The interpreter has no in-register or transposed matrix-product operands and no layout
casts, so there the products are plain dots; the schedule, the slot barriers, the
producer's refills, masks, tails and the normalisation are the kernel's own. Lowering
tests lower the default kernels for CUDA (no GPU needed) and check what the compiled
program must hold.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import api, mosaic_impl
from jflash.masks import Masks, dense_keep_numpy, kernel_records
from pallas_kernels.masking import MaskOperands, MaskOptions
from pallas_kernels.mosaic_gpu import common, configs, heuristics, scheduler
from pallas_kernels.mosaic_gpu import backward as mb
from pallas_kernels.mosaic_gpu import forward as mf
from tests.attention_test_base import AttentionTestBase, random_qkv
from tests.mask_test_base import FLOAT32_CASES, FULLY_MASKED_CASES, MaskTestBase
from tests.mask_test_base import pytest_generate_tests  # noqa: F401  (per-class case lists)
from tests.mosaic_support import on_hopper  # noqa: F401  (the fixture, used by name)
from tests.mosaic_support import (INTERPRET, check_forward, check_grads, kernel_modules,
                                  launch_grid, lowered, off_gpu_only, register_counts,
                                  watch_races)

HOPPER = dict(platform="gpu", capability="9.0")
# Head dims of every tier (16-64, 80-128, 144-256) and each swizzle width.
HEAD_DIMS = tuple(range(16, 257, 16))


def _qkv(H=64, dtype=jnp.bfloat16, T=16, S=16, N=2, K=1):
  return random_qkv((1, T, S, N, K, H), dtype)[:3]


def _shape(B, T, N, H, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct((B, T, N, H), dtype)


# -- the shared test bases ----------------------------------------------------------------

@pytest.mark.usefixtures("on_hopper")
class TestMosaicGPU(AttentionTestBase):
  """Forward and the Mosaic GPU backward through jflash.attention (`tile_config`: the
  heuristics' tiles, backward="mosaic_gpu"): bf16 and fp16, head dims of each tier."""

  implementation = "mosaic_gpu"
  input_dtypes = (jnp.bfloat16, jnp.float16)
  half_shapes = ((1, 113, 203, 4, 2, 64),     # T < S, GQA 2
                 (1, 203, 113, 4, 1, 96))     # T > S, MQA, a head dim off the table
  transform_dtype = jnp.bfloat16
  transform_head_dim = 64
  second_order = False


@pytest.mark.usefixtures("on_hopper")
class TestMasksMosaicGPU(MaskTestBase):
  """The structured masks (no dense mask, bias or dropout: refused, tested below), in
  bf16, forward and the Mosaic GPU backward."""

  implementation = "mosaic_gpu"
  float32_cases = ()
  half_cases = tuple(c for c in FLOAT32_CASES
                     if not {"bias", "mask", "dropout"} & set(c.replace("+", " ").split()))
  fully_masked_cases = tuple(c for c in FULLY_MASKED_CASES if "mask" not in c)
  dtype_name = "bfloat16"
  dropout = False
  no_cases_reason = {"float32_cases": "mosaic_gpu computes in bfloat16 and float16 only"}


def test_mask_cases_cover_every_structured_mask():
  assert set(TestMasksMosaicGPU.half_cases) == {
      "lengths", "segments", "window", "softcap", "causal+window", "causal+segments",
      "lengths+segments"}
  assert set(TestMasksMosaicGPU.fully_masked_cases) == {"lengths", "segments",
                                                        "lengths+segments"}


# -- host side: what the implementation takes and refuses ----------------------------------

def test_supported_call_on_hopper():
  q, k, v = _qkv()
  mosaic_impl.check_call(q, k, v, *jflash.prepare(q, k, v, is_causal=True, local_window_size=4,
                                                  logits_soft_cap=10.0), **HOPPER)


@pytest.mark.parametrize("device, reason", [
    (dict(platform="cpu", capability=None), "CUDA GPU"),
    (dict(platform="gpu", capability=None), "CUDA GPU"),       # a ROCm GPU
    (dict(platform="gpu", capability="8.0"), "has 8.0"),
    (dict(platform="gpu", capability="10.0"), "has 10.0"),
])
def test_refuses_devices_other_than_hopper(device, reason):
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match=reason):
    mosaic_impl.check_call(q, k, v, *jflash.prepare(q, k, v), **device)


@pytest.mark.parametrize("H, dtype, reason", [
    (72, jnp.bfloat16, "a multiple of 16 up to 256, got 72"),
    (272, jnp.float16, "a multiple of 16 up to 256, got 272"),
    (64, jnp.float32, "bfloat16 and float16"),
])
def test_refuses_shapes_and_dtypes(H, dtype, reason):
  q, k, v = _qkv(H, dtype)
  with pytest.raises(NotImplementedError, match=reason):
    mosaic_impl.check_call(q, k, v, *jflash.prepare(q, k, v), **HOPPER)


def test_refuses_dense_mask_bias_dropout():
  q, k, v = _qkv()
  mask = jnp.ones((1, 1, 16, 16), bool)
  for kw, reason in ((dict(mask=mask), "mosaic_gpu has no mask"),
                     (dict(bias=mask.astype(q.dtype)), "mosaic_gpu has no bias"),
                     (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout")):
    with pytest.raises(NotImplementedError, match=reason):
      mosaic_impl.check_call(q, k, v, *jflash.prepare(q, k, v, **kw), **HOPPER)
  mosaic_impl.check_call(q, k, v, *jflash.prepare(
      q, k, v, key_value_seq_lengths=jnp.array([3])), **HOPPER)   # structured: taken


@off_gpu_only
def test_registered_and_refused_on_cpu_with_the_reason():
  assert "mosaic_gpu" in api.available_implementations()
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match="mosaic_gpu: .*compute capability 9.x"):
    jflash.attention(q, k, v, implementation="mosaic_gpu")


@off_gpu_only
def test_falls_back_to_the_next_implementation():
  q, k, v = _qkv()
  got = jflash.attention(q, k, v, is_causal=True, implementation=("mosaic_gpu", "xla_chunked"))
  want = jflash.attention(q, k, v, is_causal=True, implementation="xla_chunked")
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# -- MosaicGPUConfig: what a user sets runs as set, or the call raises ----------------------

def test_config_has_at_most_ten_fields():
  fields = [f.name for f in dataclasses.fields(jflash.MosaicGPUConfig)]
  assert len(fields) <= 10, fields
  assert set(jflash.MosaicGPUConfig.forward_fields) | {"backward"} | set(
      jflash.MosaicGPUConfig.backward_field_names) == set(fields)


@pytest.mark.parametrize("fields, bad", [
    (dict(block_q=32), "block_q=32"), (dict(block_k=320), "block_k=320"),
    (dict(block_k=96), "block_k=96"), (dict(stages=1), "stages=1"),
    (dict(stages=33), r"stages=33 must be an int in \[2, 32\]"),
    (dict(consumers=4), "consumers=4"), (dict(consumers=2.0), "consumers=2.0"),
    (dict(persistent=1), "persistent=1"), (dict(backward="triton"), "backward='triton'"),
    (dict(backward_block_n=96), "backward_block_n=96"),
    (dict(backward_dq_block_n=32), "backward_dq_block_n=32"),
    (dict(backward_stages=1), "backward_stages=1"),
    (dict(backward_stages=17), "backward_stages=17 needs 34"),
    (dict(backward_persistent="yes"), "backward_persistent='yes'"),
    (dict(backward="pallas", backward_block_n=128), "backward='pallas' runs the Triton"),
])
def test_config_validation_names_the_field(fields, bad):
  with pytest.raises(ValueError, match=bad):
    jflash.MosaicGPUConfig(**fields)


@pytest.mark.parametrize("fields", [
    dict(block_k=64, stages=3), dict(block_q=128, consumers=2), dict(consumers=3),
    dict(persistent=False), dict(persistent=True), dict(consumers=2, block_k=192)])
@pytest.mark.parametrize("H, causal, T", [(64, True, 4096), (128, False, 1024),
                                          (128, True, 16384)])
def test_forward_fields_run_as_set(fields, H, causal, T):
  """Each forward field the caller sets is the kernel's, over the heuristics' others;
  the call runs it or raises NotImplementedError naming the reason."""
  q = _shape(1, T, 2, H)
  cfg, masks = jflash.prepare(q, q, q, is_causal=causal,
                              config=jflash.MosaicGPUConfig(**fields))
  config = mosaic_impl.kernel_config(q, cfg, masks)
  for name, value in fields.items():
    assert getattr(config, name) == value, (name, config)
  try:
    mosaic_impl.check_call(q, q, q, cfg, masks, **HOPPER)
  except NotImplementedError as e:
    assert "shared memory" in str(e) or "three consumer" in str(e), e


def test_consumers_bring_their_own_registers():
  q = _shape(1, 4096, 2, 128)
  three = mosaic_impl.kernel_config(q, *jflash.prepare(q, q, q))
  assert (three.consumers, three.ping_pong, three.register_split()) == (3, False, (160, 32))
  two = mosaic_impl.kernel_config(q, *jflash.prepare(
      q, q, q, config=jflash.MosaicGPUConfig(consumers=2)))
  assert (two.consumers, two.ping_pong, two.register_split()) == (2, True, (232, 40))


@pytest.mark.parametrize("fields", [
    dict(backward_block_n=128), dict(backward_block_n=256), dict(backward_dq_block_n=128),
    dict(backward_stages=3), dict(backward_persistent=True), dict(backward_persistent=False)])
@pytest.mark.parametrize("H, causal, group", [(64, True, 1), (128, False, 1),
                                              (128, True, 4), (256, False, 1)])
def test_backward_fields_run_the_mosaic_backward_as_set_or_raise(fields, H, causal, group):
  """A backward field the caller sets picks the Mosaic GPU backward whatever "auto"
  would (never the Triton one in its place), with that field's value; a combination the
  call cannot run raises NotImplementedError from the implementation's check."""
  q, k = _shape(1, 2048, 4, H), _shape(1, 2048, 4 // group, H)
  cfg, masks = jflash.prepare(q, k, k, is_causal=causal,
                              config=jflash.MosaicGPUConfig(**fields))
  assert mosaic_impl.backward_kind(q, k, cfg, masks) == "mosaic_gpu"
  config = mosaic_impl.backward_config(q, k, cfg, masks)
  own = cfg.backend_config(jflash.MosaicGPUConfig).backward_fields()
  assert {name: getattr(config, name) for name in own} == own
  try:
    mosaic_impl.check_call(q, k, k, cfg, masks, **HOPPER)
  except NotImplementedError as e:
    assert "shared memory" in str(e) or "persistent=True" in str(e), e


def test_unrunnable_backward_tiles_raise_rather_than_run_another_backward():
  q, k = _shape(1, 16384, 16, 128), _shape(1, 16384, 1, 128)
  big = jflash.prepare(q, k, k, is_causal=True,
                       config=jflash.MosaicGPUConfig(backward_block_n=256))
  assert mosaic_impl.backward_kind(q, k, *big) == "mosaic_gpu"
  with pytest.raises(NotImplementedError, match="shared memory"):
    mosaic_impl.check_call(q, k, k, *big, **HOPPER)


def test_backward_choice():
  """"pallas" and "mosaic_gpu" as asked; "auto" as the heuristics say
  (`mosaic_backward_wins`, tested as properties below): the Mosaic GPU backward for a
  16K d128 call, the Triton one for a short one and for a causal grid of few programs."""
  kind = lambda q, k, **kw: mosaic_impl.backward_kind(q, k, *jflash.prepare(q, k, k, **kw))
  long, short = _shape(1, 16384, 16, 128), _shape(1, 256, 16, 128)
  for backward in ("pallas", "mosaic_gpu"):
    assert kind(short, short, config=jflash.MosaicGPUConfig(backward=backward)) == backward
  assert kind(long, long) == kind(long, long, is_causal=True) == "mosaic_gpu"
  assert kind(short, short) == "pallas"
  one_head = _shape(1, 16384, 1, 128)
  assert kind(one_head, one_head, is_causal=True) == "pallas"      # 128 programs
  assert kind(_shape(1, 16384, 1, 72), _shape(1, 16384, 1, 72)) == "pallas"  # unsupported


# -- the heuristics, as properties ------------------------------------------------------------

@pytest.mark.parametrize("H", HEAD_DIMS)
def test_table_entries_are_configs_every_head_dim_of_their_tier_runs(H):
  """Every entry of the forward's table (and the two-consumer entries) is a valid
  config that fits shared memory at every head dim that takes it, in both dtypes."""
  tier = common.table_head_dim(H)
  assert tier == min(d for d in common.TABLE_HEAD_DIMS if d >= H)
  two = {key: entry for key, (entry, _) in heuristics.TWO_CONSUMER_ENTRIES.items()}
  entries = [c for (d, _), c in {**heuristics.TABLE, **two}.items() if d == tier]
  assert entries
  for dtype in (jnp.bfloat16, jnp.float16):
    q = jnp.zeros((1, 8, 1, H), dtype)
    for config in entries:
      configs.check_forward(q, q, q, config)


@pytest.mark.parametrize("H", HEAD_DIMS)
def test_default_forward_configs_run(H):
  for causal, T in itertools.product((False, True), (1, 1000, 2048, 16384, None)):
    config = heuristics.default_config(H, causal, T)
    q = jnp.zeros((1, 8, 1, H), jnp.bfloat16)
    configs.check_forward(q, q, q, config)
    assert config.consumer_ranges <= causal          # a causal mask's tiles only
    assert not (config.consumer_ranges and config.scores_ahead)


SHAPE_GRID = [(B, T, N, K) for B, T, N, K in itertools.product(
    (1, 4, 32), (64, 1000, 4096, 16384), (16, 32), (16, 8, 1)) if N % K == 0]


@pytest.mark.parametrize("H", HEAD_DIMS)
def test_backward_call_configs_run(H):
  """Every call config the heuristics return over a grid of shapes is one the kernels
  run: valid, within shared memory, its group split dividing the group, and within the
  persistent grids' and the head dims' limits (`check_backward`)."""
  for (B, T, N, K), causal in itertools.product(SHAPE_GRID, (False, True)):
    q, k = jnp.zeros((1, 8, N, H), jnp.bfloat16), jnp.zeros((1, 8, K, H), jnp.bfloat16)
    config = heuristics.call_config((B, T, N, H), (B, T, K, H), 2, causal=causal)
    configs.check_backward(q, k, k, config)
    assert configs.backward_smem_bytes(H, 2, config) <= common.SMEM_BYTES


@pytest.mark.parametrize("H", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_sms", [None, 132])
def test_mosaic_backward_wins_for_longer_calls_if_for_a_shorter(H, causal, num_sms):
  """Longer sequences and larger batches only spread each program's fixed costs further
  and fill a causal grid more: where the Mosaic GPU backward wins, it wins there too."""
  for B, (N, K) in itertools.product((1, 4, 16), ((16, 16), (32, 8), (16, 1))):
    for chain in (((B, 512), (B, 1024), (B, 2048), (B, 4096), (B, 16384), (4 * B, 16384)),
                  ((B, 1024), (4 * B, 1024), (16 * B, 1024), (64 * B, 1024))):
      wins = [heuristics.mosaic_backward_wins(
          (b, T, N, H), (b, T, K, H), causal=causal, num_sms=num_sms,
          config=heuristics.call_config((b, T, N, H), (b, T, K, H), 2, causal=causal))
          for b, T in chain]
      assert wins == sorted(wins), (B, N, K, chain, wins)


def test_mosaic_backward_wins_on_causal_grids_launched_side_by_side():
  """With a causal mask and one key head per query head, 1K rows: the Mosaic GPU
  backward where its launched grids run side by side (256 pairs on 132
  multiprocessors), the Triton one where level by level (64 pairs, or no device
  count)."""
  def wins(B, num_sms):
    q = (B, 1024, 16, 128)
    config = heuristics.call_config(q, q, 2, causal=True)
    return heuristics.mosaic_backward_wins(q, q, causal=True, config=config, num_sms=num_sms)
  assert wins(16, 132)
  assert not wins(4, 132) and not wins(16, None)


def test_swizzles_are_the_widest_a_row_fills():
  for H, itemsize in itertools.product(HEAD_DIMS, (2, 4)):
    swizzle = common.swizzle_bytes(H, itemsize)
    assert (H * itemsize) % swizzle == 0
    assert all((H * itemsize) % s for s in common.SWIZZLES if s > swizzle)


# -- the scheduler, as properties --------------------------------------------------------------

@pytest.mark.parametrize("sizes,l2_group", [((16, 32, 4), 4), ((5, 3, 2), 2), ((7, 3, 2), 3),
                                            ((3, 2, 1), 5), ((1, 4, 2), 3), ((4, 3, 2), 1),
                                            ((3, 2, 1), 2 ** 31 - 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_item_coords_cover_the_grid_once(sizes, l2_group, causal):
  """`item_coords`: a bijection onto the grid; with a causal mask and `l2_group` g the
  tiles go in groups of g consecutive ones (the last narrower), fastest within a group,
  and groups ascend."""
  n = math.prod(sizes)
  coords = np.stack([np.asarray(c) for c in scheduler.item_coords(
      jnp.arange(n, dtype=jnp.int32), sizes, causal, l2_group)], -1)
  assert sorted(map(tuple, coords.tolist())) == sorted(itertools.product(*map(range, sizes)))
  if causal:
    group = coords[:, 0] // l2_group
    assert np.all(np.diff(group) >= 0)
    width = min(l2_group, sizes[0])
    assert coords[group == 0][:width].tolist() == [[t, 0, 0] for t in range(width)]


@pytest.mark.parametrize("num_items,num_ctas,heads", [(2048, 132, 16), (7, 3, 1),
                                                      (5, 5, 1), (6, 4, 1), (11, 4, 1)])
def test_item_schedule_covers_items_once_and_snake_balances(num_items, num_ctas, heads):
  """`item_schedule`: each work item goes to exactly one program, in either order; with
  items in falling cost (a causal grid: each key tile seeing 2 query tiles fewer), the
  snake order keeps every program's sum within one item of the others, where the plain
  order puts the busiest of 132 programs more than 6% over the mean."""
  cost = np.array([256 - 2 * (w // heads) for w in range(num_items)])
  totals = {}
  for snake in (False, True):
    owned = []
    for cta in range(num_ctas):
      steps, item = scheduler.item_schedule(jnp.int32(cta), num_items, num_ctas, snake)
      owned.append([int(item(jnp.int32(k))) for k in range(int(steps))])
    assert sorted(sum(owned, [])) == list(range(num_items))
    totals[snake] = np.array([cost[o].sum() for o in owned])
  plain, snake = totals[False], totals[True]
  assert snake.max() - snake.min() <= cost.max()
  if num_items == 2048:
    assert plain.max() / plain.mean() > 1.06 and snake.max() / snake.mean() < 1.003


# -- lowering the default forward (no GPU needed) ---------------------------------------------

def _lowered(H, opts, ops_fn=None, config=None, T=200, S=330, N=4, K=2, dtype=jnp.bfloat16):
  """The forward at `config` (the heuristics' by default) lowered for CUDA, on the
  persistent grid of an H100's or H200's 132 multiprocessors."""
  q, k = _shape(2, T, N, H, dtype), _shape(2, S, K, H, dtype)
  config = config or heuristics.default_config(H, opts.is_causal, T)

  def f(q, k, v, *extra):
    ops = ops_fn(*extra) if ops_fn else None
    return mf.flash_forward(q, k, v, scale=H ** -0.5, opts=opts, ops=ops, config=config,
                            num_sms=132)
  extra = []
  if ops_fn is not None:
    extra = [jax.ShapeDtypeStruct((2, T), jnp.int32), jax.ShapeDtypeStruct((2, S), jnp.int32),
             jax.ShapeDtypeStruct((2,), jnp.int32)]
  return lowered(f, q, k, k, *extra)


def _segments_and_lengths(q_seg, kv_seg, kv_len):
  return MaskOperands(q_segment_ids=q_seg, kv_segment_ids=kv_seg, kv_lengths=kv_len,
                      schedule=None)


@pytest.mark.parametrize("H, causal, T", [
    (64, False, 4096), (64, True, 4096), (64, True, 200), (128, False, 4096),
    (128, True, 4096), (128, False, 200), (32, True, 4096), (80, False, 4096),
    (192, False, 200), (256, False, 200), (256, True, 200)])
def test_default_forward_lowers_with_its_register_split(H, causal, T):
  """The default kernel of each tier, both query-length sides of the consumer count,
  down to the matrix-product instructions; its warpgroups' setmaxnreg counts are the
  config's register split (three consumers: 4 x 128 = 3 x 160 + 32; two: 3 x 168 =
  2 x 232 + 40)."""
  config = heuristics.default_config(H, causal, T)
  module = kernel_modules(_lowered(H, MaskOptions(is_causal=causal), config=config))[0]
  assert "wgmma" in module
  assert register_counts(module) == sorted(config.register_split())


@pytest.mark.parametrize("H, dtype", [(128, jnp.float16), (64, jnp.bfloat16), (256, jnp.bfloat16)])
def test_default_forward_lowers_with_every_mask_path(H, dtype):
  opts = MaskOptions(is_causal=True, window=(40, 8), soft_cap=20.0)
  assert "wgmma" in kernel_modules(_lowered(H, opts, _segments_and_lengths, dtype=dtype))[0]


@pytest.mark.parametrize("H, T, S, padded", [(128, 1000, 3000, False), (128, 200, 330, True),
                                             (128, 131, 3000, True), (64, 197, 577, False),
                                             (32, 131, 3001, False),
                                             (48, 197, 577, True)])
def test_tails_are_padded_in_hbm_only_off_the_tensor_map_rows(H, T, S, padded):
  """Lengths that are multiples of TMA_ROWS reach the kernel as they are (the copy
  engine zero-fills and drops the rows past the end of a tile); others are padded,
  except where a row is one swizzle row (head dims 16, 32, 64) and the copies move plain
  rows: there every length reaches the kernel as it is. (The [B, T, N, H] operands: the
  per-consumer tile-range table, a few int32 per block, is padded to whole programs
  either way.)"""
  text = _lowered(H, MaskOptions(is_causal=True), T=T, S=S)
  operand_pads = re.findall(r"stablehlo\.pad.*-> tensor<\d+x\d+x\d+x\d+x(?:bf16|f16)>", text)
  assert bool(operand_pads) == padded, operand_pads
  # Unpadded, the output leaves at T rows: no slice copies it (lse, [B, N, T] float32,
  # is cut either way).
  out_cut = re.search(rf"stablehlo\.slice.*-> tensor<2x{T}x4x{H}x(?:bf16|f16)>", text)
  assert bool(out_cut) == (padded and T % common.TMA_ROWS != 0)


def test_outputs_leave_the_kernel_through_an_optimization_barrier():
  """XLA's dynamic-slice fusion would otherwise fold a scan's stacking of the output
  into a fusion around the kernel's call and keep a second call for the output's other
  users: two forward kernels per layer."""
  text = _lowered(128, MaskOptions(is_causal=True), T=1024, S=1024)
  assert text.count("stablehlo.optimization_barrier") == 1


@pytest.mark.parametrize("H", [64, 128, 256])
def test_persistent_kernel_holds_one_copy_of_the_item(H):
  """The default persistent program runs every work item through one traced body, so
  its module holds as many matrix products as the launched grid's program of one item
  (a second copy of the body would double ptxas's work)."""
  config = heuristics.default_config(H, False, 4096)
  assert config.persistent
  products = [kernel_modules(_lowered(H, MaskOptions(), config=dataclasses.replace(
      config, persistent=p)))[0].count("wgmma.mma_async") for p in (False, True)]
  assert products[0] > 0 and products[1] == products[0], products


@pytest.mark.parametrize("H, causal", [(64, True), (128, False), (256, True)])
def test_lazy_rescale_lowers_to_a_warp_vote_per_rescale(H, causal):
  """The defaults skip O's rescale where no row's max moved (`lazy_rescale`) from the
  128 tier on, through one warp vote per loop body: the loop's three tile classes (with
  `consumer_ranges`, the same three of a consumer's own range), and with
  `scores_ahead` the last tile's two classes too; none at d = 64."""
  config = heuristics.default_config(H, causal, 4096)
  sites = (5 if config.scores_ahead else 3) if config.lazy_rescale else 0
  assert config.lazy_rescale == (H >= 80)
  module = kernel_modules(_lowered(H, MaskOptions(is_causal=causal), config=config))[0]
  assert module.count("vote.sync.any") == sites


# -- the forward kernel, interpreted off a GPU (compiled on one) -----------------------------

THREE = dict(consumers=3)
SCORES_AHEAD = dict(scores_ahead=True)
LAZY = dict(lazy_rescale=True)


@pytest.mark.parametrize("variant, H", [({}, 64), (THREE, 64), ({}, 80), (SCORES_AHEAD, 64),
                                        (dict(SCORES_AHEAD, **LAZY), 256)])
def test_pipeline_mqa_causal_off_tile(variant, H):
  """Two programs of 128 rows (T = 130), the last one mostly padding (three consumers:
  one of 192 rows); S = 200 in 64-key tiles through 2 slots, so the producer refills
  slots behind the consumed barriers; the two consumers ping-ponged or three
  unsynchronised, each P V issued with the next S (d = 256's form), a head dim off the
  table."""
  q, k, v = random_qkv((1, 130, 200, 2, 1, H), jnp.bfloat16, seed=1)[:3]
  config = configs.MosaicConfig(64, 64, 2, **variant)
  out, lse = mf.flash_forward(q, k, v, scale=0.125, opts=MaskOptions(is_causal=True),
                              config=config, interpret=INTERPRET)
  check_forward(q, k, v, out, lse, is_causal=True, scale=0.125)


def test_tile_buffer_views_share_their_bytes():
  """The two views of a `tile_smem` buffer start at the same byte (Pallas lays each
  member of a RefUnion from the union's start), the premise of `rows_are_swizzle_rows`."""
  from jax._src.pallas.mosaic_gpu import core as gpu_core
  union = common.tile_smem((2, 64, 64), jnp.bfloat16, rows_view=True)
  views = jax.tree.leaves(gpu_core.flatten_ref_union(union.get_ref_aval()),
                          is_leaf=lambda x: hasattr(x, "transforms"))
  offsets = [t.offset for v in views for t in v.transforms
             if isinstance(t, gpu_core.ExtractAliasedRef)]
  assert offsets == [0, 0]


@pytest.mark.parametrize("H, causal, variant, T, S, dtype", [
    (64, False, {}, 197, 203, jnp.bfloat16),
    (64, True, dict(THREE, block_q=64, block_k=128), 197, 203, jnp.bfloat16),
    (32, False, dict(persistent=True), 197, 203, jnp.float16),
    (16, True, {}, 5, 40, jnp.bfloat16)])
def test_tails_off_the_tiling(H, causal, variant, T, S, dtype):
  """Lengths off multiples of 8 (T = 197, S = 203; T = 5, S = 40), rows of one swizzle
  row (head dims 16, 32, 64): compiled, the copies move plain rows over tensor maps of T and S rows, zeros past
  the end on load and nothing stored past T (no padded copy, `map_rows`); interpreted,
  the tails are padded to whole tiles. GQA 4/2, two batches, bf16 and fp16."""
  q, k, v = random_qkv((2, T, S, 4, 2, H), dtype, seed=3)[:3]
  config = dataclasses.replace(heuristics.default_config(H, causal, T), **variant)
  out, lse = mf.flash_forward(q, k, v, scale=H ** -0.5, opts=MaskOptions(is_causal=causal),
                              config=config, interpret=INTERPRET)
  assert out.shape == q.shape and lse.shape == (2, 4, T)
  check_forward(q, k, v, out, lse, is_causal=causal, scale=H ** -0.5)


@pytest.mark.parametrize("causal, variant", [(False, {}), (True, {}), (True, THREE),
                                             (False, SCORES_AHEAD), (True, SCORES_AHEAD)])
def test_persistent_grid_carries_slots_across_items(causal, variant):
  """Persistent grid: 3 programs over 2 query blocks x 2 batches; key tiles of 64 in 3
  slots, so slots and barrier phases run on from one item into the next; lengths make
  the items' tile counts differ (batch 1 sees 40 keys: one tile). Causal takes the
  items heaviest first. With three consumers (192-row blocks) one program takes both."""
  B, T, S = 2, 130, 150
  q, k, v = random_qkv((B, T, S, 1, 1, 64), jnp.bfloat16, seed=4)[:3]
  kv_len = jnp.asarray([150, 40], jnp.int32)
  opts, ops = kernel_records(Masks(is_causal=causal, kv_lengths=kv_len), B=B, T=T, S=S)
  config = configs.MosaicConfig(64, 64, 3, persistent=True, **variant)
  out, lse = mf.flash_forward(q, k, v, scale=0.125, opts=opts, ops=ops, config=config,
                              interpret=INTERPRET, num_sms=1 if config.consumers == 3 else 3)
  check_forward(q, k, v, out, lse, scale=0.125, key_value_seq_lengths=kv_len,
                is_causal=causal)


def test_device_sms():
  """The multiprocessors a grid is laid out for: as given, 2 interpreted, the device's
  otherwise (none on a CPU: lowering needs it given); a clear error for a bad value."""
  assert common.device_sms(132, interpret=False) == 132
  assert type(common.device_sms(np.int64(132), interpret=False)) is int
  assert common.device_sms(None, interpret=True) == 2
  if INTERPRET:     # off a GPU
    with pytest.raises(ValueError, match="num_sms is needed off a GPU"):
      common.device_sms(None, interpret=False)
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match=rf"num_sms={bad!r} must be a positive int"):
      common.device_sms(bad, interpret=True)


def test_launch_side_by_side_closed_form():
  """Side by side where a level-by-level round of the programs would hold a different
  (batch, head) pair in each (causal), or where the level-by-level grid's tiles would
  pass CUDA's z axis (any launched grid); never past it with the batch, nor on a
  persistent grid."""
  Z = common.CUDA_GRID_YZ
  side = lambda batch, heads, tiles=8, causal=True, persistent=False: (
      heuristics.launch_side_by_side(causal=causal, persistent=persistent, batch=batch,
                                     heads=heads, tiles=tiles, num_sms=132))
  assert side(16, 16)                          # 1K d128 causal, 16 x 16
  assert side(132, 1) and not side(131, 1)
  assert not side(1, 16)                       # 16K d128 causal, 16 heads
  assert not side(16, 16, causal=False) and not side(16, 16, persistent=True)
  assert side(Z, 1) and not side(Z + 1, 1)
  assert side(1, 1, tiles=Z + 1) and side(1, 1, tiles=Z + 1, causal=False)
  assert not side(1, 1, tiles=Z) and not side(Z + 1, 1, tiles=Z + 1)
  assert not side(1, 1, tiles=Z + 1, persistent=True)


def test_launches_past_cuda_grid_limits_raise():
  """A launched grid whose y or z axis (the product of all but the last two) passes
  CUDA_GRID_YZ blocks raises NotImplementedError naming the axes; at the limit it
  passes."""
  Z = common.CUDA_GRID_YZ
  common.check_launch((Z, Z, 2 ** 31 - 1), ("q", "heads", "batch"))
  common.check_launch((7,), ("sm",))
  with pytest.raises(NotImplementedError, match=r"z \(q: 65536\)"):
    common.check_launch((Z + 1, 4, 2), ("q", "heads", "batch"))
  with pytest.raises(NotImplementedError, match=r"y \(heads: 65536\)"):
    common.check_launch((2, Z + 1, 2), ("q", "heads", "batch"))
  with pytest.raises(NotImplementedError, match=r"z \(kv x heads: 65536\)"):
    common.check_launch((256, 256, 1, 2), ("kv", "heads", "split", "batch"))


def test_causal_forward_past_the_z_limit_launches_side_by_side():
  """Lowered for CUDA, one (batch, head) of 65,537 query blocks of 192 rows (12.6M
  tokens): level by level would put the blocks on z, past its 65,535; side by side
  they go on x. (The static ranges are O(blocks), `ranges_static`.)"""
  q = _shape(1, 65537 * 192, 1, 128, jnp.bfloat16)
  f = lambda q, k, v: mf.flash_forward(q, k, v, scale=0.125, opts=MaskOptions(is_causal=True),
                                       num_sms=132)
  assert launch_grid(kernel_modules(lowered(f, q, q, q))[0]) == [65537, 1, 1]


@pytest.mark.parametrize("num_sms", [2, 64])
def test_causal_launch_in_both_orders(num_sms):
  """A launched causal forward over 2 batches x 2 heads x 3 query blocks: on 2
  multiprocessors each pair's blocks side by side (`launch_side_by_side`), on 64
  one level at a time. Both equal the reference."""
  assert heuristics.launch_side_by_side(causal=True, persistent=False, batch=2, heads=2,
                                        tiles=3, num_sms=num_sms) == (num_sms == 2)
  q, k, v = random_qkv((2, 320, 320, 2, 2, 64), jnp.bfloat16, seed=3)[:3]
  out, lse = mf.flash_forward(q, k, v, scale=0.125, opts=MaskOptions(is_causal=True),
                              interpret=INTERPRET, num_sms=num_sms,
                              config=configs.MosaicConfig(64, 64, 2))
  check_forward(q, k, v, out, lse, scale=0.125, is_causal=True)


@pytest.mark.parametrize("num_sms, blocks", [(8, [6, 4, 2]), (132, [2, 4, 6])])
def test_causal_launch_order_lowered(num_sms, blocks):
  """Lowered for CUDA, 2 batches x 4 heads x 6 query blocks of 1K d128 causal: on 8
  multiprocessors the query blocks are the fastest axis, x (each pair's side by side),
  on 132 the batch (level by level)."""
  q = _shape(2, 1024, 4, 128, jnp.bfloat16)
  f = lambda q, k, v: mf.flash_forward(q, k, v, scale=0.125, opts=MaskOptions(is_causal=True),
                                       num_sms=num_sms)
  assert launch_grid(kernel_modules(lowered(f, q, q, q))[0]) == blocks


@pytest.mark.parametrize("causal", [False, True])
def test_static_ranges_need_no_op_before_the_kernels(causal):
  """Under static rules the forward computes its blocks' tile ranges from their indices
  (`StaticRanges`), and the backward's kernels load them from a table embedded as a
  constant: lowered for CUDA (2 x 1K, 4 x 128; the default config, three consumers with
  their own ranges when causal), the forward's call takes no int32 operand, and neither
  program runs an int32 broadcast or pad, which XLA's constant folding would leave to run
  as kernels before each call. With key lengths (data) the forward loads a table."""
  q = _shape(2, 1024, 4, 128, jnp.bfloat16)
  opts = MaskOptions(is_causal=causal)
  forward = lambda ops: lowered(lambda q, k, v: mf.flash_forward(
      q, k, v, scale=0.125, opts=opts, ops=ops, num_sms=132), q, q, q)
  backward = lowered(lambda q, k, v: mb.flash_backward(
      q, k, v, q, jnp.zeros((2, 4, 1024), jnp.float32), q, scale=0.125, opts=opts,
      num_sms=132), q, q, q)
  kernel_int32 = lambda text: [line for line in text.splitlines()
                               if "custom_call" in line and "xi32>" in line]
  static = forward(MaskOperands())
  assert not kernel_int32(static) and kernel_int32(backward)
  for text in (static, backward):
    assert not [line for line in text.splitlines()
                if re.search(r"stablehlo\.(broadcast_in_dim|pad)\b.*xi32>", line)]
  assert kernel_int32(forward(MaskOperands(kv_lengths=jnp.array([1000, 1024], jnp.int32))))


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's race detector")
@pytest.mark.parametrize("variant, persistent", [({}, False), (THREE, False), ({}, True),
                                                 (SCORES_AHEAD, True)])
def test_forward_refills_slots_without_a_race(monkeypatch, capsys, variant, persistent):
  """The producer refills a K or V slot only after every consumer released it (a proxy
  fence first under the interpreter, whose products are plain loads): S = 384 in
  128-key tiles through 2 slots, T = 197 (a last block mostly padding); persistent, 2
  programs over 2 batches x 2 heads x 2 query blocks. No race, and the reference."""
  watch_races(monkeypatch)
  q, k, v = random_qkv((2, 197, 384, 2, 1, 64), jnp.bfloat16, seed=5)[:3]
  config = configs.MosaicConfig(64, 128, 2, persistent=persistent, **variant)
  got = mf.flash_forward(q, k, v, scale=0.125, interpret=INTERPRET, num_sms=2, config=config)
  jax.block_until_ready(got)
  assert "RACE DETECTED" not in capsys.readouterr().out
  check_forward(q, k, v, *got, scale=0.125)


@pytest.mark.parametrize("H", [64, 128, 256])
@pytest.mark.parametrize("persistent", [False, True])
def test_q_slots_two_only_in_persistent_programs_where_they_fit(H, persistent):
  """`forward_q_slots`: a second Q slot per consumer in persistent programs (the
  defaults at d = 64 and 128: 115,712 and 230,400 bytes, in the 227 KiB a block may
  use); d = 256's two Q slots would not fit; a program of one item has one. The model
  grows by exactly the slot's bytes."""
  config = dataclasses.replace(heuristics.default_config(H, False, 4096), persistent=persistent)
  slots = configs.forward_q_slots(H, 2, config)
  assert slots == (2 if persistent and H <= 128 else 1)
  one, two = (configs.forward_smem_bytes(H, 2, config, n) for n in (1, 2))
  assert two - one == config.consumers * config.block_q * H * 2
  assert (two <= common.SMEM_BYTES) == (H <= 128)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's race detector")
@pytest.mark.parametrize("variant", [{}, THREE])
def test_persistent_forward_loads_the_next_q_without_a_race(monkeypatch, capsys, variant):
  """Two Q slots: each consumer loads its next item's Q into the slot its last item's O
  left, once that O's store has read it out; 2 programs over 2 batches x 2 heads x 2
  query blocks (4 items each), T = 197, S = 203 (a last block mostly padding). No race,
  and the outputs equal one slot's (a launched grid's) to the bit. (The interpreter
  completes a bulk store at once, so the wait for O's store before the next load into
  its slot is not what this checks; a load into the wrong slot hangs its barrier.)"""
  watch_races(monkeypatch)
  q, k, v = random_qkv((2, 197, 203, 2, 1, 64), jnp.bfloat16, seed=5)[:3]
  run = lambda persistent: mf.flash_forward(
      q, k, v, scale=0.125, interpret=INTERPRET, num_sms=2,
      config=configs.MosaicConfig(64, 128, 2, persistent=persistent, **variant))
  got = run(True)
  jax.block_until_ready(got)
  assert "RACE DETECTED" not in capsys.readouterr().out
  for x, y in zip(run(False), got):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  check_forward(q, k, v, *got, scale=0.125)


# Masks whose items at T = S = 320 (64-key tiles, programs of 128 rows: 9 items) hold
# every tile class: (causal, window, key lengths of the three batches).
TILE_CLASS_T = 320
TILE_CLASS_MASKS = [
    (True, (150, 0), [0, 40, 320]),        # lo > 0, masked, full, masked tiles; no tile
    (False, None, [256, 0, 64])]           # a FULL last tile; an item of one FULL tile


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("causal, window, kv_len", TILE_CLASS_MASKS)
def test_scores_ahead_in_every_tile_class(persistent, causal, window, kv_len):
  """`scores_ahead` carries each tile's S into the next tile's step and takes the last
  tile (P V alone) by its class: items of no key tile, of one, and of several whose
  loops start past tile 0 and run masked, unmasked and masked tiles. The output equals
  the loop without it to the bit, and the reference under the rule."""
  B, T = 3, TILE_CLASS_T
  q, k, v = random_qkv((B, T, T, 1, 1, 64), jnp.bfloat16, seed=7)[:3]
  kv_len = jnp.asarray(kv_len, jnp.int32)
  opts, ops = kernel_records(Masks(is_causal=causal, window=window, kv_lengths=kv_len),
                             B=B, T=T, S=T)
  run = lambda ahead: mf.flash_forward(q, k, v, scale=0.125, opts=opts, ops=ops,
                                       interpret=INTERPRET, num_sms=3,
                                       config=configs.MosaicConfig(
                                           64, 64, 2, persistent=persistent,
                                           scores_ahead=ahead))
  ahead = run(True)
  for x, y in zip(run(False), ahead):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  empty = check_forward(q, k, v, *ahead, scale=0.125, is_causal=causal,
                        local_window_size=window, key_value_seq_lengths=kv_len)
  assert empty >= T            # the batch of no key at least


def test_lazy_max_closed_forms():
  """The stale max moves only when passed by more than RESCALE_THRESHOLD; a row that
  saw nothing takes the new max; a NaN keeps the old one."""
  t = mf.RESCALE_THRESHOLD
  inf, nan = np.inf, np.nan
  m_i = jnp.array([-inf, -inf, 0.0, 0.0, 0.0, 5.0, 0.0], jnp.float32)
  m_new = jnp.array([-inf, 3.0, t, t + 0.5, 1.0, 5.0, nan], jnp.float32)
  np.testing.assert_array_equal(np.asarray(mf.lazy_max(m_i, m_new)),
                                [-inf, 3.0, 0.0, t + 0.5, 0.0, 5.0, 0.0])


@pytest.mark.parametrize("persistent, dtype, causal, window, kv_len", [
    (persistent, jnp.bfloat16, *mask) for persistent in (False, True)
    for mask in TILE_CLASS_MASKS] + [(False, jnp.float16, *TILE_CLASS_MASKS[0])])
def test_lazy_rescale(persistent, dtype, causal, window, kv_len):
  """`lazy_rescale` in the tile classes above, with keys from the fourth key tile on
  four times larger, so that some rows' max rises past the threshold (2^8 in
  probability) within the item and others' by less (their exponentials then exceed 1);
  on the persistent grid with scores_ahead too."""
  B, T, S = 3, TILE_CLASS_T, TILE_CLASS_T
  q, k, v = random_qkv((B, T, S, 1, 1, 64), dtype, seed=8)[:3]
  k = k.at[:, 192:].multiply(4.0)
  kv_len = jnp.asarray(kv_len, jnp.int32)
  masks = Masks(is_causal=causal, window=window, kv_lengths=kv_len)
  opts, ops = kernel_records(masks, B=B, T=T, S=S)
  logits = np.einsum("btnh,bsnh->bts", np.asarray(q, np.float64), np.asarray(k, np.float64))
  logits = np.where(dense_keep_numpy(B, 1, T, S, masks)[:, 0], logits, -np.inf)
  first, later = logits[:, :, :192].max(-1), logits[:, :, 192:].max(-1)
  seen = np.isfinite(first) & np.isfinite(later)      # rows with keys on both sides
  rise = (later[seen] - first[seen]) * 0.125 * common.LOG2E
  assert (rise > mf.RESCALE_THRESHOLD).any()
  assert ((rise > 0) & (rise <= mf.RESCALE_THRESHOLD)).any()
  for variant in ({}, SCORES_AHEAD) if persistent and dtype == jnp.bfloat16 else ({},):
    out, lse = mf.flash_forward(q, k, v, scale=0.125, opts=opts, ops=ops, interpret=INTERPRET,
                                num_sms=3, config=configs.MosaicConfig(
                                    64, 64, 2, persistent=persistent, **LAZY, **variant))
    empty = check_forward(q, k, v, out, lse, scale=0.125, is_causal=causal,
                          local_window_size=window, key_value_seq_lengths=kv_len)
    assert empty >= T


@pytest.mark.parametrize("where", ["q", "k"])
def test_lazy_rescale_keeps_nan_in_its_rows(where):
  """A NaN logit fails the threshold's comparison, so the row keeps its max; its
  exponential and sum are NaN all the same. In K's tile 2 of 3 it reaches every row
  (a NaN in q: its row only)."""
  q, k, v = random_qkv((1, 64, 192, 1, 1, 64), jnp.bfloat16, seed=3)[:3]
  if where == "q":
    q = q.at[0, 9, 0, 3].set(jnp.nan)
  else:
    k = k.at[0, 100, 0, 3].set(jnp.nan)
  out, lse = mf.flash_forward(q, k, v, scale=0.125, interpret=INTERPRET,
                              config=configs.MosaicConfig(64, 64, 2, **LAZY))
  bad = np.isnan(np.asarray(out, np.float32)).any(-1)[0, :, 0]
  assert bad.tolist() == [where == "k" or t == 9 for t in range(64)]
  assert np.isfinite(np.asarray(out, np.float32)[0, ~bad]).all()
  assert np.isnan(np.asarray(lse)[0, 0][bad]).all()


@pytest.mark.parametrize("variant, segments", [({}, False), (THREE, False),
                                               (dict(persistent=True), False), ({}, True)])
def test_consumer_ranges(variant, segments):
  """`consumer_ranges`: each consumer computes its own rows' key tiles and passes the
  rest of its program's. Causal with a window of 100 keys back, so that in one program
  the first consumer passes the last tile and the second the first; key lengths 0, 70
  and 250; T = 260 off the program's rows; or segments of 100 rows in place of the
  window. The output equals the program-wide ranges' to the bit, and the reference's
  under the rule."""
  B, T, S = 3, 260, 250
  q, k, v = random_qkv((B, T, S, 1, 1, 64), jnp.bfloat16, seed=8)[:3]
  kv_len = jnp.asarray([0, 70, 250], jnp.int32)
  ids = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) // 100, (B, n))
  mask_kw = (dict(segment_ids=(ids(T), ids(S))) if segments
             else dict(local_window_size=(100, 0)))
  opts, ops = kernel_records(jflash.prepare(q, k, v, is_causal=True,
                                            key_value_seq_lengths=kv_len, **mask_kw)[1],
                             B=B, T=T, S=S)
  run = lambda own: mf.flash_forward(q, k, v, scale=0.125, opts=opts, ops=ops,
                                     interpret=INTERPRET, num_sms=2,
                                     config=configs.MosaicConfig(64, 64, 2, consumer_ranges=own,
                                                                 **variant))
  out, lse = run(True)
  for x, y in zip(run(False), (out, lse)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  empty = check_forward(q, k, v, out, lse, scale=0.125, is_causal=True,
                        key_value_seq_lengths=kv_len, **mask_kw)
  assert empty >= T            # the batch of no key at least


def test_record_combinations_are_checked():
  with pytest.raises(ValueError, match="consumer_ranges=True is built into the loop"):
    configs.MosaicConfig(consumer_ranges=True, scores_ahead=True)
  for name in ("consumer_ranges", "scores_ahead", "lazy_rescale"):
    with pytest.raises(ValueError, match=f"{name}=1"):
      configs.MosaicConfig(**{name: 1})
  for registers in (248, 236, 0):
    with pytest.raises(ValueError, match=f"consumer_registers={registers}"):
      configs.MosaicConfig(consumer_registers=registers)
  with pytest.raises(NotImplementedError, match="three consumer warpgroups"):
    q = jnp.zeros((1, 8, 1, 256), jnp.bfloat16)
    configs.check_forward(q, q, q, configs.MosaicConfig(64, 64, consumers=3))


@pytest.mark.usefixtures("on_hopper")
def test_gradient_through_the_triton_backward():
  """The custom_vjp with this forward's residuals (out, lse in natural log [B, N, T])
  feeding the Triton backward: gradients within the rule against the float64 truth."""
  q, k, v, do = random_qkv((1, 64, 80, 2, 1, 64), jnp.bfloat16, seed=5)
  config = jflash.MosaicGPUConfig(backward="pallas")
  got = jax.vjp(lambda q, k, v: jflash.attention(
      q, k, v, is_causal=True, implementation="mosaic_gpu", config=config), q, k, v)[1](do)
  check_grads(got, q, k, v, do, is_causal=True)


def test_negative_scale():
  """The row max is taken after the scale when the scale is not positive."""
  q, k, v = random_qkv((1, 64, 64, 1, 1, 64), jnp.bfloat16, seed=6)[:3]
  out, lse = mf.flash_forward(q, k, v, scale=-0.2, interpret=INTERPRET)
  check_forward(q, k, v, out, lse, scale=-0.2)


def test_nan_reaches_only_its_row():
  q, k, v = random_qkv((1, 64, 64, 1, 1, 64), jnp.bfloat16, seed=3)[:3]
  q = q.at[0, 9, 0, 3].set(jnp.nan)
  out, lse = mf.flash_forward(q, k, v, scale=0.125, interpret=INTERPRET)
  bad = ~np.isfinite(np.asarray(out, np.float32)).all(-1)[0, :, 0]
  assert bad.tolist() == [t == 9 for t in range(64)]
  assert np.isnan(np.asarray(lse)[0, 0, 9])
