// CPU fused Adadelta (torch.optim.Adadelta semantics; optional 16-bit model copy): one
// parallel pass over chunks of all tensors, at::vec fp32 math, 64-bit offsets.
#include <ATen/ATen.h>

#include "cpu/optim_common.h"

namespace lamp {
namespace cpu {

using namespace optim;

void fused_adadelta(const TensorList& params, const TensorList& grads, const TensorList& square_avgs,
                    const TensorList& acc_deltas, const TensorList& steps, const TensorList& model_copies,
                    const AdadeltaHyper& h, const OptTensor& grad_scale, const OptTensor& found_inf) {
  if (skip_step(found_inf)) return;
  const std::vector<Chunk> chunks = make_chunks(numels_of(params));
  const VecF scale(scale_of(grad_scale)), wd(static_cast<float>(h.weight_decay)), rho(static_cast<float>(h.rho)), omr(static_cast<float>(1.0 - h.rho)),
      eps(static_cast<float>(h.eps)), neg_lr(static_cast<float>(-h.lr));
  const bool has_wd = h.weight_decay != 0.0, unscale_grads = grad_scale.has_value();
  dispatch_types(params, grads, model_copies, "multi_tensor_adadelta",
                 [&](auto p_tag, auto g_tag, auto m_tag, auto copy) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    using M = decltype(m_tag);
    run_chunks(chunks, [&](int64_t, const Chunk& c) {
      P* p = ptr<P>(params[c.tensor], c.begin);
      G* g = ptr<G>(grads[c.tensor], c.begin);
      P* sq = ptr<P>(square_avgs[c.tensor], c.begin);
      P* acc = ptr<P>(acc_deltas[c.tensor], c.begin);
      M* out = nullptr;
      if constexpr (decltype(copy)::value) out = ptr<M>(model_copies[c.tensor], c.begin);
      const int64_t n = c.end - c.begin;
      for (int64_t i = 0; i < n; i += W) {
        const int64_t k = std::min(W, n - i);
        VecF gv = load_n(g + i, k) / scale;
        if (unscale_grads) store_n(g + i, gv, k);
        VecF pv = load_n(p + i, k);
        if (has_wd) gv = at::vec::fmadd(pv, wd, gv);
        VecF sv = load_n(sq + i, k) * rho;
        sv = sv + omr * gv * gv;
        VecF av = load_n(acc + i, k);
        const VecF delta = (av + eps).sqrt() / (sv + eps).sqrt() * gv;
        av = av * rho;
        av = av + omr * delta * delta;
        pv = at::vec::fmadd(delta, neg_lr, pv);
        store_n(p + i, pv, k);
        store_n(sq + i, sv, k);
        store_n(acc + i, av, k);
        if constexpr (decltype(copy)::value) store_n(out + i, pv, k);
      }
    });
  });
  advance_steps(steps);
}

}  // namespace cpu
}  // namespace lamp
