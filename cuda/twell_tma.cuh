// The bulk tensor copy engine (TMA), the shared-memory barriers its copies complete on, and the
// cluster operations of CTA pairs (sm_90): the fused Hopper producer's operand ring, the tiled
// kernels' stages.
#pragma once

namespace twell {

// cuTensorMapEncodeTiled's opaque 128-byte descriptor, passed by value (__grid_constant__).
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (unsigned)a;
}

__device__ __forceinline__ void barrier_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_expect_bytes(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void barrier_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void barrier_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_load_2d(unsigned dst, const TensorMap* map, int c0, int c1, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// The same copy, delivered to the same shared-memory offset (data and barrier) in every CTA of
// the cluster named by cta_mask.
__device__ __forceinline__ void tma_load_2d_multicast(unsigned dst, const TensorMap* map, int c0, int c1, unsigned bar,
                                                      unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
      : "memory");
}

// An arrival on the barrier at this CTA's shared address bar, in the cluster's CTA `rank`. With
// the default (CTA-scope) release: it only says that this warp's MMAs have finished reading a
// stage (wgmma_wait before it), which needs no ordering of its own memory operations at cluster
// scope; .release.cluster would put a GPU-wide memory barrier before every arrival (SASS:
// MEMBAR.ALL.GPU), which made the pair schedule 1.6x slower than without clusters.
__device__ __forceinline__ void barrier_arrive_in(unsigned bar, unsigned rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}

// A warp's release of a ring stage: an arrival on the stage's empty barrier in every CTA of the
// cluster (each CTA's refilling thread copies into all of them), or in its own CTA alone.
template <int CLUSTER> __device__ __forceinline__ void release_stage(unsigned bar) {
  if (CLUSTER == 1) barrier_arrive(bar);
  else
#pragma unroll
    for (unsigned c = 0; c < CLUSTER; ++c) barrier_arrive_in(bar, c);
}

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster (release / acquire: shared-memory writes before it,
// barrier initialisations included, are visible to the cluster after it).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// An int in the shared memory of the cluster's CTA `rank`, at the address this CTA's `local` has.
__device__ __forceinline__ int load_from_cta(const int* local, unsigned rank) {
  unsigned remote;
  int v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(local)), "r"(rank));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
  return v;
}

}  // namespace twell
