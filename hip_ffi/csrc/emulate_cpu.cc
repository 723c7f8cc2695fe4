// The kernel compiled for the CPU emulation (emulate_cpu.h), with a C entry point
// that tests call through ctypes: same launch path as the FFI handler, no XLA.
#define JF_CPU_EMULATION 1
#include "flash_fwd.hip"

extern "C" int jflash_emulated_forward(const uint16_t* q, const uint16_t* k,
                                       const uint16_t* v, uint16_t* out, float* lse, int B,
                                       int T, int S, int N, int KH, int H, float scale,
                                       int causal, int tile) {
  if (H != 64 && H != 128) return 1;
  if (tile < 0 || tile >= jflash::kNumTiles || N % KH != 0) return 1;
  jflash::FwdParams p{q, k, v, out, lse, B, T, S, N, KH, scale * 1.4426950408889634f};
  return H == 64 ? jflash::launch_tile<64>(p, causal != 0, tile, nullptr)
                 : jflash::launch_tile<128>(p, causal != 0, tile, nullptr);
}
