// Elementwise epilogue of the dense FFN path (the automatic fallback when the activations are
// too dense for the sparse kernels to win): h = keep(act(z_act)) * z_lin, with z_lin absent for
// the non-gated block. The activation and its threshold are those of the sparse producer, so
// both paths compute the same function.
#include "twell_types.cuh"

using namespace twell;

template <typename T, int ACT>
__global__ void __launch_bounds__(256) ffn_act_mul(const T* __restrict__ z_act, const T* __restrict__ z_lin,
                                                   long long n, double threshold, T* __restrict__ out) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    // Round the activation to T first, exactly as the producer stores it, then decide.
    const T a = from_acc<T>(activate<ACT>(to_acc(z_act[i])));
    typename acc_of<T>::type h = keep(to_acc(a), threshold) ? to_acc(a) : 0;
    if (z_lin != nullptr) h *= to_acc(z_lin[i]);
    out[i] = from_acc<T>(h);
  }
}
