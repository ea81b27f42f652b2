// O2's autocast policy: kernels registered over torch's autocast kernels for the duration of an O2
// run (install/uninstall), which follow O2's rules on the threads where O2's forward is entered and
// do exactly what torch's own kernel does everywhere else.
//
// O2 forwards under torch.autocast(half) with fp32 Parameters, so every op reconciles dtypes as under
// Lightning's bf16-mixed. Inside the model it computes like bf16-true: while O2's forward is entered
// on the calling thread (enter_forward), these kernels apply O2's rules:
//   * norms (layer_norm, native_layer_norm, rms_norm, group_norm), which torch's CUDA list upcasts:
//     run in their input's dtype; the weight and bias are cast to it (an fp32 Parameter's half copy
//     for a half input; a half weight, FSDP2's, upcast for an input the model made fp32 on purpose);
//   * batch_norm: runs in its running statistics' dtype: half statistics (keep_batchnorm_fp32=False)
//     make input, weight and bias half; with fp32 statistics weight and bias are fp32 and a half input
//     takes torch's mixed kernel (fp32 math inside, half output);
//   * softmax, log_softmax, the elementwise math and reductions of torch's fp32 lists, upsampling:
//     run on their inputs as they come (an explicit dtype= is kept), as without autocast;
//   * embedding: its result is cast to the half dtype (the rows of the table rounded to half, without
//     a half copy of the table), so the stream starts half;
//   * the half stream by construction: add/sub/mul/div, where, cat and stack of a half activation and
//     an fp32 tensor that is no activation of the stream (stream_follows: a Parameter, any view or
//     expression of Parameters, a buffer, a table, a mask, a per-row statistic that broadcasts into the
//     half operand) return half. add/sub/mul/div compute in fp32 from the exact operands and round once
//     (StreamBinary: one kernel on CUDA, no cast an autograd graph or a dispatch mode would see, grads
//     of the fp32 operand reduced in fp32); where/cat/stack round the fp32 operand (they do no
//     arithmetic). A value rounded for a tensor that requires no grad (a mask) saturates at the half
//     dtype's finite range. A full-size fp32 activation (an explicit upcast, an fp32 residual) keeps
//     torch's promotion, and that promotion is reported once per arming (set_promotion_reporter);
//   * torch's lower-precision list (matmuls, convolutions): half, as torch's rule; an fp32 tensor that is an
//     unchanged exact upcast of a half activation (Hugging Face T5's ``h.to(self.wo.weight.dtype)``, noted by the
//     _to_copy kernel) is read as that activation: the same values, no second half copy saved;
//   * losses stay fp32: torch's fp32 list keeps them (they are not registered here), and CUDA's
//     cross_entropy_loss, which torch lets decompose into log_softmax and nll_loss, runs whole in fp32.
// Elsewhere (policy not active on the thread: bf16-mixed or O1 in the same process, another thread,
// a forward outside O2's) each kernel is torch's: the op's policy on that key through the template
// torch itself instantiates (at::autocast::WrapFunction), or, where torch registers none, a
// redispatch below autocast (what its fallthrough does). Which of the two is read from the installed
// torch's dispatcher before the first install (torch_kernels): an op the table lists as upcast on
// CUDA that this torch does not register there (rms_norm in torch 2.11; 2.13 upcasts it) keeps the fallthrough.
// tests/test_o2_policy.py compares both.
#include "o2_policy.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Operators.h>
#include <ATen/autocast_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace lamp {
namespace o2 {
namespace {

thread_local int64_t t_depth = 0;    // O2 forwards entered on this thread
thread_local uint64_t t_shared = 0;  // the share region this thread joined
std::atomic<uint64_t> g_live_share{0};

inline bool policy_active() {
  if (t_depth > 0) return true;
  const uint64_t token = t_shared;
  return token != 0 && token == g_live_share.load(std::memory_order_relaxed);
}

enum class Rule { as_is, follow_input, half_output, to_fp32, half_inputs, note_upcast, stream_add, stream_sub,
                  stream_mul, stream_div, stream_where, stream_list, batch_norm };
// torch's own policy for an op on a key
enum class Torch { fallthrough, fp32, fp32_set_opt_dtype, promote, lower_precision_fp };

using at::autocast::cached_cast;

template <c10::DeviceType dev>
inline bool is_half(const at::Tensor& t) {
  return t.defined() && at::autocast::is_eligible(t, dev) &&
         (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
}

template <c10::DeviceType dev>
inline bool is_fp32(const at::Tensor& t) {
  return t.defined() && at::autocast::is_eligible(t, dev) && t.scalar_type() == at::kFloat && t.dim() > 0;
}

// A trained Parameter (a leaf that requires grad), a view of one, or (with autograd history) an expression of
// trained Parameters: a graph of at most 8 nodes whose every path ends at an AccumulateGrad (an input without
// grad, a scalar or a buffer, adds no path). A heuristic with a short reach: an upcast within 8 ops of the
// embeddings would count too (it then follows the stream, computed in fp32 and rounded once).
inline bool parameter_derived(const at::Tensor& t) {
  if (t.is_leaf() && t.requires_grad()) return true;
  if (t.is_view()) {
    const at::TensorBase& base = t._base();
    if (base.is_leaf() && base.requires_grad()) return true;
  }
  if (!t.requires_grad() || !t.grad_fn()) return false;
  constexpr int max_nodes = 8;
  std::vector<torch::autograd::Node*> pending{t.grad_fn().get()};
  int visited = 0;
  while (!pending.empty()) {
    torch::autograd::Node* node = pending.back();
    pending.pop_back();
    if (++visited > max_nodes) return false;
    for (const auto& edge : node->next_edges()) {
      if (!edge.is_valid()) continue;
      if (dynamic_cast<torch::autograd::AccumulateGrad*>(edge.function.get()) == nullptr) {
        pending.push_back(edge.function.get());
      }
    }
  }
  return true;
}

// Whether an fp32 operand follows the half stream (the rule of docs/o2-design.md): it broadcasts into the
// result (fewer elements: a Parameter, a table, a mask, a per-row statistic), it derives from Parameters
// only, or it has no autograd history while grad mode is on (a buffer, a mask, a constant, the batch: no
// trained Parameter reached it). Otherwise it is an fp32 activation of the result's size: torch promotes.
inline bool follows_stream(const at::Tensor& f, int64_t result_numel) {
  if (!f.unsafeGetTensorImpl()->has_symbolic_sizes_strides() && f.numel() < result_numel) return true;
  if (parameter_derived(f)) return true;
  return at::GradMode::is_enabled() && !f.requires_grad();
}

inline int64_t numel_of(at::IntArrayRef sizes) { return c10::multiply_integers(sizes); }

// ---- promotions left to torch, reported (once per arming) to the forensics of amp/o2/stream_watch.py
std::atomic<bool> g_report_armed{false};
std::mutex g_reporter_mutex;
PromotionReporter g_reporter;

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << c10::toString(t.scalar_type()) << t.sizes();
  if (t.requires_grad()) out << " requires_grad";
  return out.str();
}

template <class... T>
void report_promotion(const char* op, const T&... tensors) {
  if (!g_report_armed.load(std::memory_order_relaxed) || !g_report_armed.exchange(false)) return;
  PromotionReporter reporter;
  {
    std::lock_guard<std::mutex> lock(g_reporter_mutex);
    reporter = g_reporter;
  }
  if (!reporter) return;
  std::string operands;
  ((operands += (operands.empty() ? "" : ", ") + describe(tensors)), ...);
  reporter(op, operands);
}

// The half dtype's finite range: a value rounded for a tensor without grad (a mask of fp32's lowest value)
// saturates there instead of becoming an infinity (which a fully masked row's softmax turns into NaN).
inline void saturate_(at::Tensor& t) {
  const double top = t.scalar_type() == at::kHalf ? 65504.0 : 3.3895313892515355e38;
  t.clamp_(-top, top);
}

enum class Binary : int64_t { add, sub, mul, div };

// op(h, f) or op(f, h) of a half operand h and an fp32 operand f, returned in h's dtype: computed in fp32
// from the exact operands and rounded once (TensorIterator's out= in the half dtype). Backward: the half
// operand's grad in its dtype through the same rule, the fp32 operand's grad reduced in fp32.
struct StreamBinary : public torch::autograd::Function<StreamBinary> {
  static at::Tensor compute(const at::Tensor& h, const at::Tensor& f, Binary op, bool half_first, double alpha) {
    const at::Tensor& a = half_first ? h : f;
    const at::Tensor& b = half_first ? f : h;
    const auto sizes = at::infer_size(a.sizes(), b.sizes());
    at::Tensor out = h.sizes().equals(sizes) ? at::empty_like(h) : at::empty(sizes, h.options());
    switch (op) {
      case Binary::add: at::add_out(out, a, b, alpha); break;
      case Binary::sub: at::sub_out(out, a, b, alpha); break;
      case Binary::mul: at::mul_out(out, a, b); break;
      case Binary::div: at::div_out(out, a, b); break;
    }
    if (!f.requires_grad()) saturate_(out);
    return out;
  }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h, const at::Tensor& f,
                            int64_t op, bool half_first, double alpha) {
    ctx->saved_data["op"] = op;
    ctx->saved_data["half_first"] = half_first;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["h_sizes"] = h.sizes().vec();
    ctx->saved_data["f_sizes"] = f.sizes().vec();
    // What backward reads, only where a grad needs it (as torch's own MulBackward/DivBackward save)
    const bool h_grad = h.requires_grad(), f_grad = f.requires_grad();
    if (op == static_cast<int64_t>(Binary::mul)) {
      ctx->save_for_backward({f_grad ? h : at::Tensor(), h_grad ? f : at::Tensor()});
    } else if (op == static_cast<int64_t>(Binary::div)) {
      ctx->save_for_backward({f_grad || !half_first ? h : at::Tensor(), h_grad || half_first ? f : at::Tensor()});
    }
    return compute(h, f, static_cast<Binary>(op), half_first, alpha);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& g = grads[0];
    const auto op = static_cast<Binary>(ctx->saved_data["op"].toInt());
    const bool half_first = ctx->saved_data["half_first"].toBool();
    const double alpha = ctx->saved_data["alpha"].toDouble();
    const auto h_sizes = ctx->saved_data["h_sizes"].toIntVector();
    const auto f_sizes = ctx->saved_data["f_sizes"].toIntVector();
    const bool need_h = ctx->needs_input_grad(0), need_f = ctx->needs_input_grad(1);
    at::Tensor gh, gf;  // gh: the half operand's grad before reduction; gf: the fp32 operand's, reduced in fp32
    if (op == Binary::add || op == Binary::sub) {
      const double coef = op == Binary::add ? alpha : -alpha;  // d(result)/d(second operand)
      if (need_h) gh = half_first || coef == 1.0 ? g : g * coef;
      if (need_f) {
        gf = sum_to_fp32(g, f_sizes);
        if (half_first && coef != 1.0) gf = gf * coef;
      }
    } else {
      const auto saved = ctx->get_saved_variables();
      const at::Tensor& h = saved[0];
      const at::Tensor& f = saved[1];
      const auto mul = static_cast<int64_t>(Binary::mul);
      if (op == Binary::mul) {
        if (need_h) gh = apply(g, f, mul, true, 1.0);
        if (need_f) gf = sum_to_fp32(g * h, f_sizes);
      } else if (half_first) {  // h / f; f is constant along the dimensions it broadcasts over
        if (need_h) gh = apply(g, f, static_cast<int64_t>(Binary::div), true, 1.0);
        if (need_f) gf = -sum_to_fp32(g * h, f_sizes) / (f * f);
      } else {  // f / h
        if (need_h) gh = -apply(g, f, mul, true, 1.0) / h / h;
        if (need_f) gf = sum_to_fp32(g / h, f_sizes);
      }
    }
    return {need_h ? at::sum_to(gh, h_sizes) : at::Tensor(), gf, {}, {}, {}};
  }

