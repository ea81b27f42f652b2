// CUDA fused LAMB with apex FusedLAMB semantics, two multi-tensor-apply launches:
//   1. lamb_moments: unscale the grads (written back unscaled, not clipped, when a grad_scale is
//      given), clip them, update the moments, and accumulate ||p||^2 and ||update||^2 per tensor
//      into an fp64 [n, 2] tensor (block reduction + one fp64 atomicAdd per block);
//   2. lamb_apply: recompute the update from the stored moments and the unchanged params and
//      apply it with the per-tensor trust ratio from those squared norms; advance the steps.
// fused_lamb runs both back to back; sharded params (FSDP2) call them apart and sum the squared
// norms of the local shards over the shard group in between.
// fp32 math, 64-bit offsets, 16-byte loads and stores (multi_tensor_apply.cuh); no host
// synchronisation (found_inf and the norms stay on device).
#include <ATen/ATen.h>

#include <type_traits>

#include "cuda/optim_common.cuh"

namespace lamp {
namespace cuda {
namespace {

using namespace optim;

struct LambArgs {
  float lr, beta1, beta2, one_minus_beta2, beta3, eps, weight_decay, max_grad_norm;
  bool bias_correction, decoupled_decay, l2_decay, trust_ratio;
};

struct Corrections {
  float inv_bc1, inv_bc2;
};

__device__ __forceinline__ Corrections corrections(const LambArgs& a, const float* steps, int64_t t) {
  if (!a.bias_correction) return {1.f, 1.f};
  const double step = static_cast<double>(steps[t]) + 1.0;
  return {static_cast<float>(1.0 / (1.0 - pow(static_cast<double>(a.beta1), step))),
          static_cast<float>(1.0 / (1.0 - pow(static_cast<double>(a.beta2), step)))};
}

__device__ __forceinline__ float lamb_update(float m, float v, float p, const Corrections& c, const LambArgs& a) {
  const float u = (m * c.inv_bc1) / (sqrtf(v * c.inv_bc2) + a.eps);
  return a.decoupled_decay ? fmaf(p, a.weight_decay, u) : u;
}

// Sums a and b over the block; the result is valid in thread 0.
__device__ __forceinline__ void block_sum2(float& a, float& b) {
  __shared__ float sa[32], sb[32];
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_down_sync(0xffffffffu, a, o);
    b += __shfl_down_sync(0xffffffffu, b, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = (blockDim.x + 31) >> 5;
    a = lane < warps ? sa[lane] : 0.f;
    b = lane < warps ? sb[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) {
      a += __shfl_down_sync(0xffffffffu, a, o);
      b += __shfl_down_sync(0xffffffffu, b, o);
    }
  }
}

template <typename P, typename G>
struct LambStage1 {
  __device__ __forceinline__ void operator()(const TensorListMetadata<4>& meta, LambArgs a, const float* steps,
                                             const float* global_grad_norm, double* norms, const float* grad_scale,
                                             const float* found_inf) const {
    if (skip_step(found_inf)) return;  // uniform over the block
    const BlockChunk c = block_chunk(meta);
    const P* p = static_cast<const P*>(meta.addresses[0][c.tensor]);
    G* g = static_cast<G*>(meta.addresses[1][c.tensor]);
    P* m = static_cast<P*>(meta.addresses[2][c.tensor]);
    P* v = static_cast<P*>(meta.addresses[3][c.tensor]);
    const int64_t t = meta.aux[c.tensor];
    const Corrections cc = corrections(a, steps, t);
    const float gnorm = *global_grad_norm;
    const float clip = (a.max_grad_norm > 0.f && gnorm > a.max_grad_norm) ? gnorm / a.max_grad_norm : 1.f;
    const float scale = scale_of(grad_scale);
    float p2 = 0.f, u2 = 0.f;
    for_each_element<vec_width<P, G>()>(c, slot_aligned(meta, c.tensor), [&](int64_t i, auto width) {
      constexpr int K = decltype(width)::value;
      float pv[K], gv[K], mv[K], vv[K];
      load_f32(pv, p, i);
      load_f32(gv, g, i);
      load_f32(mv, m, i);
      load_f32(vv, v, i);
      unscale_grads(gv, g, i, scale, grad_scale);  // written back unscaled, not clipped
#pragma unroll
      for (int k = 0; k < K; ++k) {
        gv[k] = gv[k] / clip;
        if (a.l2_decay) gv[k] = fmaf(pv[k], a.weight_decay, gv[k]);
        mv[k] = to_f32(from_f32<P>(fmaf(gv[k], a.beta3, mv[k] * a.beta1)));  // the stored moment
        const float decayed = vv[k] * a.beta2;
        vv[k] = to_f32(from_f32<P>(decayed + a.one_minus_beta2 * gv[k] * gv[k]));
        const float u = lamb_update(mv[k], vv[k], pv[k], cc, a);  // as stage 2 will recompute it
        p2 = fmaf(pv[k], pv[k], p2);
        u2 = fmaf(u, u, u2);
      }
      store_f32(m, i, mv);  // exact: mv and vv are values of P
      store_f32(v, i, vv);
    });
    block_sum2(p2, u2);
    if (threadIdx.x == 0) {
      atomicAdd(norms + 2 * t, static_cast<double>(p2));
      atomicAdd(norms + 2 * t + 1, static_cast<double>(u2));
    }
  }
};

template <typename P, typename M, bool kCopy>
struct LambStage2 {
  static constexpr int Depth = 3 + (kCopy ? 1 : 0);

