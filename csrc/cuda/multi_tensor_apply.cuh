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
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "checks.h"    // num
#include "dispatch.h"  // dispatch_float_like

namespace lamp {
namespace cuda {

constexpr int64_t kChunkSize = 65536;  // elements per block, as apex's multi_tensor_apply
constexpr int kBlockSize = 512;
constexpr int kMaxBlocksPerLaunch = 320;

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
