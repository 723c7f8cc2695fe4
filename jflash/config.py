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
  """"mosaic_gpu": tiles of the Hopper kernels and which backward runs. A field left
  None takes the heuristics' choice for the call (pallas_kernels/mosaic_gpu/
  heuristics.py); a field set here runs as set or the call raises: ValueError for a
  value no kernel takes, NotImplementedError for one the call's shapes cannot run
  (shared memory, registers), never another kernel in its place.

  Attributes:
    block_q: query rows per consumer warpgroup, a multiple of 64 (the M of one
      warpgroup matrix product); a program owns one per consumer.
    block_k: key/value rows per pipeline slot: 64, 128, 192 or 256.
    stages: shared-memory slots of K/V in flight (>= 2).
    consumers: consumer warpgroups per forward program, 2 (ping-ponged) or 3 (up to
      head_dim 128).
    persistent: one forward program per multiprocessor looping over the work items.
    backward: "auto" (default): the Mosaic GPU backward where the heuristics find it
      the faster for the call (`heuristics.mosaic_backward_wins`), else the Triton
      one, unless a backward_* field is set, which runs the Mosaic GPU backward;
      "pallas": the Triton backward kernels (no backward_* field); "mosaic_gpu": the
      Mosaic GPU backward kernels, head_dim a multiple of 16 up to 256.
    backward_block_n: the N of each Mosaic GPU backward kernel's first products:
      query rows per tile of the dK/dV kernel, key rows per tile of the dQ kernel
      unless backward_dq_block_n sets those: 64, 128, 192 or 256.
    backward_dq_block_n: key rows per tile of the dQ kernel where they differ from
      backward_block_n.
    backward_stages: shared-memory slots of the tiles the backward's producer
      warpgroups stream (>= 2).
    backward_persistent: each backward kernel launches one program per
      multiprocessor looping over the work items (not above head_dim 128).
  """

  backend: ClassVar[str] = "mosaic_gpu"
  forward_fields: ClassVar[tuple[str, ...]] = (
      "block_q", "block_k", "stages", "consumers", "persistent")
  backward_kinds: ClassVar[tuple[str, ...]] = ("auto", "pallas", "mosaic_gpu")
  # The backward fields here, by the name of the Mosaic GPU backward's record.
  backward_field_names: ClassVar[dict[str, str]] = {
      "backward_block_n": "block_n", "backward_dq_block_n": "dq_block_n",
      "backward_stages": "stages", "backward_persistent": "persistent"}

  block_q: int | None = None
  block_k: int | None = None
  stages: int | None = None
  consumers: int | None = None
  persistent: bool | None = None
  backward: str = "auto"
  backward_block_n: int | None = None
  backward_dq_block_n: int | None = None
  backward_stages: int | None = None
  backward_persistent: bool | None = None

  def __post_init__(self):
    if self.backward not in self.backward_kinds:
      raise ValueError(f"backward={self.backward!r} must be one of {self.backward_kinds}")
    set_backward = {own: getattr(self, own) for own in self.backward_field_names
                    if getattr(self, own) is not None}
    if self.backward == "pallas" and set_backward:
      raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in set_backward.items())} "
                       "configure the Mosaic GPU backward, but backward='pallas' runs the "
                       "Triton one")
    for name in ("persistent", "backward_persistent"):
      if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a bool or None")
    # The kernels' rules live with their own records: building one from the fields set
    # here checks each (their combination with the call's shapes is checked when the
    # call's config is built, `jflash.mosaic_impl`).
    from pallas_kernels.mosaic_gpu.configs import BackwardConfig, MosaicConfig
    try:
      BackwardConfig(**self.backward_fields())
    except ValueError as e:   # the kernel record's field names, as named here
      named_here = {kernel: own for own, kernel in self.backward_field_names.items()}
      raise ValueError(re.sub(rf"\b({'|'.join(named_here)})=",
                              lambda m: f"{named_here[m.group(1)]}=", str(e))) from None
    MosaicConfig(**self.forward_fields_set())

  def forward_fields_set(self) -> dict:
    """The forward fields set here (the forward record's names)."""
    return {name: getattr(self, name) for name in self.forward_fields
            if getattr(self, name) is not None}

  def backward_fields(self) -> dict:
    """The backward fields set here, by the name of the Mosaic GPU backward's record."""
    return {kernel: getattr(self, own) for own, kernel in self.backward_field_names.items()
            if getattr(self, own) is not None}
