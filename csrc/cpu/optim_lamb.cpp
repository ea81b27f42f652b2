// CPU fused LAMB with apex FusedLAMB semantics, in two parallel passes over chunks of all
// tensors (at::vec fp32 math, 64-bit offsets):
//   1. lamb_moments: unscale the grads (written back unscaled, not clipped, when a grad_scale is
//      given), clip them, update the moments, and reduce ||p||^2 and ||update||^2 per tensor (the
//      update is not stored: no scratch buffer);
//   2. lamb_apply: recompute the update from the stored moments and the unchanged params and
//      apply it with the per-tensor trust ratio from those squared norms, then advance the steps.
// fused_lamb runs both back to back; sharded params (FSDP2) call them apart and sum the squared
// norms of the local shards over the shard group in between.
#include <ATen/ATen.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu/optim_common.h"

namespace lamp {
namespace cpu {

using namespace optim;

namespace {

struct Corrections {
  VecF inv_bc1, inv_bc2;
};

// The per-step constants both passes share.
struct LambConsts {
  VecF eps, wd;
  bool decoupled;  // adam_w_mode with weight decay: u += weight_decay * p
  std::vector<Corrections> corr;

  LambConsts(const LambHyper& h, const TensorList& steps)
      : eps(static_cast<float>(h.eps)), wd(static_cast<float>(h.weight_decay)),
        decoupled(h.adam_w_mode && h.weight_decay != 0.0), corr(steps.size()) {
    for (size_t t = 0; t < steps.size(); ++t) {
      const double step = next_step(steps, static_cast<int64_t>(t));
      const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, step) : 1.0;
      const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, step) : 1.0;
      corr[t] = {VecF(static_cast<float>(1.0 / bc1)), VecF(static_cast<float>(1.0 / bc2))};
    }
  }

  // u = m_hat / (sqrt(v_hat) + eps) (+ weight_decay * p in adam_w_mode).
  VecF update(const VecF& m, const VecF& v, const VecF& p, int64_t t) const {
    const Corrections& c = corr[t];
    VecF u = (m * c.inv_bc1) / ((v * c.inv_bc2).sqrt() + eps);
    return decoupled ? at::vec::fmadd(p, wd, u) : u;
  }
};

inline double lane_sum(const VecF& v) {
  float lanes[W];
  v.store(lanes);
  double s = 0.0;
  for (int64_t j = 0; j < W; ++j) s += lanes[j];
  return s;
}

}  // namespace

at::Tensor lamb_moments(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                        const TensorList& exp_avg_sqs, const TensorList& steps, const LambHyper& h,
                        const at::Tensor& global_grad_norm, const OptTensor& grad_scale, const OptTensor& found_inf) {
  const int64_t count = static_cast<int64_t>(params.size());
  at::Tensor sq_norms = at::zeros({count, 2}, params[0].options().dtype(at::kDouble));
  if (skip_step(found_inf)) return sq_norms;
  const std::vector<Chunk> chunks = make_chunks(numels_of(params));
  const float gnorm = global_grad_norm.data_ptr<float>()[0];
  const double clip = (h.max_grad_norm > 0.0 && gnorm > h.max_grad_norm) ? gnorm / h.max_grad_norm : 1.0;
  const VecF scale(scale_of(grad_scale)), clipv(static_cast<float>(clip)), b1(static_cast<float>(h.beta1)),
      b2(static_cast<float>(h.beta2)), omb2(static_cast<float>(1.0 - h.beta2)),
      b3(static_cast<float>(h.grad_averaging ? 1.0 - h.beta1 : 1.0));
  const bool l2 = !h.adam_w_mode && h.weight_decay != 0.0, unscale_grads = grad_scale.has_value();
  const LambConsts k(h, steps);
  std::vector<double> chunk_p2(chunks.size(), 0.0), chunk_u2(chunks.size(), 0.0);
  dispatch_types(params, grads, {}, "multi_tensor_lamb", [&](auto p_tag, auto g_tag, auto, auto) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    run_chunks(chunks, [&](int64_t ci, const Chunk& c) {
      const P* p = cptr<P>(params[c.tensor], c.begin);
      G* g = ptr<G>(grads[c.tensor], c.begin);
      P* m = ptr<P>(exp_avgs[c.tensor], c.begin);
      P* v = ptr<P>(exp_avg_sqs[c.tensor], c.begin);
      VecF p2(0.f), u2(0.f);
      const int64_t n = c.end - c.begin;
      for (int64_t i = 0; i < n; i += W) {
        const int64_t w = std::min(W, n - i);
        const VecF pv = load_n(p + i, w);
        const VecF unscaled = load_n(g + i, w) / scale;
        if (unscale_grads) store_n(g + i, unscaled, w);
        VecF gv = unscaled / clipv;
        if (l2) gv = at::vec::fmadd(pv, k.wd, gv);
        VecF mv = at::vec::fmadd(gv, b3, load_n(m + i, w) * b1);
        VecF vv = load_n(v + i, w) * b2;
        vv = vv + omb2 * gv * gv;
        store_n(m + i, mv, w);
        store_n(v + i, vv, w);
        if constexpr (!std::is_same_v<P, float>) {  // pass 2 sees the stored (rounded) moments
          mv = as_stored(m + i, mv, w);
          vv = as_stored(v + i, vv, w);
        }
        const VecF u = k.update(mv, vv, pv, c.tensor);
        p2 = at::vec::fmadd(pv, pv, p2);
        u2 = at::vec::fmadd(u, u, u2);  // padded lanes: m = v = p = 0 gives u = 0
      }
      chunk_p2[ci] = lane_sum(p2);
      chunk_u2[ci] = lane_sum(u2);
    });
  });
  double* out = sq_norms.data_ptr<double>();
  for (size_t ci = 0; ci < chunks.size(); ++ci) {  // in chunk order: deterministic
    out[2 * chunks[ci].tensor] += chunk_p2[ci];
    out[2 * chunks[ci].tensor + 1] += chunk_u2[ci];
  }
  return sq_norms;
}

