// FlashAttention-2 forward and backward for GCN without matrix cores (MI50 / gfx906),
// behind XLA FFI custom calls. The same source builds for sm_90 through compat.h.
//
// Legend (shapes as in jflash.attention; leading dims before the last three are batch):
//   q, dout  [B, T, N, H] fp16     out [B, T, N, H] fp16   dq     [B, T, N, H] fp32
//   k, v     [B, S, K, H] fp16     lse [B, N, T] fp32      dk, dv [B, S, K, H] fp32
//   query head n reads key/value head n / (N / K) (GQA/MQA).
//   Visibility of (query i, key j): j < kv_len, and p >= j when causal, p - left <= j <=
//   p + right with a window, equal segment ids; p = i + q_offset is the query's position
//   (q_offset from the ranges: 0 aligns top-left, also when T != S; kv_len - q_len aligns
//   bottom-right, a KV cache's new queries after its keys).
//   Rows i >= q_len give zeros and lse = -inf.
//   Logits: scale * q.k, or with a soft cap c > 0 (Gemma 2) c * tanh(scale * q.k / c).
//
// Masks reach the kernels as data: a ranges table [B, n_blocks, 8] int32 per (batch,
// block) (lo, full_lo, full_hi, hi, q_len, kv_len, q_offset, 0), built by the caller from the
// same skip / full / boundary tile classes as the Pallas kernels. A block visits tiles
// [lo, hi); tiles in [full_lo, full_hi) are wholly visible and run without a single
// per-element test, the others test each element. Skipped tiles are never loaded.
//
// One block computes BQ query rows of one (batch, head): Q stays in LDS, the key axis
// is walked in tiles of BK keys with a running max m_i, running sum l_i and an fp32
// accumulator (FlashAttention-2, Algorithm 1). QK^T and PV are dot products along a
// contiguous fp16 axis, so both run on v_dot2_f32_f16 (two fp16 products added into
// fp32 per instruction): K is kept row-major ([key][dim]) and V transposed ([dim][key])
// in LDS, and P goes through LDS as fp16, as in the FlashAttention kernels.
//
// Thread layout: groups of TPR (16) consecutive lanes share RPT query rows; lane l
// of a group owns key columns l + TPR*j of S and head dims l + TPR*j of O. Row
// reductions are xor shuffles inside a group, which lies inside one wave whether the
// wave has 64 lanes (GCN) or 32 (NVIDIA).
#include <math.h>
#include <stdint.h>

#include <cmath>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "compat.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jflash {

// -- tile tables -------------------------------------------------------------------
// LDS row padding: 8 halves (16 bytes) keeps every row 16-byte aligned for 128-bit
// LDS reads and shifts consecutive rows by 4 of the 32 banks (4 bytes each), so the 8
// lanes of one 128-bit read phase hit 32 distinct banks.
constexpr int kPad = 8;
// gfx906 has 64 KiB of LDS per CU, and a block may take up to 48 KiB here. Every tile
// leaves room by LDS for at least 2 waves per SIMD (8-wave blocks alone, or 4-wave
// blocks two or more per CU), and the kernels' VGPR cap (JF_WAVES_PER_SIMD(2)) keeps 2:
// one wave's global loads hide behind the other's dot2 work.
constexpr int kLdsPerCu = 64 * 1024;
constexpr int kLdsBlockBudget = 48 * 1024;

// waves/SIMD on gfx906 = (blocks per CU from LDS) * (waves per block) / 4 SIMDs; every
// row reaches 2 (static_assert in FwdTile; VGPRs checked by build.py --report).
// Row: query rows BQ x key rows BK per tile, NT threads; comment: LDS bytes, blocks/CU,
// waves/SIMD. `tile` (the FFI attribute) indexes the rows of one head_dim.
template <int D, int TILE>
struct FwdTileTable;
template <> struct FwdTileTable<64, 0>  { static constexpr int BQ = 128, BK = 64, NT = 512; };  // 46080  1  2
template <> struct FwdTileTable<64, 1>  { static constexpr int BQ = 64,  BK = 64, NT = 256; };  // 27648  2  2
template <> struct FwdTileTable<80, 0>  { static constexpr int BQ = 64,  BK = 32, NT = 512; };  // 23296  2  4
template <> struct FwdTileTable<80, 1>  { static constexpr int BQ = 32,  BK = 32, NT = 256; };  // 17664  3  3
template <> struct FwdTileTable<96, 0>  { static constexpr int BQ = 64,  BK = 32, NT = 512; };  // 27648  2  4
template <> struct FwdTileTable<96, 1>  { static constexpr int BQ = 32,  BK = 32, NT = 256; };  // 20992  3  3
template <> struct FwdTileTable<128, 0> { static constexpr int BQ = 64,  BK = 32, NT = 512; };  // 36352  1  2
template <> struct FwdTileTable<128, 1> { static constexpr int BQ = 32,  BK = 32, NT = 256; };  // 27648  2  2
constexpr int kNumTiles = 2;

template <int D, int TILE>
struct FwdTile : FwdTileTable<D, TILE> {
  using T_ = FwdTileTable<D, TILE>;
  static constexpr int BQ = T_::BQ, BK = T_::BK, NT = T_::NT;
  static constexpr int TPR = 16;               // lanes per query-row group
  static constexpr int NG = NT / TPR;          // row groups per block
  static constexpr int RPT = BQ / NG;          // query rows per thread
  static constexpr int KC = BK / TPR;          // S columns per thread
  static constexpr int DC = D / TPR;           // O columns per thread
  static constexpr int QS = D + kPad;          // Q / K row stride (halves)
  static constexpr int PS = BK + kPad;         // P / V^T row stride (halves)
  static constexpr int Q_HALVES = BQ * QS;
  static constexpr int KP_HALVES = (BK * QS > BQ * PS) ? BK * QS : BQ * PS;  // K, then P
  static constexpr int V_HALVES = D * PS;
  static constexpr int LDS_BYTES = 2 * (Q_HALVES + KP_HALVES + V_HALVES);
  static constexpr int WAVES_PER_SIMD_GFX906 = (kLdsPerCu / LDS_BYTES) * (NT / 64) / 4;

  static_assert(TPR <= 32 && (TPR & (TPR - 1)) == 0,
                "xor shuffles inside a power-of-two group that fits a wave of 32 or 64");
  static_assert(NT % TPR == 0 && BQ % NG == 0, "rows must split evenly over groups");
  static_assert(BK % TPR == 0 && D % TPR == 0, "columns must split evenly over a group");
  static_assert(D % 8 == 0 && BK % 8 == 0, "128-bit chunks of 8 halves");
  static_assert((QS * 2) % 16 == 0 && (PS * 2) % 16 == 0, "LDS rows 16-byte aligned");
  static_assert(LDS_BYTES <= kLdsPerCu, "tile exceeds the 64 KiB LDS of a gfx906 CU");
  static_assert(LDS_BYTES <= kLdsBlockBudget, "tile exceeds the 48 KiB per-block LDS budget");
  static_assert(WAVES_PER_SIMD_GFX906 >= 2, "tile leaves fewer than 2 waves per SIMD");
};

// Backward tiles, one row per head_dim, shared by the dQ and the dK/dV kernels (so one
// ranges classification serves both): BQ query rows x BKV key rows, NT threads.
// 8-wave blocks: one block per CU already fills 2 waves per SIMD. The 48 KiB budget is
// also the static shared-memory limit of a CUDA block (the sm_90 build).
// Row comment: LDS bytes of the dK/dV kernel, of the dQ kernel.
template <int D>
struct BwdTileTable;
template <> struct BwdTileTable<64>  { static constexpr int BQ = 32, BKV = 64, NT = 512; };  // 39168 41472
template <> struct BwdTileTable<80>  { static constexpr int BQ = 32, BKV = 32, NT = 512; };  // 29440 31488
template <> struct BwdTileTable<96>  { static constexpr int BQ = 32, BKV = 32, NT = 512; };  // 34048 36864
template <> struct BwdTileTable<128> { static constexpr int BQ = 32, BKV = 32, NT = 512; };  // 43264 47616

