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
//   * add/sub/mul/div of a half tensor and an fp32 leaf that requires grad (a Parameter: an RMSNorm
//     weight, a layer scale, a learned position table): the leaf is cast to the half dtype, where
//     type promotion would make the result fp32;
//   * losses stay fp32: torch's fp32 list keeps them (they are not registered here), and CUDA's
//     cross_entropy_loss, which torch lets decompose into log_softmax and nll_loss, runs whole in fp32.
// Elsewhere (policy not active on the thread: bf16-mixed or O1 in the same process, another thread,
// a forward outside O2's) each kernel is torch's: the op's policy on that key through the template
// torch itself instantiates (at::autocast::WrapFunction), or, where torch registers none, a
// redispatch below autocast (what its fallthrough does). Which of the two is read from the installed
// torch's dispatcher before the first install (torch_cuda_kernels): an op the table lists as upcast on
// CUDA that this torch does not register there (rms_norm in torch 2.11; 2.13 upcasts it) keeps the fallthrough.
// tests/test_o2_policy.py compares both.
#include "o2_policy.h"

#include <ATen/ATen.h>
#include <ATen/Operators.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
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

enum class Rule { as_is, follow_input, half_output, to_fp32, param_to_half, batch_norm };
enum class Torch { fallthrough, fp32, fp32_set_opt_dtype };  // torch's own policy for an op on a key

using at::autocast::cached_cast;

