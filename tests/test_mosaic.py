"""The "mosaic_gpu" implementation (Hopper forward on Pallas Mosaic GPU) on a CPU.

Three levels, all on the CI machine:
- host side: which calls the implementation accepts and why it refuses the others,
  dispatch and fallback, the Hopper default order, tile validation;
- lowering: the kernel's Pallas program lowers to the Mosaic GPU dialect for CUDA
  (cross-platform lowering; nothing runs), for every head dim and every mask path;
- interpretation: the same kernel run by Mosaic GPU's own interpreter (simulated shared
  memory, barriers, bulk copies and three or four warpgroups) against the float64
  reference.
  The interpreter has no in-register or transposed matrix-product operands and no layout
  casts, so there the two products are plain dots; the schedule, the slot barriers, the
  producer's refills, masks, tails and the normalisation are the kernel's own.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import api, mosaic_impl
from jflash.masks import Masks, dense_keep_numpy, kernel_records
from pallas_kernels.masking import MaskOperands, MaskOptions
from pallas_kernels.mosaic_gpu import forward as mf
from tests.attention_test_base import floor, max_err, random_qkv


def _prepared(q, k, v, **kw):
  """(cfg, masks) of one call, as jflash.attention builds them."""
  return jflash.prepare(q, k, v, **kw)


def _qkv(H=64, dtype=jnp.bfloat16, T=16, S=16, N=2, K=1):
  return random_qkv((1, T, S, N, K, H), dtype)[:3]


# -- host side ----------------------------------------------------------------------------

HOPPER = dict(platform="gpu", capability="9.0")


def test_supported_call_on_hopper():
  q, k, v = _qkv()
  mosaic_impl.check_call(q, k, v, *_prepared(q, k, v, is_causal=True, local_window_size=4,
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
    mosaic_impl.check_call(q, k, v, *_prepared(q, k, v), **device)


@pytest.mark.parametrize("H, dtype, reason", [
    (72, jnp.bfloat16, "a multiple of 16 up to 256, got 72"),
    (272, jnp.float16, "a multiple of 16 up to 256, got 272"),
    (64, jnp.float32, "bfloat16 and float16"),
])
def test_refuses_shapes_and_dtypes(H, dtype, reason):
  q, k, v = _qkv(H, dtype)
  with pytest.raises(NotImplementedError, match=reason):
    mosaic_impl.check_call(q, k, v, *_prepared(q, k, v), **HOPPER)


def test_refuses_dense_mask_bias_dropout_and_takes_its_own_config():
  q, k, v = _qkv()
  mask = jnp.ones((1, 1, 16, 16), bool)
  with pytest.raises(NotImplementedError, match="mosaic_gpu has no mask"):
    mosaic_impl.check_call(q, k, v, *_prepared(q, k, v, mask=mask), **HOPPER)
  with pytest.raises(NotImplementedError, match="mosaic_gpu has no bias"):
    mosaic_impl.check_call(q, k, v, *_prepared(q, k, v, bias=mask.astype(q.dtype)), **HOPPER)
  with pytest.raises(NotImplementedError, match="dropout"):
    mosaic_impl.check_call(q, k, v, *_prepared(q, k, v, dropout_rate=0.1,
                                                dropout_rng=jax.random.key(0)), **HOPPER)
  lengths = _prepared(q, k, v, key_value_seq_lengths=jnp.array([3]))  # structured: accepted
  mosaic_impl.check_call(q, k, v, *lengths, **HOPPER)
  # Its own config over the per-head_dim default; one that overflows shared memory
  # is refused (and a sequence of implementations moves on).
  cfg, masks = _prepared(q, k, v, config=jflash.MosaicGPUConfig(block_k=64, stages=3))
  assert mosaic_impl.kernel_config(q, cfg, masks) == mf.MosaicConfig(64, 64, 3, persistent=True)
  causal = _prepared(q, k, v, is_causal=True, config=jflash.MosaicGPUConfig(stages=3))
  assert mosaic_impl.kernel_config(q, *causal) == mf.MosaicConfig(128, 64, 3, consumer_ranges=True)
  q256, k256, v256 = _qkv(256)
  big = _prepared(q256, k256, v256, config=jflash.MosaicGPUConfig(block_k=256, stages=4))
  with pytest.raises(NotImplementedError, match="shared memory"):
    mosaic_impl.check_call(q256, k256, v256, *big, **HOPPER)
  with pytest.raises(ValueError, match="stages=0"):
    jflash.MosaicGPUConfig(stages=0)
  regs = _prepared(q, k, v, config=jflash.MosaicGPUConfig(consumer_registers=240))
  assert mosaic_impl.kernel_config(q, *regs).consumer_registers == 240
  with pytest.raises(ValueError, match="consumer_registers=250"):
    jflash.MosaicGPUConfig(consumer_registers=250)
  three = _prepared(q, k, v, config=jflash.MosaicGPUConfig(consumers=3))
  assert mosaic_impl.kernel_config(q, *three).register_split() == (160, 32)
  assert not mosaic_impl.kernel_config(q, *three).ping_pong
  with pytest.raises(ValueError, match="ping_pong=False"):
    jflash.MosaicGPUConfig(consumers=3, ping_pong=True)


def test_overriding_the_three_consumer_default_at_head_dim_128():
  """The table runs three consumers at d = 128: asking for two brings back the ping-pong
  and the two-consumer registers; a two-consumer field alone is refused, naming the
  default it was laid over."""
  q, k, v = _qkv(128, T=mf.THREE_CONSUMERS_MIN_SEQ)
  assert mosaic_impl.kernel_config(q, *_prepared(q, k, v)).consumers == 3
  two = mosaic_impl.kernel_config(q, *_prepared(q, k, v,
                                                config=jflash.MosaicGPUConfig(consumers=2)))
  assert (two.consumers, two.ping_pong, two.register_split()) == (2, True, (232, 40))
  regs = jflash.MosaicGPUConfig(consumers=2, consumer_registers=240)
  assert mosaic_impl.kernel_config(q, *_prepared(q, k, v, config=regs)).register_split() == (
      240, 24)
  for alone in (dict(ping_pong=True), dict(consumer_registers=240)):
    with pytest.raises(ValueError, match="set consumers too"):
      mosaic_impl.kernel_config(q, *_prepared(q, k, v, config=jflash.MosaicGPUConfig(**alone)))


def test_short_queries_take_two_consumers():
  """Below THREE_CONSUMERS_MIN_SEQ query rows the table's three consumers (d = 64 and
  128) give way to the ping-ponged two, on the same tiles or TWO_CONSUMER_ENTRIES';
  the caller's own count still wins."""
  for H, causal in ((64, False), (64, True), (128, False), (128, True)):
    long = mf.default_config(H, causal, mf.THREE_CONSUMERS_MIN_SEQ)
    short = mf.default_config(H, causal, mf.THREE_CONSUMERS_MIN_SEQ - 1)
    assert (long.consumers, short.consumers, short.ping_pong) == (3, 2, True)
    own = mf.TWO_CONSUMER_ENTRIES.get((H, causal))
    assert short == (own or long.with_consumers(2))
    assert mf.default_config(H, causal) == long           # no length: the table's
  assert mf.default_config(64, True, 1024) == mf.MosaicConfig(128, 64, 2, consumer_ranges=True)
  q = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
  cfg = jflash.prepare(q, q, q)
  assert mosaic_impl.kernel_config(q, *cfg).consumers == 2
  cfg = jflash.prepare(q, q, q, config=jflash.MosaicGPUConfig(consumers=3))
  assert mosaic_impl.kernel_config(q, *cfg).consumers == 3