// The compiled head dims (each has a row above and in FwdTileTable), listed once:
// `with_head_dim` gives f the template instance of a runtime head_dim, and `otherwise`
// for one not compiled.
template <typename R, typename F>
inline R with_head_dim(int64_t H, R otherwise, F&& f) {
  switch (H) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 80: return f(std::integral_constant<int, 80>{});
    case 96: return f(std::integral_constant<int, 96>{});
    case 128: return f(std::integral_constant<int, 128>{});
    default: return otherwise;
  }
}

inline bool head_dim_compiled(int64_t H) {
  return with_head_dim(H, false, [](auto) { return true; });
}

template <int D>
struct BwdTile : BwdTileTable<D> {
  using T_ = BwdTileTable<D>;
  static constexpr int BQ = T_::BQ, BKV = T_::BKV, NT = T_::NT;
  static constexpr int TPR = 16, NG = NT / TPR;
  static constexpr int DS = D + kPad;           // row stride of [rows][dim] tiles
  static constexpr int QTS = BQ + kPad;         // row stride of [dim|key][query] tiles
  static constexpr int KTS = BKV + kPad;        // row stride of [dim|query][key] tiles
  // dK/dV: K, V [BKV][DS]; Q then Q^T, dO then dO^T; P^T, dS^T [BKV][QTS]; lse, delta.
  static constexpr int QREG_HALVES = (BQ * DS > D * QTS) ? BQ * DS : D * QTS;
  static constexpr int DKDV_LDS_BYTES =
      2 * (2 * BKV * DS + 2 * QREG_HALVES + 2 * BKV * QTS) + 2 * 4 * BQ;
  // dQ: Q, dO [BQ][DS]; K, V [BKV][DS]; K^T [D][KTS]; dS [BQ][KTS].
  static constexpr int DQ_LDS_BYTES = 2 * (2 * BQ * DS + 2 * BKV * DS + D * KTS + BQ * KTS);
  static constexpr int WAVES_PER_SIMD_GFX906 =
      (kLdsPerCu / (DKDV_LDS_BYTES > DQ_LDS_BYTES ? DKDV_LDS_BYTES : DQ_LDS_BYTES)) * (NT / 64) / 4;
  static_assert(BQ % NG == 0 && BKV % NG == 0, "rows split evenly over the row groups");
  static_assert(BQ % TPR == 0 && BKV % TPR == 0 && D % TPR == 0, "columns split over a group");
  static_assert(BQ % 8 == 0 && BKV % 8 == 0 && D % 8 == 0, "128-bit chunks of 8 halves");
  static_assert(DKDV_LDS_BYTES <= kLdsBlockBudget && DQ_LDS_BYTES <= kLdsBlockBudget,
                "tile exceeds the 48 KiB per-block LDS budget");
  static_assert(WAVES_PER_SIMD_GFX906 >= 2, "tile leaves fewer than 2 waves per SIMD");
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

// The mask rules of one call (see the legend); read only inside boundary tiles.
struct MaskParams {
  const int32_t* ranges;  // [B, n_blocks, 8]
  int n_blocks;
  const int32_t* q_seg;   // [B, T], or null without segment ids
  const int32_t* kv_seg;  // [B, S]
  int causal;
  int win_left, win_right;  // -1: no window
};

struct Range {
  int lo, full_lo, full_hi, hi, q_len, kv_len, q_offset;
};

// The table is the caller's input (jflash builds it from the per-tile schedule). Its
// values are clamped to the loop's tile count and to the sequence lengths, so that a
// malformed table can cost correctness but never a read outside the arrays.
__device__ __forceinline__ Range block_range(const MaskParams& m, int b, int blk, int n_tiles,
                                             int T, int S) {
  const int32_t* r = m.ranges + ((int64_t)b * m.n_blocks + blk) * 8;
  const int lo = min(max(r[0], 0), n_tiles);
  const int hi = min(max(r[3], lo), n_tiles);
  const int full_lo = min(max(r[1], lo), hi);
  const int full_hi = min(max(r[2], full_lo), hi);
  return Range{lo, full_lo, full_hi, hi, min(max(r[4], 0), T), min(max(r[5], 0), S), r[6]};
}

// Element rule of a boundary tile, split so that the row-major kernels (forward, dQ)
// test each element against one interval per row: query `row` sees keys [lo, hi) that
// also pass the segment test. `row` may lie past T in a clipped query tile (its P is
// zeroed through lse there); segment ids are read only for existing rows and keys.
struct KeyInterval {
  int lo, hi;
};

__device__ __forceinline__ KeyInterval key_interval(const MaskParams& m, int pos, int kv_len) {
  int lo = 0, hi = kv_len;  // `pos`: the query's position, its row plus the range's q_offset
  if (m.causal) hi = min(hi, pos + 1);
  if (m.win_left >= 0) {
    lo = max(lo, pos - m.win_left);
    hi = min(hi, pos + m.win_right + 1);
  }
  return KeyInterval{lo, hi};
}

__device__ __forceinline__ bool same_segment(const MaskParams& m, int b, int T, int S, int row,
                                             int col) {
  return m.q_seg == nullptr ||
         (row < T && col < S && m.q_seg[(int64_t)b * T + row] == m.kv_seg[(int64_t)b * S + col]);
}

__device__ __forceinline__ bool visible(const MaskParams& m, int b, int T, int S, int row,
                                        int col, int kv_len, int q_offset) {
  const KeyInterval w = key_interval(m, row + q_offset, kv_len);
  return col >= w.lo && col < w.hi && same_segment(m, b, T, S, row, col);
}

// How a raw product s = q.k becomes a logit. The softmax runs in base 2 (exp2 is one
// instruction), so the kernels take the logit times log2 e, and the backward the
// derivative of the natural logit with respect to s, which multiplies dS.
struct Logits {
  float scale;           // d logit / d s without a soft cap
  float scale_log2;      // scale * log2 e
  float cap;             // soft cap, 0: none
  float cap_log2;        // cap * log2 e
  float scale_over_cap;  // scale / cap
};

inline Logits make_logits(float scale, float cap) {
  return Logits{scale, scale * kLog2e, cap, cap * kLog2e, cap > 0.f ? scale / cap : 0.f};
}

// tanh from one exp2 (gfx906 has no tanh instruction): 1 - 2 / (2^(2x log2 e) + 1).
// Exactly +-1 where the exp2 overflows to inf or underflows to 0, NaN for NaN; near 0
// its absolute error is a float32 rounding (the cap multiplies it, as tanh's own would).
__device__ __forceinline__ float tanh_exp2(float x) {
  return 1.f - 2.f / (exp2f(x * (2.f * kLog2e)) + 1.f);
}

// A tile of raw products s -> their base-2 logits, in place. The cap is tested once per
// tile, not per element: the compiler keeps a uniform branch inside unrolled element
// loops, and the uncapped loop stays one multiply per element.
template <int R, int C>
__device__ __forceinline__ void logits2(const Logits& l, float (&s)[R][C]) {
  if (l.cap == 0.f) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int j = 0; j < C; ++j) s[i][j] *= l.scale_log2;
    return;
  }
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) s[i][j] = l.cap_log2 * tanh_exp2(s[i][j] * l.scale_over_cap);
}

// The same, and `slope` = d logit / d s of each: scale, or under a soft cap c
// d/ds c tanh(scale s / c) = scale (1 - tanh^2), the factor dS carries.
template <int R, int C>
__device__ __forceinline__ void logits2_slopes(const Logits& l, float (&s)[R][C],
                                               float (&slope)[R][C]) {
  if (l.cap == 0.f) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int j = 0; j < C; ++j) {
        s[i][j] *= l.scale_log2;
        slope[i][j] = l.scale;
      }
    return;
  }
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) {
      const float t = tanh_exp2(s[i][j] * l.scale_over_cap);
      s[i][j] = l.cap_log2 * t;
      slope[i][j] = l.scale * (1.f - t * t);
    }
}

