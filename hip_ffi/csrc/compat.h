// One kernel source for two compilers, in the spirit of llama.cpp's vendors/hip.h.
//
//   hipcc --offload-arch=gfx906  (the product: MI50 / Radeon VII, GCN 5.1, wave64)
//   nvcc  -arch=sm_90            (how the logic is run and checked on an H200)
//
// The kernel uses only what is defined here: a stream/error vocabulary, the warp
// width, a lane-group xor shuffle, the fp16<->fp32 conversions on packed 32-bit
// words, and `dot2`. Debian's HIP-on-NVIDIA headers do not build with CUDA 13, so the
// CUDA side is a hand-written mapping onto plain CUDA C++17, not hip_runtime.h.
#pragma once

#include <stdint.h>

#if defined(JF_CPU_EMULATION)
// ---------------------------------------------------------------------- CPU, tests only
#include "emulate_cpu.h"

#elif defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
// ---------------------------------------------------------------------- HIP / gfx906
#include <hip/hip_runtime.h>

#define JF_HIP 1
typedef hipStream_t gpuStream_t;
typedef hipError_t gpuError_t;
#define gpuSuccess hipSuccess
#define gpuErrorInvalidValue hipErrorInvalidValue
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define gpuLaunchKernel(kernel, grid, block, lds, stream, ...) \
  hipLaunchKernelGGL(kernel, grid, block, lds, stream, __VA_ARGS__)

// Wave size differs: GCN runs 64 lanes per wavefront (NVIDIA: 32). The kernel only
// ever reduces inside groups of <= 32 lanes, so no code path assumes either width.
#define JF_WARP_SIZE 64

typedef _Float16 jf_half2_t __attribute__((ext_vector_type(2)));

// xor shuffle inside aligned groups of `width` lanes (ds_swizzle/ds_bpermute on GCN).
__device__ __forceinline__ float jf_shfl_xor(float v, int mask, int width) {
  return __shfl_xor(v, mask, width);
}

// Occupancy floor: caps the VGPRs per lane at 256 / n so that n waves fit a SIMD (a
// 256-thread block otherwise lets the compiler take up to 256 VGPRs, one wave).
#define JF_WAVES_PER_SIMD(n) __attribute__((amdgpu_waves_per_eu(n)))

// dot2 differs: gfx906 has v_dot2_f32_f16 (two fp16 products summed into an fp32
// accumulator in one instruction); NVIDIA has no fp16->fp32 dot2, see the CUDA side.
__device__ __forceinline__ float jf_dot2(uint32_t a, uint32_t b, float c) {
  return __builtin_amdgcn_fdot2(__builtin_bit_cast(jf_half2_t, a),
                                __builtin_bit_cast(jf_half2_t, b), c, false);
}

__device__ __forceinline__ uint16_t jf_f2h(float x) {
  return __builtin_bit_cast(uint16_t, static_cast<_Float16>(x));
}

__device__ __forceinline__ uint32_t jf_f2h2(float lo, float hi) {
  jf_half2_t h = {static_cast<_Float16>(lo), static_cast<_Float16>(hi)};
  return __builtin_bit_cast(uint32_t, h);
}

#else
// ---------------------------------------------------------------------- CUDA / sm_90
#include <cuda_runtime.h>
#include <cuda_fp16.h>

#define JF_CUDA 1
typedef cudaStream_t gpuStream_t;
typedef cudaError_t gpuError_t;
#define gpuSuccess cudaSuccess
#define gpuErrorInvalidValue cudaErrorInvalidValue
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define gpuLaunchKernel(kernel, grid, block, lds, stream, ...) \
  kernel<<<grid, block, lds, stream>>>(__VA_ARGS__)

// Wave size differs: 32 lanes per warp here (GCN: 64); see the HIP side.
#define JF_WARP_SIZE 32

// Occupancy is the compiler's business here (the kernel is tuned for gfx906 only).
#define JF_WAVES_PER_SIMD(n)

// All lanes of the warp take part in every shuffle of the kernel (no divergence
// around the reductions), hence the full member mask.
__device__ __forceinline__ float jf_shfl_xor(float v, int mask, int width) {
  return __shfl_xor_sync(0xffffffffu, v, mask, width);
}

// dot2 differs: emulated with two fp32 FMAs. An fp16 x fp16 product is exact in fp32
// (11 + 11 significand bits <= 24), so this matches v_dot2_f32_f16 up to the
// rounding order of the two additions.
__device__ __forceinline__ float jf_dot2(uint32_t a, uint32_t b, float c) {
  const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&a));
  const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&b));
  return fmaf(fa.y, fb.y, fmaf(fa.x, fb.x, c));
}

__device__ __forceinline__ uint16_t jf_f2h(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

__device__ __forceinline__ uint32_t jf_f2h2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

#endif
