// CPU fused Adam/AdamW (+ AMSGrad, + fp32 masters writing a 16-bit model copy): one
// parallel pass over chunks of all tensors, at::vec fp32 math, 64-bit offsets.
#include <ATen/ATen.h>

#include <cmath>

#include "cpu/optim_common.h"

namespace lamp {
namespace cpu {

using namespace optim;

void fused_adam(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, const TensorList& steps,
                const TensorList& model_copies, const AdamHyper& h, const OptTensor& grad_scale,
                const OptTensor& found_inf) {
  if (skip_step(found_inf)) return;
  const bool amsgrad = !max_exp_avg_sqs.empty();
  const std::vector<Chunk> chunks = make_chunks(numels_of(params));
  // Constants are formed in double (1 - beta2 in fp32 would be off by ~1e-5 relative).
  const VecF scale(scale_of(grad_scale)), b1w(static_cast<float>(1.0 - h.beta1)), b2(static_cast<float>(h.beta2)), omb2(static_cast<float>(1.0 - h.beta2)),
      eps(static_cast<float>(h.eps)), wd(static_cast<float>(h.weight_decay)), decay(static_cast<float>(1.0 - h.lr * h.weight_decay));
  const bool has_wd = h.weight_decay != 0.0, unscale_grads = grad_scale.has_value();
  dispatch_types(params, grads, model_copies, "multi_tensor_adam", [&](auto p_tag, auto g_tag, auto m_tag, auto copy) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    using M = decltype(m_tag);
    run_chunks(chunks, [&](int64_t, const Chunk& c) {
      const double step = next_step(steps, c.tensor);
      const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, step) : 1.0;
      const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, step) : 1.0;
      const VecF neg_step_size(static_cast<float>(-h.lr / bc1)), bc2_sqrt(static_cast<float>(std::sqrt(bc2)));
      P* p = ptr<P>(params[c.tensor], c.begin);
      G* g = ptr<G>(grads[c.tensor], c.begin);
      P* m = ptr<P>(exp_avgs[c.tensor], c.begin);
      P* v = ptr<P>(exp_avg_sqs[c.tensor], c.begin);
      P* vmax = amsgrad ? ptr<P>(max_exp_avg_sqs[c.tensor], c.begin) : nullptr;
      M* out = nullptr;
      if constexpr (decltype(copy)::value) out = ptr<M>(model_copies[c.tensor], c.begin);
      const int64_t n = c.end - c.begin;
      for (int64_t i = 0; i < n; i += W) {
        const int64_t k = std::min(W, n - i);
        VecF gv = load_n(g + i, k) / scale;
        if (unscale_grads) store_n(g + i, gv, k);
        VecF pv = load_n(p + i, k);
        if (has_wd) {
          if (h.adam_w_mode) {
            pv = pv * decay;
          } else {
            gv = at::vec::fmadd(pv, wd, gv);
          }
        }
        VecF mv = load_n(m + i, k);
        mv = at::vec::fmadd(b1w, gv - mv, mv);
        VecF vv = load_n(v + i, k) * b2;
        vv = vv + omb2 * gv * gv;
        VecF second = vv;
        if (amsgrad) {
          second = at::vec::maximum(load_n(vmax + i, k), vv);
          store_n(vmax + i, second, k);
        }
        const VecF denom = second.sqrt() / bc2_sqrt + eps;
        pv = pv + neg_step_size * (mv / denom);
        store_n(p + i, pv, k);
        store_n(m + i, mv, k);
        store_n(v + i, vv, k);
        if constexpr (decltype(copy)::value) store_n(out + i, pv, k);
      }
    });
  });
  advance_steps(steps);
}

}  // namespace cpu
}  // namespace lamp