struct FwdParams {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  uint16_t* out;
  float* lse;
  int B, T, S, N, KH;
  Logits logits;
  MaskParams mask;
};

// Copies rows [row0, row0 + rows) x D of a [*, rows_total, heads, D] tensor into LDS
// rows of stride `ld`, 128 bits per load, zero-filling rows past `rows_total`.
template <int D, int NT>
__device__ __forceinline__ void load_rows(uint16_t* lds, int ld, const uint16_t* g,
                                          int64_t g_row_stride, int row0, int rows,
                                          int rows_total) {
  constexpr int CPR = D / 8;  // 128-bit chunks per row
  for (int ch = threadIdx.x; ch < rows * CPR; ch += NT) {
    const int r = ch / CPR, c = ch % CPR;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (row0 + r < rows_total)
      x = *reinterpret_cast<const uint4*>(g + (int64_t)(row0 + r) * g_row_stride + c * 8);
    *reinterpret_cast<uint4*>(lds + r * ld + c * 8) = x;
  }
}

// Copies a ROWS x D tile (rows of V, K, Q or dO) into LDS transposed ([dim][row],
// stride `ld`), so that a product contracting over rows reads row pairs as one fp16x2
// operand of dot2. Eight consecutive lanes take eight rows of one 16-byte column, the
// next eight the next column: a 64-lane wave reads 8 whole 128-byte rows at d = 64,
// and the lanes of a column write 8 consecutive halves of one transposed row (the
// 16-bit LDS stores of the other columns conflict; once per tile).
template <int D, int ROWS, int NT>
__device__ __forceinline__ void load_transposed(uint16_t* lds, int ld, const uint16_t* g,
                                                int64_t g_row_stride, int row0,
                                                int rows_total) {
  constexpr int CPR = D / 8;
  for (int ch = threadIdx.x; ch < ROWS * CPR; ch += NT) {
    const int c_lo = ch % 8, c = (ch / 8) % CPR, r = (ch / (8 * CPR)) * 8 + c_lo;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (row0 + r < rows_total)
      x = *reinterpret_cast<const uint4*>(g + (int64_t)(row0 + r) * g_row_stride + c * 8);
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      lds[(c * 8 + 2 * e) * ld + r] = (uint16_t)(w[e] & 0xffffu);
      lds[(c * 8 + 2 * e + 1) * ld + r] = (uint16_t)(w[e] >> 16);
    }
  }
}

// 8-half dot product of two 128-bit chunks on four dot2 instructions.
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float c) {
  c = jf_dot2(a.x, b.x, c);
  c = jf_dot2(a.y, b.y, c);
  c = jf_dot2(a.z, b.z, c);
  return jf_dot2(a.w, b.w, c);
}

// acc[i][j] += sum_k A[r][k] B[c][k] for the R x C elements this thread owns, r = g +
// NG * i, c = lane + 16 * j (groups of 16 lanes): both operands are read along their
// contiguous fp16 axis, 128 bits at a time, and multiplied on dot2. The 16 lanes of a
// group read one A row (an LDS broadcast) and 16 B rows whose 16-byte padded stride
// puts each phase of 8 lanes on distinct banks. Unrolled by 2: fully unrolled, the
// compiler hoists every LDS load and runs past the VGPR budget of 2 waves/SIMD.
template <int R, int C, int KD, int NT>
__device__ __forceinline__ void mm_tile(float (&acc)[R / (NT / 16)][C / 16], const uint16_t* a,
                                        int lda, const uint16_t* b, int ldb) {
  constexpr int NG = NT / 16, RP = R / NG, CP = C / 16;
  const int g = threadIdx.x / 16, lane = threadIdx.x % 16;
#pragma unroll 2
  for (int d = 0; d < KD; d += 8) {
    uint4 av[RP], bv[CP];
#pragma unroll
    for (int i = 0; i < RP; ++i) av[i] = *reinterpret_cast<const uint4*>(a + (g + NG * i) * lda + d);
#pragma unroll
    for (int j = 0; j < CP; ++j) bv[j] = *reinterpret_cast<const uint4*>(b + (lane + 16 * j) * ldb + d);
#pragma unroll
    for (int i = 0; i < RP; ++i)
#pragma unroll
      for (int j = 0; j < CP; ++j) acc[i][j] = dot8(av[i], bv[j], acc[i][j]);
  }
}

template <int TPR>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int m = TPR / 2; m > 0; m /= 2) x = fmaxf(x, jf_shfl_xor(x, m, TPR));
  return x;
}

template <int TPR>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int m = TPR / 2; m > 0; m /= 2) x += jf_shfl_xor(x, m, TPR);
  return x;
}

template <typename Tl>
struct FwdState {
  float o[Tl::RPT][Tl::DC];
  float m[Tl::RPT];  // running max of the base-2 logits, -inf until a key is seen
  float l[Tl::RPT];  // this lane's share of the running sum (summed over the group at the end)
};

// One key tile: S = Q K^T, online-softmax update, P to LDS, O += P V.
// MASK=false for tiles wholly inside the visible region: no per-element test there.
//
// NaN: fmaxf drops a NaN logit from the running max, but exp2(NaN - m) is NaN, so l
// becomes NaN and stays NaN; the row's output and lse are then NaN (see the epilogue).
template <int D, int TILE, bool MASK>
__device__ __forceinline__ void key_tile(FwdState<FwdTile<D, TILE>>& st, const FwdParams& p,
                                         int b, int kv_len, int q_offset, const uint16_t* qs,
                                         uint16_t* kps, const uint16_t* vts, int i0, int j0) {
  using Tl = FwdTile<D, TILE>;
  const int g = threadIdx.x / Tl::TPR, lane = threadIdx.x % Tl::TPR;

  // -- S = Q K^T (fp32 accumulate on dot2)
  float s[Tl::RPT][Tl::KC];
#pragma unroll
  for (int i = 0; i < Tl::RPT; ++i)
#pragma unroll
    for (int j = 0; j < Tl::KC; ++j) s[i][j] = 0.f;
  mm_tile<Tl::BQ, Tl::BK, D, Tl::NT>(s, qs, Tl::QS, kps, Tl::QS);
  logits2(p.logits, s);

  // -- update m_i and l_i; alpha = exp2(m_old - m_new) rescales what was summed so far
#pragma unroll
  for (int i = 0; i < Tl::RPT; ++i) {
    float mx = -INFINITY;
    const int row = i0 + g + Tl::NG * i;
    const KeyInterval w = MASK ? key_interval(p.mask, row + q_offset, kv_len) : KeyInterval{0, 0};
#pragma unroll
    for (int j = 0; j < Tl::KC; ++j) {
      float x = s[i][j];
      if (MASK) {  // boundary tile only
        const int col = j0 + lane + Tl::TPR * j;
        const bool ok = col >= w.lo && col < w.hi && same_segment(p.mask, b, p.T, p.S, row, col);
        x = ok ? x : -INFINITY;
      }
      s[i][j] = x;
      mx = fmaxf(mx, x);
    }
    const float m_new = fmaxf(st.m[i], group_max<Tl::TPR>(mx));
    // A row with nothing visible yet keeps m = -inf; subtract 0 instead so that
    // exp2 never sees (-inf) - (-inf).
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(st.m[i] - m_use);
    float rs = 0.f;
#pragma unroll
    for (int j = 0; j < Tl::KC; ++j) {
      s[i][j] = exp2f(s[i][j] - m_use);
      rs += s[i][j];
    }
    st.l[i] = st.l[i] * alpha + rs;
    st.m[i] = m_new;
#pragma unroll
    for (int j = 0; j < Tl::DC; ++j) st.o[i][j] *= alpha;
  }

  __syncthreads();  // every wave is done with K before P overwrites it
  // P in fp16, as the tensor-core kernels feed it to the PV product.
#pragma unroll
  for (int i = 0; i < Tl::RPT; ++i)
#pragma unroll
    for (int j = 0; j < Tl::KC; ++j)
      kps[(g + Tl::NG * i) * Tl::PS + lane + Tl::TPR * j] = jf_f2h(s[i][j]);
  __syncthreads();

  // -- O += P V, key pairs on dot2 against V^T rows
  mm_tile<Tl::BQ, D, Tl::BK, Tl::NT>(st.o, kps, Tl::PS, vts, Tl::PS);
}

