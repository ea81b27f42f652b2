// CUDA multi-tensor scale (with inf/nan flags), finite check (read only) and L2 norm (global and
// per tensor), each a few multi_tensor_apply launches per call regardless of the number of tensors.
// fp32 math; the scale and the finite check move 16 bytes per load/store (multi_tensor_apply.cuh).
// Compiled without --use_fast_math: isfinite must see inf and nan.
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/multi_tensor_apply.cuh"
#include "kernels.h"

namespace lamp {
namespace cuda {
namespace {

// dst = src * scale over one chunk; marks found_inf and flags[aux] when src has inf/nan.
template <typename S, typename D>
struct ScaleFunctor {
  __device__ void operator()(const TensorListMetadata<2>& meta, float scale, float* found_inf, float* flags) const {
    const BlockChunk c = block_chunk(meta);
    const S* in = static_cast<const S*>(meta.addresses[0][c.tensor]);
    D* out = static_cast<D*>(meta.addresses[1][c.tensor]);
    int bad = 0;
    for_each_element<vec_width<S, D>()>(c, slot_aligned(meta, c.tensor), [&](int64_t i, auto width) {
      constexpr int K = decltype(width)::value;
      float x[K];
      load_f32(x, in, i);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        bad |= !isfinite(x[k]);
        x[k] = x[k] * scale;
      }
      store_f32(out, i, x);
    });
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
      *found_inf = 1.f;  // every writer stores the same value: no atomics needed
      flags[meta.aux[c.tensor]] = 1.f;
    }
  }
};

// found_inf = 1 when one chunk holds inf/nan; the tensors are only read.
template <typename T>
struct CheckFiniteFunctor {
  __device__ void operator()(const TensorListMetadata<1>& meta, float* found_inf) const {
    const BlockChunk c = block_chunk(meta);
    const T* p = static_cast<const T*>(meta.addresses[0][c.tensor]);
    int bad = 0;
    for_each_element<vec_width<T>()>(c, slot_aligned(meta, c.tensor), [&](int64_t i, auto width) {
      constexpr int K = decltype(width)::value;
      float x[K];
      load_f32(x, p, i);
#pragma unroll
      for (int k = 0; k < K; ++k) bad |= !isfinite(x[k]);
    });
    if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.f;
  }
};

// The positions of tensors grouped by dtype: one multi_tensor_apply per dtype present.
std::map<at::ScalarType, std::vector<int64_t>> by_dtype(const std::vector<at::Tensor>& tensors) {
  std::map<at::ScalarType, std::vector<int64_t>> groups;
  for (int64_t t = 0; t < static_cast<int64_t>(tensors.size()); ++t) groups[tensors[t].scalar_type()].push_back(t);
  return groups;
}

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kBlockSize / 32];
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.f;
  if (warp == 0) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  }
  return v;  // valid in thread 0
}

// partials[aux + chunk] = sum of squares of one chunk (aux = the tensor's first partial slot).
template <typename T>
struct SumSquaresFunctor {
  __device__ void operator()(const TensorListMetadata<1>& meta, float* partials) const {
    const BlockChunk c = block_chunk(meta);
    const T* p = static_cast<const T*>(meta.addresses[0][c.tensor]);
    float acc = 0.f;
    for (int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
      const float x = static_cast<float>(p[i]);
      acc = fmaf(x, x, acc);
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) partials[meta.aux[c.tensor] + meta.block_to_chunk[blockIdx.x]] = acc;
  }
};

// One block per tensor: squares[t] = sum of partials[offsets[t], offsets[t + 1]) in fp64,
// a fixed order, so the result is deterministic.
__global__ void __launch_bounds__(256) reduce_partials_kernel(const float* partials, const int64_t* offsets,
                                                              double* squares) {
  __shared__ double sums[256];
  const int64_t t = blockIdx.x;
  double acc = 0.0;
  for (int64_t i = offsets[t] + threadIdx.x; i < offsets[t + 1]; i += blockDim.x) acc += partials[i];
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) squares[t] = sums[0];
}

}  // namespace