void lamb_apply(const TensorList& params, const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                const TensorList& steps, const TensorList& model_copies, const LambHyper& h,
                const at::Tensor& sq_norms, const OptTensor& found_inf) {
  if (skip_step(found_inf)) return;
  const int64_t count = static_cast<int64_t>(params.size());
  const std::vector<Chunk> chunks = make_chunks(numels_of(params));
  const LambConsts k(h, steps);
  std::vector<float> ratio(count, static_cast<float>(h.lr));
  if (h.weight_decay != 0.0 || h.use_nvlamb) {
    const at::Tensor norms = sq_norms.contiguous();
    const double* sq = norms.data_ptr<double>();
    for (int64_t t = 0; t < count; ++t) {
      const double pn = std::sqrt(sq[2 * t]), un = std::sqrt(sq[2 * t + 1]);
      if (pn != 0.0 && un != 0.0) ratio[t] = static_cast<float>(h.lr * (pn / un));
    }
  }
  dispatch_param_copy(params, model_copies, "multi_tensor_lamb", [&](auto p_tag, auto m_tag, auto copy) {
    using P = decltype(p_tag);
    using M = decltype(m_tag);
    run_chunks(chunks, [&](int64_t, const Chunk& c) {
      P* p = ptr<P>(params[c.tensor], c.begin);
      const P* m = cptr<P>(exp_avgs[c.tensor], c.begin);
      const P* v = cptr<P>(exp_avg_sqs[c.tensor], c.begin);
      M* out = nullptr;
      if constexpr (decltype(copy)::value) out = ptr<M>(model_copies[c.tensor], c.begin);
      const VecF neg_ratio(-ratio[c.tensor]);
      const int64_t n = c.end - c.begin;
      for (int64_t i = 0; i < n; i += W) {
        const int64_t w = std::min(W, n - i);
        VecF pv = load_n(p + i, w);
        const VecF u = k.update(load_n(m + i, w), load_n(v + i, w), pv, c.tensor);
        pv = at::vec::fmadd(u, neg_ratio, pv);
        store_n(p + i, pv, w);
        if constexpr (decltype(copy)::value) store_n(out + i, pv, w);
      }
    });
  });
  advance_steps(steps);
}

void fused_lamb(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& steps, const TensorList& model_copies,
                const LambHyper& h, const at::Tensor& global_grad_norm, const OptTensor& grad_scale,
                const OptTensor& found_inf) {
  if (skip_step(found_inf)) return;
  const at::Tensor sq_norms = lamb_moments(params, grads, exp_avgs, exp_avg_sqs, steps, h, global_grad_norm,
                                           grad_scale, found_inf);
  lamb_apply(params, exp_avgs, exp_avg_sqs, steps, model_copies, h, sq_norms, found_inf);
}

}  // namespace cpu
}  // namespace lamp