template <int D, int TILE>
__global__ void __launch_bounds__((FwdTile<D, TILE>::NT)) JF_WAVES_PER_SIMD(2)
flash_fwd_kernel(FwdParams p) {
  using Tl = FwdTile<D, TILE>;
  __shared__ __attribute__((aligned(16))) uint16_t qs[Tl::Q_HALVES];
  __shared__ __attribute__((aligned(16))) uint16_t kps[Tl::KP_HALVES];
  __shared__ __attribute__((aligned(16))) uint16_t vts[Tl::V_HALVES];

  // Causal blocks with more rows see more keys: launch those first.
  const int qtile = p.mask.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int n = blockIdx.y, b = blockIdx.z;
  const int kh = n / (p.N / p.KH);
  const int i0 = qtile * Tl::BQ;
  const int64_t q_row = (int64_t)p.N * D, kv_row = (int64_t)p.KH * D;
  const uint16_t* q = p.q + (int64_t)b * p.T * q_row + (int64_t)n * D;
  const uint16_t* k = p.k + (int64_t)b * p.S * kv_row + (int64_t)kh * D;
  const uint16_t* v = p.v + (int64_t)b * p.S * kv_row + (int64_t)kh * D;
  const Range rg = block_range(p.mask, b, qtile, (p.S + Tl::BK - 1) / Tl::BK, p.T, p.S);

  load_rows<D, Tl::NT>(qs, Tl::QS, q, q_row, i0, Tl::BQ, p.T);

  FwdState<Tl> st;
#pragma unroll
  for (int i = 0; i < Tl::RPT; ++i) {
    st.m[i] = -INFINITY;
    st.l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < Tl::DC; ++j) st.o[i][j] = 0.f;
  }

  for (int jt = rg.lo; jt < rg.hi; ++jt) {
    const int j0 = jt * Tl::BK;
    load_rows<D, Tl::NT>(kps, Tl::QS, k, kv_row, j0, Tl::BK, p.S);
    load_transposed<D, Tl::BK, Tl::NT>(vts, Tl::PS, v, kv_row, j0, p.S);
    __syncthreads();
    if (jt >= rg.full_lo && jt < rg.full_hi)
      key_tile<D, TILE, false>(st, p, b, rg.kv_len, rg.q_offset, qs, kps, vts, i0, j0);
    else
      key_tile<D, TILE, true>(st, p, b, rg.kv_len, rg.q_offset, qs, kps, vts, i0, j0);
    __syncthreads();  // before the next tile overwrites K/P and V^T
  }

  // -- normalise. Only a row that the masks empty (l == 0: no visible key) or one past
  // q_len gives zeros and lse = -inf; l = NaN (a NaN reached a visible logit) is not
  // "empty" and makes the row NaN, as the plain softmax would.
  const int g = threadIdx.x / Tl::TPR, lane = threadIdx.x % Tl::TPR;
  uint16_t* os = qs;  // Q is no longer needed: stage O there for 128-bit stores
#pragma unroll
  for (int i = 0; i < Tl::RPT; ++i) {
    const float l = group_sum<Tl::TPR>(st.l[i]);
    const int r = g + Tl::NG * i;
    const bool empty = l == 0.f || i0 + r >= rg.q_len;
    const float inv = empty ? 0.f : 1.f / l;
#pragma unroll
    for (int j = 0; j < Tl::DC; ++j) os[r * Tl::QS + lane + Tl::TPR * j] = jf_f2h(st.o[i][j] * inv);
    if (lane == 0 && i0 + r < p.T) {
      // lse in natural log: (m + log2 l) * ln 2
      const float lse = empty ? -INFINITY : (st.m[i] + log2f(l)) * kLn2;
      p.lse[((int64_t)b * p.N + n) * p.T + i0 + r] = lse;
    }
  }
  __syncthreads();
  constexpr int CPR = D / 8;
  uint16_t* out = p.out + (int64_t)b * p.T * q_row + (int64_t)n * D;
  for (int ch = threadIdx.x; ch < Tl::BQ * CPR; ch += Tl::NT) {
    const int r = ch / CPR, c = ch % CPR;
    if (i0 + r < p.T)
      *reinterpret_cast<uint4*>(out + (int64_t)(i0 + r) * q_row + c * 8) =
          *reinterpret_cast<const uint4*>(os + r * Tl::QS + c * 8);
  }
}

// -- backward (FlashAttention-2, Algorithm 2, split into three kernels) ----------------

// delta_i = rowsum(dO_i * O_i) - dlse_i (Algorithm 2, line 4; d lse_i / d s_ij = P_ij
// folds an lse cotangent in). One thread per (b, t, n) row, 128-bit loads, dot2.
struct DeltaParams {
  const uint16_t* out;
  const uint16_t* dout;
  const float* dlse;
  float* delta;
  int B, T, N;
};

constexpr int kDeltaThreads = 256;

template <int D>
__global__ void __launch_bounds__(kDeltaThreads) JF_WAVES_PER_SIMD(2)
flash_bwd_delta_kernel(DeltaParams p) {
  const int64_t row = (int64_t)blockIdx.x * kDeltaThreads + threadIdx.x;  // (b, t, n)
  if (row >= (int64_t)p.B * p.T * p.N) return;
  const uint4* o = reinterpret_cast<const uint4*>(p.out + row * D);
  const uint4* d = reinterpret_cast<const uint4*>(p.dout + row * D);
  float acc = 0.f;
#pragma unroll 2
  for (int c = 0; c < D / 8; ++c) acc = dot8(o[c], d[c], acc);
  const int n = (int)(row % p.N), t = (int)((row / p.N) % p.T), b = (int)(row / ((int64_t)p.N * p.T));
  const int64_t at = ((int64_t)b * p.N + n) * p.T + t;
  p.delta[at] = acc - p.dlse[at];
}

struct BwdParams {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* dout;
  const float* lse;    // [B, N, T], natural log
  const float* delta;  // [B, N, T]
  float* dq;           // [B, T, N, H]
  float* dk;           // [B, S, K, H]
  float* dv;           // [B, S, K, H]
  int B, T, S, N, KH;
  Logits logits;
  MaskParams mask;     // ranges per query tile (dQ) or per key tile (dK/dV)
};

