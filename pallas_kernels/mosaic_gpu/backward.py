"""FlashAttention backward on Pallas Mosaic GPU for Hopper: (q, k, v, out, lse, dO) ->
(dq, dk, dv). Checked on the H200 against float64 (experiments/results/
mosaic_backward_check_h200.json at the defaults; mosaic_bwd_persistent_check_h200.json
with the persistent grids wherever they run, mosaic_bwd_d64_persistent_check_h200.json
at head_dim 16-64 with a causal mask and grouped heads) and, on a CPU, by lowering and by
Mosaic GPU's own interpreter (tests/test_mosaic_backward.py).

The math is the Triton backward's (pallas_kernels.backward; FlashAttention-2,
Algorithm 2): P = exp2(s * c - lse2) is recomputed from the base-2 log-sum-exp,
dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dS' = dS * (1 - tanh^2) under a soft
cap, dK = scale dS'^T Q, dQ = scale dS' K, with delta = rowsum(dO * O) minus the lse
cotangent (`backward_statistics`, shared with the Triton kernels).

Two kernels, each program two or three consumer warpgroups and a producer
(warp-specialised; M = 64 rows of every warpgroup matrix product per consumer) that
loads its tiles with bulk tensor copies (TMA): the program's fixed operands once, the
streamed ones through `stages` slots; the dQ kernel also as one warpgroup that streams
its own tiles (double buffering) where two consumers' rows do not fit shared memory:

- dK/dV: grid over (key tiles, key heads, batch). K and V of the tile stay in shared
  memory; a runtime loop over the query heads of the GQA group and, inside, over the
  query tiles of the transposed per-tile schedule (`build_ranges(..., transpose=True)`)
  computes S^T = K Q^T and dP^T = V dO^T, so that P^T and dS'^T enter dV += P^T dO and
  dK += dS'^T Q as register operands straight from the accumulator. The dV product
  runs while dS'^T is computed (FlashAttention-3's backward overlap): issued right
  behind dP^T, or with `dkv_p_under_dp` (the default on d = 64's tiles) after P^T is
  computed under the dP^T product. dK/dV sum in accumulator registers: no atomics,
  deterministic.
  With `BackwardConfig.group_splits` > 1 the grid is (key tiles, key heads,
  group_splits, batch): each of a key tile's programs loops over its own share of the
  group's query heads and writes float32 partial dK, dV, summed after the kernel.
- dQ: grid over (query tiles, query heads, batch; causal: the heaviest query tiles
  first, `query_block_order`), looping over the visited key tiles: S = Q K^T and
  dP = dO V^T issued back to back, then dQ += dS' K.

Above head_dim 128 (`by_role`) the dK/dV kernel's two consumers share 64 keys and split
the work by output, S^T and dK on one, dP^T and dV on the other, P^T and dP^T passing
between them through shared memory (`_dkv_by_role`); the dQ kernel runs two consumers
and a producer there where their rows fit shared memory beside key tiles of 64
(`call_config`, d 144-224), else one warpgroup (`dq_consumers_of`).

Both skip whole tiles for causal, window, lengths and segment ids alike (the schedule
of `pallas_kernels.masking`, as the forward). Under the interpreter (`interpret=True`)
the products are plain dots: it has no transposed or in-register matrix-product
operands and no layout casts; loads, barriers, schedule and masks are the kernel's own
but tails are
padded to whole tiles (`map_rows`): reading them in place runs on the GPU only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.backward import backward_statistics
from pallas_kernels.common import round_up
from pallas_kernels.masking import (FILL, MaskOperands, MaskOptions, build_ranges,
                                    query_block_order, structured_keep, visit_tiles)
from pallas_kernels.mosaic_gpu.forward import (DEFAULT_CONSUMER_REGISTERS, LOG2E,
                                               MAX_BARRIERS, SMEM_BYTES,
                                               SMEM_SLACK, MosaicConfig, _load_vector, _plgpu,
                                               check_head_dim_and_dtype, check_l2_group,
                                               check_shared_memory,
                                               compiler_params, item_coords, map_rows,
                                               pad_axis, persistent_items, smem_layout,
                                               table_head_dim)

ROWS = 64               # M of one warpgroup matrix product: key rows (dK/dV), query rows (dQ)
# Pallas places each shared-memory buffer at a 1024-byte boundary. (The pipeline's
# "loaded" barriers, two per slot or four with `stats_streamed`, are one group of
# at most MAX_BARRIERS.)
SMEM_ALIGN = 1024


def by_role(head_dim: int) -> bool:
  """Whether the dK/dV kernel splits its work by output (`_dkv_by_role`): at the head
  dims that take d = 256's tiles (`forward.table_head_dim`: above 128) a consumer's
  dK and dV of 64 keys would take 2 x 64 x d float32 / 128 threads = d registers (256
  at d = 256, more than a thread has), so one consumer holds dK and the other dV of
  the same keys; the dQ kernel (dQ alone takes d / 2) runs two consumers there where
  their rows fit shared memory (`call_config`), else one warpgroup (`dq_consumers_of`)."""
  return table_head_dim(head_dim) == 256


# Registers per consumer thread of the warp-specialised kernels after setmaxnreg:
# FlashAttention-3's backward split, 240 / 240 / 24 (the producer keeps setmaxnreg's
# floor; the forward's record checks the split). A dK/dV consumer holds dK and dV (64
# + 64 registers at d = 128) beside the tile's S^T, dP^T and their bf16 copies, and
# ptxas spilled it at the forward's 232. On the H200, fwd+bwd TF/s in one device call
# (two processes; mosaic_bwd_regs240_h200.log against mosaic_bwd_regs232_h200.log) at
# 16K d128: 527.5 against 490.1, causal 505.5 against 470.4, MQA 16/1 545.8 against
# 500.4. Three consumers (the dQ kernel's `dq_consumers=3`) take FlashAttention-3's
# three-consumer split, 160 / 160 / 160 / 32, the most a launch of four warpgroups
# leaves them beside the producer's floor (`forward.launch_registers`).
CONSUMER_REGISTERS = {2: 240, 3: DEFAULT_CONSUMER_REGISTERS[3]}


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Tiles and compile options of the Mosaic GPU backward. The dK/dV kernel's programs
  run two consumer warpgroups, each owning 64 keys, and a producer warpgroup that
  streams the query tiles both read through `stages` slots (FlashAttention-3's warp
  specialisation), the consumers at CONSUMER_REGISTERS[2]; above head_dim 128 the two
  share 64 keys by role (`by_role`).

  block_n: the N of each kernel's first products: query rows per tile in the dK/dV
    kernel (S^T is [64, block_n]), key rows per tile in the dQ kernel (S is
    [64, block_n]) unless `dq_block_n` sets those; a multiple of 64, <= 256.
  stages: shared-memory slots of the tiles a producer warpgroup streams (a dQ program
    of one warpgroup double-buffers its own).
  group_splits: programs per key tile of the dK/dV kernel, each looping over its own
    share of the GQA group's G query heads (program s of group_splits = n runs heads
    [s G / n, (s + 1) G / n)): a causal dK/dV grid of few programs then fills the GPU,
    where one wave lasts as long as its heaviest program. Each program stores float32
    partial dK and dV and flash_backward sums them in a fixed order (deterministic).
    Must divide the call's group (NotImplementedError otherwise, `check_supported`).
  dq_block_n: key rows per tile of the dQ kernel (the N of its S and dP), where it
    differs from the dK/dV kernel's block_n; None: block_n.
  dq_consumers: the dQ kernel's consumer warpgroups (`dq_consumers_of`): None takes
    two, or one at the head dims split by role (dQ alone holds d / 2 registers per
    thread, and at d = 256 two consumers' Q and dO beside two K/V slots exceed shared
    memory). 1: one warpgroup streams its own key tiles. 2 or 3: a producer
    warpgroup streams K and V to consumers of 64 query rows each; three at
    CONSUMER_REGISTERS[3], up to head_dim 128.
  dq_rows_in_registers: the dQ kernel's consumers hold their fixed Q and dO rows in
    registers, as the A operands of S = Q K^T and dP = dO V^T, so that those products
    read only K and V from shared memory: a product m64nNk16 with both operands in
    shared memory reads (64 + N) x 16 x 2 bytes per 64 N 16 multiply-adds, at N = 64
    all of shared memory's 128 bytes per cycle (32 banks of 4 bytes) at the tensor
    cores' dense rate; with A in registers, half of it.
  persistent: each kernel launches one program per multiprocessor, which loops over
    the work items (key tiles of the dK/dV kernel, query blocks of the dQ kernel, by
    head and batch; `scheduler.item_coords` orders them), so that the producer's loads
    of the next item's streamed tiles overlap this item's last products and its
    stores, and no partial last wave is launched. Under jax.vmap the launch's batching
    rule adds a grid axis: one persistent grid per mapped problem. Not with
    dq_consumers=1, not at the head dims split by role.
  stats_streamed: the dK/dV kernel's producer also streams each query tile's lse and
    delta ([block_n] float32 each) into shared-memory slots beside Q and dO, and the
    consumers read lse after S^T's product and delta after dP^T's (JAX's Mosaic GPU
    kernel), in place of loading both at the tile's start, where they stay live in
    registers through the tile's products. Not at the head dims split by role.
  dkv_p_under_dp: the dK/dV kernel issues dP^T = V dO^T right behind S^T = K Q^T and
    waits for S^T alone, so that P^T's exponentials run under the dP^T product; dV +=
    P^T dO is issued once both are waited for, and dS'^T computed under it
    (FlashAttention-3's order). False issues dP^T after P^T, with dV behind it
    (tokamax's order). Not at the head dims split by role.
  dq_p_under_dp: the dQ kernel waits for S = Q K^T alone of the two products it issues
    back to back, so that P's exponentials run under dP = dO V^T; False waits for both.
  l2_group: with `persistent` and a causal mask, each kernel's tiles (key tiles of the
    dK/dV kernel, query blocks of the dQ kernel) go to the programs in groups of this
    many consecutive ones of one head (`scheduler.item_coords`), so that programs
    running at once share that head's streamed tiles in L2; 1: one head per program of
    a round. No other grid reads it.
  """

  block_n: int = 64
  stages: int = 2
  group_splits: int = 1
  dq_block_n: int | None = None
  dq_consumers: int | None = None
  dq_rows_in_registers: bool = False
  persistent: bool = False
  stats_streamed: bool = False
  dkv_p_under_dp: bool = False
  dq_p_under_dp: bool = False
  l2_group: int = 1

  def __post_init__(self):
    if not isinstance(self.block_n, int) or self.block_n % 64 or not 0 < self.block_n <= 256:
      raise ValueError(f"block_n={self.block_n!r} must be 64, 128, 192 or 256")
    if not isinstance(self.stages, int) or self.stages < 2:
      raise ValueError(f"stages={self.stages!r} must be an int >= 2")
    if self.dq_block_n is not None and (not isinstance(self.dq_block_n, int)
                                        or self.dq_block_n % 64 or not 0 < self.dq_block_n <= 256):
      raise ValueError(f"dq_block_n={self.dq_block_n!r} must be None, 64, 128, 192 or 256")
    for name in ("dq_rows_in_registers", "persistent", "stats_streamed", "dkv_p_under_dp",
                 "dq_p_under_dp"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
    if isinstance(self.group_splits, bool) or not isinstance(self.group_splits, int) \
        or self.group_splits < 1:
      raise ValueError(f"group_splits={self.group_splits!r} must be a positive int")
    if self.dq_consumers is not None and (isinstance(self.dq_consumers, bool)
                                          or self.dq_consumers not in (1, 2, 3)):
      raise ValueError(f"dq_consumers={self.dq_consumers!r} must be None, 1, 2 or 3")
    check_l2_group(self.l2_group)
    if self.persistent and self.dq_consumers == 1:
      raise ValueError("persistent=True runs programs of a producer and consumers: "
                       "dq_consumers=1 needs persistent=False")
    per_slot, why = (4, "four per slot with stats_streamed") if self.stats_streamed else (
        2, "two per slot")
    if per_slot * self.stages > MAX_BARRIERS:
      raise ValueError(f"stages={self.stages} needs {per_slot * self.stages} \"loaded\" "
                       f"barriers ({why}); Mosaic GPU allocates at most {MAX_BARRIERS} "
                       f"in a group")


# Two consumer warpgroups and a producer per program (warp specialisation), from fwd+bwd
# timings on the H200 (bf16, head_dim 128) at the consumers' CONSUMER_REGISTERS: ahead
# of one warpgroup per program with one key head per query head (16K d128 486.9
# against 470.5 TF/s at the forward's 232 registers, mosaic_backward_check_h200_ws.json)
# and, at 240, with grouped heads too (mosaic_backward_consumers_regs240_h200.json:
# GQA 32/8 8K 526.3 against 508.5, causal 500.8 against 483.3; MQA 16/1 16K 553.4
# against 520.4).
#
# A causal dK/dV grid of few programs lasts as long as its heaviest (the key tile
# whose rows every query sees), so a causal call whose grid has fewer than
# CAUSAL_MIN_PROGRAMS programs splits its GQA group over more (`group_splits`, the
# fewest that reach it): MQA 16/1 16K causal, 128 programs, ran 385.9 TF/s unsplit and
# 523.5 in 4 x 128 (the same file), where GQA 32/8 8K causal, 512 programs unsplit,
# ran 500.8 against 491.8 split in four.
CAUSAL_MIN_PROGRAMS = 512

# Above head_dim 128 (`by_role`) the dQ kernel's two consumers and a producer, on key
# tiles of 64 (ROWS) where both consumers' Q and dO fit shared memory beside the K/V
# slots (up to d = 224 at stages 2, d = 176 at 3; one warpgroup at d 240-256), against
# one warpgroup streaming its own tiles. fwd+bwd TF/s on the H200 at 4K d192 (batch 4,
# 8 heads), two processes (mosaic_bwd_dq2_d192_time_h200.json, ..._time2_h200.json):
# 433.1 / 433.6 against 388.6 / 382.7, causal 399.0 / 397.2 against 362.9 / 360.8
# (cuDNN 373.8 / 372.4, causal 330.4 / 329.9); gradients within the rule at d160 and
# d192 (mosaic_backward_check_dq2_h200.json). One warpgroup's dQ program loads its K
# and V tiles between its own products; two consumers share a producer's stream.
DQ_CONSUMERS_ABOVE_128 = 2

# At head_dim 128 and those that take its tiles, without a causal mask, the dQ kernel's
# three consumers (192 query rows per program on one producer's K and V stream, at
# CONSUMER_REGISTERS[3], their Q and dO in shared memory) against two with their rows in
# registers. fwd+bwd TF/s on the H200, one process, 5 rounds, the benchmark's input
# rotation (mosaic_bwd_dq3_time_h200.json): 16K d128 546.4 against 538.9, 2K 470.4
# against 462.8, 1K 409.6 against 409.6, GQA 32/8 8K 532.2 against 523.4, MQA 16/1 16K
# 555.2 against 546.5, T = S = 3000 482.2 against 472.4, the decoder LM's shape
# unmasked 475.6 against 477.4; off the table (mosaic_bwd_dq3_off_table_time_h200.json)
# 4K d96 460.3 against 447.7, d80 405.9 against 380.0, GQA 32/8 8K d96 464.8 against
# 455.8, 1K d96 368.2 against 354.6. With a causal mask within two calls' spread
# (mosaic_bwd_dq3_causal_time_h200.json: 16K 534.4 against 531.6, GQA 32/8 8K 510.7
# against 505.7, MQA 16/1 16K 539.9 against 528.3; an earlier call, mosaic_notes.md:
# 16K 529.6 against 533.5, MQA 533.8 against 526.7) and slower on the decoder LM's
# shape in a third call, 7 rounds (mosaic_bwd_dq3_causal_time2_h200.json: 432.9 against
# 455.6; the LM itself 1.015x cuDNN's tokens/s against 1.033x,
# seq_scaling_gpu_lm_dq3_causal.json and seq_scaling_gpu_lm.json), so causal calls keep
# two. A dQ program reads each K and V tile once for all its rows: three consumers for
# 192 rows, two for 128. At 160 registers the rows cannot also sit in registers (16K
# d128 427.6 against 550.6, mosaic_bwd_dq3_rows_in_registers_time_h200.json).
DQ_CONSUMERS_AT_128 = 3

# At head_dim 64, unless the caller set block_n, dq_block_n or stats_streamed: with two
# consumers, tiles of 128 in both kernels (query rows of the dK/dV kernel, key rows of
# the dQ kernel) with lse and delta streamed (`stats_streamed`), JAX's Mosaic GPU
# kernel's tiles; otherwise the dQ kernel's key tiles alone (the head dims below, which
# take d = 64's tiles, keep 64 until run on the H200 with these). Twice the rows per
# tile halve the slot barriers and matrix-product waits per unit of work; the 128-row
# dK/dV tile fits the consumers' 240 registers only with lse and delta read from shared
# memory after the products that need them (ptxas: 28 bytes spilled,
# experiments/results/ptxas_h200/bwd_d64/), where loading them at the tile's start kept
# 2 x 128 / 128 more registers live through it (283 TF/s against 331 in an earlier try).
# fwd+bwd TF/s on the H200 at 4K d64 (batch 4, 32 heads), alternating rounds of one
# process (mosaic_bwd_stats_streamed_time_h200.json): 419.1 against 385.9 with dQ key
# tiles of 128 alone, 398.0 with lse and delta streamed on 64-row tiles, 376.8 for the
# Triton backward and 435.2 for cuDNN; causal 327.5 against 315.1, 325.9, 331.4 and
# 375.3. At head_dim 128 the same tiles lose (16K: 416.3 against 539.8; streamed on
# 64-row tiles 524.1). Gradients within the rule with these tiles at d 64 and 128
# (mosaic_bwd_stats_streamed_check_h200.json: 15/15).
BLOCK_N_AT_64 = 128


def stream_slots(consumers: int, stages: int) -> int:
  """Shared-memory slots of a kernel's streamed tiles: `stages` behind a producer
  warpgroup, two (double buffering) for one warpgroup that streams its own."""
  return 2 if consumers == 1 else stages


def dq_consumers_of(head_dim: int, config: BackwardConfig) -> int:
  """The dQ kernel's consumer warpgroups: `dq_consumers`, or by default two, and one at
  the head dims split by role (`BackwardConfig.dq_consumers`)."""
  if config.dq_consumers is not None:
    return config.dq_consumers
  return 1 if by_role(head_dim) else 2


def dkv_keys(head_dim: int, config: BackwardConfig) -> int:
  """Keys per dK/dV program: 64 per consumer, or 64 shared by the two split by role."""
  return ROWS if by_role(head_dim) else 2 * ROWS


def dkv_programs(B: int, K: int, S: int, head_dim: int, config: BackwardConfig) -> int:
  """Programs of the dK/dV grid: batch x key heads x key tiles x group splits."""
  return B * K * -(-S // dkv_keys(head_dim, config)) * config.group_splits


def persistent_wins(*, causal: bool, group: int, head_dim: int) -> bool:
  """Where the persistent grids (`BackwardConfig.persistent`) are the default: one key
  head per query head without a causal mask, and at head_dim 64 also with a causal
  mask and for groups of up to 4 query heads per key head (the groups timed there; MQA
  and larger groups keep the launched grids, as at d128). fwd+bwd TF/s against the
  launched grids, two calls of one process each on the H200
  (mosaic_bwd_persistent_h200.json and its _run1): 1K d128 (batch 16) 419.7 / 422.0
  against 376.7 / 375.7, where each program's fixed loads and stores weigh on 16 query
  tiles; 16K d128 548.2 / 539.7 against 534.9 / 531.5; the decoder LM's shape
  487.7 / 494.9 against 488.3 / 484.3. At d128 slower with grouped heads (GQA 32/8 8K
  516.9 against 534.7, MQA 16/1 16K 549.2 / 548.3 against 554.3 / 553.0: a dK/dV item
  runs the group's heads, and long items leave the last round uneven) and with a
  causal mask even in the snake order (`item_schedule`: 16K 518.3 against 531.1, the
  LM's 436.6 against 444.8, whose launched grid the hardware schedules heaviest first
  as programs finish; level at 1K causal, 277.8 / 279.9 against 275.0 / 274.4). At
  d = 64 (BLOCK_N_AT_64's tiles: a causal dQ program of the 4K cell does an eighth of
  a 16K d128 one's work, so its fixed loads, first tiles and stores weigh more) faster
  or level in every cell timed, two calls (mosaic_bwd_d64_causal_dq_variants_h200.json,
  3 rounds / mosaic_bwd_d64_persistent_time_h200.json, 5): 4K causal 341.5 / 334.2
  against 333.2 / 331.4, GQA 32/8 4K 408.5 / 407.0 against 397.5 / 394.9, causal
  350.3 / 358.4 against 346.2 / 351.9, 1K causal 228.9 / 228.6 against 217.5 / 218.2,
  2K causal 289.4 against 282.3; 16K causal (batch 1, 32 heads) level, 385.4 against
  387.6."""
  return (not causal and group == 1) or (head_dim == 64 and group <= 4)


# On a causal persistent grid, `item_coords` gives a round of programs one work item
# per (batch, key head) pair in plain order: with as many pairs as programs, none of
# the round's Q/dO (dK/dV kernel) or K/V (dQ kernel) tiles is read twice through L2.
# At head_dim 64 (where it was timed), from L2_GROUP_MIN_PAIRS pairs the tiles go out
# in groups of L2_GROUP per head (`l2_group`). fwd+bwd TF/s on the H200, one process
# (mosaic_bwd_d64_l2_group_h200.json): 4K d64 causal (4 x 32 pairs) 341.0 with groups
# of 8 and 339.1 of 4 against 331.2 (cuDNN 370.4; in the next call, 5 rounds, 343.9
# against 332.1, mosaic_bwd_d64_l2_group_time_h200.json); GQA 32/8 4K d64 causal
# (4 x 8 pairs, so a round already holds about four items of each) 351.5 and 350.0
# against 359.0: there the groups only cost the snake's balance (`item_coords`).
# Groups of 16 ran level at 4K (343.5 against 347.8, mosaic_bwd_l2_group16_time_h200
# .json), and so did the groups of 8 with the items balanced across the programs by a
# trace-time greedy table instead of the snake rounds (341.7 against 340.3,
# mosaic_bwd_greedy_time_h200.json), which lost 3-5% where the snake was balanced
# already (GQA 32/8 4K, groups of one; 2K; built and removed, notes of session 26).
L2_GROUP, L2_GROUP_MIN_PAIRS = 8, 128


# Both kernels' score products issued before the softmax (`dkv_p_under_dp`,
# `dq_p_under_dp`) on d = 64's tiles (128 query rows, lse and delta streamed, two
# consumers). fwd+bwd TF/s against the order before (P after dP's product was issued) in
# one process on an H100 (jax 0.11.2; mosaic_bwd_p_under_dp_time_h100.json,
# mosaic_bwd_dq_p_under_dp_d64_time_h100.json, mosaic_bwd_p_under_dp_d64_more_time_h100.json;
# persistent grids, one group split), two calls at 4K: 416.2 and 423.9 against 413.0
# and 420.4, causal 361.8 and 359.6 against 343.2 and 344.8; causal GQA 32/8 4K 377.5
# against 351.8, MHA 16K 427.1 against 382.5 and 1K 242.1 against 233.9. The launched
# grids and group splits take it untimed (the order is within a consumer's tile). On
# the H200 (mosaic_bwd_p_under_dp_d64_time_h200.json): 4K 427.0 against 422.9, causal
# 365.8 against 344.3, causal GQA 32/8 4K 385.6 against 360.5, causal 16K 410.9 against
# 390.8. With a causal mask both flags beat either alone wherever one alone was timed,
# except 16K on the H200 (the dK/dV kernel's alone 416.1, one call of 3 rounds);
# without one, both and each alone are within 1% in each call (on the H100 the flags
# alone ran in separate calls: 4K 418.0 with the dK/dV kernel's against 416.2 with
# both, 422.7 with the dQ kernel's against 423.9). At head_dim 128 slower: on the H100
# 16K 512.4 against 541.0, the dK/dV kernel's flag alone 533.9; on the H200 that flag
# alone 542.2 against 553.0 (causal 511.2 against 525.3), the dQ kernel's alone 543.9
# against 549.6.
P_UNDER_DP = ("dkv_p_under_dp", "dq_p_under_dp")


def call_config(q_shape, k_shape, itemsize: int, *, causal: bool, **fields) -> BackwardConfig:
  """The backward's config for a call of q [B, T, N, H] and k [B, S, K, H]: the
  caller's BackwardConfig `fields` over two consumers; at head_dim 64, unless the
  caller set block_n, dq_block_n or stats_streamed, tiles of BLOCK_N_AT_64
  (`tiles_at_64`) and, where both kernels take them, P under dP in both (P_UNDER_DP,
  each unless the caller set it); unless the caller set dq_rows_in_registers, the dQ
  kernel's rows in registers where it runs with two (`dq_consumers_of`; not at the
  head dims split by role, where dQ alone takes d / 2 registers, nor with fused_dq,
  where no dQ kernel runs); unless the caller set persistent, the persistent grids
  where they measured faster (`persistent_wins`: one key head per query head without a
  causal mask; at head_dim 64 groups of up to 4, causal or not) and both kernels run two
  consumers, at head_dim 64 causal ones in groups of L2_GROUP tiles per head from
  L2_GROUP_MIN_PAIRS (batch, key head) pairs unless the caller set l2_group;
  unless the caller set dq_consumers or dq_rows_in_registers, at head_dim 128 and those
  that take its tiles (80-128) without a causal mask, with two dK/dV consumers and a dQ
  kernel, the dQ kernel's DQ_CONSUMERS_AT_128 (rows in shared memory) where they fit
  shared memory;
  unless the caller set dq_consumers, above head_dim 128 the dQ kernel's
  DQ_CONSUMERS_ABOVE_128 on key tiles of 64 where they fit shared memory; for a
  causal call whose dK/dV grid has fewer than CAUSAL_MIN_PROGRAMS programs and no
  group_splits of the caller's, the fewest splits of its GQA group (N / K query heads)
  that reach it, or the most that fit shared memory. (Under jax.vmap, B is one
  problem's batch: the grid is then larger than counted, and the split at most larger
  than needed.)"""
  B, S, K, H = k_shape
  group = q_shape[2] // K
  config = BackwardConfig(**fields)
  if (H == 64
      and not {"block_n", "dq_block_n", "stats_streamed"} & set(fields)):
    config = tiles_at_64(config, itemsize)
    if config.stats_streamed:      # both kernels on d = 64's tiles, as timed
      config = dataclasses.replace(
          config, **{f: True for f in P_UNDER_DP if f not in fields})
  if (by_role(H) and "dq_consumers" not in fields
      and (config.dq_block_n or config.block_n) == ROWS):
    config = where_it_fits(config, H, itemsize, dq_consumers=DQ_CONSUMERS_ABOVE_128)
  if (table_head_dim(H) == 128 and not causal
      and not {"dq_consumers", "dq_rows_in_registers"} & set(fields)):
    config = where_it_fits(config, H, itemsize, dq_consumers=DQ_CONSUMERS_AT_128)
  # Against Q and dO read from shared memory, fwd+bwd in alternating rounds of one
  # process on the H200 (ab_dq_rows_in_registers_h200.json): 16K d128 1.009x, causal
  # 1.027x, GQA 32/8 8K causal 1.026x, MQA 16/1 16K causal 1.019x, the decoder LM's
  # attention 1.015x.
  if (dq_consumers_of(H, config) == 2 and not by_role(H)
      and "dq_rows_in_registers" not in fields):
    config = dataclasses.replace(config, dq_rows_in_registers=True)
  if (persistent_wins(causal=causal, group=group, head_dim=H)
      and dq_consumers_of(H, config) >= 2 and not by_role(H)
      and "persistent" not in fields):
    config = dataclasses.replace(config, persistent=True)
  if (causal and config.persistent and H == 64 and "l2_group" not in fields
      and B * K >= L2_GROUP_MIN_PAIRS):
    config = dataclasses.replace(config, l2_group=L2_GROUP)
  if causal and "group_splits" not in fields and not by_role(H):
    for splits in (d for d in range(2, group + 1) if group % d == 0):
      if dkv_programs(B, K, S, H, config) >= CAUSAL_MIN_PROGRAMS:
        break
      split = dataclasses.replace(config, group_splits=splits)
      if smem_bytes(H, itemsize, split) > SMEM_BYTES:
        break
      config = split
  return config


# Query and key lengths from which the Mosaic GPU backward runs ahead of the Triton one
# (fwd+bwd on the H200, bf16, both timed in one process; docs/notes/mosaic.md has the
# figures). Shorter calls spread each program's fixed loads, pipeline fill and stores
# over fewer tiles.
MHA_MIN_SEQ = 2048              # one key head per query head, head_dim 80-128, launched grids
MHA_PERSISTENT_MIN_SEQ = 1024   # ... on the persistent grids (no partial last wave)
BY_ROLE_MIN_SEQ = 1024          # head dims split by role (above 128): the shortest timed
D64_MIN_SEQ = 1024              # head_dim 64, one key head per query head
D64_CAUSAL_MIN_SEQ = 4096       # ... with a causal mask (shorter, the Triton one leads)
D64_GROUPED_MIN_SEQ = 4096      # ... grouped heads: the length timed


def mosaic_backward_wins(q_shape, k_shape, *, causal: bool, config: BackwardConfig) -> bool:
  """Whether the Mosaic GPU backward at `config` (the call's `call_config`) runs ahead of
  the Triton backward for a call of q [B, T, N, H] and k [B, S, K, H]:
  - not when the call is causal and its dK/dV grid has fewer than CAUSAL_MIN_PROGRAMS
    programs: a causal program's work grows with its key tile's distance from the end,
    and one wave of a few hundred programs lasts as long as the heaviest;
  - above head_dim 128 (split by role) from BY_ROLE_MIN_SEQ rows;
  - at head dims that take d = 64's tiles only at 64 itself (the 128-row tiles have not
    run below it), from D64_MIN_SEQ, D64_CAUSAL_MIN_SEQ or D64_GROUPED_MIN_SEQ rows;
  - at 80-128 always for grouped heads (the dK/dV program runs the group's query heads
    against K and V held in shared memory), and for one key head per query head from
    MHA_MIN_SEQ rows (MHA_PERSISTENT_MIN_SEQ on the persistent grids)."""
  B, S, K, H = k_shape
  T, grouped = q_shape[1], q_shape[2] > K
  if causal and dkv_programs(B, K, S, H, config) < CAUSAL_MIN_PROGRAMS:
    return False
  if by_role(H):
    return min(T, S) >= BY_ROLE_MIN_SEQ
  if table_head_dim(H) == 64:
    min_seq = (D64_GROUPED_MIN_SEQ if grouped else
               D64_CAUSAL_MIN_SEQ if causal else D64_MIN_SEQ)
    return H == 64 and min(T, S) >= min_seq
  return grouped or min(T, S) >= (MHA_PERSISTENT_MIN_SEQ if config.persistent
                                  else MHA_MIN_SEQ)


def where_it_fits(config: BackwardConfig, head_dim: int, itemsize: int,
                  **changes) -> BackwardConfig:
  """`config` with `changes` where that fits shared memory (`smem_bytes`), else `config`."""
  changed = dataclasses.replace(config, **changes)
  return changed if smem_bytes(head_dim, itemsize, changed) <= SMEM_BYTES else config


def tiles_at_64(config: BackwardConfig, itemsize: int) -> BackwardConfig:
  """`config` with d = 64's default tiles (BLOCK_N_AT_64): both kernels' with lse and
  delta streamed where that form runs (the caller's stages within its "loaded"
  barriers and shared memory), else the dQ kernel's alone."""
  try:
    streamed = dataclasses.replace(config, block_n=BLOCK_N_AT_64, stats_streamed=True)
  except ValueError:   # four "loaded" barriers per slot: the stages exceed MAX_BARRIERS
    streamed = None
  if streamed is not None and smem_bytes(64, itemsize, streamed) <= SMEM_BYTES:
    return streamed
  return dataclasses.replace(config, dq_block_n=BLOCK_N_AT_64)


def smem_bytes(head_dim: int, itemsize: int, config: BackwardConfig) -> int:
  """Shared memory of the larger of the two kernels' programs: each consumer's two
  fixed 64-row tiles and the two streamed operands' slots (block_n rows in the dK/dV
  kernel, `dq_block_n` in the dQ kernel, whose consumers `dq_consumers_of` counts),
  plus the forward's slack for barriers and alignment; with `group_splits` > 1, each
  consumer's float32 tile of partial dK, then dV, on the way to global memory; with
  `stats_streamed`, the lse and delta slots."""
  slots = config.stages
  tile = ROWS * head_dim * itemsize
  streamed = lambda rows, slots=slots: slots * 2 * rows * head_dim * itemsize
  dq_rows = config.dq_block_n or config.block_n
  partial = 2 * ROWS * head_dim * 4 if config.group_splits > 1 else 0
  dq_c = dq_consumers_of(head_dim, config)
  # dQ: each consumer's Q and dO, and the K, V slots.
  dq = dq_c * 2 * tile + streamed(dq_rows, stream_slots(dq_c, config.stages))
  if by_role(head_dim):
    # dK/dV: K and V once (one consumer each), two slots of the P^T tile and one of the
    # float32 dP^T tile they pass each other.
    passed = ROWS * config.block_n * (2 * itemsize + 4)
    dkv = 2 * tile + streamed(config.block_n) + passed + partial
    return max(dkv, dq) + SMEM_SLACK
  fixed = 2 * 2 * tile
  if config.stats_streamed:    # lse and delta slots beside Q and dO, each buffer aligned
    fixed += 2 * round_up(slots * config.block_n * 4, SMEM_ALIGN)
  dkv = fixed + streamed(config.block_n) + partial
  return max(dkv, dq) + SMEM_SLACK


def by_role_error(head_dim: int, config: BackwardConfig) -> str | None:
  """Why the backward cannot run `config` at `head_dim`, or None: split by role
  (`by_role`), the dK/dV kernel runs no group split (its float32 partial tiles of
  64 x 256 would not fit shared memory either), no persistent grid and its own tile
  loop."""
  if by_role(head_dim) and (config.group_splits != 1 or config.dq_rows_in_registers
                            or config.persistent or config.stats_streamed
                            or config.dkv_p_under_dp):
    return (f"the Mosaic GPU backward at head_dim={head_dim} runs two consumers, one "
            f"holding dK and one dV, no group split, no fixed rows in registers, no "
            f"persistent grid and its own tile loop: got "
            f"group_splits={config.group_splits}, "
            f"dq_rows_in_registers={config.dq_rows_in_registers}, "
            f"persistent={config.persistent}, stats_streamed={config.stats_streamed}, "
            f"dkv_p_under_dp={config.dkv_p_under_dp}")
  return None


def group_split_error(group: int, splits: int) -> str | None:
  """Why `splits` programs cannot share a GQA group of `group` query heads, or None:
  each program runs group / splits of them."""
  if group % splits:
    return f"group_splits={splits} does not divide the GQA group of {group}"
  return None


def check_supported(q, k, v, config: BackwardConfig):
  """Raises NotImplementedError naming what these kernels cannot run."""
  check_head_dim_and_dtype(q, "backward")
  if config.dq_consumers == 3 and q.shape[-1] > 128:
    # As the forward's three consumers (forward.check_supported): ptxas holds their
    # products to a launch of four warpgroups' 128 registers per thread, and only what
    # ran on the H200 with three is taken, up to head_dim 128.
    raise NotImplementedError(f"dq_consumers=3 supports head_dim <= 128, got "
                              f"head_dim={q.shape[-1]}")
  why = by_role_error(q.shape[-1], config)
  if why:
    raise NotImplementedError(why)
  why = group_split_error(q.shape[2] // k.shape[2], config.group_splits)
  if why:
    raise NotImplementedError(f"{why} query heads per key head ({q.shape[2]} query heads, "
                              f"{k.shape[2]} key heads)")
  check_shared_memory(config, q.shape[-1], smem_bytes(q.shape[-1], q.dtype.itemsize, config))


class _Products:
  """Warpgroup matrix products, or plain dots under the interpreter. `a` is a value in
  registers or a shared-memory ref, `b` a shared-memory ref, used as b^T with `b_t` (a
  transposed view: no data moves). Running sums live in `accumulators` (float32 refs:
  the matrix-product accumulator registers on the GPU, shared memory under the
  interpreter) and are added to asynchronously by `issue`; `wait` waits for every
  product in flight."""

  def __init__(self, interpret, scratch=None):
    self.interpret = interpret
    self.scratch = scratch      # interpreter: [accumulator, consumer, rows, cols] float32

  @staticmethod
  def _dot(a, b, b_t):
    a, b = a[...], b[...]         # a ref or a value alike
    return jnp.dot(a, b.T if b_t else b, preferred_element_type=jnp.float32)

  @staticmethod
  def _t(ref, transposed):
    return _plgpu().transpose_ref(ref, (1, 0)) if transposed else ref

  def fresh(self, a, b, shape, *, b_t=False):
    """a @ b(^T) into a new float32 accumulator, waited for."""
    return self.fresh_pair(a, b, None, None, shape, b_t=b_t)[0]

  def fresh_pair(self, a1, b1, a2, b2, shape, *, b_t=False, under_second=None):
    """(a1 @ b1(^T), a2 @ b2(^T)), issued back to back, then both waited for (the
    second product's issue does not wait for the first's result). a2 None: one.
    `under_second`: a function of the first result, run after waiting for the first
    product alone, so that it runs under the second; (its value, the second) returned."""
    assert under_second is None or a2 is not None, "under_second runs under a second product"
    after = under_second or (lambda first: first)
    if self.interpret:
      return after(self._dot(a1, b1, b_t)), (None if a2 is None else self._dot(a2, b2, b_t))
    plgpu = _plgpu()

    def run(acc1, acc2):
      plgpu.wgmma(acc1, a1, self._t(b1, b_t))
      if a2 is not None:
        plgpu.wgmma(acc2, a2, self._t(b2, b_t))
      if under_second is None:
        return acc1[...], (None if a2 is None else acc2[...])
      first = after(plgpu.wgmma_accumulator_load(acc1, wait_n=1))
      return first, plgpu.wgmma_accumulator_load(acc2, wait_n=0)
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))

  def fresh_under(self, a, b, shape, *, b_t, then):
    """a @ b(^T) into a new accumulator, with `then` = (acc, a2, b2), acc += a2 @ b2,
    issued right after it and left in flight: only the first is waited for, so the
    caller's next instructions run under the second (FlashAttention-3's overlap of
    dP^T with the dV product in the backward)."""
    acc, a2, b2 = then
    if self.interpret:
      acc[...] += self._dot(a2, b2, False)
      return self._dot(a, b, b_t)
    plgpu = _plgpu()

    def run(fresh):
      plgpu.wgmma(fresh, a, self._t(b, b_t))
      plgpu.wgmma(acc, a2, b2)
      return plgpu.wgmma_accumulator_load(fresh, wait_n=1)
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

  def issue(self, acc, a, b):
    """acc += a @ b, left in flight on the GPU."""
    if self.interpret:
      acc[...] += self._dot(a, b, False)
    else:
      _plgpu().wgmma(acc, a, b)

  def wait(self):
    if not self.interpret:
      _plgpu().wgmma_wait(0)

  def accumulators(self, shape, count, body, consumer=0):
    """Runs body(*refs) with `count` zeroed float32 accumulators of `shape` and returns
    their final values. (The interpreter allocates shared memory only for all
    warpgroups at once, so there they are slices of the kernel's `scratch`.)"""
    plgpu = _plgpu()
    if self.interpret:
      refs = [self.scratch.at[a, consumer] for a in range(count)]
      for ref in refs:
        ref[...] = jnp.zeros(shape, jnp.float32)
      body(*refs)
      return tuple(ref[...] for ref in refs)

    def run(*refs):     # ACC scratch starts at zero
      body(*refs)
      return tuple(plgpu.wgmma_accumulator_load(ref) for ref in refs)
    return pl.run_scoped(run, *[plgpu.ACC(shape, jnp.float32)] * count)


def _logits(s, opts: MaskOptions, scale):
  """(s, t, c): base-2 logits are s * c; t = tanh of the soft cap (for its derivative)
  or None. As in the forward, a soft cap or a scale <= 0 is applied to s first."""
  if opts.soft_cap is not None:
    t = jnp.tanh(s * (scale / opts.soft_cap))
    return opts.soft_cap * t, t, LOG2E
  if scale * LOG2E > 0:
    return s, None, scale * LOG2E
  return s * scale, None, LOG2E


def _tile_p(s, lse2, *, opts, scale, keep):
  """(P, t) of one tile from the raw product s and the per-query lse2 (broadcast to the
  tile); t is the soft cap's tanh (for dS') or None. A hidden key has P = 0 even on a
  row whose lse is NaN, so a NaN reaches only the gradients of the keys its row sees."""
  s, t, c = _logits(s, opts, scale)
  if keep is not None:
    s = jnp.where(keep, s, -jnp.inf)
  p = jnp.exp2(s * c - lse2)      # lse2 = +inf on rows with no visible key: P = 0
  if keep is not None:
    p = jnp.where(keep, p, 0.0)
  return p, t


def _tile_ds(p, t, dp, delta):
  """dS' = P * (dP - delta), times the soft cap's derivative 1 - tanh^2."""
  ds = p * (dp - delta)
  if t is not None:
    ds = ds * (1.0 - t * t)       # d(cap tanh(x / cap)) / dx
  return ds


def _layouts(interpret, shape):
  """(iota, row layout, column layout) of a [rows, cols] accumulator tile."""
  if interpret:
    return (lambda d: lax.broadcasted_iota(jnp.int32, shape, d)), None, None
  plgpu = _plgpu()
  wgmma = plgpu.Layout.WGMMA
  return (lambda d: plgpu.broadcasted_iota(jnp.int32, shape, d, layout=wgmma),
          wgmma.reduce(1), wgmma.reduce(0))


def _row(ranges, b, i):
  """(lo, full_lo, full_hi, hi) of one block's row of the per-tile schedule."""
  return tuple(ranges[b, i, t] for t in range(4))


def _load_tile(src, dst, barrier):
  _load_tiles([(src, dst, barrier)])


def _load_tiles(loads):
  """Copies each (src, dst, barrier) of `loads` to shared memory, all issued before the
  first is waited for: their latencies overlap."""
  plgpu = _plgpu()
  for src, dst, barrier in loads:
    plgpu.copy_gmem_to_smem(src, dst, barrier)
  for _, _, barrier in loads:
    plgpu.barrier_wait(barrier)


class _Stream:
  """Two streamed operands (Q and dO, or K and V) in two shared-memory slots: the tile
  after the current one is copied into the other slot while this one is computed on
  (double buffering). The other slot held the previous tile, whose products were all
  waited for (`_Products.wait` at the end of each tile) before the next copy is issued. Each slot's
  barriers complete once per copy and are waited on once per tile."""

  def __init__(self, srcs, smems, loaded):
    self.srcs, self.smems, self.loaded = srcs, smems, loaded   # loaded: [operand, slot]

  def start(self, slot, *coords):
    plgpu = _plgpu()
    for a, (src, smem) in enumerate(zip(self.srcs, self.smems)):
      plgpu.copy_gmem_to_smem(src(*coords), smem.at[slot], self.loaded.at[2 * a + slot])

  def wait(self, slot):
    plgpu = _plgpu()
    for a in range(len(self.srcs)):
      plgpu.barrier_wait(self.loaded.at[2 * a + slot])
    return tuple(smem.at[slot] for smem in self.smems)


def _load_fixed(loads):
  """A work item's fixed tiles, each (src, dst, barrier), one tile loaded and waited
  for at a time."""
  for load in loads:
    _load_tiles([load])


def _store_outputs(stores):
  """A work item's outputs, each (x, smem, dst) through its own tile, each stored and
  waited for in full."""
  for store in stores:
    _store_tiles([store])


def _store_tile(x, smem, dst, read_only=False):
  _store_tiles([(x, smem, dst)], read_only)


def _store_tiles(stores, read_only=False):
  """Stores each (x, smem, dst) of `stores` through its shared-memory tile, all copies
  issued before one wait: for their completion, or with `read_only` only until the
  copy engine has read shared memory, which may then be rewritten (the global writes
  complete with the kernel: CUTLASS's Hopper epilogues end on the same wait,
  `tma_store_wait<0>`, cp.async.bulk.wait_group.read, and so does JAX's persistent
  Mosaic GPU matmul, `hopper_matmul_mgpu.py`, which also reuses its output tile after
  it)."""
  plgpu = _plgpu()
  for x, smem, _ in stores:
    smem[...] = x.astype(smem.dtype)
  plgpu.commit_smem()
  for _, smem, dst in stores:
    plgpu.copy_smem_to_gmem(smem, dst)
  plgpu.wait_smem_to_gmem(0, wait_read_only=read_only)


class _Pipeline:
  """Streamed operands in `stages` shared-memory slots between a producer warpgroup,
  which only issues the bulk copies, and consumer warpgroups that all read every tile
  (FlashAttention-3, section 3.1): slot t % stages holds tile t; its "loaded" barriers
  complete when the copy engine has written it, its "consumed" barrier when every
  consumer has released it (one arrival each). Each completion is waited on exactly
  once: "loaded" by each consumer, "consumed" by the producer before it refills the
  slot, or in `drain` for the last tiles."""

  def __init__(self, srcs, smems, loaded, consumed, stages):
    self.srcs, self.smems, self.stages = srcs, smems, stages
    self.loaded, self.consumed = loaded, consumed          # loaded: [operand, slot]

  def produce(self, t, *coords):
    plgpu = _plgpu()
    slot = lax.rem(t, self.stages)

    @pl.when(t >= self.stages)        # the slot held tile t - stages: wait until released
    def _():
      plgpu.barrier_wait(self.consumed.at[slot])
    for a, (src, smem) in enumerate(zip(self.srcs, self.smems)):
      plgpu.copy_gmem_to_smem(src(*coords), smem.at[slot],
                              self.loaded.at[a * self.stages + slot])

  def acquire(self, t):
    plgpu = _plgpu()
    slot = lax.rem(t, self.stages)
    for a in range(len(self.smems)):
      plgpu.barrier_wait(self.loaded.at[a * self.stages + slot])
    return tuple(smem.at[slot] for smem in self.smems)

  def release(self, t):
    _plgpu().barrier_arrive(self.consumed.at[lax.rem(t, self.stages)])

  def drain(self, total):
    def wait(t, _):
      _plgpu().barrier_wait(self.consumed.at[lax.rem(t, self.stages)])
    lax.fori_loop(jnp.maximum(0, total - self.stages), total, wait, None)


def _warp_specialised(wg, consumers, produce, consume):
  """Warpgroup `consumers` runs `produce` with a small register file; the others run
  `consume(wg)` with the registers it gives up (setmaxnreg)."""
  plgpu = _plgpu()
  consumer_registers, producer_registers = MosaicConfig(
      consumers=consumers,
      consumer_registers=CONSUMER_REGISTERS[consumers]).register_split()

  @pl.when(wg == consumers)
  def _():
    plgpu.set_max_registers(producer_registers, action="decrease")
    produce()

  @pl.when(wg < consumers)
  def _():
    plgpu.set_max_registers(consumer_registers, action="increase")
    consume(wg)


def _along_queries(ref, bq, interpret):
  """A per-query vector [bq] (in global or shared memory) broadcast along the keys of
  the dK/dV kernels' [keys, queries] tiles."""
  _, _, query_layout = _layouts(interpret, (ROWS, bq))
  return lax.broadcast_in_dim(_load_vector(ref, query_layout, interpret), (ROWS, bq), [1])


def _dkv_keep(r, b, i, rows, masked, kv_seg, *, bq, key0, opts, kv_len, interpret):
  """The structured mask of query tile i (its `rows`) in the dK/dV kernels' [keys,
  queries] tiles of keys [key0, key0 + 64), or None on a FULL tile."""
  if not masked:
    return None
  iota = _layouts(interpret, (ROWS, bq))[0]
  q_seg = None
  if kv_seg is not None:
    q_seg = _along_queries(r["q_seg"].at[b, rows], bq, interpret)
  return structured_keep(i * bq + iota(1), key0 + iota(0), opts, kv_len=kv_len,
                         q_seg=q_seg, kv_seg=kv_seg)


def _dkv_query_side(r, b, n, i, masked, kv_seg, *, bq, key0, opts, kv_len, interpret):
  """(lse2, delta, keep) of query tile i of query head n in the dK/dV kernels' [keys,
  queries] tiles of keys [key0, key0 + 64): the per-query statistics broadcast along
  the keys, loaded from global memory, and the structured mask (`_dkv_keep`)."""
  rows = pl.ds(i * bq, bq)
  lse2 = _along_queries(r["lse2"].at[b, n, rows], bq, interpret)
  delta = _along_queries(r["delta"].at[b, n, rows], bq, interpret)
  return lse2, delta, _dkv_keep(r, b, i, rows, masked, kv_seg, bq=bq, key0=key0,
                                opts=opts, kv_len=kv_len, interpret=interpret)


def _producer_and_consumers(r, fixed, streamed, *, consumers, stages, rows):
  """The plumbing of a kernel whose producer warpgroup streams `streamed` (the names of
  two refs, or four with `stats_streamed`) to consumers that each own 64 rows of
  `fixed` (two more): (pipe(srcs), the
  producer's side of the slots for sources `srcs`; slots, the consumers' side and the
  final drain; consume_as(wg, block, consume, count=None) -> count, which runs
  consume(wg, fixed tiles, their barriers, first row, tiles, count) for consumer wg of
  the program's block, its rows (block * consumers + wg) * rows on)."""
  loaded = r["fixed_loaded"]
  pipe = lambda srcs: _Pipeline(srcs, [r[name] for name in streamed], r["loaded"],
                                r["consumed"], stages)
  slots = pipe(None)

  def consume_as(wg, block, consume, count=None):
    return consume(wg, *(r[name].at[wg] for name in fixed),
                   (loaded.at[2 * wg], loaded.at[2 * wg + 1]), (block * consumers + wg) * rows,
                   (None, None, slots.acquire, slots.release), count)
  return pipe, slots, consume_as


def _produce_query_tiles(pipe, ranges, b, j, own, base=None):
  """The producer of the dK/dV kernels: the visited query tiles of key tile j, for each
  of the program's `own` query heads in turn (the consumers' loop order). `base`: the
  tiles the program streamed before this work item (persistent), whose count goes on
  and whose last slots the caller drains; returned with this item's added."""
  lo, _, _, hi = _row(ranges, b, j)
  per_head = hi - lo
  counted = _counted_from(base)

  def load(t, _):
    pipe.produce(counted(t), lo + lax.rem(t, per_head), lax.div(t, per_head))
  total = own * per_head
  lax.fori_loop(0, total, load, None)
  if base is None:
    pipe.drain(total)
  return _count_after(base, lambda: total)


def _counted_from(count):
  """t -> the program's count of streamed tiles at an item's t-th: t itself in a
  program of one item (no index arithmetic added, so that grid launches lower as they
  did before the persistent grid existed), count + t in a persistent one."""
  return (lambda t: t) if count is None else (lambda t: count + t)


def _count_after(count, tiles):
  """The count after an item of `tiles` streamed tiles (persistent), or None in a
  program of one item, which computes nothing for it."""
  return None if count is None else count + tiles()


class _PersistentGrid(NamedTuple):
  """A kernel's persistent launch (`BackwardConfig.persistent`): `programs` programs
  looping over the `items` work items of the grid of `sizes` they stand for, in
  `item_coords`'s order with `l2_group`."""
  items: int
  programs: int
  sizes: tuple
  l2_group: int


def _run_persistent(persistent: _PersistentGrid, pipe, item_of, produce, consume, snake,
                    consumers=2):
  """A persistent program of `consumers` consumers and a producer: the producer runs
  produce(item, count) -> count over this program's work items (`persistent_items`;
  item_of(w) gives item w) and then waits for the last slots' release; each consumer
  runs consume(wg, item, count) -> count over the same items."""
  num_items, num_ctas = persistent.items, persistent.programs

  def produce_all():
    pipe.drain(persistent_items(num_items, num_ctas,
                                lambda w, count: produce(item_of(w), count), snake))

  def consume_all(wg):
    persistent_items(num_items, num_ctas, lambda w, count: consume(wg, item_of(w), count),
                     snake)
  _warp_specialised(lax.axis_index("wg"), consumers, produce_all, consume_all)


def _dkv_kernel(*refs, names, opts: MaskOptions, scale, bq, group, interpret, consumers,
                stages, group_splits=1, persistent=None, stats_streamed=False,
                p_under_dp=False):
  """dK, dV of 2 x 64 keys of one key head, summed over the group's heads (or the
  program's share of them, `group_splits`) and the visited query tiles (S^T = K Q^T, so
  each tile is [keys, queries]): each consumer warpgroup owns 64 keys, and a producer
  warpgroup streams the query tiles both read (`_Pipeline`). `persistent` (a
  `_PersistentGrid`): each program loops over work items (key tile, key head, split,
  batch) of the grid it stands for; `stats_streamed`: as `BackwardConfig`'s,
  `p_under_dp` as its `dkv_p_under_dp`."""
  r = dict(zip(names, refs))
  bk = ROWS
  H = r["q_smem"].shape[-1]
  mm = _Products(interpret, r.get("acc"))
  _, key_layout, _ = _layouts(interpret, (bk, bq))
  own = group // group_splits       # query heads per program
  ranges = r["ranges"]

  def item_at(j, kv_head, split, b):
    """The work item of key tile j of key head kv_head (the split()-th share of its GQA
    group) in batch b: (j, kv_head, b, head, srcs, key_segments, consume)."""
    return _dkv_program(r, mm, j, kv_head, split, b, own=own, bk=bk, bq=bq, H=H,
                        key_layout=key_layout, group=group, group_splits=group_splits,
                        interpret=interpret, opts=opts, scale=scale,
                        stats_streamed=stats_streamed, p_under_dp=p_under_dp)

  if persistent is None:
    j, kv_head, b, head, srcs, key_segments, consume = item_at(
        lax.axis_index("kv"), lax.axis_index("heads"), lambda: lax.axis_index("split"),
        lax.axis_index("batch"))
    if by_role(H):
      _dkv_by_role(r, mm, ranges, b, j, kv_head, head, own, srcs, key_segments, opts=opts,
                   scale=scale, bq=bq, stages=stages, interpret=interpret)
      return

  streamed = ("q_smem", "do_smem") + (("lse_smem", "delta_smem") if stats_streamed else ())
  pipe, slots, consume_as = _producer_and_consumers(
      r, ("k_smem", "v_smem"), streamed, consumers=consumers, stages=stages, rows=bk)
  if persistent is None:
    _warp_specialised(lax.axis_index("wg"), consumers,
                      lambda: _produce_query_tiles(pipe(srcs), ranges, b, j, own),
                      lambda wg: consume_as(wg, j, consume))
    return

  # Config validation keeps the persistent grid off the head dims split by role.
  assert not by_role(H), H

  def item_of(w):
    coords = item_coords(w, persistent.sizes, opts.is_causal, persistent.l2_group)
    if group_splits == 1:       # the grid (key tiles, key heads, batch)
      j, kv_head, b = coords
      return item_at(j, kv_head, None, b)
    j, kv_head, split, b = coords
    return item_at(j, kv_head, lambda: split, b)

  def produce(item, count):
    return _produce_query_tiles(pipe(item.srcs), ranges, item.b, item.j, own, base=count)

  def consume(wg, item, count):
    return consume_as(wg, item.j, item.consume, count)
  _run_persistent(persistent, slots, item_of, produce, consume, snake=opts.is_causal)


def _dkv_program(r, mm, j, kv_head, split, b, *, own, bk, bq, H, key_layout, group,
                 group_splits, interpret, opts, scale, stats_streamed=False,
                 p_under_dp=False):
  """The closures of one dK/dV work item (see `_dkv_kernel`; `split` returns the
  item's group split where there are several): (j, kv_head, b, head, srcs,
  key_segments, consume)."""
  ranges = r["ranges"]

  def head(g):
    """The query head that is the program's g-th (g < own): program `split` of its key
    tile's group_splits runs the group's heads [split * own, (split + 1) * own)."""
    if group_splits > 1:
      g = split() * own + g
    return kv_head * group + g
  # Query tiles stream in the loop order: every visited tile of the program's first
  # head, then of its second, ...
  srcs = [lambda i, g: r["q"].at[b, pl.ds(i * bq, bq), head(g)],
          lambda i, g: r["do"].at[b, pl.ds(i * bq, bq), head(g)]]
  if stats_streamed:      # the tile's lse and delta beside them
    srcs += [lambda i, g: r["lse2"].at[b, head(g), pl.ds(i * bq, bq)],
             lambda i, g: r["delta"].at[b, head(g), pl.ds(i * bq, bq)]]

  def key_segments(keys):
    if "kv_seg" not in r:
      return None
    return lax.broadcast_in_dim(
        _load_vector(r["kv_seg"].at[b, keys], key_layout, interpret), (bk, bq), [0])

  def consume(wg, k_smem, v_smem, fixed_loaded, key0, tiles, count=None):
    """dK, dV of keys [key0, key0 + 64). `tiles` = (start(lo), before(t, i, g, lo, hi),
    acquire(t), release(t)) hand over the query tiles in loop order (t counts them,
    from `count` on in a persistent program); start and before are None when a
    producer streams them. Returns the count after this item's tiles."""
    start, before, acquire, release = tiles
    counted = _counted_from(count)
    keys = pl.ds(key0, bk)
    _load_fixed([(r["k"].at[b, keys, kv_head], k_smem, fixed_loaded[0]),
                 (r["v"].at[b, keys, kv_head], v_smem, fixed_loaded[1])])
    lo, full_lo, full_hi, hi = _row(ranges, b, j)
    kv_seg = key_segments(keys)
    tile = dict(bq=bq, key0=key0, opts=opts, kv_len=ranges[b, j, 5], interpret=interpret)
    query_side = functools.partial(_dkv_query_side, r, b, **tile)
    keep_of = functools.partial(_dkv_keep, r, b, **tile)   # stats_streamed: the mask alone
    if start is not None:
      pl.when(hi > lo)(lambda: start(lo))

    def body(i, carry, g, masked, dk_acc, dv_acc):
      n = head(g)
      t = counted(g * (hi - lo) + i - lo)
      if before is not None:
        before(t, i, g, lo, hi)
      rows = pl.ds(i * bq, bq)
      if stats_streamed:     # lse and delta read from the slot where they are used
        keep = keep_of(i, rows, masked, kv_seg)
        q_smem, do_smem, lse_smem, delta_smem = acquire(t)
      else:
        lse2, delta, keep = query_side(n, i, masked, kv_seg)
        q_smem, do_smem = acquire(t)

      def probabilities(s_t):
        lse = _along_queries(lse_smem, bq, interpret) if stats_streamed else lse2
        return _tile_p(s_t, lse, opts=opts, scale=scale, keep=keep)
      if p_under_dp:
        # S^T = K Q^T and dP^T = V dO^T back to back, P^T under the second; then dV +=
        # P^T dO, with dS'^T computed under it.
        (p_t, c), dp_t = mm.fresh_pair(k_smem, q_smem, v_smem, do_smem, (bk, bq), b_t=True,
                                       under_second=probabilities)
        mm.issue(dv_acc, p_t.astype(do_smem.dtype), do_smem)
      else:
        p_t, c = probabilities(mm.fresh(k_smem, q_smem, (bk, bq), b_t=True))  # S^T = K Q^T
        # dP^T = V dO^T, then dV += P^T dO issued behind it: dS'^T is computed under
        # the dV product, and dK += dS'^T Q follows it on the tensor cores.
        dp_t = mm.fresh_under(v_smem, do_smem, (bk, bq), b_t=True,
                              then=(dv_acc, p_t.astype(do_smem.dtype), do_smem))
      if stats_streamed:
        delta = _along_queries(delta_smem, bq, interpret)
      ds_t = _tile_ds(p_t, c, dp_t, delta).astype(q_smem.dtype)
      mm.issue(dk_acc, ds_t, q_smem)
      mm.wait()          # this tile's slot is refilled once its products are done
      if release is not None:
        release(t)
      return carry

    # The program's query heads run as a loop of the program (its size does not grow
    # with the group); their dK/dV sum in the same accumulators.
    def heads(dk_acc, dv_acc):
      lax.fori_loop(0, own, lambda g, c: visit_tiles(
          (lo, full_lo, full_hi, hi),
          functools.partial(body, g=g, dk_acc=dk_acc, dv_acc=dv_acc), c), 0)

    dk, dv = mm.accumulators((bk, H), 2, heads, wg)
    if group_splits == 1:
      _store_outputs([(dk * scale, k_smem, r["dk"].at[b, keys, kv_head]),
                      (dv, v_smem, r["dv"].at[b, keys, kv_head])])
    else:
      # Partial sums over the program's heads, summed over the splits by flash_backward:
      # float32 through a float32 tile, so that only the total is rounded to the input
      # dtype (k_smem and v_smem would round each partial).
      this_split, partial = split(), r["partial_smem"].at[wg]
      _store_tile(dk * scale, partial, r["dk"].at[b, this_split, keys, kv_head])
      _store_tile(dv, partial, r["dv"].at[b, this_split, keys, kv_head])
    return _count_after(count, lambda: own * (hi - lo))

  return _DkvItem(j, kv_head, b, head, srcs, key_segments, consume)


class _DkvItem(NamedTuple):
  """One dK/dV work item's coordinates and closures (`_dkv_program`)."""
  j: jax.Array
  kv_head: jax.Array
  b: jax.Array
  head: Callable
  srcs: list
  key_segments: Callable
  consume: Callable


# The two consumers of the dK/dV kernel at head dims split by role (`by_role`).
DK_ROLE, DV_ROLE = 0, 1


def _dkv_by_role(r, mm, ranges, b, j, kv_head, head, own, srcs, key_segments, *, opts, scale,
                 bq, stages, interpret):
  """dK and dV of the 64 keys of key tile j, split by output between two consumers
  (`by_role`), two matrix products each per tile, with a producer warpgroup streaming
  the query tiles both read (`_Pipeline`):
  - DK_ROLE (holds K): S^T = K Q^T, P^T, which it writes (in the input dtype) to one of
    two "p" slots for the other consumer, then, with that consumer's dP^T, dS'^T and
    dK += dS'^T Q from registers;
  - DV_ROLE (holds V): dP^T = V dO^T, issued as the other issues S^T, which it writes
    in float32 to the "dp" slot (dS' = P (dP - delta) subtracts two close numbers:
    rounded first, dP would lose the difference), then dV += P^T dO from the p slot.
  Each slot's "ready" barrier completes when written and its "free" barrier when read;
  every completion is waited on once."""
  plgpu = _plgpu()
  bk, H = ROWS, r["q_smem"].shape[-1]
  keys = pl.ds(j * bk, bk)
  lo, full_lo, full_hi, hi = _row(ranges, b, j)
  per_head = hi - lo
  total = own * per_head
  pipe = _Pipeline(srcs, [r["q_smem"], r["do_smem"]], r["loaded"], r["consumed"], stages)
  p_smem, p_ready, p_free = r["p_smem"], r["p_ready"], r["p_free"]
  dp_smem, dp_ready, dp_free = r["dp_smem"], r["dp_ready"], r["dp_free"]
  fixed = r["fixed_loaded"]

  def dk_consumer():
    k_smem = r["k_smem"]
    _load_tile(r["k"].at[b, keys, kv_head], k_smem, fixed.at[0])
    kv_seg = key_segments(keys)
    query_side = functools.partial(_dkv_query_side, r, b, bq=bq, key0=j * bk, opts=opts,
                                   kv_len=ranges[b, j, 5], interpret=interpret)

    def body(i, carry, g, masked, dk_acc):
      t = g * per_head + i - lo
      lse2, delta, keep = query_side(head(g), i, masked, kv_seg)
      q_smem, _ = pipe.acquire(t)
      p_t, c = _tile_p(mm.fresh(k_smem, q_smem, (bk, bq), b_t=True), lse2, opts=opts,
                       scale=scale, keep=keep)                      # S^T = K Q^T
      slot = lax.rem(t, 2)
      pl.when(t >= 2)(lambda: plgpu.barrier_wait(p_free.at[slot]))   # read two tiles ago
      p_smem.at[slot][...] = p_t.astype(q_smem.dtype)
      plgpu.commit_smem()          # visible to the tensor cores' reads
      plgpu.barrier_arrive(p_ready.at[slot])
      plgpu.barrier_wait(dp_ready.at[0])
      dp_t = dp_smem[...]
      plgpu.barrier_arrive(dp_free.at[0])
      mm.issue(dk_acc, _tile_ds(p_t, c, dp_t, delta).astype(q_smem.dtype), q_smem)
      mm.wait()                    # this tile's slot is refilled once its products are done
      pipe.release(t)
      return carry

    (dk,) = mm.accumulators((bk, H), 1, lambda dk_acc: lax.fori_loop(
        0, own, lambda g, c: visit_tiles((lo, full_lo, full_hi, hi), functools.partial(
            body, g=g, dk_acc=dk_acc), c), 0), DK_ROLE)
    lax.fori_loop(jnp.maximum(0, total - 2), total,     # the last two tiles' "p_free"
                  lambda t, _: plgpu.barrier_wait(p_free.at[lax.rem(t, 2)]), None)
    _store_tile(dk * scale, k_smem, r["dk"].at[b, keys, kv_head])

  def dv_consumer():
    v_smem = r["v_smem"]
    _load_tile(r["v"].at[b, keys, kv_head], v_smem, fixed.at[1])

    def body(t, _, dv_acc):
      _, do_smem = pipe.acquire(t)
      dp_t = mm.fresh(v_smem, do_smem, (bk, bq), b_t=True)         # dP^T = V dO^T
      pl.when(t >= 1)(lambda: plgpu.barrier_wait(dp_free.at[0]))    # the last one read
      dp_smem[...] = dp_t
      plgpu.barrier_arrive(dp_ready.at[0])
      slot = lax.rem(t, 2)
      plgpu.barrier_wait(p_ready.at[slot])
      mm.issue(dv_acc, p_smem.at[slot], do_smem)
      mm.wait()
      plgpu.barrier_arrive(p_free.at[slot])
      pipe.release(t)

    (dv,) = mm.accumulators((bk, H), 1, lambda dv_acc: lax.fori_loop(
        0, total, functools.partial(body, dv_acc=dv_acc), None), DV_ROLE)
    pl.when(total >= 1)(lambda: plgpu.barrier_wait(dp_free.at[0]))  # the last tile's
    _store_tile(dv, v_smem, r["dv"].at[b, keys, kv_head])

  def consume(wg):
    pl.when(wg == DK_ROLE)(dk_consumer)
    pl.when(wg == DV_ROLE)(dv_consumer)
  _warp_specialised(lax.axis_index("wg"), 2, lambda: _produce_query_tiles(
      pipe, ranges, b, j, own), consume)


def _dq_kernel(*refs, names, opts: MaskOptions, scale, bk, num_q_blocks, group, interpret,
               consumers, stages, rows_in_registers=False, persistent=None,
               p_under_dp=False):
  """dQ of `consumers` x 64 query rows of one query head over the visited key tiles.
  One consumer streams its own key tiles (double buffering); two or three share the
  key tiles a producer warpgroup streams (`_Pipeline`), each owning 64 query rows.
  `rows_in_registers`: Q and dO enter S and dP from registers
  (`BackwardConfig.dq_rows_in_registers`); `persistent` (a `_PersistentGrid`): each
  program of a producer and its consumers loops over work items (query block, head,
  batch) of the grid it stands for; `p_under_dp`: as `BackwardConfig.dq_p_under_dp`."""
  r = dict(zip(names, refs))
  bq = ROWS
  ranges = r["ranges"]
  block_of = query_block_order(num_q_blocks, opts)
  item_at = functools.partial(_dq_program, r, _Products(interpret, r.get("acc")), bq=bq,
                              bk=bk, group=group, interpret=interpret, opts=opts,
                              scale=scale, rows_in_registers=rows_in_registers,
                              p_under_dp=p_under_dp)
  if persistent is None:
    i, b, srcs, consume = item_at(block_of(lax.axis_index("q")), lax.axis_index("heads"),
                                  lax.axis_index("batch"))
    if consumers == 1:
      stream = _Stream(srcs, [r["k_smem"], r["v_smem"]], r["loaded"])

      def before(t, j, hi):                # copy the next tile into the other slot
        slot = lax.rem(t, 2)
        pl.when(j + 1 < hi)(lambda: stream.start(1 - slot, j + 1))
      fixed = r["fixed_loaded"]
      consume(0, r["q_smem"], r["do_smem"], (fixed.at[0], fixed.at[1]), i * bq,
              (lambda lo: stream.start(0, lo), before, lambda t: stream.wait(lax.rem(t, 2)),
               None))
      return

  pipe, slots, consume_as = _producer_and_consumers(
      r, ("q_smem", "do_smem"), ("k_smem", "v_smem"), consumers=consumers, stages=stages,
      rows=bq)

  def produce(srcs, b, i, count=None):
    """The visited key tiles of query block i, counted from `count` on in a persistent
    program (whose caller drains the last slots); returns the count after them."""
    lo, _, _, hi = _row(ranges, b, i)
    counted = _counted_from(count)
    lax.fori_loop(0, hi - lo, lambda t, _: pipe(srcs).produce(counted(t), lo + t), None)
    if count is None:
      pipe(srcs).drain(hi - lo)
    return _count_after(count, lambda: hi - lo)

  if persistent is None:
    _warp_specialised(lax.axis_index("wg"), consumers, lambda: produce(srcs, b, i),
                      lambda wg: consume_as(wg, i, consume))
    return

  assert consumers >= 2, consumers   # config validation: a producer and consumers

  def item_of(w):
    q, n, b = item_coords(w, persistent.sizes, opts.is_causal, persistent.l2_group)
    return item_at(block_of(q), n, b)

  _run_persistent(persistent, slots, item_of,
                  lambda item, count: produce(item.srcs, item.b, item.i, count),
                  lambda wg, item, count: consume_as(wg, item.i, item.consume, count),
                  snake=opts.is_causal, consumers=consumers)


def _dq_program(r, mm, i, n, b, *, bq, bk, group, interpret, opts, scale,
                rows_in_registers, p_under_dp=False):
  """The closures of one dQ work item (see `_dq_kernel`), query block i of query head
  n in batch b: (i, b, srcs, consume)."""
  ranges = r["ranges"]
  H = r["q_smem"].shape[-1]
  iota, query_layout, key_layout = _layouts(interpret, (bq, bk))
  kv_head = lax.div(n, jnp.int32(group))
  srcs = [lambda j: r["k"].at[b, pl.ds(j * bk, bk), kv_head],
          lambda j: r["v"].at[b, pl.ds(j * bk, bk), kv_head]]

  def consume(wg, q_smem, do_smem, fixed_loaded, row0, tiles, count=None):
    """dQ of query rows [row0, row0 + 64). `tiles` = (start(lo), before(t, j, hi),
    acquire(t), release(t)) hand over the key tiles (t counts them, from `count` on in
    a persistent program); start and before are None when a producer streams them.
    Returns the count after this item's tiles."""
    start, before, acquire, release = tiles
    counted = _counted_from(count)
    rows = pl.ds(row0, bq)
    lo, full_lo, full_hi, hi = _row(ranges, b, i)
    if start is not None:
      pl.when(hi > lo)(lambda: start(lo))
    _load_fixed([(r["q"].at[b, rows, n], q_smem, fixed_loaded[0]),
                 (r["do"].at[b, rows, n], do_smem, fixed_loaded[1])])
    q_a, do_a = (q_smem[...], do_smem[...]) if rows_in_registers else (q_smem, do_smem)
    along_keys = lambda x: lax.broadcast_in_dim(x, (bq, bk), [0])
    lse2 = along_keys(_load_vector(r["lse2"].at[b, n, rows], query_layout, interpret))
    delta = along_keys(_load_vector(r["delta"].at[b, n, rows], query_layout, interpret))
    kv_len = ranges[b, i, 5]
    q_seg = None
    if "q_seg" in r:
      q_seg = along_keys(_load_vector(r["q_seg"].at[b, rows], query_layout, interpret))

    def body(j, carry, masked, dq_acc):
      t = counted(j - lo)
      if before is not None:
        before(t, j, hi)
      keep = None
      if masked:
        kv_seg = None
        if q_seg is not None:
          kv_seg = lax.broadcast_in_dim(_load_vector(
              r["kv_seg"].at[b, pl.ds(j * bk, bk)], key_layout, interpret), (bq, bk), [1])
        keep = structured_keep(row0 + iota(0), j * bk + iota(1), opts, kv_len=kv_len,
                               q_seg=q_seg, kv_seg=kv_seg)
      k_smem, v_smem = acquire(t)
      probabilities = lambda s: _tile_p(s, lse2, opts=opts, scale=scale, keep=keep)
      if p_under_dp:     # S = Q K^T, dP = dO V^T, P under the second
        (p, c), dp = mm.fresh_pair(q_a, k_smem, do_a, v_smem, (bq, bk), b_t=True,
                                   under_second=probabilities)
      else:
        s, dp = mm.fresh_pair(q_a, k_smem, do_a, v_smem, (bq, bk), b_t=True)
        p, c = probabilities(s)
      mm.issue(dq_acc, _tile_ds(p, c, dp, delta).astype(k_smem.dtype), k_smem)  # dQ += dS' K
      mm.wait()          # this tile's slot is refilled once the product is done
      if release is not None:
        release(t)
      return carry

    (dq,) = mm.accumulators((bq, H), 1, lambda dq_acc: visit_tiles(
        (lo, full_lo, full_hi, hi), functools.partial(body, dq_acc=dq_acc), 0), wg)
    _store_outputs([(dq * scale, q_smem, r["dq"].at[b, rows, n])])
    return _count_after(count, lambda: hi - lo)

  return _DqItem(i, b, srcs, consume)


class _DqItem(NamedTuple):
  """One dQ work item's coordinates and closures (`_dq_program`)."""
  i: jax.Array
  b: jax.Array
  srcs: list
  consume: Callable


def flash_backward(q, k, v, out, lse, dout, dlse=None, *, scale: float,
                   opts: MaskOptions | None = None, ops: MaskOperands | None = None,
                   config: BackwardConfig | None = None, interpret: bool = False,
                   num_sms: int | None = None):
  """Gradients (dq, dk, dv) of attention from the forward's residuals: q [B, T, N, H],
  k/v [B, S, K, H] (bf16/fp16), out [B, T, N, H], lse [B, N, T] in natural log, the
  output cotangent dout and optionally the lse cotangent dlse [B, N, T]. Same contract
  as pallas_kernels.backward.flash_backward for the structured masks (no dense mask,
  bias or dropout). Tails are read and written in place as in the forward (`map_rows`:
  only lengths off the tensor maps' 8-row tiling are padded in HBM, and everything
  under the interpreter); the per-row statistics and segment ids, read by plain loads,
  are padded to whole tiles.
  `num_sms`: programs of the persistent grids (`BackwardConfig.persistent`; default:
  the device's multiprocessors, 2 when interpreted)."""
  plgpu = _plgpu()
  opts = opts or MaskOptions()
  ops = ops or MaskOperands()
  if opts.dropout_rate or ops.mask is not None or ops.bias is not None:
    raise NotImplementedError("the Mosaic GPU backward has no dense mask, bias or dropout")
  config = config or BackwardConfig()
  check_supported(q, k, v, config)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  group = N // K
  lse2, delta = backward_statistics(lse, out, dout, dlse)      # [B, N, T] float32

  def padded(bq, bk):
    """(Tp, Sp: whole tiles of the grid, T_map, S_map: the rows of the operands the tensor
    maps are built over, the operands). Query rows past T, zeros from HBM padding or from
    the copy engine, have lse2 = +inf (P = 0, read in whole tiles) and dO = 0; keys past
    S are masked in the last key tile (never FULL) by the key length; gradient rows past
    T or S are not stored."""
    Tp, Sp = round_up(T, bq), round_up(S, bk)
    T_map, S_map = map_rows(T, bq, interpret), map_rows(S, bk, interpret)
    x = dict(q=pad_axis(q, T_map, 1), k=pad_axis(k, S_map, 1), v=pad_axis(v, S_map, 1),
             do=pad_axis(dout, T_map, 1), lse2=pad_axis(lse2, Tp, 2, jnp.inf),
             delta=pad_axis(delta, Tp, 2))
    if ops.q_segment_ids is not None:   # padded with ids that match nothing
      x["q_seg"] = pad_axis(ops.q_segment_ids, Tp, 1, FILL["q_seg"])
      x["kv_seg"] = pad_axis(ops.kv_segment_ids, Sp, 1, FILL["kv_seg"])
    return Tp, Sp, T_map, S_map, x

  # Every input-dtype tile in the head dim's swizzle, the [64, 64] ones passed between
  # consumers too (they enter products beside Q, K, V or dO); float32 tiles by their own
  # rows.
  swizzled = smem_layout(H, q.dtype.itemsize)
  f32_layout = lambda cols: smem_layout(cols, 4)
  extra = {}
  if interpret:   # Mosaic GPU's own interpreter: simulated SMEM, barriers, TMA
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    extra["interpret"] = InterpretGPUParams()

  stages, roles = config.stages, by_role(H)

  def call(kernel, grid, grid_names, x, ranges, fixed, streamed, out_type,
           partials=False, C=2, shared_fixed=False, stats=False):
    """fixed / streamed: the names of the two operands each consumer keeps / the two
    that stream through the slots, with their rows. partials: the outputs are float32 partial sums (`group_splits`), stored
    from a float32 tile of each consumer's fixed rows. C: consumers; shared_fixed: the
    consumers split one program's fixed rows by role (`_dkv_by_role`): each holds one
    of the two fixed operands, and they pass each other P^T (two slots) and float32
    dP^T (one), each slot with its "ready" and "free" barriers. stats: the lse and
    delta of each streamed tile stream beside it (`stats_streamed`)."""
    (f1, f2), fixed_rows = fixed
    (s1, s2), stream_rows = streamed
    per_consumer = (fixed_rows, H) if C == 1 or shared_fixed else (C, fixed_rows, H)
    slots = stream_slots(C, stages)
    smem = lambda shape: plgpu.SMEM(shape, q.dtype, **swizzled)
    scratch = {f1: smem(per_consumer), f2: smem(per_consumer),
               s1: smem((slots, stream_rows, H)), s2: smem((slots, stream_rows, H)),
               "fixed_loaded": plgpu.Barrier(num_barriers=2 if shared_fixed else 2 * C),
               "loaded": plgpu.Barrier(num_barriers=(4 if stats else 2) * slots)}
    if stats:
      scratch["lse_smem"] = plgpu.SMEM((slots, stream_rows), jnp.float32)
      scratch["delta_smem"] = plgpu.SMEM((slots, stream_rows), jnp.float32)
    threads = {}
    if C > 1:      # consumers + the producer warpgroup
      scratch["consumed"] = plgpu.Barrier(num_arrivals=C, num_barriers=slots)
      threads = dict(num_threads=C + 1, thread_name="wg")
    if shared_fixed:    # the tiles `_dkv_by_role`'s consumers pass each other
      scratch["p_smem"] = smem((2, fixed_rows, stream_rows))
      scratch["p_ready"] = plgpu.Barrier(num_barriers=2)
      scratch["p_free"] = plgpu.Barrier(num_barriers=2)
      scratch["dp_smem"] = plgpu.SMEM((fixed_rows, stream_rows), jnp.float32,
                                      **f32_layout(stream_rows))
      scratch["dp_ready"] = plgpu.Barrier(num_barriers=1)
      scratch["dp_free"] = plgpu.Barrier(num_barriers=1)
    if interpret:  # the float32 accumulators (dK and dV, or dQ) of each consumer
      scratch["acc"] = plgpu.SMEM((len(out_type), C, ROWS, H), jnp.float32)
    if partials:
      scratch["partial_smem"] = plgpu.SMEM((C, fixed_rows, H), jnp.float32, **f32_layout(H))
    in_names = ["q", "k", "v", "do", "lse2", "delta", "ranges",
                *(n for n in ("q_seg", "kv_seg") if n in x)]
    out_names = ["dq"] if len(out_type) == 1 else ["dk", "dv"]
    args = [x[n] for n in in_names if n != "ranges"]
    args.insert(in_names.index("ranges"), ranges)
    body = functools.partial(kernel, opts=opts, scale=scale, group=group,
                             interpret=interpret, consumers=C, stages=slots)
    return plgpu.kernel(
        functools.partial(body, names=[*in_names, *out_names, *scratch]),
        out_type=out_type, scratch_types=list(scratch.values()), grid=grid,
        grid_names=grid_names, compiler_params=compiler_params(), **threads, **extra)(*args)

  # With `persistent`, each kernel's grid is one program per multiprocessor (axis "sm"),
  # looping over the work items of the grid it stands for.
  if config.persistent and num_sms is None:
    num_sms = 2 if interpret else getattr(jax.devices()[0], "core_count", None)
    if num_sms is None:
      raise ValueError("num_sms is needed for the persistent grid off a GPU (lowering only)")
  if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int)
                              or num_sms < 1):
    raise ValueError(f"num_sms={num_sms!r} must be a positive int")

  def persistent_grid(grid):
    """The kernel's `_PersistentGrid` over `grid`, or None."""
    if not config.persistent:
      return None
    items = math.prod(grid)
    return _PersistentGrid(items, min(num_sms, items), grid, config.l2_group)

  def grid_of(grid, grid_names):
    """The launch's grid and axis names."""
    if not config.persistent:
      return grid, grid_names
    return (persistent_grid(grid).programs,), ("sm",)

  # -- dK, dV: consumers x ROWS keys per program (ROWS when split by role), query tiles of
  # block_n rows
  bq, bk = config.block_n, dkv_keys(H, config)
  Tp, Sp, _, S_map, x = padded(bq, bk)
  ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk, transpose=True)
  splits = config.group_splits
  grid, grid_names = (Sp // bk, K, B), ("kv", "heads", "batch")
  kv_type = jax.ShapeDtypeStruct((B, S_map, K, H), k.dtype)
  if splits > 1:
    # A key tile's programs side by side, each with float32 partial dK and dV of its
    # own: [B, splits, Sp, K, H]. The batch stays the grid's last axis.
    grid, grid_names = (Sp // bk, K, splits, B), ("kv", "heads", "split", "batch")
    kv_type = jax.ShapeDtypeStruct((B, splits, Sp, K, H), jnp.float32)
  dk, dv = call(functools.partial(_dkv_kernel, bq=bq, group_splits=splits,
                                  persistent=persistent_grid(grid),
                                  stats_streamed=config.stats_streamed,
                                  p_under_dp=config.dkv_p_under_dp),
                *grid_of(grid, grid_names),
                x, ranges, (("k_smem", "v_smem"), ROWS), (("q_smem", "do_smem"), bq),
                [kv_type, kv_type], partials=splits > 1, shared_fixed=roles,
                stats=config.stats_streamed)
  if splits > 1:      # in a fixed order, rounded once
    dk, dv = (d.sum(1).astype(k.dtype) for d in (dk, dv))

  # -- dQ: dq_consumers_of x ROWS query rows per program, key tiles of dq_block_n (or
  # block_n) rows
  dq_consumers = dq_consumers_of(H, config)
  bq, bk = dq_consumers * ROWS, config.dq_block_n or config.block_n
  Tp, Sp, T_map, _, x = padded(bq, bk)
  ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk)
  grid = (Tp // bq, N, B)
  (dq,) = call(functools.partial(_dq_kernel, bk=bk, num_q_blocks=Tp // bq,
                                 rows_in_registers=config.dq_rows_in_registers,
                                 p_under_dp=config.dq_p_under_dp,
                                 persistent=persistent_grid(grid)),
               *grid_of(grid, ("q", "heads", "batch")), x, ranges, (("q_smem", "do_smem"), ROWS),
               (("k_smem", "v_smem"), bk), [jax.ShapeDtypeStruct((B, T_map, N, H), q.dtype)],
               C=dq_consumers)
  return dq[:, :T], dk[:, :S], dv[:, :S]