  // The sum of t over the dimensions that broadcast an operand of ``sizes`` into t, accumulated and returned in fp32.
  static at::Tensor sum_to_fp32(const at::Tensor& t, at::IntArrayRef sizes) {
    if (!t.defined()) return t;
    const int64_t leading = t.dim() - static_cast<int64_t>(sizes.size());
    std::vector<int64_t> dims;
    for (int64_t i = 0; i < t.dim(); ++i) {
      if (i < leading || (sizes[i - leading] == 1 && t.size(i) != 1)) dims.push_back(i);
    }
    if (dims.empty()) return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
    return at::sum(t, dims, /*keepdim=*/true, at::kFloat).reshape(sizes);
  }
};

// add/sub/mul/div of a half tensor and an fp32 one that follows the stream: StreamBinary; nullopt where torch's
// promotion stays (reported when an fp32 activation promotes a half one).
template <c10::DeviceType dev>
std::optional<at::Tensor> stream_binary(const char* name, Binary op, const at::Tensor& a, const at::Tensor& b,
                                        double alpha = 1.0) {
  const bool half_first = is_half<dev>(a) && is_fp32<dev>(b);
  if (!half_first && !(is_half<dev>(b) && is_fp32<dev>(a))) return std::nullopt;
  const at::Tensor& h = half_first ? a : b;
  const at::Tensor& f = half_first ? b : a;
  if (h.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || f.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return std::nullopt;
  }
  if (!follows_stream(f, numel_of(at::infer_size(a.sizes(), b.sizes())))) {
    report_promotion(name, a, b);
    return std::nullopt;
  }
  return StreamBinary::apply(h, f, static_cast<int64_t>(op), half_first, alpha);
}

// The fp32 operand of an op that does no arithmetic (where, cat, stack), rounded to the stream's dtype.
template <c10::DeviceType dev>
at::Tensor to_stream(const at::Tensor& f, at::ScalarType half) {
  at::Tensor out = f.to(half);
  if (!f.requires_grad()) saturate_(out);
  return out;
}

// A plain dense tensor (no tensor subclass, functorch wrapper, functional or fake tensor, symbolic shape), outside
// inference mode.
inline bool plain(const at::Tensor& t) {
  constexpr auto wrappers = c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                                 c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                                 c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Conjugate,
                                                 c10::DispatchKey::Negative});
  return t.layout() == at::kStrided && (t.key_set() & wrappers).empty() && t.has_storage() &&
         !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() && !c10::InferenceMode::is_enabled();
}