at::Tensor multi_tensor_scale(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale,
                              at::Tensor& found_inf) {
  const int64_t count = static_cast<int64_t>(src.size());
  at::Tensor flags = at::zeros({count}, found_inf.options().dtype(at::kFloat));
  if (count == 0) return flags;
  // One multi_tensor_apply per (src dtype, dst dtype) pair present in the lists.
  std::map<std::pair<at::ScalarType, at::ScalarType>, std::vector<int64_t>> groups;
  for (int64_t i = 0; i < count; ++i) groups[{src[i].scalar_type(), dst[i].scalar_type()}].push_back(i);
  for (const auto& group : groups) {
    const std::pair<at::ScalarType, at::ScalarType>& types = group.first;
    const std::vector<int64_t>& members = group.second;
    std::vector<std::vector<at::Tensor>> lists(2);
    for (int64_t i : members) {
      lists[0].push_back(src[i]);
      lists[1].push_back(dst[i]);
    }
    dispatch_float_like(types.first, "multi_tensor_scale", [&](auto s_tag) {
      dispatch_float_like(types.second, "multi_tensor_scale", [&](auto d_tag) {
        using S = decltype(s_tag);
        using D = decltype(d_tag);
        multi_tensor_apply<2>(lists, members, ScaleFunctor<S, D>(), static_cast<float>(scale),
                              found_inf.data_ptr<float>(), flags.data_ptr<float>());
      });
    });
  }
  return flags;
}

void multi_tensor_check_finite(const std::vector<at::Tensor>& tensors, at::Tensor& found_inf) {
  for (const auto& group : by_dtype(tensors)) {
    std::vector<std::vector<at::Tensor>> lists(1);
    for (int64_t t : group.second) lists[0].push_back(tensors[t]);
    dispatch_float_like(group.first, "multi_tensor_check_finite", [&](auto tag) {
      using T = decltype(tag);
      multi_tensor_apply<1>(lists, group.second, CheckFiniteFunctor<T>(), found_inf.data_ptr<float>());
    });
  }
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& tensors) {
  const int64_t count = static_cast<int64_t>(tensors.size());
  const auto options = tensors[0].options();
  std::vector<int64_t> offsets(count + 1, 0);
  for (int64_t t = 0; t < count; ++t) {
    offsets[t + 1] = offsets[t] + (tensors[t].numel() + kChunkSize - 1) / kChunkSize;
  }
  at::Tensor partials = at::empty({std::max<int64_t>(offsets[count], 1)}, options.dtype(at::kFloat));
  for (const auto& group : by_dtype(tensors)) {
    const at::ScalarType dtype = group.first;
    const std::vector<int64_t>& members = group.second;
    std::vector<std::vector<at::Tensor>> lists(1);
    std::vector<int64_t> first_slot;
    for (int64_t t : members) {
      lists[0].push_back(tensors[t]);
      first_slot.push_back(offsets[t]);
    }
    dispatch_float_like(dtype, "multi_tensor_l2norm", [&](auto tag) {
      using T = decltype(tag);
      multi_tensor_apply<1>(lists, first_slot, SumSquaresFunctor<T>(), partials.data_ptr<float>());
    });
  }
  const at::Tensor device_offsets =
      at::from_blob(offsets.data(), {count + 1}, at::TensorOptions().dtype(at::kLong)).to(options.device());
  at::Tensor squares = at::empty({count}, options.dtype(at::kDouble));
  const c10::cuda::CUDAGuard guard(options.device());
  reduce_partials_kernel<<<static_cast<unsigned int>(count), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      partials.data_ptr<float>(), device_offsets.data_ptr<int64_t>(), squares.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor each = squares.sqrt().to(at::kFloat);
  at::Tensor total = squares.sum().sqrt().to(at::kFloat);
  return {total, each};
}

}  // namespace cuda
}  // namespace lamp
