// CPU emulation of the few GPU constructs the kernel uses, so that its logic (tiling,
// masks, clipping, GQA indexing, online softmax, LDS layouts) is tested on a machine
// without a GPU. Not a performance path; included by compat.h under JF_CPU_EMULATION.
//
// Each GPU thread of a block is a fiber; the fibers run in lockstep, one after another
// up to the next __syncthreads, which is all the kernel needs: its barriers and
// shuffles are reached by every thread of the block (uniform control flow). A shuffle
// is a write, a barrier and a read, through one of two buffers in turn. Blocks run one
// at a time, so static locals stand in for LDS. Fibers start on their own stack with
// makecontext and then switch with _setjmp/_longjmp (no signal-mask system call).
#pragma once

#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <memory>
#include <vector>

// A fortified _longjmp (__longjmp_chk) aborts on a switch into a fiber's stack; the
// translation unit undefines _FORTIFY_SOURCE before its first include (emulate_cpu.cc).
#if defined(__USE_FORTIFY_LEVEL) && __USE_FORTIFY_LEVEL > 0
#error "the CPU emulation's fibers need _longjmp without _FORTIFY_SOURCE"
#endif

#define JF_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define JF_WAVES_PER_SIMD(n)

using std::max;
using std::min;

struct uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline dim3 threadIdx, blockIdx, gridDim, blockDim;

struct JfEmu {
  std::vector<ucontext_t> start;  // fresh fibers
  struct Parked { jmp_buf jb; };
  std::vector<Parked> resume;     // fibers parked at a barrier
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<float> xchg[2];
  int xchg_turn = 0;
  ucontext_t scheduler_ctx;
  jmp_buf scheduler;
  int current = 0;
  bool ended = false;
};
inline JfEmu jf_emu;

inline void __syncthreads() {
  if (!_setjmp(jf_emu.resume[jf_emu.current].jb)) _longjmp(jf_emu.scheduler, 1);
  threadIdx = dim3(jf_emu.current);  // resumed: this fiber's thread index again
}

#define JF_WARP_SIZE 64
typedef void* gpuStream_t;
typedef int gpuError_t;
#define gpuSuccess 0
#define gpuErrorInvalidValue 1
inline int gpuGetLastError() { return 0; }
inline const char* gpuGetErrorString(int) { return "no error"; }

// Two buffers in turn: a fiber writes buffer b only after the barrier of the previous
// shuffle, which every fiber passes only after it has read buffer b the time before.
inline float jf_shfl_xor(float v, int mask, int width) {
  const int t = (int)threadIdx.x;
  std::vector<float>& buf = jf_emu.xchg[jf_emu.xchg_turn];
  buf[t] = v;
  __syncthreads();
  if (t == 0) jf_emu.xchg_turn ^= 1;  // fiber 0 runs first in every round
  return buf[(t & ~(width - 1)) | ((t ^ mask) & (width - 1))];
}

inline float jf_h2f(uint16_t h) {
  _Float16 x;
  memcpy(&x, &h, 2);
  return (float)x;
}

// Same arithmetic as the CUDA mapping: exact fp16 products, two fp32 FMAs.
inline float jf_dot2(uint32_t a, uint32_t b, float c) {
  return fmaf(jf_h2f(a >> 16), jf_h2f(b >> 16),
              fmaf(jf_h2f(a & 0xffffu), jf_h2f(b & 0xffffu), c));
}

inline uint16_t jf_f2h(float x) {
  const _Float16 h = (_Float16)x;
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}

inline uint32_t jf_f2h2(float lo, float hi) {
  return (uint32_t)jf_f2h(lo) | ((uint32_t)jf_f2h(hi) << 16);
}

template <typename Kernel, typename Arg>
struct JfEmuLaunch {
  static inline Kernel kernel;
  static inline const Arg* arg;
  static void entry() {
    kernel(*arg);
    jf_emu.ended = true;
    _longjmp(jf_emu.scheduler, 1);
  }
};

template <typename Kernel, typename Arg>
inline void jf_emu_launch(Kernel kernel, dim3 grid, dim3 block, const Arg& arg) {
  using L = JfEmuLaunch<Kernel, Arg>;
  L::kernel = kernel;
  L::arg = &arg;
  const int nt = (int)block.x;
  constexpr size_t kStack = 256 * 1024;
  jf_emu.start.assign(nt, ucontext_t{});
  jf_emu.resume.resize(nt);
  jf_emu.stacks.resize(nt);
  jf_emu.xchg[0].assign(nt, 0.f);
  jf_emu.xchg[1].assign(nt, 0.f);
  for (auto& s : jf_emu.stacks)
    if (!s) s.reset(new char[kStack]);
  gridDim = grid;
  blockDim = block;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = dim3(bx, by, bz);
        for (int t = 0; t < nt; ++t) {
          getcontext(&jf_emu.start[t]);
          jf_emu.start[t].uc_stack.ss_sp = jf_emu.stacks[t].get();
          jf_emu.start[t].uc_stack.ss_size = kStack;
          jf_emu.start[t].uc_link = nullptr;  // entry() never returns: it jumps back
          makecontext(&jf_emu.start[t], (void (*)())L::entry, 0);
        }
        // Lockstep: each fiber runs to its next barrier, then the next fiber. The
        // kernel's barriers are uniform, so all fibers end in the same round.
        for (bool first = true, running = true; running; first = false) {
          int ended = 0;
          for (int t = 0; t < nt; ++t) {
            jf_emu.current = t;
            jf_emu.ended = false;
            threadIdx = dim3(t);
            if (!_setjmp(jf_emu.scheduler)) {
              if (first)
                swapcontext(&jf_emu.scheduler_ctx, &jf_emu.start[t]);
              else
                _longjmp(jf_emu.resume[t].jb, 1);
            }
            ended += jf_emu.ended;
          }
          if (ended != 0 && ended != nt) abort();  // divergent barrier: a kernel bug
          running = ended == 0;
        }
      }
}

#define gpuLaunchKernel(kernel, grid, block, lds, stream, ...) \
  jf_emu_launch(kernel, grid, block, __VA_ARGS__)
