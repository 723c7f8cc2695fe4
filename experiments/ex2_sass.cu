// What one exp2 costs in SASS: libdevice's non-FTZ path (ex2.approx.f32) against the
// bare MUFU instruction (ex2.approx.ftz.f32). Built and disassembled by
// experiments/run_h200.sh: nvcc -arch=sm_90 -cubin, then cuobjdump -sass.
__global__ void ex2_approx(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float y; asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x[i])); x[i] = y; }
}
__global__ void ex2_approx_ftz(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x[i])); x[i] = y; }
}
