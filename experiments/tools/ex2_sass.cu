// What one exp2 costs in SASS: libdevice's non-FTZ path (ex2.approx.f32) against the
// bare MUFU instruction (ex2.approx.ftz.f32), and the packed half-precision forms
// (ex2.approx.f16x2, ex2.approx.ftz.bf16x2), which would halve the multi-function
// unit's work per exponential only if each compiled to one MUFU instruction. Built and
// disassembled on any machine (no GPU needed):
//   nvcc -arch=sm_90a -cubin -o ex2.cubin experiments/tools/ex2_sass.cu
//   cuobjdump -sass ex2.cubin     (cuobjdump and nvdisasm: PyPI's nvidia-cuda-cuobjdump
//                                  and nvidia-cuda-nvdisasm wheels where the toolkit
//                                  has none)
__global__ void ex2_approx(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float y; asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x[i])); x[i] = y; }
}
__global__ void ex2_approx_ftz(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x[i])); x[i] = y; }
}
// Two exponentials per 32-bit register.
__global__ void ex2_approx_f16x2(unsigned* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { unsigned y; asm("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x[i])); x[i] = y; }
}
__global__ void ex2_approx_ftz_bf16x2(unsigned* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    unsigned y;
    asm("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(y) : "r"(x[i]));
    x[i] = y;
  }
}
