#pragma once
// The copy engine's 1-D bulk copy (cp.async.bulk, sm_90) into a CTA's shared memory, completing on an
// mbarrier: the row-resident kernels prefetch the next row's slice with it while computing this one.
#include <cstdint>

namespace lossverify::cuda {

__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void barrier_init(std::uint64_t* barrier) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(barrier)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival (the issuing thread's) that also expects `bytes` of copies, then the copy itself. Source and
// destination 16-byte aligned, `bytes` a multiple of 16.
__device__ __forceinline__ void bulk_load(void* destination, const void* source, std::uint32_t bytes,
                                          std::uint64_t* barrier) {
  const std::uint32_t b = smem_address(barrier);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
  if (bytes > 0) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_address(destination)),
                 "l"(source), "r"(bytes), "r"(b)
                 : "memory");
  }
}
__device__ __forceinline__ void barrier_wait(std::uint64_t* barrier, std::uint32_t parity) {
  const std::uint32_t b = smem_address(barrier);
  std::uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(b), "r"(parity)
        : "memory");
  }
}
// Before a bulk copy overwrites a buffer that threads have just read through the generic proxy.
__device__ __forceinline__ void async_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

}  // namespace lossverify::cuda