template <c10::DeviceType dev>
inline bool is_half(const at::Tensor& t) {
  return t.defined() && at::autocast::is_eligible(t, dev) &&
         (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
}

// An fp32 Parameter: a leaf that requires grad, not 0-dim (a 0-dim tensor does not promote a half one).
template <c10::DeviceType dev>
inline bool is_fp32_param(const at::Tensor& t) {
  return t.defined() && at::autocast::is_eligible(t, dev) && t.scalar_type() == at::kFloat && t.dim() > 0 &&
         t.is_leaf() && t.requires_grad();
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

template <c10::DeviceType dev, class Op>
struct O2Rule<Rule::param_to_half, dev, Op> {
  template <class... A>
  static auto call(const at::Tensor& a, const at::Tensor& b, const A&... rest) {
    if (is_half<dev>(a) && is_fp32_param<dev>(b)) return Op::call(a, cached_cast(a.scalar_type(), b, dev), rest...);
    if (is_half<dev>(b) && is_fp32_param<dev>(a)) return Op::call(cached_cast(b.scalar_type(), a, dev), b, rest...);
    return Op::call(a, b, rest...);
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
      constexpr auto policy = torch_policy == Torch::fp32 ? at::autocast::CastPolicy::fp32
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

// (op in at::_ops, O2's rule, torch's policy on AutocastCUDA, registered on AutocastCPU in mode "torch").
// On the CPU key torch registers none of these (tests/test_o2_policy.py checks it), so there its policy
// is the fallthrough; the ops whose O2 rule only drops an upcast are not registered there at all.
#define LAMP_O2_OPS(_)                                               \
  _(layer_norm, follow_input, fp32, true)                           \
  _(native_layer_norm, follow_input, fp32, true)                    \
  _(rms_norm, follow_input, fp32, true)                             \
  _(group_norm, follow_input, fp32, true)                           \
  _(batch_norm, batch_norm, fallthrough, true)                      \
  _(embedding, half_output, fallthrough, true)                      \
  _(add_Tensor, param_to_half, fallthrough, true)                   \
  _(sub_Tensor, param_to_half, fallthrough, true)                   \
  _(mul_Tensor, param_to_half, fallthrough, true)                   \
  _(div_Tensor, param_to_half, fallthrough, true)                   \
  _(cross_entropy_loss, to_fp32, fallthrough, false)                \
  _(softmax_int, as_is, fp32_set_opt_dtype, false)                  \
  _(log_softmax_int, as_is, fp32_set_opt_dtype, false)              \
  _(sum, as_is, fp32_set_opt_dtype, false)                          \
  _(sum_dim_IntList, as_is, fp32_set_opt_dtype, false)              \
  _(prod, as_is, fp32_set_opt_dtype, false)                         \
  _(prod_dim_int, as_is, fp32_set_opt_dtype, false)                 \
  _(cumsum, as_is, fp32_set_opt_dtype, false)                       \
  _(cumprod, as_is, fp32_set_opt_dtype, false)                      \
  _(linalg_vector_norm, as_is, fp32_set_opt_dtype, false)           \
  _(frobenius_norm_dim, as_is, fp32, false)                         \
  _(pow_Tensor_Scalar, as_is, fp32, false)                          \
  _(pow_Tensor_Tensor, as_is, fp32, false)                          \
  _(pow_Scalar, as_is, fp32, false)                                 \
  _(exp, as_is, fp32, false)                                        \
  _(expm1, as_is, fp32, false)                                      \
  _(log, as_is, fp32, false)                                        \
  _(log10, as_is, fp32, false)                                      \
  _(log2, as_is, fp32, false)                                       \
  _(log1p, as_is, fp32, false)                                      \
  _(reciprocal, as_is, fp32, false)                                 \
  _(rsqrt, as_is, fp32, false)                                      \
  _(acos, as_is, fp32, false)                                       \
  _(asin, as_is, fp32, false)                                       \
  _(cosh, as_is, fp32, false)                                       \
  _(sinh, as_is, fp32, false)                                       \
  _(tan, as_is, fp32, false)                                        \
  _(erfinv, as_is, fp32, false)                                     \
  _(softplus, as_is, fp32, false)                                   \
  _(upsample_nearest1d, as_is, fp32, false)                         \
  _(_upsample_nearest_exact1d, as_is, fp32, false)                  \
  _(upsample_nearest2d, as_is, fp32, false)                         \
  _(_upsample_nearest_exact2d, as_is, fp32, false)                  \
  _(upsample_nearest3d, as_is, fp32, false)                         \
  _(_upsample_nearest_exact3d, as_is, fp32, false)                  \
  _(upsample_linear1d, as_is, fp32, false)                          \
  _(upsample_bilinear2d, as_is, fp32, false)                        \
  _(_upsample_bilinear2d_aa, as_is, fp32, false)                    \
  _(upsample_trilinear3d, as_is, fp32, false)                       \
  _(upsample_bicubic2d, as_is, fp32, false)                         \
  _(_upsample_bicubic2d_aa, as_is, fp32, false)

// The ops of the table for which the installed torch registers its own AutocastCUDA kernel. Read once,
// before any of ours is registered (the first install or table(), both with nothing installed).
const std::unordered_set<std::string>& torch_cuda_kernels() {
  static const std::unordered_set<std::string> names = [] {
    std::unordered_set<std::string> out;
#define LAMP_O2_PROBE(op, rule, torch_cuda, on_cpu)                                                   \
  {                                                                                                   \
    auto handle = c10::Dispatcher::singleton().findOp({at::_ops::op::name, at::_ops::op::overload_name}); \
    if (handle && handle->hasKernelForDispatchKey(c10::DispatchKey::AutocastCUDA))                  \
      out.insert(op_name<at::_ops::op>());                                                            \
  }
    LAMP_O2_OPS(LAMP_O2_PROBE)
#undef LAMP_O2_PROBE
    return out;
  }();
  return names;
}

bool torch_registers_on_cuda(const std::string& name) { return torch_cuda_kernels().count(name) > 0; }

void register_cuda_key(torch::Library& lib) {
#define LAMP_O2_ADD(op, rule, torch_cuda, on_cpu) \
  add<at::_ops::op, c10::DeviceType::CUDA, Torch::torch_cuda, Rule::rule>(lib, torch_registers_on_cuda(op_name<at::_ops::op>()));
  LAMP_O2_OPS(LAMP_O2_ADD)
#undef LAMP_O2_ADD
}

void register_cpu_key(torch::Library& lib) {
#define LAMP_O2_ADD(op, rule, torch_cuda, on_cpu) \
  if (on_cpu) add<at::_ops::op, c10::DeviceType::CPU, Torch::fallthrough, Rule::rule>(lib);
  LAMP_O2_OPS(LAMP_O2_ADD)
#undef LAMP_O2_ADD
}

void register_cuda_lists_on_cpu_key(torch::Library& lib) {
#define LAMP_O2_ADD(op, rule, torch_cuda, on_cpu) \
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

void enter_forward() { ++t_depth; }

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
  torch_cuda_kernels();  // read torch's own registrations before any of ours
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

std::vector<std::tuple<std::string, std::string, std::string, bool>> table() {
  std::vector<std::tuple<std::string, std::string, std::string, bool>> rows;
  // torch's policy as installed: an upcast the table names but this torch does not register is its fallthrough
#define LAMP_O2_ROW(op, rule, torch_cuda, on_cpu)                                                        \
  {                                                                                                      \
    const std::string name = op_name<at::_ops::op>();                                                   \
    const bool torch_has = std::string(#torch_cuda) == "fallthrough" || torch_registers_on_cuda(name);  \
    rows.emplace_back(name, #rule, torch_has ? #torch_cuda : "fallthrough", on_cpu);                     \
  }
  LAMP_O2_OPS(LAMP_O2_ROW)
#undef LAMP_O2_ROW
  return rows;
}

}  // namespace o2
}  // namespace lamp