def test_registered_and_refused_on_cpu_with_the_reason():
  assert "mosaic_gpu" in api.available_implementations()
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match="mosaic_gpu: .*compute capability 9.x"):
    jflash.attention(q, k, v, implementation="mosaic_gpu")


def test_falls_back_to_the_next_implementation():
  q, k, v = _qkv()
  got = jflash.attention(q, k, v, is_causal=True, implementation=("mosaic_gpu", "xla_chunked"))
  want = jflash.attention(q, k, v, is_causal=True, implementation="xla_chunked")
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("capability, order", [
    ("9.0", ("mosaic_gpu", "pallas", "xla_chunked")),
    ("8.0", ("pallas", "xla_chunked")),
])
def test_default_order_puts_mosaic_first_on_hopper(monkeypatch, capability, order):
  device = types.SimpleNamespace(platform="gpu", compute_capability=capability,
                                 client=types.SimpleNamespace(platform_version="cuda 13.0"))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda *a: [device])
  assert api.default_implementation() == order


@pytest.mark.parametrize("kw, bad", [
    (dict(block_q=32), "block_q=32"), (dict(block_k=320), "block_k=320"),
    (dict(block_k=96), "block_k=96"), (dict(stages=1), "stages=1"),
    (dict(stages=33), r"stages=33 must be an int in \[2, 32\]"),
    (dict(consumer_registers=248), "consumer_registers=248"),
    (dict(consumer_registers=236), "consumer_registers=236"),
    (dict(consumers=4), "consumers=4"), (dict(consumers=2.0), "consumers=2.0"),
    (dict(consumers=3, ping_pong=True), "consumers=3 needs ping_pong=False"),
    (dict(ping_pong=0), "ping_pong=0"), (dict(consumer_registers=0), "consumer_registers=0"),
    (dict(consumers=3, consumer_registers=168), "consumer_registers=168"),
])
def test_tile_validation(kw, bad):
  with pytest.raises(ValueError, match=bad):
    mf.MosaicConfig(**kw)


# Head dims between the table's: each swizzle width, and both sides of by_role's 128.
OFF_TABLE_HEAD_DIMS = (32, 80, 96, 160, 192)


def test_off_table_head_dims_take_the_next_entry_and_the_widest_swizzle():
  """A head dim between the table's takes the next one's tiles; its tiles' rows are
  laid out in the widest swizzle they fill whole (bytes: 2 per element, 4 for the
  backward's float32 tiles)."""
  assert [mf.table_head_dim(H) for H in (16, 32, 64, 80, 96, 128, 160, 192, 256)] == \
      [64, 64, 64, 128, 128, 128, 256, 256, 256]
  assert mf.default_config(96, True, 4096) == mf.default_config(128, True, 4096)
  assert [mf.swizzle_bytes(H, 2) for H in (16, 32, 48, 64, 80, 96, 160, 192, 256)] == \
      [32, 64, 32, 128, 32, 64, 64, 128, 128]
  assert [mf.swizzle_bytes(H, 4) for H in (16, 80, 96)] == [64, 64, 128]
  for H in (0, 8, 72, 272):
    with pytest.raises(NotImplementedError, match=f"multiple of 16 up to 256, got {H}"):
      mf.table_head_dim(H)