  __device__ __forceinline__ void operator()(const TensorListMetadata<Depth>& meta, LambArgs a, const float* steps,
                                             const double* norms, const float* found_inf) const {
    if (skip_step(found_inf)) return;
    const BlockChunk c = block_chunk(meta);
    P* p = static_cast<P*>(meta.addresses[0][c.tensor]);
    const P* m = static_cast<const P*>(meta.addresses[1][c.tensor]);
    const P* v = static_cast<const P*>(meta.addresses[2][c.tensor]);
    M* out = kCopy ? static_cast<M*>(meta.addresses[3][c.tensor]) : nullptr;
    const int64_t t = meta.aux[c.tensor];
    const Corrections cc = corrections(a, steps, t);
    float ratio = a.lr;
    if (a.trust_ratio) {
      const double pn = sqrt(norms[2 * t]), un = sqrt(norms[2 * t + 1]);
      if (pn != 0.0 && un != 0.0) ratio = static_cast<float>(static_cast<double>(a.lr) * (pn / un));
    }
    for_each_element<vec_width<P, M>()>(c, slot_aligned(meta, c.tensor), [&](int64_t i, auto width) {
      constexpr int K = decltype(width)::value;
      float pv[K], mv[K], vv[K];
      load_f32(pv, p, i);
      load_f32(mv, m, i);
      load_f32(vv, v, i);
#pragma unroll
      for (int k = 0; k < K; ++k) pv[k] = fmaf(lamb_update(mv[k], vv[k], pv[k], cc, a), -ratio, pv[k]);
      store_f32(p, i, pv);
      if constexpr (kCopy) store_f32(out, i, pv);
    });
  }
};

LambArgs lamb_args(const LambHyper& h) {
  const bool has_wd = h.weight_decay != 0.0;
  return LambArgs{float(h.lr), float(h.beta1), float(h.beta2), float(1.0 - h.beta2),
                  float(h.grad_averaging ? 1.0 - h.beta1 : 1.0), float(h.eps), float(h.weight_decay),
                  float(h.max_grad_norm), h.bias_correction, h.adam_w_mode && has_wd, !h.adam_w_mode && has_wd,
                  has_wd || h.use_nvlamb};
}

}  // namespace

at::Tensor lamb_moments(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                        const TensorList& exp_avg_sqs, const TensorList& steps, const LambHyper& h,
                        const at::Tensor& global_grad_norm, const OptTensor& grad_scale, const OptTensor& found_inf) {
  const LambArgs args = lamb_args(h);
  const at::Tensor step_vals = step_values(steps);
  const at::Tensor sq_norms = at::zeros({static_cast<int64_t>(params.size()), 2},
                                        params[0].options().dtype(at::kDouble));
  const at::Tensor gnorm = global_grad_norm.reshape({}).contiguous();
  const std::vector<int64_t> aux = positions(params.size());
  dispatch_types(params, grads, {}, "multi_tensor_lamb", [&](auto p_tag, auto g_tag, auto, auto) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    multi_tensor_apply<4>({params, grads, exp_avgs, exp_avg_sqs}, aux, LambStage1<P, G>{}, args,
                          step_vals.data_ptr<float>(), gnorm.data_ptr<float>(), sq_norms.data_ptr<double>(),
                          ptr_or_null(grad_scale), ptr_or_null(found_inf));
  });
  return sq_norms;
}

void lamb_apply(const TensorList& params, const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                const TensorList& steps, const TensorList& model_copies, const LambHyper& h,
                const at::Tensor& sq_norms, const OptTensor& found_inf) {
  const LambArgs args = lamb_args(h);
  const at::Tensor step_vals = step_values(steps);
  const at::Tensor norms = sq_norms.contiguous();
  const std::vector<int64_t> aux = positions(params.size());
  dispatch_param_copy(params, model_copies, "multi_tensor_lamb", [&](auto p_tag, auto m_tag, auto copy) {
    using P = decltype(p_tag);
    using M = decltype(m_tag);
    constexpr bool kCopy = decltype(copy)::value;
    std::vector<std::vector<at::Tensor>> lists = {params, exp_avgs, exp_avg_sqs};
    if (kCopy) lists.push_back(model_copies);
    multi_tensor_apply<LambStage2<P, M, kCopy>::Depth>(lists, aux, LambStage2<P, M, kCopy>{}, args,
                                                        step_vals.data_ptr<float>(), norms.data_ptr<double>(),
                                                        ptr_or_null(found_inf));
  });
  advance_steps(steps, found_inf);
}

void fused_lamb(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                const TensorList& exp_avg_sqs, const TensorList& steps, const TensorList& model_copies,
                const LambHyper& h, const at::Tensor& global_grad_norm, const OptTensor& grad_scale,
                const OptTensor& found_inf) {
  const at::Tensor sq_norms = lamb_moments(params, grads, exp_avgs, exp_avg_sqs, steps, h, global_grad_norm,
                                           grad_scale, found_inf);
  lamb_apply(params, exp_avgs, exp_avg_sqs, steps, model_copies, h, sq_norms, found_inf);
}

}  // namespace cuda
}  // namespace lamp
