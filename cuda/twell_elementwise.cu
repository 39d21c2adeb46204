// Elementwise epilogue of the dense FFN path (the automatic fallback when the activations are
// too dense for the sparse kernels to win): h = keep(act(z_act)) * z_lin, with z_lin absent for
// the non-gated block. The activation and its threshold are those of the sparse producer, so
// both paths compute the same function.
#include "twell_types.cuh"

using namespace twell;

// The activation of z rounded to T first, exactly as the producer stores it (into `a`), and
// whether the producer keeps it.
template <typename T, int ACT>
__device__ __forceinline__ bool kept_activation(T z, double threshold, T& a) {
  a = from_acc<T>(activate<ACT>(to_acc(z)));
  return keep(to_acc(a), threshold);
}

template <typename T, int ACT>
__device__ __forceinline__ T act_mul_one(T z_act, const T* z_lin, long long i, double threshold) {
  T a;
  typename acc_of<T>::type h = kept_activation<T, ACT>(z_act, threshold, a) ? to_acc(a) : 0;
  if (z_lin != nullptr) h *= to_acc(z_lin[i]);
  return from_acc<T>(h);
}

// Grid-stride over 16-byte chunks when `vector_ok` (all three arrays 16-byte aligned), then the
// scalar tail: a streaming pass that reads z_act (and z_lin) once and writes out once.
template <typename T, int ACT>
__global__ void __launch_bounds__(256) ffn_act_mul(const T* __restrict__ z_act, const T* __restrict__ z_lin,
                                                   long long n, int vector_ok, double threshold,
                                                   T* __restrict__ out) {
  constexpr int V = 16 / (int)sizeof(T);
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const long long n_vec = vector_ok ? n / V : 0;
  for (long long c = first; c < n_vec; c += stride) {
    const Chunk<T, V> a = reinterpret_cast<const Chunk<T, V>*>(z_act)[c];
    Chunk<T, V> lin;
    if (z_lin != nullptr) lin = reinterpret_cast<const Chunk<T, V>*>(z_lin)[c];
    Chunk<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = act_mul_one<T, ACT>(a.v[j], z_lin != nullptr ? lin.v : nullptr, j, threshold);
    reinterpret_cast<Chunk<T, V>*>(out)[c] = o;
  }
  for (long long i = n_vec * V + first; i < n; i += stride) out[i] = act_mul_one<T, ACT>(z_act[i], z_lin, i, threshold);
}

// How many activations of the sampled rows the sparse path would keep (kept_activation, as
// act_mul_one decides): rows 0, step, 2*step, ... of z (row
// stride ld), one block each. `count` (zeroed by the caller) gets the total. The FFN plans'
// density sample in one launch: the chain of array operations it replaces cost about 0.15 ms of
// host time per sample, which at 4096 tokens made the dense remainder wait for the host.
template <typename T, int ACT>
__global__ void __launch_bounds__(256) ffn_kept_count(const T* __restrict__ z, long long ld, long long step, int N,
                                                      double threshold, unsigned long long* __restrict__ count) {
  const T* row = z + blockIdx.x * step * ld;
  unsigned kept = 0;
  for (int j = threadIdx.x; j < N; j += blockDim.x) {
    T a;
    kept += kept_activation<T, ACT>(row[j], threshold, a) ? 1u : 0u;
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) kept += __shfl_xor_sync(0xffffffffu, kept, d);
  if ((threadIdx.x & 31) == 0 && kept) atomicAdd(count, (unsigned long long)kept);
}

// Keeps one thread busy for `ns` nanoseconds of the GPU's global timer. The benchmarks' timer
// queues it before the start event so that the host has queued every launch of the timed call
// before the GPU reaches them: the measured time is then the GPU's alone, without the host's
// launch gaps (which a CUDA graph or a host running ahead would hide in a real model).
extern "C" __global__ void twell_spin(long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while ((long long)(t - t0) < ns);
}
