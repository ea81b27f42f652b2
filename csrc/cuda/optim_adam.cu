// CUDA fused Adam/AdamW (+ AMSGrad, + fp32 masters writing a 16-bit model copy): one
// multi-tensor-apply launch over chunks of many tensors, fp32 math, 64-bit offsets, 16-byte
// loads and stores (multi_tensor_apply.cuh).
#include <ATen/ATen.h>

#include <cmath>

#include "cuda/optim_common.cuh"

namespace lamp {
namespace cuda {
namespace {

using namespace optim;

struct AdamArgs {
  float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, decay;
  bool adam_w_mode, bias_correction;
};

template <typename P, typename G, typename M, bool kAms, bool kCopy>
struct AdamFunctor {
  static constexpr int Depth = 4 + (kAms ? 1 : 0) + (kCopy ? 1 : 0);

  __device__ __forceinline__ void operator()(const TensorListMetadata<Depth>& meta, AdamArgs a, const float* steps,
                                             const float* grad_scale, const float* found_inf) const {
    if (skip_step(found_inf)) return;
    const BlockChunk c = block_chunk(meta);
    P* p = static_cast<P*>(meta.addresses[0][c.tensor]);
    G* g = static_cast<G*>(meta.addresses[1][c.tensor]);
    P* m = static_cast<P*>(meta.addresses[2][c.tensor]);
    P* v = static_cast<P*>(meta.addresses[3][c.tensor]);
    P* vmax = kAms ? static_cast<P*>(meta.addresses[4][c.tensor]) : nullptr;
    M* out = kCopy ? static_cast<M*>(meta.addresses[Depth - 1][c.tensor]) : nullptr;
    const double step = static_cast<double>(steps[meta.aux[c.tensor]]) + 1.0;
    const double bc1 = a.bias_correction ? 1.0 - pow(static_cast<double>(a.beta1), step) : 1.0;
    const double bc2 = a.bias_correction ? 1.0 - pow(static_cast<double>(a.beta2), step) : 1.0;
    const float neg_step_size = static_cast<float>(-a.lr / bc1);
    const float bc2_sqrt = static_cast<float>(sqrt(bc2));
    const float scale = scale_of(grad_scale);
    for_each_element<vec_width<P, G, M>()>(c, slot_aligned(meta, c.tensor), [&](int64_t i, auto width) {
      constexpr int K = decltype(width)::value;
      float gv[K], pv[K], mv[K], vv[K], second[K];
      load_f32(gv, g, i);
      load_f32(pv, p, i);
      load_f32(mv, m, i);
      load_f32(vv, v, i);
      if constexpr (kAms) load_f32(second, vmax, i);
      unscale_grads(gv, g, i, scale, grad_scale);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (a.weight_decay != 0.f) {
          if (a.adam_w_mode) {
            pv[k] = pv[k] * a.decay;
          } else {
            gv[k] = fmaf(pv[k], a.weight_decay, gv[k]);
          }
        }
        mv[k] = fmaf(a.one_minus_beta1, gv[k] - mv[k], mv[k]);
        vv[k] = vv[k] * a.beta2;
        vv[k] = vv[k] + a.one_minus_beta2 * gv[k] * gv[k];
        second[k] = kAms ? fmaxf(second[k], vv[k]) : vv[k];
        const float denom = sqrtf(second[k]) / bc2_sqrt + a.eps;
        pv[k] = pv[k] + neg_step_size * (mv[k] / denom);
      }
      if constexpr (kAms) store_f32(vmax, i, second);
      store_f32(p, i, pv);
      store_f32(m, i, mv);
      store_f32(v, i, vv);
      if constexpr (kCopy) store_f32(out, i, pv);
    });
  }
};

template <bool kAms, bool kCopy>
void launch_adam(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                 const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, const TensorList& model_copies,
                 const AdamArgs& args, const at::Tensor& steps, const OptTensor& grad_scale,
                 const OptTensor& found_inf) {
  std::vector<std::vector<at::Tensor>> lists = {params, grads, exp_avgs, exp_avg_sqs};
  if (kAms) lists.push_back(max_exp_avg_sqs);
  if (kCopy) lists.push_back(model_copies);
  dispatch_types(params, grads, model_copies, "multi_tensor_adam", [&](auto p_tag, auto g_tag, auto m_tag, auto copy) {
    if constexpr (decltype(copy)::value == kCopy) {
      using Functor = AdamFunctor<decltype(p_tag), decltype(g_tag), decltype(m_tag), kAms, kCopy>;
      static_assert(sizeof(TensorListMetadata<Functor::Depth>) < 4096, "kernel argument too large");
      multi_tensor_apply<Functor::Depth>(lists, positions(params.size()), Functor{}, args,
                                         steps.data_ptr<float>(), ptr_or_null(grad_scale), ptr_or_null(found_inf));
    }
  });
}

}  // namespace

void fused_adam(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& max_exp_avg_sqs, const TensorList& steps,
                const TensorList& model_copies, const AdamHyper& h, const OptTensor& grad_scale,
                const OptTensor& found_inf) {
  const AdamArgs args{float(h.lr), float(h.beta1), float(h.beta2), float(1.0 - h.beta1), float(1.0 - h.beta2),
                      float(h.eps), float(h.weight_decay), float(1.0 - h.lr * h.weight_decay), h.adam_w_mode,
                      h.bias_correction};
  const at::Tensor step_vals = step_values(steps);
  const bool ams = !max_exp_avg_sqs.empty(), copy = !model_copies.empty();
  if (ams && copy) {
    launch_adam<true, true>(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_copies, args, step_vals,
                            grad_scale, found_inf);
  } else if (ams) {
    launch_adam<true, false>(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_copies, args, step_vals,
                             grad_scale, found_inf);
  } else if (copy) {
    launch_adam<false, true>(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_copies, args, step_vals,
                             grad_scale, found_inf);
  } else {
    launch_adam<false, false>(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_copies, args, step_vals,
                              grad_scale, found_inf);
  }
  advance_steps(steps, found_inf);
}

}  // namespace cuda
}  // namespace lamp
