"""Tile sizes for the Pallas kernels, per head_dim, in one table."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the forward and backward kernels (rows of Q x rows of K/V).

  Attributes:
    block_q, block_k: forward tile; the forward grid runs over query blocks
      (FlashAttention-2 loop order) and loops over key blocks.
    block_q_dkv, block_k_dkv: the dK/dV kernel (grid over key blocks, loop over
      query blocks and the query heads of a GQA group).
    block_q_dq, block_k_dq: the dQ kernel (grid over query blocks, loop over keys).
    num_warps, num_stages: Triton launch parameters (ignored in interpret mode);
      None picks from the table.
  """

  block_q: int = 64
  block_k: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      val = getattr(self, f.name)
      if f.name in ("num_warps", "num_stages"):
        if val is not None and (not isinstance(val, int) or val < 1):
          raise ValueError(f"{f.name}={val!r} must be a positive int or None")
        continue
      if not isinstance(val, int) or val < 16 or val & (val - 1):
        # Triton tiles are powers of two and tl.dot needs at least 16 rows.
        raise ValueError(f"{f.name}={val!r} must be a power of two >= 16")


# Defaults per padded head_dim, from the block sweep on one H200
# (experiments/results/bench_attention_block_sweep_h200.json; notes in
# experiments/results/tuning_notes.md):
#   fwd: (block_q, block_k, num_warps, num_stages)
#   bwd: (block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, num_warps, num_stages)
# The backward prefers square 64 x 64 tiles with 4 warps: its tile holds P, dP and dS
# at once, and larger tiles spill (128 x 128 with 8 warps ran 11% slower at d=128).
# head_dim 16/32 follow 64 and 256 halves the tiles (neither swept).
_TABLE = {
    16: ((64, 64, 4, 3), (64, 64, 64, 64, 4, 2)),
    32: ((64, 64, 4, 3), (64, 64, 64, 64, 4, 2)),
    64: ((64, 64, 4, 3), (64, 64, 64, 64, 4, 2)),
    128: ((128, 128, 8, 3), (64, 64, 64, 64, 4, 2)),
    256: ((64, 64, 8, 2), (32, 32, 32, 32, 4, 2)),
}


def padded_head_dim(head_dim: int) -> int:
  """Head dim rounded up to a power of two >= 16 (what a Triton tile can hold)."""
  return max(16, 1 << (head_dim - 1).bit_length())


def default_block_sizes(head_dim: int) -> BlockSizes:
  hp = padded_head_dim(head_dim)
  if hp not in _TABLE:
    raise NotImplementedError(f"head_dim={head_dim} (padded {hp}) > 256 has no tile table entry")
  (bq, bk, _, _), (bq_dkv, bk_dkv, bq_dq, bk_dq, _, _) = _TABLE[hp]
  return BlockSizes(bq, bk, bq_dkv, bk_dkv, bq_dq, bk_dq)


def launch_params(head_dim: int, blocks: BlockSizes, backward: bool) -> tuple[int, int]:
  """(num_warps, num_stages) for a launch: explicit values win over the table."""
  fwd, bwd = _TABLE[padded_head_dim(head_dim)]
  row = bwd if backward else fwd
  return blocks.num_warps or row[-2], blocks.num_stages or row[-1]
