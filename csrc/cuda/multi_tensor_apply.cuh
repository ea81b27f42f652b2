// CUDA multi-tensor-apply: one kernel launch processes chunks of many tensors.
//
// The host walks the tensor lists, cuts every tensor into chunks of kChunkSize elements and
// packs (tensor, chunk) pairs into a TensorListMetadata passed by value as the kernel
// argument (< 4 KiB); one CUDA block handles one chunk. A launch is issued whenever the
// metadata runs out of tensor slots or block slots; a tensor whose chunks straddle two
// launches is carried over. Sizes and element offsets are int64_t, so tensors past 2^31
// elements are indexed correctly (chunk indices are int32: up to 2^47 elements a tensor).
//
// Usage: multi_tensor_apply<Depth>(lists, aux, functor, args...) with lists[d][t] the t-th
// tensor of list d (all the same numel per t, all on one device, contiguous) and aux[t] an
// int64 the functor may use per tensor (e.g. its position in the caller's list). The functor
// is a device callable: functor(meta, args...) run by every thread of every block.
//
// Inside a chunk, functors walk their elements with for_each_element and move them with
// load_f32/store_f32: 16-byte loads and stores of N consecutive elements per thread (N such that
// the narrowest dtype of the functor's lists fills 16 bytes) when every list's pointer of the
// chunk's tensor is 16-byte aligned, then the chunk's last (size mod N) elements one at a time; a
// tensor with an unaligned pointer (a view at an odd offset) is walked one element at a time.
// Either walk applies the same per-element code, so the results do not depend on the path.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <vector>

#include "checks.h"    // num
#include "dispatch.h"  // dispatch_float_like

namespace lamp {
namespace cuda {

constexpr int64_t kChunkSize = 65536;  // elements per block, as apex's multi_tensor_apply
constexpr int kBlockSize = 512;
constexpr int kMaxBlocksPerLaunch = 320;

constexpr int kVecBytes = 16;  // one 128-bit load or store
static_assert(kChunkSize % (kVecBytes / 2) == 0, "chunk starts must keep 16-byte alignment for 2-byte dtypes");

// Tensor slots per launch by list depth, sized so the metadata stays below 4 KiB.
template <int Depth>
struct MaxTensors {
  static constexpr int value = Depth == 1 ? 96 : Depth == 2 ? 64 : Depth == 3 ? 48 : Depth == 4 ? 36 : 30;
};

template <int Depth>
struct TensorListMetadata {
  static constexpr int kMaxTensors = MaxTensors<Depth>::value;
  void* addresses[Depth][kMaxTensors];
  int64_t sizes[kMaxTensors];
  int64_t aux[kMaxTensors];
  uint8_t block_to_tensor[kMaxBlocksPerLaunch];
  int32_t block_to_chunk[kMaxBlocksPerLaunch];
};
static_assert(sizeof(TensorListMetadata<1>) < 4096, "kernel argument too large");
static_assert(sizeof(TensorListMetadata<5>) < 4096, "kernel argument too large");

// This block's chunk: tensor slot, [begin, end) element range (64-bit).
struct BlockChunk {
  int tensor;
  int64_t begin;
  int64_t end;
};

template <int Depth>
__device__ __forceinline__ BlockChunk block_chunk(const TensorListMetadata<Depth>& meta) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t end = begin + kChunkSize < meta.sizes[t] ? begin + kChunkSize : meta.sizes[t];
  return {t, begin, end};
}

// Elements per thread and step for lists of dtypes Ts: the narrowest fills 16 bytes (fp32 4, 16-bit 8).
template <typename... Ts>
constexpr int vec_width() {
  size_t narrowest = 16;
  for (size_t size : {sizeof(Ts)...}) narrowest = size < narrowest ? size : narrowest;
  return kVecBytes / static_cast<int>(narrowest);
}

// Whether every list's pointer of the tensor in `slot` is 16-byte aligned. Chunk starts are
// multiples of kChunkSize elements from it, so then every chunk start is too.
template <int Depth>
__device__ __forceinline__ bool slot_aligned(const TensorListMetadata<Depth>& meta, int slot) {
  bool aligned = true;
#pragma unroll
  for (int d = 0; d < Depth; ++d) aligned &= reinterpret_cast<uintptr_t>(meta.addresses[d][slot]) % kVecBytes == 0;
  return aligned;
}

template <int K>
using Width = std::integral_constant<int, K>;

// Calls body(i, Width<K>{}) so that every element of chunk c is handled once, by one thread, as
// element k of a group [i, i + K): when `aligned`, the chunk's whole N-element groups first (K = N;
// c.begin + multiples of N, so each group is 16-byte aligned), then the remaining elements with
// K = 1 (all of the chunk when not `aligned`).
template <int N, typename Body>
__device__ __forceinline__ void for_each_element(const BlockChunk& c, bool aligned, Body&& body) {
  int64_t rest = c.begin;
  if (aligned) {
    rest = c.begin + (c.end - c.begin) / N * N;
    const int64_t stride = static_cast<int64_t>(blockDim.x) * N;
    for (int64_t i = c.begin + static_cast<int64_t>(threadIdx.x) * N; i < rest; i += stride) body(i, Width<N>{});
  }
  for (int64_t i = rest + threadIdx.x; i < c.end; i += blockDim.x) body(i, Width<1>{});
}

// out[k] = float(src[i + k]), k < K: one plain load for K = 1, else K * sizeof(T) / 16 16-byte
// loads (src + i must then be 16-byte aligned, as for_each_element guarantees).
template <int K, typename T>
__device__ __forceinline__ void load_f32(float (&out)[K], const T* src, int64_t i) {
  if constexpr (K == 1) {
    out[0] = static_cast<float>(src[i]);
  } else {
    constexpr int kPer = kVecBytes / static_cast<int>(sizeof(T));
    static_assert(K % kPer == 0, "a group must be whole 16-byte vectors of every list");
#pragma unroll
    for (int v = 0; v < K / kPer; ++v) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src + i + v * kPer);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kPer; ++k) out[v * kPer + k] = static_cast<float>(e[k]);
    }
  }
}