// ---- exact upcasts of half activations (T5's feed-forward: ``h.to(self.wo.weight.dtype)``, fp32 under O2)
// Inside O2's forward an fp32 tensor made by ``_to_copy`` from a half activation of the same shape is noted (weak
// references, this thread, this forward region); a half op that reads it while neither tensor was written since
// reads the half activation itself: the same values (the round trip is exact) and no second half copy that the op
// would save. Its grad reaches the activation directly instead of through the two casts (exact too when the fp32
// tensor has no other reader).
struct Upcast {
  c10::weak_intrusive_ptr<c10::TensorImpl> out, source;
  int64_t out_version, source_version;
};
thread_local std::unordered_map<c10::TensorImpl*, Upcast> t_upcasts;

inline void note_upcast(const at::Tensor& source, const at::Tensor& out) {
  if (t_upcasts.size() >= 4096) t_upcasts.clear();  // a bound for a forward region that never ends
  t_upcasts.insert_or_assign(out.unsafeGetTensorImpl(),
                             Upcast{c10::weak_intrusive_ptr<c10::TensorImpl>(out.getIntrusivePtr()),
                                    c10::weak_intrusive_ptr<c10::TensorImpl>(source.getIntrusivePtr()),
                                    out._version(), source._version()});
}

// The half activation ``t`` is an unchanged exact upcast of, in the dtype ``half``; undefined if none.
inline at::Tensor upcast_source(const at::Tensor& t, at::ScalarType half) {
  if (t_upcasts.empty()) return at::Tensor();
  auto found = t_upcasts.find(t.unsafeGetTensorImpl());
  if (found == t_upcasts.end()) return at::Tensor();
  const Upcast& note = found->second;
  auto out = note.out.lock();
  auto source = note.source.lock();
  if (!out || out.get() != t.unsafeGetTensorImpl() || !source) return at::Tensor();
  at::Tensor half_tensor(std::move(source));
  if (half_tensor.scalar_type() != half || t._version() != note.out_version ||
      half_tensor._version() != note.source_version) {
    return at::Tensor();
  }
  return half_tensor;
}

