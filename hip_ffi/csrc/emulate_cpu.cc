// The kernels compiled for the CPU emulation (emulate_cpu.h), with C entry points that
// tests call through ctypes: the same launch functions as the FFI handlers, no XLA.
// Shapes are already checked by the caller (hip_ffi.emulate); B is the product of all
// leading (batch) dims. Each returns 0, or 1 for a head_dim or tile not compiled.
//
// Fibers switch stacks with _longjmp (emulate_cpu.h). With _FORTIFY_SOURCE (on by
// default in Ubuntu's gcc at -O1 and above) glibc routes it to __longjmp_chk, which
// aborts the process on a jump to a stack pointer below the current one outside the
// signal stack ("longjmp causes uninitialized stack frame"): the jump from the caller's
// stack into a fiber's heap stack can be that. Undefined before the first include.
#undef _FORTIFY_SOURCE
#define JF_CPU_EMULATION 1
#include "flash_attn.hip"

namespace {

jflash::MaskParams mask(const int32_t* ranges, int n_blocks, const int32_t* q_seg,
                        const int32_t* kv_seg, int causal, int win_left, int win_right) {
  return jflash::MaskParams{ranges, n_blocks, q_seg, kv_seg, causal, win_left, win_right};
}

}  // namespace

extern "C" int jflash_emulated_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                       const int32_t* ranges, int n_blocks,
                                       const int32_t* q_seg, const int32_t* kv_seg,
                                       uint16_t* out, float* lse, int B, int T, int S, int N,
                                       int KH, int H, float scale, int causal, int win_left,
                                       int win_right, float soft_cap, int tile) {
  if (!jflash::head_dim_compiled(H) || tile < 0 || tile >= jflash::kNumTiles || N % KH != 0)
    return 1;
  jflash::FwdParams p{q, k, v, out, lse, B, T, S, N, KH, jflash::make_logits(scale, soft_cap),
                      mask(ranges, n_blocks, q_seg, kv_seg, causal, win_left, win_right)};
  return jflash::launch_forward(p, H, tile, nullptr);
}

extern "C" int jflash_emulated_bwd_delta(const uint16_t* out, const uint16_t* dout,
                                         const float* dlse, float* delta, int B, int T, int N,
                                         int H) {
  if (!jflash::head_dim_compiled(H)) return 1;
  jflash::DeltaParams p{out, dout, dlse, delta, B, T, N};
  return jflash::launch_delta(p, H, nullptr);
}

// dq == nullptr: the dK/dV kernel (ranges per key tile); else the dQ kernel.
extern "C" int jflash_emulated_bwd(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                   const uint16_t* dout, const float* lse, const float* delta,
                                   const int32_t* ranges, int n_blocks, const int32_t* q_seg,
                                   const int32_t* kv_seg, float* dq, float* dk, float* dv, int B,
                                   int T, int S, int N, int KH, int H, float scale, int causal,
                                   int win_left, int win_right, float soft_cap) {
  if (!jflash::head_dim_compiled(H) || N % KH != 0) return 1;
  jflash::BwdParams p{q, k, v, dout, lse, delta, dq, dk, dv, B, T, S, N, KH,
                      jflash::make_logits(scale, soft_cap),
                      mask(ranges, n_blocks, q_seg, kv_seg, causal, win_left, win_right)};
  return dq != nullptr ? jflash::launch_dq(p, H, nullptr) : jflash::launch_dkdv(p, H, nullptr);
}
