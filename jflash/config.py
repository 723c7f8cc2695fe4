"""Per-backend configs: how one implementation is tuned, defined here for every backend.

A config belongs to exactly one implementation (its `backend` names it) and is passed as
`jflash.attention(..., config=...)`. Each implementation reads its own with
`cfg.backend_config(ItsConfig)` and turns it into whatever record its kernel package
takes, in its adapter module (jflash/pallas_impl.py for the Pallas kernels). A config
for an implementation that is not among the call's candidates is a `ValueError`, never
ignored.

A new backend adds a subclass of `BackendConfig` here with `backend = "<name>"` and
declares it as its `Implementation.config_type`.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar


def _check_positive(name, val, optional=True):
  if val is None and optional:
    return
  if isinstance(val, bool) or not isinstance(val, int) or val < 1:
    raise ValueError(f"{name}={val!r} must be a positive int" + (" or None" if optional else ""))


@dataclasses.dataclass(frozen=True)
class BackendConfig:
  """Base of the per-backend configs (frozen: part of the compiled program)."""

  backend: ClassVar[str] = ""


@dataclasses.dataclass(frozen=True)
class PallasConfig(BackendConfig):
  """Tiles (rows of Q x rows of K/V) and Triton launch parameters of the Pallas kernels.

  Attributes:
    block_q, block_k: forward tile; the forward grid runs over query blocks
      (FlashAttention-2 loop order) and loops over key blocks.
    block_q_dkv, block_k_dkv: the dK/dV kernel (grid over key blocks, loop over
      query blocks and the query heads of a GQA group).
    block_q_dq, block_k_dq: the dQ kernel (grid over query blocks, loop over keys).
    num_warps, num_stages: Triton launch parameters of every kernel (ignored in
      interpret mode); None picks from the tile table.
    num_warps_dkv, num_stages_dkv, num_warps_dq, num_stages_dq: the same for one
      backward kernel; they win over num_warps / num_stages.

  Without a PallasConfig the kernels take the per-head_dim defaults of
  pallas_kernels/tuning.py.
  """

  backend: ClassVar[str] = "pallas"

  block_q: int = 64
  block_k: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  num_warps: int | None = None
  num_stages: int | None = None
  num_warps_dkv: int | None = None
  num_stages_dkv: int | None = None
  num_warps_dq: int | None = None
  num_stages_dq: int | None = None

  def __post_init__(self):
    # The Triton tile rules live with the kernels' own record: building one checks them.
    from pallas_kernels.tuning import BlockSizes
    BlockSizes(**dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class ChunkedConfig(BackendConfig):
  """"xla_chunked": keys per `lax.scan` step.

  The default is large enough that each step is a real matmul on a CPU and small
  enough that the [T, block_k] score tile stays far below the T x S matrix.
  """

  backend: ClassVar[str] = "xla_chunked"

  block_k: int = 256

  def __post_init__(self):
    _check_positive("block_k", self.block_k, optional=False)


@dataclasses.dataclass(frozen=True)
class HipConfig(BackendConfig):
  """"hip": the (block_q, block_k) tile, one of those compiled for the head_dim
  (`hip_ffi.tile_table()`); None for both takes the first compiled tile. A tile that
  is not compiled is a `NotImplementedError` from the implementation."""

  backend: ClassVar[str] = "hip"

  block_q: int | None = None
  block_k: int | None = None

  def __post_init__(self):
    _check_positive("block_q", self.block_q)
    _check_positive("block_k", self.block_k)
    if (self.block_q is None) != (self.block_k is None):
      raise ValueError(f"block_q={self.block_q!r} and block_k={self.block_k!r} must both "
                       "be set (one compiled tile) or both be None (the default tile)")


@dataclasses.dataclass(frozen=True)
class MosaicGPUConfig(BackendConfig):
  """"mosaic_gpu": tiles of the Hopper forward and which backward runs. Any tile field
  left None takes the per-head_dim default of pallas_kernels/mosaic_gpu/forward.py; the
  kernel checks the combination (ValueError) and whether it fits shared memory
  (NotImplementedError).

  Attributes:
    block_q: query rows per consumer warpgroup, a multiple of 64 (the M of one
      warpgroup matrix product); a program owns one per consumer.
    block_k: key/value rows per pipeline slot: 64, 128, 192 or 256.
    stages: shared-memory slots of K/V in flight (>= 2).
    persistent: one program per multiprocessor looping over the work items.
    overlap: FlashAttention-3's overlap of the softmax with the P V product inside
      each consumer warpgroup, in place of the ping-pong between the two (correct on
      the H200 but slower there; not in the default table).
    consumers: consumer warpgroups per program, 2 or 3 (pallas_kernels/mosaic_gpu/
      forward.py says where three run; the default has three up to head_dim 128 from
      THREE_CONSUMERS_MIN_SEQ query rows); setting
      it drops the default's ping_pong and consumer_registers for the new count's own.
    ping_pong: stagger two consumers so one's softmax runs under the other's matrix
      products (None: with two consumers, not with three).
    consumer_registers: registers per thread of each consumer warpgroup (a multiple of
      8; the producer warpgroup keeps the rest of the launch's pool).
    l2_group: with a causal mask, consecutive query blocks of one head given to
      programs that run at once, so they share its K and V in L2 (a positive int).
    consumer_ranges: each consumer warpgroup computes only the key tiles its own rows
      see (with a causal mask, not the diagonal's tiles fully masked for its rows);
      not with overlap or scores_ahead (setting either drops the default's, which has
      it with a causal mask up to head_dim 128; setting it drops the default's
      scores_ahead).
    scores_ahead: issue each key tile's P V product and the next tile's S = Q K^T
      back to back, waited for together (not read with overlap; the default has it at
      head_dim 256, pallas_kernels/mosaic_gpu/forward.py).
    lazy_rescale: keep each row's running max until a key tile's exceeds it by more than
      2^8 in probability, and rescale O only in warps where a row's moved
      (FlashAttention-4's conditional rescaling; not read with overlap; the default has
      it from head_dim 80, pallas_kernels/mosaic_gpu/forward.py).
    backward: "auto" (default): the Mosaic GPU backward at head_dim 80-128 for grouped
      heads (GQA, MQA) and for one key head per query head from
      `jflash.mosaic_impl.MHA_MIN_SEQ` rows (`MHA_PERSISTENT_MIN_SEQ`
      without a causal mask), above 128 from
      `jflash.mosaic_impl.BY_ROLE_MIN_SEQ` rows, unless a causal dK/dV
      grid stays small, and at 64 for one key head per query head from
      `jflash.mosaic_impl.D64_MIN_SEQ` rows (`D64_CAUSAL_MIN_SEQ` with a causal mask)
      and for grouped heads from `D64_GROUPED_MIN_SEQ`, where it measured faster on
      the H200, else the Triton one (the rule: `jflash.mosaic_impl.backward_kind`);
      "pallas": the Triton backward
      kernels; "mosaic_gpu": the Mosaic GPU backward kernels
      (pallas_kernels/mosaic_gpu/backward.py), head_dim a multiple of 16 up to 256.
    backward_block_n: whenever the Mosaic GPU backward runs, the N of each of its
      kernels' first products (query rows per tile of the dK/dV kernel, key rows per
      tile of the dQ kernel unless backward_dq_block_n sets those): 64, 128, 192 or
      256; None takes the kernel's default.
    backward_consumers: whenever the Mosaic GPU backward runs, compute warpgroups per
      program: 1, or 2 with a producer warpgroup (warp-specialised); None takes the
      default, 2, the faster on the H200 (`pallas_kernels.mosaic_gpu.backward
      .call_config`); above head_dim 128 only 2 runs (the two share the dK/dV work by
      role).
    backward_fused_dq: whenever the Mosaic GPU backward runs, accumulate dQ in its
      dK/dV kernel through float32 reduce-adds in global memory instead of a dQ kernel
      (FlashAttention-3; five matrix products per tile instead of seven, not
      bit-identical on repeat; correct but slower on the H200, where its consumers'
      live values overflowed their registers); needs backward_block_n 64, or 128 up to
      head_dim 64.
    backward_fused_dq_row_split: with backward_fused_dq, two consumers and
      backward_block_n 128: each consumer adds its 64 of the tile's query rows of dQ
      over both consumers' keys, so the tile's dQ is added to global memory once
      ([64, head_dim] by each consumer) instead of once per consumer: half the
      reduce-adds' bytes (correct on an H100, and slower there than without
      backward_fused_dq: at best 0.96x, on the persistent grid).
    backward_group_splits: whenever the Mosaic GPU backward runs, programs per key tile
      of its dK/dV kernel, each looping over its share of the GQA group's query heads
      and writing float32 partial dK and dV that are summed after the kernel (more
      programs where a causal dK/dV grid is small, e.g. MQA); must divide the call's
      group (NotImplementedError otherwise); None takes the kernel's default: 1, or for
      a causal call whose dK/dV grid has fewer programs than the kernel's
      CAUSAL_MIN_PROGRAMS, the fewest splits that reach it (or the most that fit
      shared memory).
    backward_dq_block_n: whenever the Mosaic GPU backward runs, key rows per tile of
      its dQ kernel where they differ from backward_block_n; None: the same. At
      head_dim 64, unless backward_block_n, backward_dq_block_n,
      backward_stats_streamed or backward_fused_dq is set, both kernels' tiles are
      128 rows with lse and delta streamed (the dQ kernel's alone with one consumer;
      `pallas_kernels.mosaic_gpu.backward.BLOCK_N_AT_64`).
    backward_dq_consumers: whenever the Mosaic GPU backward runs, consumer warpgroups
      of its dQ kernel: 1, 2 or 3 (up to head_dim 128); None: as backward_consumers,
      but at head_dim 80-128 without a causal mask three where two consumers run
      the dK/dV kernel beside a dQ kernel and three fit shared memory (unless
      backward_dq_rows_in_registers is set), and above head_dim 128 two on dQ key
      tiles of 64 where they fit shared memory (up to head_dim 224 at backward_stages
      2, 176 at 3), else one, as at head_dim 240-256
      (`pallas_kernels.mosaic_gpu.backward.call_config`).
    backward_dq_rows_in_registers, backward_dkv_rows_in_registers: whenever the Mosaic
      GPU backward runs, its dQ kernel (dK/dV kernel) keeps the fixed Q and dO (K and V)
      rows of each consumer in registers, as the register operand of its first two
      matrix products, in place of reading them from shared memory for each product
      (`pallas_kernels.mosaic_gpu.backward.BackwardConfig`); None takes the kernel's
      default (`call_config`): the dQ kernel's rows in registers wherever it runs two
      consumers, the dK/dV kernel's in shared memory.
    backward_stages: whenever the Mosaic GPU backward runs, shared-memory slots of the
      tiles its producer warpgroups stream (>= 2; a program of one warpgroup, as the
      dQ kernel's at head_dim 256, double-buffers its own); None: 2.
    backward_persistent: whenever the Mosaic GPU backward runs, each of its kernels
      launches one program per multiprocessor looping over the work items (two
      consumers in the dK/dV kernel, two or three in the dQ kernel: not with
      backward_dq_consumers 1, not above head_dim 128; with backward_fused_dq the
      dK/dV kernel alone); None: the kernel's
      default (`pallas_kernels.mosaic_gpu.backward.persistent_wins`: one key head per
      query head without a causal mask; at head_dim 64 groups of up to 4, causal or
      not).
    backward_stats_streamed, backward_dv_overlap: whenever the Mosaic GPU backward
      runs, its dK/dV kernel's form of a tile: lse and delta streamed beside Q and dO
      and read where used (two consumers), and dV's product overlapped
      with dS^T's computation or not; neither other than the default above head_dim 128
      (`pallas_kernels.mosaic_gpu.backward.BackwardConfig`); None: True where
      head_dim 64's 128-row tiles are the default (backward_dq_block_n above), else
      False; and True.
    backward_dkv_p_under_dp, backward_dq_p_under_dp: whenever the Mosaic GPU backward
      runs, its dK/dV kernel (dQ kernel) issues both score products of a tile (S^T and
      dP^T; S and dP) before the softmax and waits for the first alone, so that P's
      exponentials run under the second product (FlashAttention-3's order; the dK/dV
      kernel's not above head_dim 128); None: True at head_dim 64 on its default tiles
      with two consumers (`pallas_kernels.mosaic_gpu.backward.P_UNDER_DP`), else False.
    backward_edge_overlap: whenever the Mosaic GPU backward runs, at each work item's
      edges its kernels issue both fixed tiles' loads before waiting for either and
      both outputs' stores before one wait for the copy engine's reads (not above
      head_dim 128; correct on an H100 and no faster there); None: False.
    backward_l2_group: whenever the Mosaic GPU backward runs on persistent grids with
      a causal mask, consecutive tiles of one head (key tiles of the dK/dV kernel,
      query blocks of the dQ kernel) given to programs that run at once (`l2_group`);
      None: the kernel's default (`pallas_kernels.mosaic_gpu.backward.L2_GROUP` at
      head_dim 64 from `L2_GROUP_MIN_PAIRS` (batch, key head) pairs, else 1).
  """

  backend: ClassVar[str] = "mosaic_gpu"
  forward_fields: ClassVar[tuple[str, ...]] = (
      "block_q", "block_k", "stages", "persistent", "overlap", "consumers", "ping_pong",
      "consumer_registers", "l2_group", "scores_ahead", "lazy_rescale", "consumer_ranges")
  backward_kinds: ClassVar[tuple[str, ...]] = ("auto", "pallas", "mosaic_gpu")
  # The backward fields here, by the name of the Mosaic GPU backward's record.
  backward_field_names: ClassVar[dict[str, str]] = {
      "backward_block_n": "block_n", "backward_consumers": "consumers",
      "backward_fused_dq": "fused_dq", "backward_fused_dq_row_split": "fused_dq_row_split",
      "backward_group_splits": "group_splits",
      "backward_dq_block_n": "dq_block_n", "backward_dq_consumers": "dq_consumers",
      "backward_dq_rows_in_registers": "dq_rows_in_registers",
      "backward_dkv_rows_in_registers": "dkv_rows_in_registers",
      "backward_stages": "stages", "backward_persistent": "persistent",
      "backward_stats_streamed": "stats_streamed", "backward_dv_overlap": "dv_overlap",
      "backward_dkv_p_under_dp": "dkv_p_under_dp", "backward_dq_p_under_dp": "dq_p_under_dp",
      "backward_edge_overlap": "edge_overlap",
      "backward_l2_group": "l2_group"}

  block_q: int | None = None
  block_k: int | None = None
  stages: int | None = None
  persistent: bool | None = None
  overlap: bool | None = None
  consumers: int | None = None
  ping_pong: bool | None = None
  consumer_registers: int | None = None
  l2_group: int | None = None
  scores_ahead: bool | None = None
  lazy_rescale: bool | None = None
  consumer_ranges: bool | None = None
  backward: str = "auto"
  backward_block_n: int | None = None
  backward_consumers: int | None = None
  backward_fused_dq: bool | None = None
  backward_fused_dq_row_split: bool | None = None
  backward_group_splits: int | None = None
  backward_dq_block_n: int | None = None
  backward_dq_consumers: int | None = None
  backward_dq_rows_in_registers: bool | None = None
  backward_dkv_rows_in_registers: bool | None = None
  backward_stages: int | None = None
  backward_persistent: bool | None = None
  backward_stats_streamed: bool | None = None
  backward_dv_overlap: bool | None = None
  backward_dkv_p_under_dp: bool | None = None
  backward_dq_p_under_dp: bool | None = None
  backward_edge_overlap: bool | None = None
  backward_l2_group: int | None = None

  def __post_init__(self):
    if self.backward not in self.backward_kinds:
      raise ValueError(f"backward={self.backward!r} must be one of {self.backward_kinds}")
    # The backward's tile rules live with the kernel's own record: building one checks
    # them (its fields are these without the "backward_" prefix).
    from pallas_kernels.mosaic_gpu.backward import two_consumer_config
    try:
      two_consumer_config(**self.backward_fields())
    except ValueError as e:   # the kernel record's field names, as named here
      named_here = {kernel: own for own, kernel in self.backward_field_names.items()}
      raise ValueError(re.sub(rf"\b({'|'.join(named_here)})=",
                              lambda m: f"{named_here[m.group(1)]}=", str(e))) from None
    # (ping_pong: the kernel's record checks it)
    for name in ("persistent", "overlap", "scores_ahead", "lazy_rescale", "consumer_ranges"):
      if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a bool or None")
    # The forward's rules live with the kernel's record too: building one from the
    # fields set here checks each (their combination with the per-head_dim default is
    # checked when the call's config is built, `jflash.mosaic_impl.kernel_config`).
    from pallas_kernels.mosaic_gpu.forward import MosaicConfig
    MosaicConfig(**{name: getattr(self, name) for name in self.forward_fields
                    if getattr(self, name) is not None})

  def backward_fields(self) -> dict:
    """The backward fields set here, by the name of the Mosaic GPU backward's record."""
    return {kernel: getattr(self, own) for own, kernel in self.backward_field_names.items()
            if getattr(self, own) is not None}
