// FlashAttention-2 forward for GCN without matrix cores (MI50 / gfx906), behind an
// XLA FFI custom call. The same source builds for sm_90 through compat.h.
//
// Legend (shapes as in jflash.attention):
//   q   [B, T, N, H] fp16      out [B, T, N, H] fp16
//   k,v [B, S, K, H] fp16      lse [B, N, T]    fp32, natural log
//   query head n reads key/value head n / (N / K) (GQA/MQA).
//   is_causal: query i sees keys j <= i, aligned at the top-left also when T != S.
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
#include <string>

#include "compat.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jflash {

// -- tile table -------------------------------------------------------------------
// LDS row padding: 8 halves (16 bytes) keeps every row 16-byte aligned for 128-bit
// LDS reads and shifts consecutive rows by 4 of the 32 banks (4 bytes each), so the 8
// lanes of one 128-bit read phase hit 32 distinct banks.
constexpr int kPad = 8;
// gfx906 has 64 KiB of LDS per CU, and a block may take up to 48 KiB here. Two blocks
// share a CU only at <= 32 KiB each, so the larger tiles run 8-wave (512-thread)
// blocks and the smaller ones 4-wave blocks, two per CU: 2 waves per SIMD either way,
// so one wave's global loads hide behind the other's dot2 work.
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