// ``t`` in the half dtype ``half`` as a matmul or convolution inside O2's forward reads it: an unchanged exact
// upcast of a half activation as that activation, anything else as torch's autocast casts it.
template <c10::DeviceType dev>
at::Tensor o2_cast(at::ScalarType half, const at::Tensor& t) {
  if (!t.is_leaf() && is_fp32<dev>(t)) {
    at::Tensor source = upcast_source(t, half);
    if (source.defined()) return source;
  }
  return cached_cast(half, t, dev);
}

template <c10::DeviceType dev>
inline std::optional<at::Tensor> o2_cast(at::ScalarType half, const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(o2_cast<dev>(half, *t)) : t;
}

template <c10::DeviceType dev, class T>
inline T o2_cast(at::ScalarType, T value) {
  return value;
}

// O2's rule for one op; called with autocast excluded for the device (as torch's own kernels are).
template <Rule rule, c10::DeviceType dev, class Op>
struct O2Rule;

template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::as_is, dev, Op> {
  template <class... A>
  static auto call(const A&... args) {
    return Op::call(args...);
  }
};

template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::follow_input, dev, Op> {
  template <class... A>
  static auto call(const at::Tensor& input, const A&... rest) {
    if (input.defined() && at::autocast::is_eligible(input, dev)) {
      return Op::call(input, cached_cast(input.scalar_type(), rest, dev)...);
    }
    return Op::call(input, rest...);
  }
};

// The result cast to the half dtype: an embedding's rows of the fp32 table rounded to half are the rows of
// the table rounded to half, without a half copy of the whole table (and its half grad) per forward.
template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::half_output, dev, Op> {
  template <class... A>
  static auto call(const A&... args) {
    auto out = Op::call(args...);
    if (out.scalar_type() == at::kFloat && at::autocast::is_eligible(out, dev)) {
      return out.to(at::autocast::get_lower_precision_fp_from_device_type(dev));
    }
    return out;
  }
};

template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::to_fp32, dev, Op> {
  template <class... A>
  static auto call(const A&... args) {
    return Op::call(cached_cast(at::kFloat, args, dev)...);
  }
};

// _to_copy: as torch's; an exact upcast of a half activation is noted (above, "exact upcasts").
template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::note_upcast, dev, Op> {
  template <class... A>
  static at::Tensor call(const at::Tensor& self, const A&... rest) {
    at::Tensor out = Op::call(self, rest...);
    if (is_half<dev>(self) && is_fp32<dev>(out) && self.requires_grad() && !self.is_leaf() &&
        out.sizes().equals(self.sizes()) && plain(self)) {
      note_upcast(self, out);
    }
    return out;
  }
};

// torch's lower-precision list (matmuls, convolutions): every floating argument in the half dtype, as torch's rule;
// an exact upcast of a half activation read as that activation (above).
template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::half_inputs, dev, Op> {
  template <class... A>
  static auto call(const A&... args) {
    const auto half = at::autocast::get_lower_precision_fp_from_device_type(dev);
    return Op::call(o2_cast<dev>(half, args)...);
  }
};