def test_default_tiles_fit_shared_memory():
  for H in (*mf.TABLE_HEAD_DIMS, *OFF_TABLE_HEAD_DIMS):
    for causal in (False, True):
      assert mf.smem_bytes(H, 2, mf.default_config(H, causal)) <= mf.SMEM_BYTES
  with pytest.raises(NotImplementedError, match="shared memory"):
    q, k, v = _qkv(256)
    mf.check_supported(q, k, v, mf.MosaicConfig(64, 256, 4))


# -- lowering to Mosaic GPU (no GPU needed) -------------------------------------------------

def _lowered(H, opts, ops_fn=None, config=None, T=200, S=330, N=4, K=2, dtype=jnp.bfloat16,
             num_sms=132):   # the persistent grid's size, as on an H100/H200
  q = jax.ShapeDtypeStruct((2, T, N, H), dtype)
  k = jax.ShapeDtypeStruct((2, S, K, H), dtype)

  def f(q, k, v, *extra):
    ops = ops_fn(*extra) if ops_fn else None
    return mf.flash_forward(q, k, v, scale=H ** -0.5, opts=opts, ops=ops, config=config,
                            num_sms=num_sms)
  extra = []
  if ops_fn is not None:
    extra = [jax.ShapeDtypeStruct((2, T), jnp.int32), jax.ShapeDtypeStruct((2, S), jnp.int32),
             jax.ShapeDtypeStruct((2,), jnp.int32)]
  try:
    return jax.jit(f).trace(q, k, k, *extra).lower(lowering_platforms=("cuda",)).as_text()
  except ImportError as e:  # pragma: no cover - jaxlib without the Mosaic GPU bindings
    pytest.skip(f"this jaxlib cannot lower Mosaic GPU kernels: {e}")


def _segments_and_lengths(q_seg, kv_seg, kv_len):
  return MaskOperands(q_segment_ids=q_seg, kv_segment_ids=kv_seg, kv_lengths=kv_len,
                      schedule=None)


