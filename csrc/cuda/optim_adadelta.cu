// CUDA fused Adadelta (torch.optim.Adadelta semantics; optional 16-bit model copy): one
// multi-tensor-apply launch over chunks of many tensors, fp32 math, 64-bit offsets.
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
    for (int64_t i = c.begin + threadIdx.x; i < c.end; i += blockDim.x) {
      float gv = to_f32(g[i]) / scale;
      if (grad_scale != nullptr) g[i] = from_f32<G>(gv);  // the grad left unscaled, as torch's fused kernels
      float pv = to_f32(p[i]);
      if (a.weight_decay != 0.f) gv = fmaf(pv, a.weight_decay, gv);
      float sv = to_f32(sq[i]) * a.rho;
      sv = sv + a.one_minus_rho * gv * gv;
      float av = to_f32(acc[i]);
      const float delta = sqrtf(av + a.eps) / sqrtf(sv + a.eps) * gv;
      av = av * a.rho;
      av = av + a.one_minus_rho * delta * delta;
      pv = fmaf(delta, -a.lr, pv);
      p[i] = from_f32<P>(pv);
      sq[i] = from_f32<P>(sv);
      acc[i] = from_f32<P>(av);
      if constexpr (kCopy) out[i] = from_f32<M>(pv);
    }
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
