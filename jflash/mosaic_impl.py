""""mosaic_gpu": the Hopper forward kernel on Pallas Mosaic GPU behind jflash's
custom_vjp. The backward is either the Mosaic GPU backward kernels (pallas_kernels/mosaic_gpu/
backward.py) or the Triton ("pallas") backward, both fed the residuals (q, k, v, out,
lse) this forward returns and the same mask records; `backward_kind` picks per call
(`MosaicGPUConfig(backward=...)` overrides).

The one adapter between jflash's vocabulary and the kernel's own records: `Masks` ->
pallas_kernels.masking's MaskOptions / MaskOperands (through `kernel_records`, the
same per-tile schedule as the Triton kernels), `MosaicGPUConfig` ->
pallas_kernels.mosaic_gpu.forward.MosaicConfig.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jflash import pallas_impl
from jflash.config import MosaicGPUConfig
from jflash.derivatives import first_order_only
from jflash.masks import Masks, kernel_records
from jflash.platforms import device_capability, is_hopper
from pallas_kernels.mosaic_gpu import backward as _bwd
from pallas_kernels.mosaic_gpu import forward as _fwd

# The device kinds (jflash.platforms.device_kinds) where `implementation=None` tries
# this implementation, before those preferred on less specific kinds.
PREFERRED_ON = ("hopper",)

# Fields of `Masks` the kernel takes; the others raise NotImplementedError.
UNSUPPORTED_MASKS = ("mask", "bias", "dropout_rate", "dropout_seed", "causal_alignment")


def kernel_config(q, cfg, masks: Masks) -> _fwd.MosaicConfig:
  """The caller's MosaicGPUConfig over the kernel's default for (head_dim, causal,
  query length)."""
  config = _fwd.default_config(q.shape[-1], masks.is_causal, q.shape[1])
  own = cfg.backend_config(MosaicGPUConfig)
  if own is None:
    return config
  fields = {name: getattr(own, name) for name in own.forward_fields
            if getattr(own, name) is not None}
  if "consumers" in fields:   # the table's ping-pong and registers go with its own count
    config = config.with_consumers(fields.pop("consumers"))
  # A loop the caller picks drops the table's choice the other loop alone reads.
  if (fields.get("overlap") or fields.get("scores_ahead")) and "consumer_ranges" not in fields:
    config = dataclasses.replace(config, consumer_ranges=False)
  if fields.get("consumer_ranges") and "scores_ahead" not in fields:
    config = dataclasses.replace(config, scores_ahead=False)
  try:
    return dataclasses.replace(config, **fields)
  except ValueError as e:
    raise ValueError(f"{e} (over the default {config} at head_dim={q.shape[-1]} and "
                     f"{q.shape[1]} query rows; set consumers too)") from None


def check_call(q, k, v, cfg, masks: Masks, *, platform: str, capability: str | None):
  """Raises NotImplementedError naming what this implementation lacks for the call."""
  if platform != "gpu" or capability is None:
    raise NotImplementedError(
        f"mosaic_gpu needs a CUDA GPU of compute capability 9.x (Hopper); the default "
        f"device is {platform}" + (" but not CUDA" if platform == "gpu" else ""))
  if not is_hopper(capability):
    raise NotImplementedError(
        f"mosaic_gpu needs compute capability 9.x (Hopper), the GPU has {capability}")
  lacking = [name for name in masks.in_use() if name in UNSUPPORTED_MASKS]
  if lacking:
    raise NotImplementedError(f"mosaic_gpu has no {', '.join(lacking)}")
  _fwd.check_supported(q, k, v, kernel_config(q, cfg, masks))
  if backward_kind(q, k, cfg, masks) == "mosaic_gpu":
    _bwd.check_supported(q, k, v, backward_config(q, k, cfg, masks))


def backward_config(q, k, cfg, masks: Masks, *, own_fields: bool = True) -> _bwd.BackwardConfig:
  """The Mosaic GPU backward's config for the call: the caller's backward fields
  (unless `own_fields` is False) over the kernel's default for the call's shapes
  (`pallas_kernels.mosaic_gpu.backward.call_config`: two consumers, and a causal
  call's GQA group split when its dK/dV grid is small)."""
  own = cfg.backend_config(MosaicGPUConfig)
  fields = own.backward_fields() if own is not None and own_fields else {}
  return _bwd.call_config(q.shape, k.shape, q.dtype.itemsize, causal=masks.is_causal,
                          **fields)


# Query and key lengths from which "auto" takes the Mosaic GPU backward with one key
# head per query head: at 2K the two backwards ran level (419.1 against 420.1 TF/s
# fwd+bwd, causal 339.7 against 339.5; mosaic_ws_2k_time_h200.json), at 1K level or
# slower (381.6 against 380.3, causal 278.1 against 280.3 at the backward's 240
# registers; mosaic_backward_consumers_regs240_h200.json), from 4K faster.
MHA_MIN_SEQ = 2048
# ... and from which it takes it where the config runs the persistent grids
# (`pallas_kernels.mosaic_gpu.backward.persistent_wins`), fwd+bwd against the Triton
# backward in one process (mosaic_bwd_persistent_short_h200.json): 1K (batch 16, 16
# heads) 422.6 TF/s against 375.0, 2K (batch 8) 471.9 against 420.8.
MHA_PERSISTENT_MIN_SEQ = 1024
# Query and key lengths from which "auto" takes the Mosaic GPU backward at the head dims
# split by role (`pallas_kernels.mosaic_gpu.backward.by_role`): the shortest timed, 1K
# (fwd+bwd 1.13x and 1.15x the Triton backward's, causal second;
# mosaic_bwd_d256_cells_h200.json).
BY_ROLE_MIN_SEQ = 1024
# Query and key lengths from which "auto" takes the Mosaic GPU backward at head_dim 64
# (its default tiles, `pallas_kernels.mosaic_gpu.backward.BLOCK_N_AT_64`), fwd+bwd TF/s
# against the Triton backward's in alternating rounds of one process (32 query heads):
# for one key head per query head without a causal mask the shortest timed, 1K (batch
# 16): 355.5 against 329.3; 2K (batch 8) 395.7 against 355.8
# (mosaic_bwd_d64_short_time_h200.json); 4K (batch 4) 409.8 against 364.0
# (mosaic_bwd_d64_tiles128_variants_h200.json; 419.1 against 376.8 in another call,
# mosaic_bwd_stats_streamed_time_h200.json). These and the two below were timed with
# P computed after dP's product (the order before `_bwd.P_UNDER_DP`), which the
# default's order ran ahead of in one process on an H100.
D64_MIN_SEQ = 1024
# ... with a causal mask, on the persistent grids (`persistent_wins`), from 4K: 334.2
# against 329.4 (mosaic_bwd_d64_persistent_time_h200.json, 5 rounds; 341.5 against 322.9
# in the call before, mosaic_bwd_d64_causal_dq_variants_h200.json) and 16K (batch 1)
# 385.4 against 376.1; shorter the Triton one leads (2K 291.3 against 289.4, 1K 246.9
# against 228.6).
D64_CAUSAL_MIN_SEQ = 4096
# ... and for grouped heads, the length timed, 4K: GQA 32/8 407.0 against 374.1, causal
# 358.4 against 330.1 (mosaic_bwd_d64_persistent_time_h200.json).
D64_GROUPED_MIN_SEQ = 4096


def backward_kind(q, k, cfg, masks: Masks) -> str:
  """Which backward runs: the caller's choice, or with "auto" the faster one as measured
  on the H200 (bf16, fwd+bwd against the Triton backward in the same process), with
  the backward's default config (two consumer warpgroups and a producer, the dQ kernel
  three at head_dim 80-128 without a causal mask;
  `pallas_kernels.mosaic_gpu.backward.call_config`). At head_dim 128 (and those that
  take its tiles, below):
  - grouped heads (GQA, MQA): the Mosaic GPU backward, whose dK/dV program runs the
    group's query heads against K and V held in shared memory (GQA 32/8 8K 526.3
    against 468.6 TF/s, causal 500.8 against 437.9; MQA 16/1 16K 553.4 against 458.4,
    causal with the group split in four 523.5 against 464.4;
    mosaic_backward_consumers_regs240_h200.json);
  - one key head per query head, with the default backward fields (the config that was
    timed, or the same on the launched grids), query and key lengths from MHA_MIN_SEQ
    (MHA_PERSISTENT_MIN_SEQ where the config runs the persistent grids): the Mosaic
    GPU backward (16K d128 527.5 against 464.7, causal 505.5 against 467.7,
    mosaic_bwd_regs240_h200.log, with the dQ kernel's rows then in shared memory; in
    registers, the default since, 1.009x and 1.027x that,
    ab_dq_rows_in_registers_h200.json; without a causal mask three dQ consumers
    since, `_bwd.DQ_CONSUMERS_AT_128`, 1.014x that), off whole tiles too, whose tails
    it reads in place (T = S = 3000, batch 4, 16 heads: 479.6 against 423.9, causal
    406.3 against 365.3, mosaic_bwd_tails_time_h200.json; padded in HBM it had run 299.8 causal
    where the Triton backward ran 335, bench_model_h200.json); shorter, the Triton
    backward;
  - either way not when the call is causal and its dK/dV grid, with the config's
    group split, still has fewer than the kernel's CAUSAL_MIN_PROGRAMS programs: a
    causal program's work grows with its key tile's distance from the end, and one
    wave of a few hundred programs lasts as long as the heaviest. (The 512 comes from
    grouped heads; with one key head per query head a causal grid of 512 programs ran
    477.6 against 395.5, mosaic_bwd_512_programs_h200.json: 8K, 8 heads, batch 1.)
  - not when the caller's backward fields make a config the kernels cannot run for
    the call (shared memory, a group split that does not divide the group).
  - head_dim 256 (split by role: the dK/dV kernel's only config there): the Mosaic GPU
    backward from BY_ROLE_MIN_SEQ query and key rows (the timed calls, MHA and GQA, on
    whole tiles; tails are read in place as above), unless a causal grid stays small
    as above (4K 417.8 against 324.0, causal 359.1 against 291.1,
    mosaic_bwd_d256_time_h200.json; 1K, batch 16, 323.5 against 287.4, causal 253.3
    against 220.6; GQA 16/4 4K 441.4 against 316.7, causal 407.1 against 285.6,
    mosaic_bwd_d256_cells_h200.json).
  head_dim 64: the Mosaic GPU backward with the default config (its tiles of 128, on
  the persistent grids up to groups of 4; or the same on the launched grids, timed
  against it with a causal mask and grouped heads) for one key head per query head
  from D64_MIN_SEQ rows (D64_CAUSAL_MIN_SEQ with a causal mask) and for grouped heads
  from D64_GROUPED_MIN_SEQ (unless a causal grid stays small, as above), else the
  Triton backward (the numbers at those constants).
  Head dims off the table follow the one whose tiles they take
  (`pallas_kernels.mosaic_gpu.forward.table_head_dim`), but below 64 the Triton
  backward (the Mosaic GPU one's tiles of 128 have not run there);
  80 and 96 the rule of 128 (timed with one key head per query head at 4K, batch 4,
  16 heads: d96 455.7 against 393.7, causal 379.1 against 344.2; d80 394.3 against
  357.7, causal 339.9 against 310.3; mosaic_off_table_bwd_time_h200.json; grouped,
  GQA 32/8 8K d96 467.4 against 372.5, causal 460.7 against 380.4, and 1K d96 380.5
  against 335.2, causal 244.3 against 238.4 where the rule keeps the Triton one;
  mosaic_off_table_rule_time_h200.json; without a causal mask three dQ consumers
  since, faster again, `_bwd.DQ_CONSUMERS_AT_128`); above 128 the rule of 256 (d192,
  8 heads: 398.9 against 372.4, causal 371.5 against 335.7 with one dQ warpgroup; with the
  two dQ consumers now taken there, 433.1 and 399.0 against the Triton backward's
  361.8 and 325.1, mosaic_bwd_dq2_d192_time_h200.json)."""
  own = cfg.backend_config(MosaicGPUConfig)
  if own is not None and own.backward != "auto":
    return own.backward
  B, S, K, H = k.shape
  T = q.shape[1]
  grouped = q.shape[2] > K
  config = backward_config(q, k, cfg, masks)
  try:      # a caller's backward fields the kernels cannot run there: the Triton backward
    _bwd.check_supported(q, k, k, config)
  except NotImplementedError:
    return "pallas"
  filled = (not masks.is_causal
            or _bwd.dkv_programs(B, K, S, H, config) >= _bwd.CAUSAL_MIN_PROGRAMS)
  if _bwd.by_role(H):   # as timed: from BY_ROLE_MIN_SEQ
    return "mosaic_gpu" if filled and min(T, S) >= BY_ROLE_MIN_SEQ else "pallas"
  # (dq_consumers resolved first: None and the count it stands for are one config;
  # l2_group left out: it orders a persistent causal grid's items, and at d = 64 both
  # orders timed, groups of 1 and 8, ran ahead of the Triton backward.)
  def resolved(c):
    dq = {} if c.fused_dq else {"dq_consumers": _bwd.dq_consumers_of(H, c)}
    return dataclasses.replace(c, l2_group=1, **dq)
  # The configs timed against the Triton backward: the default and, where it takes
  # three dQ consumers, the two with their rows in registers that ran before them (the
  # figures above); each also on the launched grids.
  default = backward_config(q, k, cfg, masks, own_fields=False)
  timed = [default]
  if default.dkv_p_under_dp:     # at d = 64: the order before P_UNDER_DP, timed above
    timed.append(dataclasses.replace(default, **dict.fromkeys(_bwd.P_UNDER_DP, False)))
  if default.dq_consumers == _bwd.DQ_CONSUMERS_AT_128:
    timed.append(dataclasses.replace(default, dq_consumers=2, dq_rows_in_registers=True))
  timed_config = resolved(config) in [resolved(c) for t in timed
                                      for c in (t, dataclasses.replace(t, persistent=False))]
  if _fwd.table_head_dim(H) == 64:   # as timed: d = 64
    min_seq = (D64_GROUPED_MIN_SEQ if grouped else
               D64_CAUSAL_MIN_SEQ if masks.is_causal else D64_MIN_SEQ)
    return ("mosaic_gpu" if H == 64 and timed_config and filled and min(T, S) >= min_seq
            else "pallas")
  # one key head per query head: only the timed configs (from MHA_MIN_SEQ rows; the
  # persistent grids from MHA_PERSISTENT_MIN_SEQ).
  min_seq = MHA_PERSISTENT_MIN_SEQ if config.persistent else MHA_MIN_SEQ
  timed_mha = timed_config and min(T, S) >= min_seq
  return "mosaic_gpu" if (grouped or timed_mha) and filled else "pallas"


def supports(q, k, v, cfg, masks: Masks):
  platform, capability = device_capability()
  check_call(q, k, v, cfg, masks, platform=platform, capability=capability)


def forward(q, k, v, cfg, masks: Masks):
  """(out, lse); interpreted by Mosaic GPU's own interpreter off the GPU (tests)."""
  interpret = jax.default_backend() != "gpu"
  config = kernel_config(q, cfg, masks)

  def fwd(q, k, v, masks):
    opts, ops = kernel_records(masks, B=q.shape[0], T=q.shape[1], S=k.shape[1])
    out, lse = _fwd.flash_forward(q, k, v, scale=cfg.scale, opts=opts, ops=ops,
                                  config=config, interpret=interpret)
    if masks.q_lengths is not None:
      # Rows past the query length return zeros and lse = -inf (jax.nn semantics); the
      # kernel's schedule skips whole query blocks past it, this clears the rest.
      live = jnp.arange(q.shape[1])[None, :] < masks.q_lengths[:, None]     # [B, T]
      out = jnp.where(live[:, :, None, None], out, jnp.zeros((), out.dtype))
      lse = jnp.where(live[:, None, :], lse, -jnp.inf)
    return out, lse
  return first_order_only(fwd, "the mosaic_gpu forward kernel")(q, k, v, masks)


def backward(q, k, v, out, lse, dout, dlse, cfg, masks: Masks):
  """(dq, dk, dv) from the backward `backward_kind` picks (the Mosaic GPU one is
  interpreted by Mosaic GPU's own interpreter off the GPU, as the forward)."""
  if backward_kind(q, k, cfg, masks) == "pallas":
    return pallas_impl.backward(q, k, v, out, lse, dout, dlse, cfg, masks)
  interpret = jax.default_backend() != "gpu"

  def bwd(q, k, v, out, lse, dout, dlse, masks):
    opts, ops = kernel_records(masks, B=q.shape[0], T=q.shape[1], S=k.shape[1])
    return _bwd.flash_backward(q, k, v, out, lse, dout, dlse, scale=cfg.scale, opts=opts,
                               ops=ops, config=backward_config(q, k, cfg, masks),
                               interpret=interpret)
  return first_order_only(bwd, "the mosaic_gpu backward kernels")(
      q, k, v, out, lse, dout, dlse, masks)