// lse in base 2 as the backward subtracts it: P = exp2(base-2 logit - lse2).
// A row that the masks empty has lse = -inf and must give P = 0: it becomes +inf. A
// NaN lse stays NaN, so a NaN of the forward reaches the gradients.
__device__ __forceinline__ float lse_base2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// dQ = sum over key tiles of dS K, dS = P * (dP - delta) * d logit / d s, dP = dO V^T.
// gfx906 has no fp32 global atomic add, so dQ has its own kernel (grid over query
// tiles) instead of being accumulated by the dK/dV blocks.
template <int D>
__global__ void __launch_bounds__(BwdTile<D>::NT) JF_WAVES_PER_SIMD(2)
flash_bwd_dq_kernel(BwdParams p) {
  using Tl = BwdTile<D>;
  constexpr int NG = Tl::NG, RP = Tl::BQ / NG, KP = Tl::BKV / 16, DP = D / 16;
  __shared__ __attribute__((aligned(16))) uint16_t qs[Tl::BQ * Tl::DS];
  __shared__ __attribute__((aligned(16))) uint16_t dos[Tl::BQ * Tl::DS];
  __shared__ __attribute__((aligned(16))) uint16_t ks[Tl::BKV * Tl::DS];
  __shared__ __attribute__((aligned(16))) uint16_t vs[Tl::BKV * Tl::DS];
  __shared__ __attribute__((aligned(16))) uint16_t kts[D * Tl::KTS];
  __shared__ __attribute__((aligned(16))) uint16_t dss[Tl::BQ * Tl::KTS];

  const int qtile = blockIdx.x, n = blockIdx.y, b = blockIdx.z;
  const int kh = n / (p.N / p.KH);
  const int i0 = qtile * Tl::BQ;
  const int g = threadIdx.x / 16, lane = threadIdx.x % 16;
  const int64_t q_row = (int64_t)p.N * D, kv_row = (int64_t)p.KH * D;
  const int64_t q_off = (int64_t)b * p.T * q_row + (int64_t)n * D;
  const uint16_t* k = p.k + (int64_t)b * p.S * kv_row + (int64_t)kh * D;
  const uint16_t* v = p.v + (int64_t)b * p.S * kv_row + (int64_t)kh * D;
  const Range rg = block_range(p.mask, b, qtile, (p.S + Tl::BKV - 1) / Tl::BKV, p.T, p.S);

  load_rows<D, Tl::NT>(qs, Tl::DS, p.q + q_off, q_row, i0, Tl::BQ, p.T);
  load_rows<D, Tl::NT>(dos, Tl::DS, p.dout + q_off, q_row, i0, Tl::BQ, p.T);
  float lse2[RP], delta[RP], dq[RP][DP];
#pragma unroll
  for (int i = 0; i < RP; ++i) {
    const int row = i0 + g + NG * i;
    const int64_t at = ((int64_t)b * p.N + n) * p.T + row;
    lse2[i] = row < p.T ? lse_base2(p.lse[at]) : INFINITY;  // rows past T: P = 0
    delta[i] = row < p.T ? p.delta[at] : 0.f;
#pragma unroll
    for (int j = 0; j < DP; ++j) dq[i][j] = 0.f;
  }

  for (int jt = rg.lo; jt < rg.hi; ++jt) {
    const int j0 = jt * Tl::BKV;
    load_rows<D, Tl::NT>(ks, Tl::DS, k, kv_row, j0, Tl::BKV, p.S);
    load_rows<D, Tl::NT>(vs, Tl::DS, v, kv_row, j0, Tl::BKV, p.S);
    load_transposed<D, Tl::BKV, Tl::NT>(kts, Tl::KTS, k, kv_row, j0, p.S);
    __syncthreads();
    float s[RP][KP], dp[RP][KP];
#pragma unroll
    for (int i = 0; i < RP; ++i)
#pragma unroll
      for (int j = 0; j < KP; ++j) s[i][j] = dp[i][j] = 0.f;
    mm_tile<Tl::BQ, Tl::BKV, D, Tl::NT>(s, qs, Tl::DS, ks, Tl::DS);
    mm_tile<Tl::BQ, Tl::BKV, D, Tl::NT>(dp, dos, Tl::DS, vs, Tl::DS);
    float slope[RP][KP];
    logits2_slopes(p.logits, s, slope);
    const bool masked = jt < rg.full_lo || jt >= rg.full_hi;
#pragma unroll
    for (int i = 0; i < RP; ++i) {
      const int row = i0 + g + NG * i;
      const KeyInterval w =
          masked ? key_interval(p.mask, row + rg.q_offset, rg.kv_len) : KeyInterval{0, 0};
#pragma unroll
      for (int j = 0; j < KP; ++j) {
        const int col = j0 + lane + 16 * j;
        float pr = exp2f(s[i][j] - lse2[i]);
        if (masked && !(col >= w.lo && col < w.hi && same_segment(p.mask, b, p.T, p.S, row, col)))
          pr = 0.f;
        dss[(g + NG * i) * Tl::KTS + lane + 16 * j] = jf_f2h(pr * (dp[i][j] - delta[i]) * slope[i][j]);
      }
    }
    __syncthreads();
    mm_tile<Tl::BQ, D, Tl::BKV, Tl::NT>(dq, dss, Tl::KTS, kts, Tl::KTS);
    __syncthreads();  // before the next tile overwrites K, V, K^T and dS
  }

#pragma unroll
  for (int i = 0; i < RP; ++i) {
    const int row = i0 + g + NG * i;
    if (row < p.T)
#pragma unroll
      for (int j = 0; j < DP; ++j)
        p.dq[(int64_t)b * p.T * q_row + (int64_t)row * q_row + (int64_t)n * D + lane + 16 * j] =
            dq[i][j];
  }
}

// dK, dV of one key tile of one key/value head: a runtime loop over the query heads
// of its GQA group and over the query tiles the ranges give, P^T recomputed from lse.
//   S^T = K Q^T, P^T = exp2(base-2 logits of S^T - lse2), dP^T = V dO^T,
//   dS^T = P^T * (dP^T - delta) * d logit / d s, dV += P^T dO, dK += dS^T Q.
// Q and dO are read row-major for S^T and dP^T, then reloaded transposed over the same
// LDS for the two products that contract over query rows (LDS holds one at a time).
template <int D>
__global__ void __launch_bounds__(BwdTile<D>::NT) JF_WAVES_PER_SIMD(2)
flash_bwd_dkdv_kernel(BwdParams p) {
  using Tl = BwdTile<D>;
  constexpr int NG = Tl::NG, RP = Tl::BKV / NG, QP = Tl::BQ / 16, DP = D / 16;
  __shared__ __attribute__((aligned(16))) uint16_t ks[Tl::BKV * Tl::DS];
  __shared__ __attribute__((aligned(16))) uint16_t vs[Tl::BKV * Tl::DS];
  __shared__ __attribute__((aligned(16))) uint16_t qreg[Tl::QREG_HALVES];   // Q, then Q^T
  __shared__ __attribute__((aligned(16))) uint16_t doreg[Tl::QREG_HALVES];  // dO, then dO^T
  __shared__ __attribute__((aligned(16))) uint16_t pts[Tl::BKV * Tl::QTS];
  __shared__ __attribute__((aligned(16))) uint16_t dsts[Tl::BKV * Tl::QTS];
  __shared__ float lse_s[Tl::BQ], delta_s[Tl::BQ];

  const int ktile = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const int G = p.N / p.KH;
  const int j0 = ktile * Tl::BKV;
  const int g = threadIdx.x / 16, lane = threadIdx.x % 16;
  const int64_t q_row = (int64_t)p.N * D, kv_row = (int64_t)p.KH * D;
  const int64_t kv_off = (int64_t)b * p.S * kv_row + (int64_t)kh * D;
  const Range rg = block_range(p.mask, b, ktile, (p.T + Tl::BQ - 1) / Tl::BQ, p.T, p.S);

  load_rows<D, Tl::NT>(ks, Tl::DS, p.k + kv_off, kv_row, j0, Tl::BKV, p.S);
  load_rows<D, Tl::NT>(vs, Tl::DS, p.v + kv_off, kv_row, j0, Tl::BKV, p.S);
  float dk[RP][DP], dv[RP][DP];
#pragma unroll
  for (int i = 0; i < RP; ++i)
#pragma unroll
    for (int j = 0; j < DP; ++j) dk[i][j] = dv[i][j] = 0.f;

  for (int gi = 0; gi < G; ++gi) {
    const int n = kh * G + gi;
    const int64_t q_off = (int64_t)b * p.T * q_row + (int64_t)n * D;
    const uint16_t* q = p.q + q_off;
    const uint16_t* dout = p.dout + q_off;
    for (int it = rg.lo; it < rg.hi; ++it) {
      const int i0 = it * Tl::BQ;
      load_rows<D, Tl::NT>(qreg, Tl::DS, q, q_row, i0, Tl::BQ, p.T);
      load_rows<D, Tl::NT>(doreg, Tl::DS, dout, q_row, i0, Tl::BQ, p.T);
      for (int r = threadIdx.x; r < Tl::BQ; r += Tl::NT) {
        const int64_t at = ((int64_t)b * p.N + n) * p.T + i0 + r;
        lse_s[r] = i0 + r < p.T ? lse_base2(p.lse[at]) : INFINITY;  // rows past T: P = 0
        delta_s[r] = i0 + r < p.T ? p.delta[at] : 0.f;
      }
      __syncthreads();
      float st[RP][QP], dpt[RP][QP];
#pragma unroll
      for (int i = 0; i < RP; ++i)
#pragma unroll
        for (int j = 0; j < QP; ++j) st[i][j] = dpt[i][j] = 0.f;
      mm_tile<Tl::BKV, Tl::BQ, D, Tl::NT>(st, ks, Tl::DS, qreg, Tl::DS);
      mm_tile<Tl::BKV, Tl::BQ, D, Tl::NT>(dpt, vs, Tl::DS, doreg, Tl::DS);
      float slope[RP][QP];
      logits2_slopes(p.logits, st, slope);
      const bool masked = it < rg.full_lo || it >= rg.full_hi;
#pragma unroll
      for (int i = 0; i < RP; ++i)
#pragma unroll
        for (int j = 0; j < QP; ++j) {
          const int c = lane + 16 * j, col = j0 + g + NG * i, row = i0 + c;
          float pr = exp2f(st[i][j] - lse_s[c]);
          if (masked && !visible(p.mask, b, p.T, p.S, row, col, rg.kv_len, rg.q_offset)) pr = 0.f;
          const int at = (g + NG * i) * Tl::QTS + c;
          pts[at] = jf_f2h(pr);
          dsts[at] = jf_f2h(pr * (dpt[i][j] - delta_s[c]) * slope[i][j]);
        }
      __syncthreads();  // every wave is done with Q and dO row-major
      load_transposed<D, Tl::BQ, Tl::NT>(qreg, Tl::QTS, q, q_row, i0, p.T);
      load_transposed<D, Tl::BQ, Tl::NT>(doreg, Tl::QTS, dout, q_row, i0, p.T);
      __syncthreads();
      mm_tile<Tl::BKV, D, Tl::BQ, Tl::NT>(dv, pts, Tl::QTS, doreg, Tl::QTS);
      mm_tile<Tl::BKV, D, Tl::BQ, Tl::NT>(dk, dsts, Tl::QTS, qreg, Tl::QTS);
      __syncthreads();  // before the next query tile overwrites Q, dO, P^T and dS^T
    }
  }

#pragma unroll
  for (int i = 0; i < RP; ++i) {
    const int key = j0 + g + NG * i;
    if (key < p.S)
#pragma unroll
      for (int j = 0; j < DP; ++j) {
        const int64_t at = kv_off + (int64_t)key * kv_row + lane + 16 * j;
        p.dk[at] = dk[i][j];
        p.dv[at] = dv[i][j];
      }
  }
}

