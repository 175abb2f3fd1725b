#pragma once
// Compensated float64 sums on the device (Neumaier's variant of Kahan's), shared by the GPU oracles' kernels
// (reference_kernels.cu, kinds/router/router_oracle_kernels.cu, kinds/lm_head/lm_head_oracle_kernels.cu): a sum and
// the rounding errors of its additions, which the value adds back. Compiled with -fmad=false where it is used.
#include <cuda_runtime.h>

namespace lossverify::cuda {

namespace {

struct Neumaier {
  double s = 0.0, c = 0.0;
  __device__ void add(double x) {
    const double t = s + x;
    if (fabs(s) >= fabs(x)) {
      c += (s - t) + x;
    } else {
      c += (x - t) + s;
    }
    s = t;
  }
  __device__ void merge(const Neumaier& o) {
    add(o.s);
    add(o.c);
  }
  __device__ double value() const { return s + c; }
};

// x from lane + offset (a shuffle down).
__device__ Neumaier shfl(const Neumaier& x, int offset) {
  Neumaier r;
  r.s = __shfl_down_sync(0xffffffffu, x.s, offset);
  r.c = __shfl_down_sync(0xffffffffu, x.c, offset);
  return r;
}

}  // namespace

}  // namespace lossverify::cuda
