// O2's autocast policy (csrc/o2_policy.cpp): while O2's forward is entered on a thread, the ops
// torch's autocast would upcast for the model's own computation run in their activations' dtype.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace lamp {
namespace o2 {

// O2's forward entered / left on the calling thread (nestable).
void enter_forward();
void exit_forward();
// Whether O2's policy applies on the calling thread now.
bool active();

// A backward whose activation-checkpointing recompute may run on another thread (CUDA's autograd
// thread): share_begin() opens a region, share_join(token) makes the calling thread follow O2's
// policy while that region is open, share_end() closes it for every thread that joined.
// Regions opened while one is open share its token (reference counted).
uint64_t share_begin();
void share_join(uint64_t token);
void share_end();

// Register the policy's kernels on the AutocastCPU and AutocastCUDA keys (reference counted:
// the last uninstall() removes them and torch's own kernels serve again). mode "torch": each key
// keeps torch's own lists when the policy is not active. mode "cuda-lists-on-cpu" (tests): the
// AutocastCPU key gets every kernel with CUDA's lists, so the CPU runs CUDA's autocast policy.
void install(const std::string& mode);
void uninstall();
int64_t installs();

// (op name, O2 rule, torch's CUDA policy, registered on the CPU key, torch's CPU policy) of every kernel.
std::vector<std::tuple<std::string, std::string, std::string, bool, std::string>> table();

// Called (op, its operands described) the first time after arming that an fp32 activation promotes a half
// one inside O2's forward (torch's promotion kept: docs/o2-design.md); a reporter arms, an empty one
// disarms. Called on the thread of the op, which holds no lock of the policy.
using PromotionReporter = std::function<void(const std::string& op, const std::string& operands)>;
void set_promotion_reporter(PromotionReporter reporter);

}  // namespace o2
}  // namespace lamp