template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::stream_add, dev, Op> {
  static at::Tensor call(const at::Tensor& a, const at::Tensor& b, const c10::Scalar& alpha) {
    if (auto out = stream_binary<dev>(Op::name, Binary::add, a, b, alpha.toDouble())) return *out;
    return Op::call(a, b, alpha);
  }
};

template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::stream_sub, dev, Op> {
  static at::Tensor call(const at::Tensor& a, const at::Tensor& b, const c10::Scalar& alpha) {
    if (auto out = stream_binary<dev>(Op::name, Binary::sub, a, b, alpha.toDouble())) return *out;
    return Op::call(a, b, alpha);
  }
};

template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::stream_mul, dev, Op> {
  static at::Tensor call(const at::Tensor& a, const at::Tensor& b) {
    if (auto out = stream_binary<dev>(Op::name, Binary::mul, a, b)) return *out;
    return Op::call(a, b);
  }
};

template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::stream_div, dev, Op> {
  static at::Tensor call(const at::Tensor& a, const at::Tensor& b) {
    if (auto out = stream_binary<dev>(Op::name, Binary::div, a, b)) return *out;
    return Op::call(a, b);
  }
};

// where(condition, self, other): a half and an fp32 branch that follows the stream: the fp32 branch rounded.
template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::stream_where, dev, Op> {
  static at::Tensor call(const at::Tensor& condition, const at::Tensor& a, const at::Tensor& b) {
    const bool half_first = is_half<dev>(a) && is_fp32<dev>(b);
    if (!half_first && !(is_half<dev>(b) && is_fp32<dev>(a))) return Op::call(condition, a, b);
    const at::Tensor& h = half_first ? a : b;
    const at::Tensor& f = half_first ? b : a;
    for (const at::Tensor* t : {&condition, &a, &b}) {
      if (t->unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return Op::call(condition, a, b);
    }
    const auto sizes = at::infer_size(at::infer_size(condition.sizes(), a.sizes()), b.sizes());
    if (!follows_stream(f, numel_of(sizes))) {
      report_promotion(Op::name, a, b);
      return Op::call(condition, a, b);
    }
    const at::Tensor rounded = to_stream<dev>(f, h.scalar_type());
    return half_first ? Op::call(condition, a, rounded) : Op::call(condition, rounded, b);
  }
};

// cat/stack of half tensors and fp32 ones that follow the stream (a class token expanded from its Parameter):
// the fp32 ones rounded to the half dtype; with an fp32 activation among them, torch's promotion.
template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::stream_list, dev, Op> {
  template <class List>
  static at::Tensor call(const List& tensors, int64_t dim) {
    std::optional<at::ScalarType> half;
    bool fp32 = false;
    for (const at::Tensor& t : tensors) {
      if (is_half<dev>(t)) half = t.scalar_type();
      fp32 = fp32 || is_fp32<dev>(t);
    }
    if (!half || !fp32) return Op::call(tensors, dim);
    std::vector<at::Tensor> rounded;
    for (const at::Tensor& t : tensors) {
      if (!is_fp32<dev>(t)) {
        rounded.push_back(t);
      } else if (follows_stream(t, 0)) {
        rounded.push_back(to_stream<dev>(t, *half));
      } else {
        report_promotion(Op::name, t);
        return Op::call(tensors, dim);
      }
    }
    return Op::call(rounded, dim);
  }
};

// batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled): the
// statistics are updated in place, so they set the dtype (the input's without them). Half statistics
// (keep_batchnorm_fp32=False): input, weight and bias are cast to that half dtype, BatchNorm computes in
// half. fp32 statistics: weight and bias fp32, the input as it comes (a half one takes torch's mixed
// kernel: fp32 math inside, half output).
template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::batch_norm, dev, Op> {
  using OptTensor = std::optional<at::Tensor>;
  static auto call(const at::Tensor& input, const OptTensor& weight, const OptTensor& bias, const OptTensor& mean,
                   const OptTensor& var, bool training, double momentum, double eps, bool cudnn) {
    if (!input.defined() || !at::autocast::is_eligible(input, dev)) {
      return Op::call(input, weight, bias, mean, var, training, momentum, eps, cudnn);
    }
    const bool has_stats = mean.has_value() && mean->defined();
    const auto t = has_stats ? mean->scalar_type() : input.scalar_type();
    const bool half = t == at::kHalf || t == at::kBFloat16;
    return Op::call(half ? cached_cast(t, input, dev) : input, cached_cast(t, weight, dev), cached_cast(t, bias, dev),
                    mean, var, training, momentum, eps, cudnn);
  }
};

template <class Op, c10::DeviceType dev, Torch torch_policy, Rule rule, class ArgList>
struct Kernel;

template <class Op, c10::DeviceType dev, Torch torch_policy, Rule rule, class... Args>
struct Kernel<Op, dev, torch_policy, rule, c10::guts::typelist::typelist<Args...>> {
  using Ret = typename c10::guts::function_traits<typename Op::schema>::return_type;

  static Ret call(c10::DispatchKeySet keys, Args... args) {
    const auto autocast_key = at::autocast::get_autocast_dispatch_key_from_device_type(dev);
    if (policy_active()) {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
      return O2Rule<rule, dev, Op>::call(args...);
    }
    if constexpr (torch_policy == Torch::fallthrough) {
      return Op::redispatch(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, autocast_key), args...);
    } else {
      constexpr auto policy = torch_policy == Torch::fp32                 ? at::autocast::CastPolicy::fp32
                              : torch_policy == Torch::promote            ? at::autocast::CastPolicy::promote
                              : torch_policy == Torch::lower_precision_fp ? at::autocast::CastPolicy::lower_precision_fp
                                                                          : at::autocast::CastPolicy::fp32_set_opt_dtype;
      return at::autocast::WrapFunction<policy, dev, typename Op::schema, typename Op::schema, &Op::call>::type::call(
          args...);
    }
  }
};