@pytest.mark.parametrize("H", mf.TABLE_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_lowers_to_mosaic_gpu(H, causal):
  assert "mosaic_gpu" in _lowered(H, MaskOptions(is_causal=causal))


@pytest.mark.parametrize("H", OFF_TABLE_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_lowers_off_table_head_dims(H, causal):
  """Through Mosaic GPU's own checks of each product's operands (their tiling must be
  one swizzle row) down to the matrix-product instructions."""
  assert "wgmma" in _kernel_module(_lowered(H, MaskOptions(is_causal=causal)))


@pytest.mark.parametrize("T, S, padded", [(1000, 3000, False), (200, 330, True),
                                          (131, 3000, True)])
def test_tails_are_padded_in_hbm_only_off_the_tensor_map_rows(T, S, padded):
  """Lengths that are multiples of mf.TMA_ROWS reach the kernel as they are (the copy
  engine zero-fills and drops the rows past the end of a tile); others are padded."""
  text = _lowered(128, MaskOptions(is_causal=True), T=T, S=S)
  assert ("stablehlo.pad" in text) == padded


def test_outputs_leave_the_kernel_through_an_optimization_barrier():
  """XLA's dynamic-slice fusion would otherwise fold a scan's stacking of the output
  into a fusion around the kernel's call and keep a second call for the output's other
  users: two forward kernels per layer of the decoder LM on the H200
  (experiments/results/lm_profile_h200/)."""
  text = _lowered(128, MaskOptions(is_causal=True), T=1024, S=1024)
  assert text.count("stablehlo.optimization_barrier") == 1


@pytest.mark.parametrize("H, dtype", [(128, jnp.float16), (64, jnp.bfloat16)])
def test_lowers_with_every_mask_path(H, dtype):
  opts = MaskOptions(is_causal=True, window=(40, 8), soft_cap=20.0)
  assert "mosaic_gpu" in _lowered(H, opts, _segments_and_lengths, dtype=dtype)


@pytest.mark.parametrize("H, config", [
    (64, mf.default_config(64, True)),                    # three consumers, own ranges
    (64, mf.default_config(64, True, 1024)),              # two ping-ponged, own ranges
    (128, mf.default_config(128, True)),                  # three, lazy rescale, own ranges
    (128, dataclasses.replace(mf.default_config(128, True), consumer_ranges=False,
                              l2_group=4))])              # the launch in head groups
def test_lowers_with_consumer_ranges_and_launched_groups(H, config):
  """The table's causal configs, each consumer on its own rows' key tiles
  (`consumer_ranges`), with segments and lengths, and the launched causal grid in head
  groups."""
  opts = MaskOptions(is_causal=True, window=(40, 8))
  assert "wgmma" in _kernel_module(_lowered(H, opts, _segments_and_lengths, config=config))


@pytest.mark.parametrize("causal", [False, True])
def test_lowers_under_warpgroup_semantics(causal):
  config = mf.MosaicConfig(64, 128, 2, semantics="warpgroup")
  assert "mosaic_gpu" in _lowered(128, MaskOptions(is_causal=causal), config=config)


SCORES_AHEAD = dict(scores_ahead=True)   # each P V issued with the next tile's S


@pytest.mark.parametrize("causal,order", [(False, {}), (True, {}),
                                          (True, dict(l2_group=4)), (False, SCORES_AHEAD),
                                          (True, SCORES_AHEAD)])
def test_lowers_persistent(causal, order):
  config = mf.MosaicConfig(64, 128, 2, persistent=True, **order)
  assert "mosaic_gpu" in _lowered(128, MaskOptions(is_causal=causal), config=config)


@pytest.mark.parametrize("H", [128, 256])
def test_persistent_kernel_holds_one_copy_of_the_item(H):
  """A persistent program runs every work item through one traced body, so its module
  holds as many matrix products as the launched grid's program of one item (a second
  copy of the body cost 1.9-3.6 s of the first call of a 4K d256 fwd+bwd on the H200:
  experiments/results/compile_time_h200.json)."""
  config = mf.default_config(H, False)
  opts = MaskOptions(is_causal=False)
  products = [_kernel_module(_lowered(H, opts, config=dataclasses.replace(
      config, persistent=persistent))).count("wgmma.mma_async") for persistent in (False, True)]
  assert products[0] > 0 and products[1] == products[0], products


def _kernel_module(lowered: str) -> str:
  """The first Mosaic GPU module inside a lowered program, printed as text."""
  return _kernel_modules(lowered)[0]


def _kernel_modules(lowered: str) -> list[str]:
  """Every Mosaic GPU module inside a lowered program, printed as text."""
  from experiments.tools.lowered import mosaic_modules
  return mosaic_modules(lowered)


def _register_counts(module: str) -> list[int]:
  """The register counts a Mosaic GPU module's warpgroups set (setmaxnreg), sorted."""
  return sorted(int(n) for n in re.findall(r"setmaxregister.*regCount = (\d+)", module))


@pytest.mark.parametrize("H, config", [
    (256, dict(block_q=64, block_k=64)), (64, dict(block_q=64, block_k=256)),
    (128, dict(block_q=128, block_k=64)), (64, dict(block_q=64, block_k=128, overlap=True))])
def test_three_consumers_refused_where_they_do_not_compile(H, config):
  # Outside what compiled on the H200 (a launch of four warpgroups: 128 registers each).
  q, k, v = _qkv(H)
  with pytest.raises(NotImplementedError, match="three consumer warpgroups"):
    mf.check_supported(q, k, v, mf.MosaicConfig(**config, **THREE_CONSUMERS))


@pytest.mark.parametrize("H", mf.TABLE_HEAD_DIMS)
def test_sweep_variants_are_configs_the_kernel_takes(H):
  from experiments.mosaic_check import sweep_configs
  q, k, v = _qkv(H)
  for config in sweep_configs(H):
    mf.check_supported(q, k, v, config)


def test_lowers_three_consumers_with_their_register_split():
  config = mf.MosaicConfig(64, 128, 2, persistent=True, **THREE_CONSUMERS)
  assert config.register_split() == (160, 32)          # 4 x 128 = 3 x 160 + 32
  module = _kernel_module(_lowered(64, MaskOptions(is_causal=True), config=config))
  counts = _register_counts(module)
  assert counts == [32, 160]


@pytest.mark.parametrize("consumer, producer", [(232, 40), (240, 24)])
def test_register_split_reaches_the_kernel(consumer, producer):
  config = dataclasses.replace(mf.default_config(256), consumer_registers=consumer)
  assert config.register_split() == (consumer, producer)
  module = _kernel_module(_lowered(256, MaskOptions(), config=config))
  counts = _register_counts(module)
  assert counts == sorted([consumer, producer])


@pytest.mark.parametrize("H", mf.TABLE_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_lowers_overlapped(H, causal):
  config = dataclasses.replace(mf.default_config(H, causal).with_consumers(2), overlap=True,
                               consumer_ranges=False)
  assert "mosaic_gpu" in _lowered(H, MaskOptions(is_causal=causal), config=config)


def test_lowers_overlapped_with_every_mask_path():
  opts = MaskOptions(is_causal=True, window=(40, 8), soft_cap=20.0)
  config = mf.MosaicConfig(64, 128, 2, overlap=True)
  assert "mosaic_gpu" in _lowered(64, opts, _segments_and_lengths, config=config)


def test_lowers_with_a_fresh_accumulator_and_deeper_pipeline():
  config = mf.MosaicConfig(64, 64, 3, pv_in_place=False)
  assert "mosaic_gpu" in _lowered(128, MaskOptions(), config=config)


# -- the kernel under Mosaic GPU's interpreter ------------------------------------------------

def _check_against_reference(q, k, v, out, lse, **kw):
  ref_kw = {a: (tuple(np.asarray(x) for x in b) if isinstance(b, tuple) else
                np.asarray(b) if hasattr(b, "shape") else b) for a, b in kw.items()}
  r_out, r_lse = jflash.attention_numpy(*(np.asarray(x, np.float64) for x in (q, k, v)), **ref_kw)
  p_out, p_lse = jflash.attention(q, k, v, implementation="xla", return_residuals=True, **kw)
  H = q.shape[-1]
  err, plain = max_err(out, r_out), max_err(p_out, r_out)
  assert err <= 2 * plain + floor(q.dtype, r_out, H), (err, plain)
  live = np.isfinite(r_lse)
  lse = np.asarray(lse)
  np.testing.assert_array_equal(lse[~live], -np.inf)
  l_err = max_err(lse[live], r_lse[live])
  assert l_err <= 2 * max_err(np.asarray(p_lse)[live], r_lse[live]) + floor(
      jnp.float32, r_lse[live], H) + 4 * float(jnp.finfo(q.dtype).eps), l_err
  rows_out = np.asarray(out, np.float64).transpose(0, 2, 1, 3)      # [B, N, T, H]
  np.testing.assert_array_equal(rows_out[~live], 0.0)
  return int((~live).sum())


THREE_CONSUMERS = dict(consumers=3)          # unsynchronised: ping_pong resolves to False


@pytest.mark.parametrize("variant, H", [({}, 64), (dict(overlap=True), 64),
                                        (THREE_CONSUMERS, 64), ({}, 80), (SCORES_AHEAD, 64)])
def test_interpreted_pipeline_mqa_causal_off_tile(variant, H):
  """Two programs of 128 rows (T = 130), the last one mostly padding (with three
  consumers one program of 192 rows, 62 of them padding); S = 200 in 64-key tiles
  through 2 slots, so the producer refills slots behind the consumed barriers; with the
  two consumers ping-ponged, with the softmax overlapped with P V in each consumer, or
  with three unsynchronised consumers; and at a head dim off the table."""
  q, k, v = random_qkv((1, 130, 200, 2, 1, H), jnp.bfloat16, seed=1)[:3]
  config = mf.MosaicConfig(64, 64, 2, **variant)
  out, lse = mf.flash_forward(q, k, v, scale=0.125, opts=MaskOptions(is_causal=True),
                              config=config, interpret=True)
  _check_against_reference(q, k, v, out, lse, is_causal=True, scale=0.125)


@pytest.mark.parametrize("causal, variant", [(False, {}), (True, {}), (True, dict(overlap=True)),
                                             (True, THREE_CONSUMERS), (False, SCORES_AHEAD),
                                             (True, SCORES_AHEAD)])
def test_interpreted_persistent_grid_carries_slots_across_items(causal, variant):
  """Persistent grid: 3 programs over 2 query blocks x 2 batches; key tiles of 64 in 3
  slots, so slots and barrier phases run on from one item into the next; lengths make
  the items' tile counts differ (batch 1 sees 40 keys: one tile). Causal takes the
  items in the other order (batches fastest, heaviest query block first). With three
  consumers (192-row blocks: one per batch) one program takes both items."""
  B, T, S = 2, 130, 150
  q, k, v = random_qkv((B, T, S, 1, 1, 64), jnp.bfloat16, seed=4)[:3]
  kv_len = jnp.asarray([150, 40], jnp.int32)
  opts, ops = kernel_records(Masks(is_causal=causal, kv_lengths=kv_len), B=B, T=T, S=S)
  config = mf.MosaicConfig(64, 64, 3, persistent=True, **variant)
  out, lse = mf.flash_forward(q, k, v, scale=0.125, opts=opts, ops=ops, config=config,
                              interpret=True, num_sms=1 if config.consumers == 3 else 3)
  _check_against_reference(q, k, v, out, lse, scale=0.125, key_value_seq_lengths=kv_len,
                           is_causal=causal)


# Masks whose items at T = S = 320 (64-key tiles, programs of 128 rows: 9 items) hold
# every tile class: (causal, window, key lengths of the three batches).
TILE_CLASS_T = 320
TILE_CLASS_MASKS = [
    (True, (150, 0), [0, 40, 320]),        # lo > 0, masked, full, masked tiles; no tile
    (False, None, [256, 0, 64])]           # a FULL last tile; an item of one FULL tile


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("causal, window, kv_len", TILE_CLASS_MASKS)
def test_interpreted_scores_ahead_in_every_tile_class(persistent, causal, window, kv_len):
  """`scores_ahead` carries each tile's S into the next tile's step and takes the last
  tile (P V alone) by its class: items of no key tile (key length 0), of one, and of
  several whose loops start past tile 0 and run masked, unmasked and masked tiles
  (TILE_CLASS_MASKS; on 3 programs when persistent). The output equals the loop
  without it to the bit, and the reference under the rule; fully masked rows give
  zeros."""
  B, T = 3, TILE_CLASS_T
  q, k, v = random_qkv((B, T, T, 1, 1, 64), jnp.bfloat16, seed=7)[:3]
  kv_len = jnp.asarray(kv_len, jnp.int32)
  masks = Masks(is_causal=causal, window=window, kv_lengths=kv_len)
  opts, ops = kernel_records(masks, B=B, T=T, S=T)
  run = lambda ahead: mf.flash_forward(q, k, v, scale=0.125, opts=opts, ops=ops,
                                       interpret=True, num_sms=3, config=mf.MosaicConfig(
                                           64, 64, 2, persistent=persistent,
                                           scores_ahead=ahead))
  ahead = run(True)
  for x, y in zip(run(False), ahead):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  empty = _check_against_reference(q, k, v, *ahead, scale=0.125, is_causal=causal,
                                   local_window_size=window, key_value_seq_lengths=kv_len)
  assert empty >= T            # the batch of no key at least


def test_scores_ahead_is_checked():
  for bad in (dict(pv_in_place=False), dict(scores_ahead=1)):
    with pytest.raises(ValueError, match="scores_ahead"):
      mf.MosaicConfig(**{"scores_ahead": True, **bad})
  with pytest.raises(ValueError, match="scores_ahead=1"):
    jflash.MosaicGPUConfig(scores_ahead=1)


def test_scores_ahead_is_the_default_where_it_was_faster():
  """At head_dim 256 only (faster there on the H200; slower at 64, 128 and 192), causal
  or not; the rest of the entry is d = 256's table entry, as for 192."""
  for causal in (False, True):
    assert mf.default_config(256, causal).scores_ahead
    assert dataclasses.replace(mf.default_config(256, causal), scores_ahead=False) == \
        mf.default_config(192, causal)
    for H in (64, 128, 160, 192):
      assert not mf.default_config(H, causal).scores_ahead
  # A caller's field over the default, either way.
  for H, ahead in ((256, False), (64, True)):
    q, k, v = _qkv(H)
    cfg, masks = _prepared(q, k, v, config=jflash.MosaicGPUConfig(scores_ahead=ahead))
    assert mosaic_impl.kernel_config(q, cfg, masks) == dataclasses.replace(
        mf.default_config(H, False, q.shape[1]), scores_ahead=ahead)


LAZY = dict(lazy_rescale=True)   # the row max moved only past RESCALE_THRESHOLD


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
def test_interpreted_lazy_rescale(persistent, dtype, causal, window, kv_len):
  """`lazy_rescale` in the tile classes of the test above, with keys from the fourth
  key tile on four times larger, so that some rows' max rises past the threshold
  (2^8 in probability) within the item and others' by less (their exponentials then
  exceed 1): the reference's output under the rule, lse to float32, fully masked rows
  zeros; on the persistent grid with scores_ahead too (the loop the launched grid runs
  once per program). In fp16 (at most 65504, 2^16) a threshold far above
  RESCALE_THRESHOLD would overflow P (one case, without scores_ahead)."""
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
  rise = (later[seen] - first[seen]) * 0.125 * mf.LOG2E
  assert (rise > mf.RESCALE_THRESHOLD).any()
  assert ((rise > 0) & (rise <= mf.RESCALE_THRESHOLD)).any()
  for variant in ({}, SCORES_AHEAD) if persistent and dtype == jnp.bfloat16 else ({},):
    out, lse = mf.flash_forward(q, k, v, scale=0.125, opts=opts, ops=ops, interpret=True,
                                num_sms=3, config=mf.MosaicConfig(
                                    64, 64, 2, persistent=persistent, **LAZY, **variant))
    empty = _check_against_reference(q, k, v, out, lse, scale=0.125, is_causal=causal,
                                     local_window_size=window, key_value_seq_lengths=kv_len)
    assert empty >= T


@pytest.mark.parametrize("where", ["q", "k"])
def test_interpreted_lazy_rescale_keeps_nan_in_its_rows(where):
  """A NaN logit fails the threshold's comparison, so the row keeps its max; its
  exponential and sum are NaN all the same. In K's tile 2 of 3 it reaches every row
  (a NaN in q: its row only)."""
  q, k, v = random_qkv((1, 64, 192, 1, 1, 64), jnp.bfloat16, seed=3)[:3]
  if where == "q":
    q = q.at[0, 9, 0, 3].set(jnp.nan)
  else:
    k = k.at[0, 100, 0, 3].set(jnp.nan)
  out, lse = mf.flash_forward(q, k, v, scale=0.125, interpret=True,
                              config=mf.MosaicConfig(64, 64, 2, **LAZY))
  bad = np.isnan(np.asarray(out, np.float32)).any(-1)[0, :, 0]
  assert bad.tolist() == [where == "k" or t == 9 for t in range(64)]
  assert np.isfinite(np.asarray(out, np.float32)[0, ~bad]).all()
  assert np.isnan(np.asarray(lse)[0, 0][bad]).all()


def test_lazy_rescale_is_checked():
  with pytest.raises(ValueError, match="lazy_rescale=True .* pv_in_place=False"):
    mf.MosaicConfig(lazy_rescale=True, pv_in_place=False)
  with pytest.raises(ValueError, match="lazy_rescale=1"):
    mf.MosaicConfig(lazy_rescale=1)
  with pytest.raises(ValueError, match="lazy_rescale=1"):
    jflash.MosaicGPUConfig(lazy_rescale=1)


@pytest.mark.parametrize("H", [64, 80, 128, 256])
def test_lazy_rescale_is_the_default_where_it_was_faster(H):
  """On from head dim 80 (the 128 and 256 table entries, LAZY_RESCALE_TABLE_DIMS),
  off at 64, causal or not; a config given by the user wins either way."""
  for causal in (False, True):
    assert mf.default_config(H, causal, 4096).lazy_rescale == (H >= 80)
  q, k, v = _qkv(H)
  for given in (False, True):
    cfg = _prepared(q, k, v, config=jflash.MosaicGPUConfig(lazy_rescale=given))
    assert mosaic_impl.kernel_config(q, *cfg).lazy_rescale is given


@pytest.mark.parametrize("H, causal", [(64, True), (256, False)])
def test_lazy_rescale_lowers_to_a_warp_vote_per_rescale(H, causal):
  """One warp vote (the branch around O's rescale hangs on it) per loop body
  (`scale_moved_rows`): the sequential loop's three tile classes, with scores_ahead the
  last tile's two classes too; none without it."""
  for ahead, sites in ((False, 3), (True, 5)):
    config = mf.MosaicConfig(64, 64, 2, scores_ahead=ahead)
    lazy = _kernel_module(_lowered(H, MaskOptions(is_causal=causal),
                                   config=dataclasses.replace(config, **LAZY)))
    assert lazy.count("vote.sync.any") == sites
    plain = _kernel_module(_lowered(H, MaskOptions(is_causal=causal), config=config))
    assert "vote.sync" not in plain


@pytest.mark.parametrize("persistent", [True, False])
def test_interpreted_causal_grid_in_head_groups(persistent):
  """A causal grid whose items go out in groups of query blocks of one head (`l2_group`
  2 over 3 blocks: a narrower last group), persistent (2 programs) or launched (the
  groups over the launch index): 3 blocks x 3 heads of GQA 3/1, with tails; every
  item's output as the reference's. A bad group size is refused."""
  q, k, v = random_qkv((1, 260, 250, 3, 1, 64), jnp.bfloat16, seed=6)[:3]
  config = mf.MosaicConfig(64, 64, 2, persistent=persistent, l2_group=2)
  out, lse = mf.flash_forward(q, k, v, scale=0.125, opts=MaskOptions(is_causal=True),
                              config=config, interpret=True, num_sms=2)
  _check_against_reference(q, k, v, out, lse, is_causal=True, scale=0.125)
  for bad in (0, 1.0, True):
    with pytest.raises(ValueError, match="l2_group"):
      mf.MosaicConfig(l2_group=bad)


@pytest.mark.parametrize("variant, segments", [({}, False), (THREE_CONSUMERS, False),
                                               (dict(persistent=True), False), ({}, True)])
def test_interpreted_consumer_ranges(variant, segments):
  """`consumer_ranges`: each consumer computes its own rows' key tiles and passes the
  rest of its program's. Causal with a window of 100 keys back, so that in one program
  the first consumer passes the last tile and the second the first; key lengths 0 (an
  item of no tile), 70 and 250; T = 260 off the program's rows (a consumer of padding
  rows alone); two consumers ping-ponged, three unsynchronised, or slots carried
  across the items of a persistent grid; or segments of 100 rows in place of the
  window (the own ranges from the data-dependent schedule). The output equals the
  program-wide ranges' to the bit (a passed tile is fully masked for the consumer, a
  tile run without the element-wise mask has none to apply), and the reference's
  under the rule."""
  B, T, S = 3, 260, 250
  q, k, v = random_qkv((B, T, S, 1, 1, 64), jnp.bfloat16, seed=8)[:3]
  kv_len = jnp.asarray([0, 70, 250], jnp.int32)
  ids = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) // 100, (B, n))
  mask_kw = (dict(segment_ids=(ids(T), ids(S))) if segments
             else dict(local_window_size=(100, 0)))
  opts, ops = kernel_records(_prepared(q, k, v, is_causal=True, key_value_seq_lengths=kv_len,
                                       **mask_kw)[1], B=B, T=T, S=S)
  run = lambda own: mf.flash_forward(q, k, v, scale=0.125, opts=opts, ops=ops, interpret=True,
                                     num_sms=2, config=mf.MosaicConfig(
                                         64, 64, 2, consumer_ranges=own, **variant))
  out, lse = run(True)
  for x, y in zip(run(False), (out, lse)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  empty = _check_against_reference(q, k, v, out, lse, scale=0.125, is_causal=True,
                                   key_value_seq_lengths=kv_len, **mask_kw)
  assert empty >= T            # the batch of no key at least


def test_consumer_ranges_is_checked():
  with pytest.raises(ValueError, match="consumer_ranges=1"):
    mf.MosaicConfig(consumer_ranges=1)
  for other in (dict(overlap=True), dict(scores_ahead=True)):
    with pytest.raises(ValueError, match="consumer_ranges"):
      mf.MosaicConfig(consumer_ranges=True, **other)
  with pytest.raises(ValueError, match="consumer_ranges=1"):
    jflash.MosaicGPUConfig(consumer_ranges=1)
  # The causal table entries up to d = 128 have it; a caller's other loop drops it, and
  # a caller's consumer_ranges the table's scores_ahead (d = 256).
  assert [H for H in mf.TABLE_HEAD_DIMS if mf.default_config(H, True).consumer_ranges] == [64, 128]
  q, k, v = _qkv(64, T=4096, S=4096)
  for loop in (dict(overlap=True), dict(scores_ahead=True)):
    call = _prepared(q, k, v, is_causal=True, config=jflash.MosaicGPUConfig(**loop))
    assert not mosaic_impl.kernel_config(q, *call).consumer_ranges
    with pytest.raises(ValueError, match="consumer_ranges"):
      jflash.MosaicGPUConfig(**loop, consumer_ranges=True)
  q, k, v = _qkv(256, T=4096, S=4096)
  call = _prepared(q, k, v, is_causal=True, config=jflash.MosaicGPUConfig(consumer_ranges=True))
  config = mosaic_impl.kernel_config(q, *call)
  assert config.consumer_ranges and not config.scores_ahead


@pytest.mark.parametrize("sizes,l2_group", [((16, 32, 4), 4), ((5, 3, 2), 2), ((7, 3, 2), 3),
                                            ((3, 2, 1), 5), ((1, 4, 2), 3),
                                            ((3, 2, 1), 2 ** 31 - 1)])
def test_item_coords_in_head_groups_cover_the_grid_once(sizes, l2_group):
  """`item_coords` with a causal mask and `l2_group` g: a bijection onto the grid; the
  tiles go in groups of g consecutive ones (the last group narrower when g does not
  divide them), within a group fastest, then heads, then batch, and groups ascend."""
  n = math.prod(sizes)
  coords = np.stack([np.asarray(c) for c in mf.item_coords(
      jnp.arange(n, dtype=jnp.int32), sizes, True, l2_group)], -1)
  assert sorted(map(tuple, coords.tolist())) == sorted(itertools.product(*map(range, sizes)))
  group = coords[:, 0] // l2_group
  assert np.all(np.diff(group) >= 0)
  first = coords[group == 0]
  width = min(l2_group, sizes[0])
  assert first[:width].tolist() == [[t, 0, 0] for t in range(width)]


@pytest.mark.parametrize("overlap", [None, True])
def test_interpreted_masks_through_the_adapter(overlap):
  """Window, segments (one query segment sees no key: empty rows), soft cap, key and
  query lengths including 0, through jflash's adapter; T != S; fp16."""
  B, T, S = 2, 100, 120
  q, k, v = random_qkv((B, T, S, 1, 1, 64), jnp.float16, seed=2)[:3]
  q_seg = np.zeros((B, T), np.int32)
  q_seg[:, 90:] = 7                                   # no key has segment 7
  kv_seg = np.zeros((B, S), np.int32)
  kv_seg[:, 60:] = 1
  q_seg[:, 50:90] = 1
  kw = dict(is_causal=True, local_window_size=(48, 0), logits_soft_cap=5.0,
            segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)),
            query_seq_lengths=jnp.asarray([100, 0], jnp.int32),
            key_value_seq_lengths=jnp.asarray([70, 120], jnp.int32))
  cfg, masks = _prepared(q, k, v, config=jflash.MosaicGPUConfig(overlap=overlap), **kw)
  assert mosaic_impl.kernel_config(q, cfg, masks).overlap == bool(overlap)
  qz, kz, vz = api.zero_padding(q, k, v, masks)
  out, lse = mosaic_impl.forward(qz, kz, vz, cfg, masks)
  empty = _check_against_reference(q, k, v, out, lse, **kw)
  assert empty >= 10 + T                # segment 7 rows of batch 0 and all of batch 1


def test_interpreted_gradient_through_the_triton_backward():
  """The custom_vjp with this forward's residuals (out, lse in natural log [B, N, T])
  feeding the Triton backward: gradients within the rule against the float64 closed form."""
  q, k, v, do = random_qkv((1, 64, 80, 2, 1, 64), jnp.bfloat16, seed=5)
  impl = api.get_implementation("mosaic_gpu")
  cfg, masks = _prepared(q, k, v, is_causal=True, config=jflash.MosaicGPUConfig(backward="pallas"))
  got = jax.vjp(lambda q, k, v: api._flash(q, k, v, masks, impl, cfg)[0], q, k, v)[1](do)
  plain = jax.vjp(lambda q, k, v: jflash.attention(q, k, v, is_causal=True,
                                                   implementation="xla"), q, k, v)[1](do)
  ref = jflash.attention_numpy(*(np.asarray(x, np.float64) for x in (q, k, v)), is_causal=True,
                               dout=np.asarray(do, np.float64))[2:5]
  for name, g, p, t in zip(("dq", "dk", "dv"), got, plain, ref):
    err, err_plain = max_err(g, t), max_err(p, t)
    assert err <= 2 * err_plain + floor(q.dtype, t, 64), (name, err, err_plain)


def test_interpreted_negative_scale():
  """The row max is taken after the scale when the scale is not positive."""
  q, k, v = random_qkv((1, 64, 64, 1, 1, 64), jnp.bfloat16, seed=6)[:3]
  out, lse = mf.flash_forward(q, k, v, scale=-0.2, interpret=True)
  _check_against_reference(q, k, v, out, lse, scale=-0.2)


def test_interpreted_nan_reaches_only_its_row():
  q, k, v = random_qkv((1, 64, 64, 1, 1, 64), jnp.bfloat16, seed=3)[:3]
  q = q.at[0, 9, 0, 3].set(jnp.nan)
  out, lse = mf.flash_forward(q, k, v, scale=0.125, interpret=True)
  bad = ~np.isfinite(np.asarray(out, np.float32)).all(-1)[0, :, 0]
  assert bad.tolist() == [t == 9 for t in range(64)]
  assert np.isnan(np.asarray(lse)[0, 0, 9])
