// CPU fused SGD (momentum, dampening, nesterov, weight decay; optional 16-bit model copy):
// one parallel pass over chunks of all tensors, at::vec fp32 math, 64-bit offsets.
#include <ATen/ATen.h>

#include <type_traits>

#include "cpu/optim_common.h"

namespace lamp {
namespace cpu {

using namespace optim;

void fused_sgd(const TensorList& params, const TensorList& grads, const TensorList& momentum_buffers,
               const TensorList& model_copies, const SgdHyper& h, const OptTensor& grad_scale,
               const OptTensor& found_inf) {
  if (skip_step(found_inf)) return;
  const bool use_momentum = h.momentum != 0.0;
  const std::vector<Chunk> chunks = make_chunks(numels_of(params));
  const VecF scale(scale_of(grad_scale)), wd(static_cast<float>(h.weight_decay)), mom(static_cast<float>(h.momentum)),
      damp(static_cast<float>(1.0 - h.dampening)), neg_lr(static_cast<float>(-h.lr));
  const bool has_wd = h.weight_decay != 0.0, unscale_grads = grad_scale.has_value();
  dispatch_types(params, grads, model_copies, "multi_tensor_sgd", [&](auto p_tag, auto g_tag, auto m_tag, auto copy) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    using M = decltype(m_tag);
    run_chunks(chunks, [&](int64_t, const Chunk& c) {
      P* p = ptr<P>(params[c.tensor], c.begin);
      G* g = ptr<G>(grads[c.tensor], c.begin);
      P* buf = use_momentum ? ptr<P>(momentum_buffers[c.tensor], c.begin) : nullptr;
      M* out = nullptr;
      if constexpr (decltype(copy)::value) out = ptr<M>(model_copies[c.tensor], c.begin);
      const int64_t n = c.end - c.begin;
      for (int64_t i = 0; i < n; i += W) {
        const int64_t k = std::min(W, n - i);
        VecF gv = load_n(g + i, k) / scale;
        if (unscale_grads) store_n(g + i, gv, k);
        VecF pv = load_n(p + i, k);
        if (has_wd) gv = at::vec::fmadd(pv, wd, gv);
        if (use_momentum) {
          VecF bv = h.first_run ? gv : at::vec::fmadd(gv, damp, load_n(buf + i, k) * mom);
          store_n(buf + i, bv, k);
          if constexpr (!std::is_same_v<P, float>) bv = as_stored(buf + i, bv, k);  // the stored momentum, as torch
          gv = h.nesterov ? at::vec::fmadd(bv, mom, gv) : bv;
        }
        pv = at::vec::fmadd(gv, neg_lr, pv);
        store_n(p + i, pv, k);
        if constexpr (decltype(copy)::value) store_n(out + i, pv, k);
      }
    });
  });
}

}  // namespace cpu
}  // namespace lamp