// -- launches (shared by the FFI handlers and the CPU emulation) ----------------------

template <int D, int TILE>
gpuError_t launch_fwd_tile(const FwdParams& p, gpuStream_t stream) {
  using Tl = FwdTile<D, TILE>;
  const dim3 grid((p.T + Tl::BQ - 1) / Tl::BQ, p.N, p.B);
  gpuLaunchKernel((flash_fwd_kernel<D, TILE>), grid, dim3(Tl::NT), 0, stream, p);
  return gpuGetLastError();
}

inline gpuError_t launch_forward(const FwdParams& p, int H, int tile, gpuStream_t stream) {
  return with_head_dim(H, gpuError_t(gpuErrorInvalidValue), [&](auto d) {
    constexpr int D = decltype(d)::value;
    return tile == 0 ? launch_fwd_tile<D, 0>(p, stream) : launch_fwd_tile<D, 1>(p, stream);
  });
}

// Query rows per block of the forward tile `tile` at head_dim H (0: not compiled).
inline int fwd_block_q(int H, int tile) {
  return with_head_dim(H, 0, [&](auto d) {
    constexpr int D = decltype(d)::value;
    return tile == 0 ? FwdTile<D, 0>::BQ : FwdTile<D, 1>::BQ;
  });
}

template <int D>
gpuError_t launch_delta_d(const DeltaParams& p, gpuStream_t stream) {
  const int64_t rows = (int64_t)p.B * p.T * p.N;
  const dim3 grid((unsigned)((rows + kDeltaThreads - 1) / kDeltaThreads));
  gpuLaunchKernel((flash_bwd_delta_kernel<D>), grid, dim3(kDeltaThreads), 0, stream, p);
  return gpuGetLastError();
}

inline gpuError_t launch_delta(const DeltaParams& p, int H, gpuStream_t stream) {
  return with_head_dim(H, gpuError_t(gpuErrorInvalidValue),
                       [&](auto d) { return launch_delta_d<decltype(d)::value>(p, stream); });
}

template <int D>
gpuError_t launch_dq_d(const BwdParams& p, gpuStream_t stream) {
  using Tl = BwdTile<D>;
  const dim3 grid((p.T + Tl::BQ - 1) / Tl::BQ, p.N, p.B);
  gpuLaunchKernel((flash_bwd_dq_kernel<D>), grid, dim3(Tl::NT), 0, stream, p);
  return gpuGetLastError();
}

inline gpuError_t launch_dq(const BwdParams& p, int H, gpuStream_t stream) {
  return with_head_dim(H, gpuError_t(gpuErrorInvalidValue),
                       [&](auto d) { return launch_dq_d<decltype(d)::value>(p, stream); });
}

template <int D>
gpuError_t launch_dkdv_d(const BwdParams& p, gpuStream_t stream) {
  using Tl = BwdTile<D>;
  const dim3 grid((p.S + Tl::BKV - 1) / Tl::BKV, p.KH, p.B);
  gpuLaunchKernel((flash_bwd_dkdv_kernel<D>), grid, dim3(Tl::NT), 0, stream, p);
  return gpuGetLastError();
}

inline gpuError_t launch_dkdv(const BwdParams& p, int H, gpuStream_t stream) {
  return with_head_dim(H, gpuError_t(gpuErrorInvalidValue),
                       [&](auto d) { return launch_dkdv_d<decltype(d)::value>(p, stream); });
}

// (query rows, key rows) per block of the backward kernels at head_dim H (0: not compiled).
inline int bwd_block_q(int H) {
  return with_head_dim(H, 0, [](auto d) { return BwdTile<decltype(d)::value>::BQ; });
}
inline int bwd_block_kv(int H) {
  return with_head_dim(H, 0, [](auto d) { return BwdTile<decltype(d)::value>::BKV; });
}

// -- XLA FFI handlers -------------------------------------------------------------------
// The last guard: jflash checks every input in Python first (hip_ffi.check_inputs);
// these checks only keep a malformed direct call from reaching a kernel. Dtypes are
// checked by XLA through the typed buffers. Dims before the last three (or two, for
// lse-shaped operands) are batch, so a vmapped call (vmap_method="broadcast_all")
// arrives as one larger batch.

using F16 = ffi::Buffer<ffi::F16>;
using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;

static std::string shape_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

static bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

struct Dims {
  int64_t B, T, S, N, KH, H;
};

// Product of the leading (batch) dims; -1 unless `dims` has rank >= tail + 1 and its
// leading dims equal `lead`.
using Lead = std::vector<int64_t>;

// The leading (batch) dims of `dims`, all but the last `tail`.
static Lead lead_of(ffi::Span<const int64_t> dims, size_t tail) {
  Lead lead;
  for (size_t i = 0; i + tail < dims.size(); ++i) lead.push_back(dims[i]);
  return lead;
}

static int64_t batch_of(ffi::Span<const int64_t> dims, size_t tail, const Lead& lead) {
  if (dims.size() < tail + 1 || dims.size() - tail != lead.size()) return -1;
  int64_t b = 1;
  for (size_t i = 0; i < lead.size(); ++i) {
    if (dims[i] != lead[i]) return -1;
    b *= dims[i];
  }
  return b;
}

static ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// q [.., T, N, H], k and v [.., S, K, H].
static ffi::Error qkv_dims(const char* op, ffi::Span<const int64_t> qd,
                           ffi::Span<const int64_t> kd, ffi::Span<const int64_t> vd, Dims* d) {
  if (qd.size() < 4 || kd.size() != qd.size() || vd.size() != qd.size())
    return invalid(op, "q, k, v must have rank >= 4 [.., T|S, N|K, H] and one rank, got q" +
                           shape_str(qd) + " k" + shape_str(kd) + " v" + shape_str(vd));
  const size_t r = qd.size();
  const Lead lead = lead_of(qd, 3);
  d->B = batch_of(qd, 3, lead);
  d->T = qd[r - 3]; d->N = qd[r - 2]; d->H = qd[r - 1];
  d->S = kd[r - 3]; d->KH = kd[r - 2];
  for (size_t i = 0; i < r; ++i)
    if (kd[i] != vd[i]) return invalid(op, "k" + shape_str(kd) + " and v" + shape_str(vd) + " differ");
  if (batch_of(kd, 3, lead) != d->B || kd[r - 1] != d->H)
    return invalid(op, "q" + shape_str(qd) + " and k" + shape_str(kd) +
                           " disagree on batch or head_dim");
  if (d->B < 1 || d->T < 1 || d->S < 1 || d->N < 1 || d->KH < 1 || d->N % d->KH != 0)
    return invalid(op, "need B, T, S, N, K >= 1 and N a multiple of K, got q" + shape_str(qd) +
                           " k" + shape_str(kd));
  if (!head_dim_compiled(d->H))
    return invalid(op, "head_dim must be 64, 80, 96 or 128, got " + std::to_string(d->H));
  // grid.y and grid.z are limited to 65535; int32 row counters inside the kernels.
  if (d->N > 65535 || d->B > 65535 || d->T > INT32_MAX / 2 || d->S > INT32_MAX / 2)
    return invalid(op, "q" + shape_str(qd) + " k" + shape_str(kd) + " exceed the launch limits");
  return ffi::Error::Success();
}

static ffi::Error expect_shape(const char* op, const char* name, ffi::Span<const int64_t> got,
                               const Lead& lead, std::initializer_list<int64_t> tail) {
  bool ok = batch_of(got, tail.size(), lead) >= 0;
  size_t i = lead.size();
  for (int64_t t : tail) ok = ok && got[i++] == t;
  if (ok) return ffi::Error::Success();
  std::string want = "[..";
  for (int64_t t : tail) want += ", " + std::to_string(t);
  return invalid(op, std::string(name) + shape_str(got) + " must be " + want + "]");
}

// Fills `m` from the ranges / segment-id buffers and the mask attributes.
static ffi::Error mask_params(const char* op, const Dims& d, const Lead& lead,
                              int block, int rows, S32 ranges, S32 q_seg, S32 kv_seg,
                              bool is_causal, int32_t win_left, int32_t win_right,
                              bool has_segments, MaskParams* m) {
  const int64_t n_blocks = (rows + block - 1) / block;
  if (auto e = expect_shape(op, "ranges", ranges.dimensions(), lead, {n_blocks, 8}); e.failure())
    return e;
  if (has_segments) {
    if (auto e = expect_shape(op, "q_segment_ids", q_seg.dimensions(), lead, {d.T}); e.failure())
      return e;
    if (auto e = expect_shape(op, "kv_segment_ids", kv_seg.dimensions(), lead, {d.S}); e.failure())
      return e;
  }
  if ((win_left < 0) != (win_right < 0))
    return invalid(op, "window_left and window_right must both be >= 0 or both -1");
  m->ranges = ranges.typed_data();
  m->n_blocks = (int)n_blocks;
  m->q_seg = has_segments ? q_seg.typed_data() : nullptr;
  m->kv_seg = has_segments ? kv_seg.typed_data() : nullptr;
  m->causal = is_causal;
  m->win_left = win_left;
  m->win_right = win_right;
  return ffi::Error::Success();
}

static ffi::Error check_logits(const char* op, float scale, float soft_cap) {
  if (!std::isfinite(scale)) return invalid(op, "scale must be finite");
  if (!std::isfinite(soft_cap) || soft_cap < 0.f)
    return invalid(op, "soft_cap must be finite and >= 0 (0: none), got " + std::to_string(soft_cap));
  return ffi::Error::Success();
}

static ffi::Error launched(const char* op, gpuError_t err) {
  if (err != gpuSuccess)
    return ffi::Error::Internal(std::string(op) + ": kernel launch failed: " + gpuGetErrorString(err));
  return ffi::Error::Success();
}

static ffi::Error FlashFwdImpl(gpuStream_t stream, F16 q, F16 k, F16 v, S32 ranges, S32 q_seg,
                               S32 kv_seg, ffi::Result<F16> out, ffi::Result<F32> lse,
                               float scale, bool is_causal, int32_t window_left,
                               int32_t window_right, bool has_segments, float soft_cap,
                               int32_t tile) {
  const char* op = "jflash_flash_fwd";
  Dims d;
  if (auto e = qkv_dims(op, q.dimensions(), k.dimensions(), v.dimensions(), &d); e.failure()) return e;
  const auto lead = lead_of(q.dimensions(), 3);
  if (auto e = expect_shape(op, "out", out->dimensions(), lead, {d.T, d.N, d.H}); e.failure()) return e;
  if (auto e = expect_shape(op, "lse", lse->dimensions(), lead, {d.N, d.T}); e.failure()) return e;
  if (auto e = check_logits(op, scale, soft_cap); e.failure()) return e;
  if (tile < 0 || tile >= kNumTiles)
    return invalid(op, "tile must be in [0, " + std::to_string(kNumTiles) + "), got " +
                           std::to_string(tile));
  // 128-bit global loads and stores.
  if (!aligned16(q.typed_data()) || !aligned16(k.typed_data()) || !aligned16(v.typed_data()) ||
      !aligned16(out->typed_data()))
    return invalid(op, "q, k, v and out must be 16-byte aligned");
  const int bq = fwd_block_q((int)d.H, tile);
  FwdParams p;
  if (auto e = mask_params(op, d, lead, bq, (int)d.T, ranges, q_seg, kv_seg, is_causal,
                           window_left, window_right, has_segments, &p.mask); e.failure())
    return e;
  p.q = q.typed_data(); p.k = k.typed_data(); p.v = v.typed_data();
  p.out = out->typed_data(); p.lse = lse->typed_data();
  p.B = (int)d.B; p.T = (int)d.T; p.S = (int)d.S; p.N = (int)d.N; p.KH = (int)d.KH;
  p.logits = make_logits(scale, soft_cap);
  return launched(op, launch_forward(p, (int)d.H, tile, stream));
}

static ffi::Error FlashBwdDeltaImpl(gpuStream_t stream, F16 out, F16 dout, F32 dlse,
                                    ffi::Result<F32> delta) {
  const char* op = "jflash_flash_bwd_delta";
  const auto od = out.dimensions();
  if (od.size() < 4) return invalid(op, "out" + shape_str(od) + " must have rank >= 4");
  const Lead lead = lead_of(od, 3);
  const int64_t T = od[od.size() - 3], N = od[od.size() - 2], H = od[od.size() - 1];
  const int64_t B = batch_of(od, 3, lead);
  if (auto e = expect_shape(op, "dout", dout.dimensions(), lead, {T, N, H}); e.failure()) return e;
  if (auto e = expect_shape(op, "dlse", dlse.dimensions(), lead, {N, T}); e.failure()) return e;
  if (auto e = expect_shape(op, "delta", delta->dimensions(), lead, {N, T}); e.failure()) return e;
  if (!head_dim_compiled(H))
    return invalid(op, "head_dim must be 64, 80, 96 or 128, got " + std::to_string(H));
  if (B * T * N / kDeltaThreads >= INT32_MAX || T > INT32_MAX || N > INT32_MAX)
    return invalid(op, "out" + shape_str(od) + " exceeds the launch limits");
  if (!aligned16(out.typed_data()) || !aligned16(dout.typed_data()))
    return invalid(op, "out and dout must be 16-byte aligned");
  DeltaParams p{out.typed_data(), dout.typed_data(), dlse.typed_data(), delta->typed_data(),
                (int)B, (int)T, (int)N};
  return launched(op, launch_delta(p, (int)H, stream));
}

