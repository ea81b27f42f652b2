// CUDA fused SGD (momentum, dampening, nesterov, weight decay; optional 16-bit model copy):
// one multi-tensor-apply launch over chunks of many tensors, fp32 math, 64-bit offsets.
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
    for (int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
      float gv = to_f32(g[i]) / scale;
      if (grad_scale != nullptr) g[i] = from_f32<G>(gv);  // the grad left unscaled, as torch's fused kernels
      float pv = to_f32(p[i]);
      if (a.weight_decay != 0.f) gv = fmaf(pv, a.weight_decay, gv);
      if constexpr (kMomentum) {
        const P stored = from_f32<P>(a.first_run ? gv : fmaf(gv, a.one_minus_dampening, to_f32(buf[i]) * a.momentum));
        buf[i] = stored;
        const float bv = to_f32(stored);  // the stored momentum, as torch
        gv = a.nesterov ? fmaf(bv, a.momentum, gv) : bv;
      }
      pv = fmaf(gv, -a.lr, pv);
      p[i] = from_f32<P>(pv);
      if constexpr (kCopy) out[i] = from_f32<M>(pv);
    }
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
