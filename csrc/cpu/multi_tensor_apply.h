// CPU multi-tensor-apply: splits a list of tensors into chunks of at most kChunkSize
// elements and runs a functor over all chunks of all tensors with at::parallel_for, so one
// call keeps every core busy whether the list holds one huge tensor or many small ones.
// All offsets are int64_t: tensors past 2^31 elements are indexed correctly.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace lamp {
namespace cpu {

constexpr int64_t kChunkSize = 65536;  // elements per chunk, as apex's multi_tensor_apply

struct Chunk {
  int64_t tensor;  // index into the tensor list
  int64_t begin;   // first element (inclusive)
  int64_t end;     // last element (exclusive)
};

inline std::vector<Chunk> make_chunks(const std::vector<int64_t>& numels, int64_t chunk_size = kChunkSize) {
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < static_cast<int64_t>(numels.size()); ++t) {
    for (int64_t b = 0; b < numels[t]; b += chunk_size) {
      chunks.push_back({t, b, std::min(numels[t], b + chunk_size)});
    }
  }
  return chunks;
}

inline std::vector<int64_t> numels_of(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> n;
  n.reserve(tensors.size());
  for (const auto& t : tensors) n.push_back(t.numel());
  return n;
}

// Runs fn(chunk_index, chunk) for every chunk, in parallel over chunks.
template <typename F>
inline void for_each_chunk(const std::vector<Chunk>& chunks, const F& fn) {
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(i, chunks[i]);
  });
}

}  // namespace cpu
}  // namespace lamp