struct FwdParams {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  uint16_t* out;
  float* lse;
  int B, T, S, N, KH;
  float scale_log2;  // scale * log2(e): softmax in base 2, exp2 is one instruction
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

// Copies a BK x D tile of V into LDS transposed ([dim][key], stride `ld`), so that PV
// reads key pairs as one fp16x2 operand of dot2. Eight consecutive lanes take eight
// keys of one 16-byte column, the next eight the next column: a 64-lane wave reads 8
// whole 128-byte rows at d = 64, and the lanes of a column write 8 consecutive halves
// of one V^T row (the 16-bit LDS stores of the other columns conflict; once per tile).
template <int D, int BK, int NT>
__device__ __forceinline__ void load_v_transposed(uint16_t* lds, int ld, const uint16_t* g,
                                                  int64_t g_row_stride, int row0,
                                                  int rows_total) {
  constexpr int CPR = D / 8;
  for (int ch = threadIdx.x; ch < BK * CPR; ch += NT) {
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
template <int D, int TILE, bool CAUSAL, bool MASK>
__device__ __forceinline__ void key_tile(FwdState<FwdTile<D, TILE>>& st,
                                         const uint16_t* qs, uint16_t* kps,
                                         const uint16_t* vts, int i0, int j0, int S,
                                         float scale_log2) {
  using Tl = FwdTile<D, TILE>;
  const int g = threadIdx.x / Tl::TPR, lane = threadIdx.x % Tl::TPR;

  // -- S = Q K^T (fp32 accumulate on dot2), in base-2 logit units
  float s[Tl::RPT][Tl::KC];
#pragma unroll
  for (int i = 0; i < Tl::RPT; ++i)
#pragma unroll
    for (int j = 0; j < Tl::KC; ++j) s[i][j] = 0.f;
  // Unrolled by 2 only: fully unrolled, the compiler hoists every LDS load of the
  // loop and runs past the VGPR budget of 2 waves/SIMD (then spills to scratch).
#pragma unroll 2
  for (int d = 0; d < D; d += 8) {
    uint4 qv[Tl::RPT], kv[Tl::KC];
#pragma unroll
    for (int i = 0; i < Tl::RPT; ++i)
      qv[i] = *reinterpret_cast<const uint4*>(qs + (g + Tl::NG * i) * Tl::QS + d);
#pragma unroll
    for (int j = 0; j < Tl::KC; ++j)
      kv[j] = *reinterpret_cast<const uint4*>(kps + (lane + Tl::TPR * j) * Tl::QS + d);
#pragma unroll
    for (int i = 0; i < Tl::RPT; ++i)
#pragma unroll
      for (int j = 0; j < Tl::KC; ++j) s[i][j] = dot8(qv[i], kv[j], s[i][j]);
  }

  // -- update m_i and l_i; alpha = exp2(m_old - m_new) rescales what was summed so far
#pragma unroll
  for (int i = 0; i < Tl::RPT; ++i) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < Tl::KC; ++j) {
      float x = s[i][j] * scale_log2;
      if (MASK) {  // boundary tile only: key past S, or above the causal diagonal
        const int col = j0 + lane + Tl::TPR * j, row = i0 + g + Tl::NG * i;
        const bool ok = col < S && (!CAUSAL || col <= row);
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
#pragma unroll 2
  for (int c = 0; c < Tl::BK; c += 8) {
    uint4 pv[Tl::RPT], vv[Tl::DC];
#pragma unroll
    for (int i = 0; i < Tl::RPT; ++i)
      pv[i] = *reinterpret_cast<const uint4*>(kps + (g + Tl::NG * i) * Tl::PS + c);
#pragma unroll
    for (int j = 0; j < Tl::DC; ++j)
      vv[j] = *reinterpret_cast<const uint4*>(vts + (lane + Tl::TPR * j) * Tl::PS + c);
#pragma unroll
    for (int i = 0; i < Tl::RPT; ++i)
#pragma unroll
      for (int j = 0; j < Tl::DC; ++j) st.o[i][j] = dot8(pv[i], vv[j], st.o[i][j]);
  }
}

template <int D, int TILE, bool CAUSAL>
__global__ void __launch_bounds__((FwdTile<D, TILE>::NT))
flash_fwd_kernel(FwdParams p) {
  using Tl = FwdTile<D, TILE>;
  __shared__ __attribute__((aligned(16))) uint16_t qs[Tl::Q_HALVES];
  __shared__ __attribute__((aligned(16))) uint16_t kps[Tl::KP_HALVES];
  __shared__ __attribute__((aligned(16))) uint16_t vts[Tl::V_HALVES];

  // Causal blocks with more rows see more keys: launch those first.
  const int qtile = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int n = blockIdx.y, b = blockIdx.z;
  const int kh = n / (p.N / p.KH);
  const int i0 = qtile * Tl::BQ;
  const int64_t q_row = (int64_t)p.N * D, kv_row = (int64_t)p.KH * D;
  const uint16_t* q = p.q + (int64_t)b * p.T * q_row + (int64_t)n * D;
  const uint16_t* k = p.k + (int64_t)b * p.S * kv_row + (int64_t)kh * D;
  const uint16_t* v = p.v + (int64_t)b * p.S * kv_row + (int64_t)kh * D;

  load_rows<D, Tl::NT>(qs, Tl::QS, q, q_row, i0, Tl::BQ, p.T);

  FwdState<Tl> st;
#pragma unroll
  for (int i = 0; i < Tl::RPT; ++i) {
    st.m[i] = -INFINITY;
    st.l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < Tl::DC; ++j) st.o[i][j] = 0.f;
  }

  // Keys any existing row of this block can see; causal tiles past it are skipped.
  const int rows_end = min(i0 + Tl::BQ, p.T);
  const int k_end = CAUSAL ? min(p.S, rows_end) : p.S;
  for (int j0 = 0; j0 < k_end; j0 += Tl::BK) {
    load_rows<D, Tl::NT>(kps, Tl::QS, k, kv_row, j0, Tl::BK, p.S);
    load_v_transposed<D, Tl::BK, Tl::NT>(vts, Tl::PS, v, kv_row, j0, p.S);
    __syncthreads();
    // Full tile: all keys exist and (causal) the first row of the block sees the last key.
    const bool full = j0 + Tl::BK <= p.S && (!CAUSAL || j0 + Tl::BK - 1 <= i0);
    if (full)
      key_tile<D, TILE, CAUSAL, false>(st, qs, kps, vts, i0, j0, p.S, p.scale_log2);
    else
      key_tile<D, TILE, CAUSAL, true>(st, qs, kps, vts, i0, j0, p.S, p.scale_log2);
    __syncthreads();  // before the next tile overwrites K/P and V^T
  }

  // -- normalise; a row that saw no key gives zeros and lse = -inf
  const int g = threadIdx.x / Tl::TPR, lane = threadIdx.x % Tl::TPR;
  uint16_t* os = qs;  // Q is no longer needed: stage O there for 128-bit stores
#pragma unroll
  for (int i = 0; i < Tl::RPT; ++i) {
    const float l = group_sum<Tl::TPR>(st.l[i]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int r = g + Tl::NG * i;
#pragma unroll
    for (int j = 0; j < Tl::DC; ++j) os[r * Tl::QS + lane + Tl::TPR * j] = jf_f2h(st.o[i][j] * inv);
    if (lane == 0 && i0 + r < p.T) {
      // lse in natural log: (m + log2 l) * ln 2
      const float lse = l > 0.f ? (st.m[i] + log2f(l)) * 0.69314718055994531f : -INFINITY;
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

template <int D, int TILE, bool CAUSAL>
gpuError_t launch(const FwdParams& p, gpuStream_t stream) {
  using Tl = FwdTile<D, TILE>;
  const dim3 grid((p.T + Tl::BQ - 1) / Tl::BQ, p.N, p.B);
  gpuLaunchKernel((flash_fwd_kernel<D, TILE, CAUSAL>), grid, dim3(Tl::NT), 0, stream, p);
  return gpuGetLastError();
}

template <int D, int TILE>
gpuError_t launch_causal(const FwdParams& p, bool causal, gpuStream_t stream) {
  return causal ? launch<D, TILE, true>(p, stream) : launch<D, TILE, false>(p, stream);
}

template <int D>
gpuError_t launch_tile(const FwdParams& p, bool causal, int tile, gpuStream_t stream) {
  return tile == 0 ? launch_causal<D, 0>(p, causal, stream)
                   : launch_causal<D, 1>(p, causal, stream);
}

// -- XLA FFI handler ----------------------------------------------------------------

static std::string shape_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

static bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

static ffi::Error FlashFwdImpl(gpuStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> lse, float scale,
                               bool is_causal, int32_t tile) {
  using ffi::DataType;
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument(
        "jflash_flash_fwd: q, k, v must have rank 4 [B, T|S, N|K, H], got q" +
        shape_str(qd) + " k" + shape_str(kd) + " v" + shape_str(vd));
  if (q.element_type() != DataType::F16 || k.element_type() != DataType::F16 ||
      v.element_type() != DataType::F16 || out->element_type() != DataType::F16)
    return ffi::Error::InvalidArgument("jflash_flash_fwd: q, k, v and out must be float16");
  if (lse->element_type() != DataType::F32)
    return ffi::Error::InvalidArgument("jflash_flash_fwd: lse must be float32");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3], S = kd[1], KH = kd[2];
  for (int i = 0; i < 4; ++i)
    if (kd[i] != vd[i])
      return ffi::Error::InvalidArgument("jflash_flash_fwd: k" + shape_str(kd) +
                                         " and v" + shape_str(vd) + " differ");
  if (kd[0] != B || kd[3] != H)
    return ffi::Error::InvalidArgument("jflash_flash_fwd: q" + shape_str(qd) + " and k" +
                                       shape_str(kd) + " disagree on batch or head_dim");
  if (B < 1 || T < 1 || S < 1 || N < 1 || KH < 1 || N % KH != 0)
    return ffi::Error::InvalidArgument(
        "jflash_flash_fwd: need B, T, S, N, K >= 1 and N a multiple of K, got q" +
        shape_str(qd) + " k" + shape_str(kd));
  if (H != 64 && H != 128)
    return ffi::Error::InvalidArgument("jflash_flash_fwd: head_dim must be 64 or 128, got " +
                                       std::to_string(H));
  // grid.y = N, grid.z = B are limited to 65535; int32 row counters inside the kernel.
  if (N > 65535 || B > 65535 || T > INT32_MAX / 2 || S > INT32_MAX / 2)
    return ffi::Error::InvalidArgument("jflash_flash_fwd: q" + shape_str(qd) + " k" +
                                       shape_str(kd) + " exceed the launch limits");
  const auto od = out->dimensions(), ld = lse->dimensions();
  if (od.size() != 4 || od[0] != B || od[1] != T || od[2] != N || od[3] != H)
    return ffi::Error::InvalidArgument("jflash_flash_fwd: out" + shape_str(od) +
                                       " must have the shape of q" + shape_str(qd));
  if (ld.size() != 3 || ld[0] != B || ld[1] != N || ld[2] != T)
    return ffi::Error::InvalidArgument("jflash_flash_fwd: lse" + shape_str(ld) +
                                       " must be [B, N, T] = [" + std::to_string(B) + ", " +
                                       std::to_string(N) + ", " + std::to_string(T) + "]");
  if (!std::isfinite(scale))
    return ffi::Error::InvalidArgument("jflash_flash_fwd: scale must be finite");
  if (tile < 0 || tile >= kNumTiles)
    return ffi::Error::InvalidArgument("jflash_flash_fwd: tile must be in [0, " +
                                       std::to_string(kNumTiles) + "), got " +
                                       std::to_string(tile));
  // 128-bit global loads and stores.
  if (!aligned16(q.untyped_data()) || !aligned16(k.untyped_data()) ||
      !aligned16(v.untyped_data()) || !aligned16(out->untyped_data()))
    return ffi::Error::InvalidArgument(
        "jflash_flash_fwd: q, k, v and out must be 16-byte aligned");

  FwdParams p;
  p.q = static_cast<const uint16_t*>(q.untyped_data());
  p.k = static_cast<const uint16_t*>(k.untyped_data());
  p.v = static_cast<const uint16_t*>(v.untyped_data());
  p.out = static_cast<uint16_t*>(out->untyped_data());
  p.lse = static_cast<float*>(lse->untyped_data());
  p.B = (int)B; p.T = (int)T; p.S = (int)S; p.N = (int)N; p.KH = (int)KH;
  p.scale_log2 = scale * 1.4426950408889634f;  // 1/ln(2)
  const gpuError_t err = H == 64 ? launch_tile<64>(p, is_causal, tile, stream)
                                 : launch_tile<128>(p, is_causal, tile, stream);
  if (err != gpuSuccess)
    return ffi::Error::Internal(std::string("jflash_flash_fwd: kernel launch failed: ") +
                                gpuGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace jflash

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JflashFlashFwd, jflash::FlashFwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<gpuStream_t>>()  // the stream XLA runs this op on
        .Arg<ffi::AnyBuffer>()                    // q   [B, T, N, H] fp16
        .Arg<ffi::AnyBuffer>()                    // k   [B, S, K, H] fp16
        .Arg<ffi::AnyBuffer>()                    // v   [B, S, K, H] fp16
        .Ret<ffi::AnyBuffer>()                    // out [B, T, N, H] fp16
        .Ret<ffi::AnyBuffer>()                    // lse [B, N, T] fp32, natural log
        .Attr<float>("scale")                     // logits scale (f32)
        .Attr<bool>("is_causal")                  // query i sees keys j <= i (top-left)
        .Attr<int32_t>("tile"));                  // row of FwdTileTable for this head_dim
