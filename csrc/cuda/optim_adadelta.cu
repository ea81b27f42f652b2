// CUDA fused Adadelta (torch.optim.Adadelta semantics; optional 16-bit model copy): one
// multi-tensor-apply launch over chunks of many tensors, fp32 math, 64-bit offsets, 16-byte
// loads and stores (multi_tensor_apply.cuh).
#include <ATen/ATen.h>

#include "cuda/optim_common.cuh"

namespace lamp {
namespace cuda {
namespace {

using namespace optim;

struct AdadeltaArgs {
  float lr, rho, one_minus_rho, eps, weight_decay;
};

template <typename P, typename G, typename M, bool kCopy>
struct AdadeltaFunctor {
  static constexpr int Depth = 4 + (kCopy ? 1 : 0);

  __device__ __forceinline__ void operator()(const TensorListMetadata<Depth>& meta, AdadeltaArgs a,
                                             const float* grad_scale, const float* found_inf) const {
    if (skip_step(found_inf)) return;
    const BlockChunk c = block_chunk(meta);
    P* p = static_cast<P*>(meta.addresses[0][c.tensor]);
    G* g = static_cast<G*>(meta.addresses[1][c.tensor]);
    P* sq = static_cast<P*>(meta.addresses[2][c.tensor]);
    P* acc = static_cast<P*>(meta.addresses[3][c.tensor]);
    M* out = kCopy ? static_cast<M*>(meta.addresses[4][c.tensor]) : nullptr;
    const float scale = scale_of(grad_scale);
    for_each_element<vec_width<P, G, M>()>(c, slot_aligned(meta, c.tensor), [&](int64_t i, auto width) {
      constexpr int K = decltype(width)::value;
      float gv[K], pv[K], sv[K], av[K];
      load_f32(gv, g, i);
      load_f32(pv, p, i);
      load_f32(sv, sq, i);
      load_f32(av, acc, i);
      unscale_grads(gv, g, i, scale, grad_scale);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (a.weight_decay != 0.f) gv[k] = fmaf(pv[k], a.weight_decay, gv[k]);
        sv[k] = sv[k] * a.rho;
        sv[k] = sv[k] + a.one_minus_rho * gv[k] * gv[k];
        const float delta = sqrtf(av[k] + a.eps) / sqrtf(sv[k] + a.eps) * gv[k];
        av[k] = av[k] * a.rho;
        av[k] = av[k] + a.one_minus_rho * delta * delta;
        pv[k] = fmaf(delta, -a.lr, pv[k]);
      }
      store_f32(p, i, pv);
      store_f32(sq, i, sv);
      store_f32(acc, i, av);
      if constexpr (kCopy) store_f32(out, i, pv);
    });
  }
};

}  // namespace

void fused_adadelta(const TensorList& params, const TensorList& grads, const TensorList& square_avgs,
                    const TensorList& acc_deltas, const TensorList& steps, const TensorList& model_copies,
                    const AdadeltaHyper& h, const OptTensor& grad_scale, const OptTensor& found_inf) {
  const AdadeltaArgs args{float(h.lr), float(h.rho), float(1.0 - h.rho), float(h.eps), float(h.weight_decay)};
  std::vector<std::vector<at::Tensor>> lists = {params, grads, square_avgs, acc_deltas};
  const bool copy = !model_copies.empty();
  if (copy) lists.push_back(model_copies);
  dispatch_types(params, grads, model_copies, "multi_tensor_adadelta",
                 [&](auto p_tag, auto g_tag, auto m_tag, auto copy_tag) {
    using Functor = AdadeltaFunctor<decltype(p_tag), decltype(g_tag), decltype(m_tag), decltype(copy_tag)::value>;
    multi_tensor_apply<Functor::Depth>(lists, positions(params.size()), Functor{}, args, ptr_or_null(grad_scale),
                                       ptr_or_null(found_inf));
  });
  advance_steps(steps, found_inf);
}

}  // namespace cuda
}  // namespace lamp