// dQ or dK/dV: the same operands, ranges per query tile (dQ) or per key tile (dK/dV).
static ffi::Error bwd_params(const char* op, bool per_key_tile, F16 q, F16 k, F16 v, F16 dout,
                             F32 lse, F32 delta, S32 ranges, S32 q_seg, S32 kv_seg, float scale,
                             bool is_causal, int32_t window_left, int32_t window_right,
                             bool has_segments, float soft_cap, Dims* d, BwdParams* p) {
  if (auto e = qkv_dims(op, q.dimensions(), k.dimensions(), v.dimensions(), d); e.failure()) return e;
  const auto lead = lead_of(q.dimensions(), 3);
  if (auto e = expect_shape(op, "dout", dout.dimensions(), lead, {d->T, d->N, d->H}); e.failure()) return e;
  if (auto e = expect_shape(op, "lse", lse.dimensions(), lead, {d->N, d->T}); e.failure()) return e;
  if (auto e = expect_shape(op, "delta", delta.dimensions(), lead, {d->N, d->T}); e.failure()) return e;
  if (auto e = check_logits(op, scale, soft_cap); e.failure()) return e;
  if (!aligned16(q.typed_data()) || !aligned16(k.typed_data()) || !aligned16(v.typed_data()) ||
      !aligned16(dout.typed_data()))
    return invalid(op, "q, k, v and dout must be 16-byte aligned");
  const int bq = bwd_block_q((int)d->H), bkv = bwd_block_kv((int)d->H);
  if (auto e = mask_params(op, *d, lead, per_key_tile ? bkv : bq, (int)(per_key_tile ? d->S : d->T),
                           ranges, q_seg, kv_seg, is_causal, window_left, window_right,
                           has_segments, &p->mask); e.failure())
    return e;
  p->q = q.typed_data(); p->k = k.typed_data(); p->v = v.typed_data(); p->dout = dout.typed_data();
  p->lse = lse.typed_data(); p->delta = delta.typed_data();
  p->dq = p->dk = p->dv = nullptr;
  p->B = (int)d->B; p->T = (int)d->T; p->S = (int)d->S; p->N = (int)d->N; p->KH = (int)d->KH;
  p->logits = make_logits(scale, soft_cap);
  return ffi::Error::Success();
}

static ffi::Error FlashBwdDqImpl(gpuStream_t stream, F16 q, F16 k, F16 v, F16 dout, F32 lse,
                                 F32 delta, S32 ranges, S32 q_seg, S32 kv_seg,
                                 ffi::Result<F32> dq, float scale, bool is_causal,
                                 int32_t window_left, int32_t window_right, bool has_segments,
                                 float soft_cap) {
  const char* op = "jflash_flash_bwd_dq";
  Dims d;
  BwdParams p;
  if (auto e = bwd_params(op, false, q, k, v, dout, lse, delta, ranges, q_seg, kv_seg, scale,
                          is_causal, window_left, window_right, has_segments, soft_cap, &d, &p);
      e.failure())
    return e;
  const auto lead = lead_of(q.dimensions(), 3);
  if (auto e = expect_shape(op, "dq", dq->dimensions(), lead, {d.T, d.N, d.H}); e.failure()) return e;
  p.dq = dq->typed_data();
  return launched(op, launch_dq(p, (int)d.H, stream));
}

static ffi::Error FlashBwdDkdvImpl(gpuStream_t stream, F16 q, F16 k, F16 v, F16 dout, F32 lse,
                                   F32 delta, S32 ranges, S32 q_seg, S32 kv_seg,
                                   ffi::Result<F32> dk, ffi::Result<F32> dv, float scale,
                                   bool is_causal, int32_t window_left, int32_t window_right,
                                   bool has_segments, float soft_cap) {
  const char* op = "jflash_flash_bwd_dkdv";
  Dims d;
  BwdParams p;
  if (auto e = bwd_params(op, true, q, k, v, dout, lse, delta, ranges, q_seg, kv_seg, scale,
                          is_causal, window_left, window_right, has_segments, soft_cap, &d, &p);
      e.failure())
    return e;
  const auto lead = lead_of(q.dimensions(), 3);
  if (auto e = expect_shape(op, "dk", dk->dimensions(), lead, {d.S, d.KH, d.H}); e.failure()) return e;
  if (auto e = expect_shape(op, "dv", dv->dimensions(), lead, {d.S, d.KH, d.H}); e.failure()) return e;
  p.dk = dk->typed_data();
  p.dv = dv->typed_data();
  return launched(op, launch_dkdv(p, (int)d.H, stream));
}

}  // namespace jflash

#define JF_MASK_ATTRS                                                              \
  .Attr<float>("scale")               /* logits scale (f32) */                     \
      .Attr<bool>("is_causal")        /* query i sees keys j <= i + q_offset */    \
      .Attr<int32_t>("window_left")   /* i - left <= j, or -1: no window */        \
      .Attr<int32_t>("window_right")  /* j <= i + right, or -1 */                  \
      .Attr<bool>("has_segments")     /* read q_/kv_segment_ids */                 \
      .Attr<float>("soft_cap")        /* logits -> cap tanh(logits / cap), 0: none */

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JflashFlashFwd, jflash::FlashFwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<gpuStream_t>>()  // the stream XLA runs this op on
        .Arg<jflash::F16>()                       // q   [B, T, N, H]
        .Arg<jflash::F16>()                       // k   [B, S, K, H]
        .Arg<jflash::F16>()                       // v   [B, S, K, H]
        .Arg<jflash::S32>()                       // ranges [B, ceil(T / BQ), 8]
        .Arg<jflash::S32>()                       // q_segment_ids [B, T]
        .Arg<jflash::S32>()                       // kv_segment_ids [B, S]
        .Ret<jflash::F16>()                       // out [B, T, N, H]
        .Ret<jflash::F32>()                       // lse [B, N, T], natural log
        JF_MASK_ATTRS
        .Attr<int32_t>("tile"));                  // row of FwdTileTable for this head_dim

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JflashFlashBwdDelta, jflash::FlashBwdDeltaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<gpuStream_t>>()
        .Arg<jflash::F16>()                       // out  [B, T, N, H]
        .Arg<jflash::F16>()                       // dout [B, T, N, H]
        .Arg<jflash::F32>()                       // dlse [B, N, T]
        .Ret<jflash::F32>());                     // delta [B, N, T]

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JflashFlashBwdDq, jflash::FlashBwdDqImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<gpuStream_t>>()
        .Arg<jflash::F16>()                       // q
        .Arg<jflash::F16>()                       // k
        .Arg<jflash::F16>()                       // v
        .Arg<jflash::F16>()                       // dout
        .Arg<jflash::F32>()                       // lse
        .Arg<jflash::F32>()                       // delta
        .Arg<jflash::S32>()                       // ranges [B, ceil(T / BQ), 8]
        .Arg<jflash::S32>()                       // q_segment_ids
        .Arg<jflash::S32>()                       // kv_segment_ids
        .Ret<jflash::F32>()                       // dq [B, T, N, H]
        JF_MASK_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JflashFlashBwdDkdv, jflash::FlashBwdDkdvImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<gpuStream_t>>()
        .Arg<jflash::F16>()                       // q
        .Arg<jflash::F16>()                       // k
        .Arg<jflash::F16>()                       // v
        .Arg<jflash::F16>()                       // dout
        .Arg<jflash::F32>()                       // lse
        .Arg<jflash::F32>()                       // delta
        .Arg<jflash::S32>()                       // ranges [B, ceil(S / BKV), 8] (per key tile)
        .Arg<jflash::S32>()                       // q_segment_ids
        .Arg<jflash::S32>()                       // kv_segment_ids
        .Ret<jflash::F32>()                       // dk [B, S, K, H]
        .Ret<jflash::F32>()                       // dv [B, S, K, H]
        JF_MASK_ATTRS);