// dst[i + k] = T(in[k]), k < K (rounded to nearest even, as a scalar store): as load_f32.
template <int K, typename T>
__device__ __forceinline__ void store_f32(T* dst, int64_t i, const float (&in)[K]) {
  if constexpr (K == 1) {
    dst[i] = static_cast<T>(in[0]);
  } else {
    constexpr int kPer = kVecBytes / static_cast<int>(sizeof(T));
    static_assert(K % kPer == 0, "a group must be whole 16-byte vectors of every list");
#pragma unroll
    for (int v = 0; v < K / kPer; ++v) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int k = 0; k < kPer; ++k) e[k] = static_cast<T>(in[v * kPer + k]);
      *reinterpret_cast<uint4*>(dst + i + v * kPer) = raw;
    }
  }
}

template <int Depth, typename Functor, typename... Args>
__global__ void __launch_bounds__(kBlockSize) multi_tensor_apply_kernel(TensorListMetadata<Depth> meta, Functor functor,
                                                                      Args... args) {
  functor(meta, args...);
}

template <int Depth, typename Functor, typename... Args>
void multi_tensor_apply(const std::vector<std::vector<at::Tensor>>& lists, const std::vector<int64_t>& aux,
                        Functor functor, Args... args) {
  TORCH_CHECK(lists.size() == Depth, "multi_tensor_apply: expected ", num(Depth), " lists, got ",
              num(lists.size()));
  const size_t count = lists[0].size();
  if (count == 0) return;
  TORCH_CHECK(aux.size() == count, "multi_tensor_apply: aux must hold one entry per tensor");
  const c10::cuda::CUDAGuard guard(lists[0][0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  using Meta = TensorListMetadata<Depth>;

  Meta meta;
  int tensors = 0;
  int blocks = 0;
  auto launch = [&]() {
    multi_tensor_apply_kernel<Depth><<<blocks, kBlockSize, 0, stream>>>(meta, functor, args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    blocks = 0;
  };
  for (size_t t = 0; t < count; ++t) {
    const int64_t numel = lists[0][t].numel();
    if (numel == 0) continue;
    const int64_t chunks = (numel + kChunkSize - 1) / kChunkSize;
    TORCH_CHECK(chunks <= std::numeric_limits<int32_t>::max(), "multi_tensor_apply: tensor of ", num(numel),
                " elements exceeds 2^31 chunks");
    for (int d = 0; d < Depth; ++d) meta.addresses[d][tensors] = lists[d][t].data_ptr();
    meta.sizes[tensors] = numel;
    meta.aux[tensors] = aux[t];
    ++tensors;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[blocks] = static_cast<uint8_t>(tensors - 1);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      if (blocks == kMaxBlocksPerLaunch || (tensors == Meta::kMaxTensors && last_chunk)) {
        launch();
        if (last_chunk) {
          tensors = 0;
        } else {  // the current tensor continues in the next launch: move it to slot 0
          for (int d = 0; d < Depth; ++d) meta.addresses[d][0] = meta.addresses[d][tensors - 1];
          meta.sizes[0] = meta.sizes[tensors - 1];
          meta.aux[0] = meta.aux[tensors - 1];
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) launch();
}

}  // namespace cuda
}  // namespace lamp