template <class Op>
std::string op_name() {
  std::string name(Op::name);
  if (Op::overload_name[0] != '\0') name += std::string(".") + Op::overload_name;
  return name;
}

// ``torch_registers``: whether the installed torch has its own kernel for the op on the key whose policy
// ``torch_policy`` describes; without one torch's policy there is the fallthrough.
template <class Op, c10::DeviceType dev, Torch torch_policy, Rule rule>
void add(torch::Library& lib, bool torch_registers = true) {
  using Params = typename c10::guts::function_traits<typename Op::schema>::parameter_types;
  const std::string name = op_name<Op>();
  if (torch_policy == Torch::fallthrough || torch_registers) {
    lib.impl(name.c_str(), TORCH_FN((Kernel<Op, dev, torch_policy, rule, Params>::call)));
  } else {
    lib.impl(name.c_str(), TORCH_FN((Kernel<Op, dev, Torch::fallthrough, rule, Params>::call)));
  }
}

// (op in at::_ops, O2's rule, torch's policy on AutocastCUDA, torch's policy on AutocastCPU, registered on
// AutocastCPU in mode "torch"). On the CPU key torch registers none of these but cat and stack (promote;
// tests/test_o2_policy.py checks it); the ops whose O2 rule only drops an upcast are not registered there.
#define LAMP_O2_OPS(_)                                               \
  _(layer_norm, follow_input, fp32, fallthrough, true)              \
  _(native_layer_norm, follow_input, fp32, fallthrough, true)       \
  _(rms_norm, follow_input, fp32, fallthrough, true)                \
  _(group_norm, follow_input, fp32, fallthrough, true)              \
  _(batch_norm, batch_norm, fallthrough, fallthrough, true)         \
  _(embedding, half_output, fallthrough, fallthrough, true)         \
  _(linear, half_inputs, lower_precision_fp, lower_precision_fp, true) \
  _(matmul, half_inputs, lower_precision_fp, lower_precision_fp, true) \
  _(mm, half_inputs, lower_precision_fp, lower_precision_fp, true)     \
  _(addmm, half_inputs, lower_precision_fp, lower_precision_fp, true)  \
  _(bmm, half_inputs, lower_precision_fp, lower_precision_fp, true)    \
  _(baddbmm, half_inputs, lower_precision_fp, lower_precision_fp, true) \
  _(addbmm, half_inputs, lower_precision_fp, lower_precision_fp, true) \
  _(conv1d, half_inputs, lower_precision_fp, lower_precision_fp, true) \
  _(conv2d, half_inputs, lower_precision_fp, lower_precision_fp, true) \
  _(conv3d, half_inputs, lower_precision_fp, lower_precision_fp, true) \
  _(conv_transpose1d, half_inputs, lower_precision_fp, lower_precision_fp, true) \
  _(conv_transpose2d_input, half_inputs, lower_precision_fp, lower_precision_fp, true) \
  _(conv_transpose3d_input, half_inputs, lower_precision_fp, lower_precision_fp, true) \
  _(prelu, half_inputs, lower_precision_fp, lower_precision_fp, true)  \
  _(_to_copy, note_upcast, fallthrough, fallthrough, true)          \
  _(add_Tensor, stream_add, fallthrough, fallthrough, true)         \
  _(sub_Tensor, stream_sub, fallthrough, fallthrough, true)         \
  _(mul_Tensor, stream_mul, fallthrough, fallthrough, true)         \
  _(div_Tensor, stream_div, fallthrough, fallthrough, true)         \
  _(where_self, stream_where, fallthrough, fallthrough, true)       \
  _(cat, stream_list, fallthrough, promote, true)                   \
  _(stack, stream_list, fallthrough, promote, true)                 \
  _(cross_entropy_loss, to_fp32, fallthrough, fallthrough, false)   \
  _(softmax_int, as_is, fp32_set_opt_dtype, fallthrough, false)     \
  _(log_softmax_int, as_is, fp32_set_opt_dtype, fallthrough, false) \
  _(sum, as_is, fp32_set_opt_dtype, fallthrough, false)             \
  _(sum_dim_IntList, as_is, fp32_set_opt_dtype, fallthrough, false) \
  _(prod, as_is, fp32_set_opt_dtype, fallthrough, false)            \
  _(prod_dim_int, as_is, fp32_set_opt_dtype, fallthrough, false)    \
  _(cumsum, as_is, fp32_set_opt_dtype, fallthrough, false)          \
  _(cumprod, as_is, fp32_set_opt_dtype, fallthrough, false)         \
  _(linalg_vector_norm, as_is, fp32_set_opt_dtype, fallthrough, false)\
  _(frobenius_norm_dim, as_is, fp32, fallthrough, false)            \
  _(pow_Tensor_Scalar, as_is, fp32, fallthrough, false)             \
  _(pow_Tensor_Tensor, as_is, fp32, fallthrough, false)             \
  _(pow_Scalar, as_is, fp32, fallthrough, false)                    \
  _(exp, as_is, fp32, fallthrough, false)                           \
  _(expm1, as_is, fp32, fallthrough, false)                         \
  _(log, as_is, fp32, fallthrough, false)                           \
  _(log10, as_is, fp32, fallthrough, false)                         \
  _(log2, as_is, fp32, fallthrough, false)                          \
  _(log1p, as_is, fp32, fallthrough, false)                         \
  _(reciprocal, as_is, fp32, fallthrough, false)                    \
  _(rsqrt, as_is, fp32, fallthrough, false)                         \
  _(acos, as_is, fp32, fallthrough, false)                          \
  _(asin, as_is, fp32, fallthrough, false)                          \
  _(cosh, as_is, fp32, fallthrough, false)                          \
  _(sinh, as_is, fp32, fallthrough, false)                          \
  _(tan, as_is, fp32, fallthrough, false)                           \
  _(erfinv, as_is, fp32, fallthrough, false)                        \
  _(softplus, as_is, fp32, fallthrough, false)                      \
  _(upsample_nearest1d, as_is, fp32, fallthrough, false)            \
  _(_upsample_nearest_exact1d, as_is, fp32, fallthrough, false)     \
  _(upsample_nearest2d, as_is, fp32, fallthrough, false)            \
  _(_upsample_nearest_exact2d, as_is, fp32, fallthrough, false)     \
  _(upsample_nearest3d, as_is, fp32, fallthrough, false)            \
  _(_upsample_nearest_exact3d, as_is, fp32, fallthrough, false)     \
  _(upsample_linear1d, as_is, fp32, fallthrough, false)             \
  _(upsample_bilinear2d, as_is, fp32, fallthrough, false)           \
  _(_upsample_bilinear2d_aa, as_is, fp32, fallthrough, false)       \
  _(upsample_trilinear3d, as_is, fp32, fallthrough, false)          \
  _(upsample_bicubic2d, as_is, fp32, fallthrough, false)            \
  _(_upsample_bicubic2d_aa, as_is, fp32, fallthrough, false)        

