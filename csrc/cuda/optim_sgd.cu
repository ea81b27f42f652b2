// CUDA fused SGD (momentum, dampening, nesterov, weight decay; optional 16-bit model copy):
// one multi-tensor-apply launch over chunks of many tensors, fp32 math, 64-bit offsets, 16-byte
// loads and stores (multi_tensor_apply.cuh).
#include <ATen/ATen.h>

#include "cuda/optim_common.cuh"

namespace lamp {
namespace cuda {
namespace {

using namespace optim;

struct SgdArgs {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, first_run;
};

template <typename P, typename G, typename M, bool kMomentum, bool kCopy>
struct SgdFunctor {
  static constexpr int Depth = 2 + (kMomentum ? 1 : 0) + (kCopy ? 1 : 0);

  __device__ __forceinline__ void operator()(const TensorListMetadata<Depth>& meta, SgdArgs a, const float* grad_scale,
                                             const float* found_inf) const {
    if (skip_step(found_inf)) return;
    const BlockChunk c = block_chunk(meta);
    P* p = static_cast<P*>(meta.addresses[0][c.tensor]);
    G* g = static_cast<G*>(meta.addresses[1][c.tensor]);
    P* buf = kMomentum ? static_cast<P*>(meta.addresses[2][c.tensor]) : nullptr;
    M* out = kCopy ? static_cast<M*>(meta.addresses[Depth - 1][c.tensor]) : nullptr;
    const float scale = scale_of(grad_scale);
    for_each_element<vec_width<P, G, M>()>(c, slot_aligned(meta, c.tensor), [&](int64_t i, auto width) {
      constexpr int K = decltype(width)::value;
      float gv[K], pv[K];
      [[maybe_unused]] float bv[K];  // the momentum (kMomentum)
      load_f32(gv, g, i);
      load_f32(pv, p, i);
      if constexpr (kMomentum) {
        if (!a.first_run) load_f32(bv, buf, i);
      }
      unscale_grads(gv, g, i, scale, grad_scale);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (a.weight_decay != 0.f) gv[k] = fmaf(pv[k], a.weight_decay, gv[k]);
        if constexpr (kMomentum) {
          // the stored momentum, as torch
          bv[k] = to_f32(from_f32<P>(a.first_run ? gv[k] : fmaf(gv[k], a.one_minus_dampening, bv[k] * a.momentum)));
          gv[k] = a.nesterov ? fmaf(bv[k], a.momentum, gv[k]) : bv[k];
        }
        pv[k] = fmaf(gv[k], -a.lr, pv[k]);
      }
      if constexpr (kMomentum) store_f32(buf, i, bv);  // exact: bv holds values of P
      store_f32(p, i, pv);
      if constexpr (kCopy) store_f32(out, i, pv);
    });
  }
};

template <bool kMomentum, bool kCopy>
void launch_sgd(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
                const TensorList& model_copies, const SgdArgs& args, const OptTensor& grad_scale,
                const OptTensor& found_inf) {
  std::vector<std::vector<at::Tensor>> lists = {params, grads};
  if (kMomentum) lists.push_back(momentum_buffers);
  if (kCopy) lists.push_back(model_copies);
  dispatch_types(params, grads, model_copies, "multi_tensor_sgd", [&](auto p_tag, auto g_tag, auto m_tag, auto copy) {
    if constexpr (decltype(copy)::value == kCopy) {
      using Functor = SgdFunctor<decltype(p_tag), decltype(g_tag), decltype(m_tag), kMomentum, kCopy>;
      multi_tensor_apply<Functor::Depth>(lists, positions(params.size()), Functor{}, args, ptr_or_null(grad_scale),
                                         ptr_or_null(found_inf));
    }
  });
}

}  // namespace

void fused_sgd(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
               const TensorList& model_copies, const SgdHyper& h, const OptTensor& grad_scale,
               const OptTensor& found_inf) {
  const SgdArgs args{float(h.lr), float(h.momentum), float(1.0 - h.dampening), float(h.weight_decay), h.nesterov,
                     h.first_run};
  const bool momentum = h.momentum != 0.0, copy = !model_copies.empty();
  if (momentum && copy) {
    launch_sgd<true, true>(params, grads, momentum_buffers, model_copies, args, grad_scale, found_inf);
  } else if (momentum) {
    launch_sgd<true, false>(params, grads, momentum_buffers, model_copies, args, grad_scale, found_inf);
  } else if (copy) {
    launch_sgd<false, true>(params, grads, momentum_buffers, model_copies, args, grad_scale, found_inf);
  } else {
    launch_sgd<false, false>(params, grads, momentum_buffers, model_copies, args, grad_scale, found_inf);
  }
}

}  // namespace cuda
}  // namespace lamp
