"""Tile sizes for the Pallas kernels, per head_dim, in one table."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the forward and backward kernels (rows of Q x rows of K/V): the kernels'
  own record, and the one place of the tile rules (jflash's public PallasConfig has the
  same fields and is checked by building one of these).

  Attributes:
    block_q, block_k: forward tile; the forward grid runs over query blocks
      (FlashAttention-2 loop order) and loops over key blocks.
    block_q_dkv, block_k_dkv: the dK/dV kernel (grid over key blocks, loop over
      query blocks and the query heads of a GQA group).
    block_q_dq, block_k_dq: the dQ kernel (grid over query blocks, loop over keys).
    num_warps, num_stages: Triton launch parameters of every kernel (ignored in
      interpret mode); None picks from the table.
    num_warps_dkv, num_stages_dkv, num_warps_dq, num_stages_dq: the same for one
      backward kernel; they win over num_warps / num_stages.
  """

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
    for f in dataclasses.fields(self):
      val = getattr(self, f.name)
      integer = isinstance(val, int) and not isinstance(val, bool)
      if f.name.startswith(("num_warps", "num_stages")):
        if val is not None and (not integer or val < 1):
          raise ValueError(f"{f.name}={val!r} must be a positive int or None")
        continue
      if not integer or val < 16 or val & (val - 1):
        # Triton tiles are powers of two and tl.dot needs at least 16 rows.
        raise ValueError(f"{f.name}={val!r} must be a power of two >= 16")


# Defaults per head_dim, from per-kernel block sweeps on an H200 (the sweeps and their
# figures: docs/performance.md, "Where the Triton defaults come from"). A head dim
# missing here takes the row of its padded width (72: d = 128's; its pieces are those of
# 80, 64 + 16); products over a head dim that is not a power of two run on power-of-two
# pieces of it (`common.head_pieces`). Each kernel's row is (rows of Q, rows of K/V,
# num_warps, num_stages).
# - dK/dV holds P^T, dP^T and dS^T of its tile at once, so its tiles stay small: 64 x 64
#   with 4 warps up to d = 128 (wider key tiles spill at d = 128), 32 x 64 at d = 160-192,
#   64 x 32 at d = 256 (why 32-row key tiles win there was not profiled).
# - The forward and dQ kernels keep one query tile resident: 128 query rows from d = 80,
#   8 warps from d = 128.
# - Head dims that share pieces share a row (80 and 96; 160 and 192) where their best
#   rows differed by less than a run's spread; 16 and 32 follow 64 (not swept).
_TABLE = {  # head_dim: {kernel: (block_q, block_k, num_warps, num_stages)}
    16: dict(fwd=(64, 64, 4, 3), dkv=(64, 64, 4, 3), dq=(64, 64, 4, 3)),
    32: dict(fwd=(64, 64, 4, 3), dkv=(64, 64, 4, 3), dq=(64, 64, 4, 3)),
    64: dict(fwd=(64, 64, 4, 3), dkv=(64, 64, 4, 3), dq=(64, 64, 4, 3)),
    80: dict(fwd=(128, 64, 4, 3), dkv=(64, 64, 4, 3), dq=(128, 32, 4, 3)),
    96: dict(fwd=(128, 64, 4, 3), dkv=(64, 64, 4, 3), dq=(128, 32, 4, 3)),
    128: dict(fwd=(128, 128, 8, 3), dkv=(64, 64, 4, 2), dq=(128, 64, 8, 3)),
    160: dict(fwd=(128, 64, 8, 3), dkv=(32, 64, 4, 2), dq=(128, 32, 8, 3)),
    192: dict(fwd=(128, 64, 8, 3), dkv=(32, 64, 4, 2), dq=(128, 32, 8, 3)),
    256: dict(fwd=(128, 64, 8, 2), dkv=(64, 32, 4, 2), dq=(128, 32, 8, 3)),
}
KERNELS = ("fwd", "dkv", "dq")


def padded_head_dim(head_dim: int) -> int:
  """Head dim rounded up to a power of two >= 16: the width of a kernel's block over the
  arrays (which keep their own head dim; the kernels load and multiply only the pieces
  of `common.head_pieces` inside it)."""
  return max(16, 1 << (head_dim - 1).bit_length())


def _row(head_dim: int):
  """The table's row for this head dim, else for its padded tile width."""
  if head_dim in _TABLE:
    return _TABLE[head_dim]
  hp = padded_head_dim(head_dim)
  if hp not in _TABLE:
    raise NotImplementedError(f"head_dim={head_dim} (padded {hp}) > 256 has no tile table entry")
  return _TABLE[hp]


def default_block_sizes(head_dim: int) -> BlockSizes:
  row = _row(head_dim)
  return BlockSizes(*row["fwd"][:2], *row["dkv"][:2], *row["dq"][:2])


def launch_params(head_dim: int, blocks: BlockSizes, kernel: str) -> tuple[int, int]:
  """(num_warps, num_stages) of one kernel ("fwd", "dkv" or "dq"): a per-kernel
  BlockSizes value wins over num_warps / num_stages, which win over the table."""
  if kernel not in KERNELS:
    raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
  _, _, warps, stages = _row(head_dim)[kernel]
  own = lambda name: getattr(blocks, f"{name}_{kernel}", None)  # noqa: E731
  return (own("num_warps") or blocks.num_warps or warps,
          own("num_stages") or blocks.num_stages or stages)