// The ops of the table for which the installed torch registers its own AutocastCUDA kernel. Read once,
// before any of ours is registered (the first install or table(), both with nothing installed).
const std::unordered_set<std::string>& torch_kernels(c10::DispatchKey key) {
  static std::mutex probe_mutex;
  static std::unordered_map<c10::DispatchKey, std::unordered_set<std::string>> by_key;
  std::lock_guard<std::mutex> lock(probe_mutex);
  auto found = by_key.find(key);
  if (found != by_key.end()) return found->second;
  std::unordered_set<std::string>& out = by_key[key];
  {
#define LAMP_O2_PROBE(op, rule, torch_cuda, torch_cpu, on_cpu)                                                   \
  {                                                                                                   \
    auto handle = c10::Dispatcher::singleton().findOp({at::_ops::op::name, at::_ops::op::overload_name}); \
    if (handle && handle->hasKernelForDispatchKey(key))                                             \
      out.insert(op_name<at::_ops::op>());                                                            \
  }
    LAMP_O2_OPS(LAMP_O2_PROBE)
#undef LAMP_O2_PROBE
  }
  return out;
}

// Called with g_mutex held or before any install (table()): the probe reads torch's own registrations.
bool torch_registers_on_cuda(const std::string& name) {
  return torch_kernels(c10::DispatchKey::AutocastCUDA).count(name) > 0;
}
bool torch_registers_on_cpu(const std::string& name) {
  return torch_kernels(c10::DispatchKey::AutocastCPU).count(name) > 0;
}

void register_cuda_key(torch::Library& lib) {
#define LAMP_O2_ADD(op, rule, torch_cuda, torch_cpu, on_cpu) \
  add<at::_ops::op, c10::DeviceType::CUDA, Torch::torch_cuda, Rule::rule>(lib, torch_registers_on_cuda(op_name<at::_ops::op>()));
  LAMP_O2_OPS(LAMP_O2_ADD)
#undef LAMP_O2_ADD
}

void register_cpu_key(torch::Library& lib) {
#define LAMP_O2_ADD(op, rule, torch_cuda, torch_cpu, on_cpu) \
  if (on_cpu) add<at::_ops::op, c10::DeviceType::CPU, Torch::torch_cpu, Rule::rule>(lib, torch_registers_on_cpu(op_name<at::_ops::op>()));
  LAMP_O2_OPS(LAMP_O2_ADD)
#undef LAMP_O2_ADD
}

void register_cuda_lists_on_cpu_key(torch::Library& lib) {
#define LAMP_O2_ADD(op, rule, torch_cuda, torch_cpu, on_cpu) \
  add<at::_ops::op, c10::DeviceType::CPU, Torch::torch_cuda, Rule::rule>(lib, torch_registers_on_cuda(op_name<at::_ops::op>()));
  LAMP_O2_OPS(LAMP_O2_ADD)
#undef LAMP_O2_ADD
}

std::mutex g_mutex;  // guards everything below
int64_t g_installs = 0;
std::string g_mode;
std::vector<std::unique_ptr<torch::Library>> g_libraries;
int64_t g_shares = 0;
uint64_t g_next_token = 1;

std::unique_ptr<torch::Library> library_for(c10::DispatchKey key) {
  return std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
}

}  // namespace

void enter_forward() {
  if (t_depth++ == 0) t_upcasts.clear();  // a forward region begins: the upcasts noted are of the one before
}

void exit_forward() {
  TORCH_CHECK(t_depth > 0, "o2_policy: exit_forward without enter_forward on this thread");
  --t_depth;
}

bool active() { return policy_active(); }

uint64_t share_begin() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_shares++ == 0) g_live_share.store(g_next_token++, std::memory_order_relaxed);
  return g_live_share.load(std::memory_order_relaxed);
}

void share_join(uint64_t token) { t_shared = token; }

void share_end() {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(g_shares > 0, "o2_policy: share_end without share_begin");
  if (--g_shares == 0) g_live_share.store(0, std::memory_order_relaxed);
}

void install(const std::string& mode) {
  TORCH_CHECK_VALUE(mode == "torch" || mode == "cuda-lists-on-cpu",
                    "o2_policy install: `mode` must be \"torch\" or \"cuda-lists-on-cpu\", got \"", mode, "\"");
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_installs > 0) {
    TORCH_CHECK_VALUE(mode == g_mode, "o2_policy install: installed in mode \"", g_mode, "\", asked for \"", mode,
                      "\"");
    ++g_installs;
    return;
  }
  torch_kernels(c10::DispatchKey::AutocastCUDA);  // read torch's own registrations before any of ours
  torch_kernels(c10::DispatchKey::AutocastCPU);
  auto cuda = library_for(c10::DispatchKey::AutocastCUDA);
  register_cuda_key(*cuda);
  auto cpu = library_for(c10::DispatchKey::AutocastCPU);
  if (mode == "torch") {
    register_cpu_key(*cpu);
  } else {
    register_cuda_lists_on_cpu_key(*cpu);
  }
  g_libraries.push_back(std::move(cuda));
  g_libraries.push_back(std::move(cpu));
  g_mode = mode;
  g_installs = 1;
}

void uninstall() {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(g_installs > 0, "o2_policy: uninstall without install");
  if (--g_installs == 0) {
    g_libraries.clear();  // deregisters: torch's own kernels serve again
    g_mode.clear();
  }
}

int64_t installs() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_installs;
}

void set_promotion_reporter(PromotionReporter reporter) {
  std::lock_guard<std::mutex> lock(g_reporter_mutex);
  g_reporter = std::move(reporter);
  g_report_armed.store(static_cast<bool>(g_reporter));
}

std::vector<std::tuple<std::string, std::string, std::string, bool, std::string>> table() {
  std::vector<std::tuple<std::string, std::string, std::string, bool, std::string>> rows;
  // torch's policy as installed: an upcast the table names but this torch does not register is its fallthrough
#define LAMP_O2_ROW(op, rule, torch_cuda, torch_cpu, on_cpu)                                             \
  {                                                                                                      \
    const std::string name = op_name<at::_ops::op>();                                                   \
    const bool torch_has = std::string(#torch_cuda) == "fallthrough" || torch_registers_on_cuda(name);  \
    const bool torch_cpu_has = std::string(#torch_cpu) == "fallthrough" || torch_registers_on_cpu(name);  \
    rows.emplace_back(name, #rule, torch_has ? #torch_cuda : "fallthrough", on_cpu,                      \
                      torch_cpu_has ? #torch_cpu : "fallthrough");                                       \
  }
  LAMP_O2_OPS(LAMP_O2_ROW)
#undef LAMP_O2_ROW
  return rows;
}

}  // namespace o2
}  // namespace lamp
