#pragma once
/// The executor: carries out one worker's part of a `Plan` on real tensors, forward and
/// backward, over a Transport. It never decides anything the plan did not say: the blocks it
/// owns, the KV it sends and receives in each stage, the pairs it computes, when it frees a
/// buffer and where each dK/dV partial goes all come from the plan.
///
/// Tensors are fp32. In the user layout rank r holds tokens [start[r], start[r + 1]) of the
/// packed batch (plan::userLayoutStarts): Q, O, dO, dQ as [tokens, numHeadsQ, headDim], K, V,
/// dK, dV as [tokens, numHeadsKv, headDim], LSE as [tokens, numHeadsQ] (natural log).

#include <cstdint>
#include <memory>
#include <span>

#include "fcp/plan/plan.h"
#include "fcp/runtime/timeline.h"
#include "fcp/runtime/transport.h"

namespace fcp::runtime {

struct ExecutorOptions {
  /// Kernel threads per rank.
  int numThreads = 1;
  /// When set, every kernel call and message is recorded here.
  Timeline* timeline = nullptr;
};

/// What one pass cost on this rank.
struct PassStats {
  double wallMs = 0;        ///< the whole pass, reshuffles included
  double kernelMs = 0;      ///< time inside attention kernels (and LSE merges)
  double flops = 0;         ///< useful FLOPs computed (DESIGN.md's convention)
  int64_t sentBytes = 0;    ///< bytes this rank sent: KV, dK/dV partials and reshuffle pieces
  int64_t kvBytes = 0;      ///< of which KV blocks and dK/dV partials (the plan's transfers)
};

/// Runs a plan's stages for transport.rank(). The plan must be valid (plan::validate) with
/// elementBytes 4, and identical on every rank (see checkPlanAgreement).
class Executor {
 public:
  Executor(const plan::Plan& plan, Transport& transport, const ExecutorOptions& options = {});
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// Tokens this rank holds in the user layout.
  int64_t userTokens() const;

  /// Attention forward. Inputs and outputs in the user layout (sizes as above); keeps O and
  /// LSE in the plan's layout for `backward`. Collective: every rank calls it.
  void forward(std::span<const float> q, std::span<const float> k, std::span<const float> v,
               std::span<float> o, std::span<float> lse);

  /// Attention backward of the last forward: dO in, dQ, dK, dV out, all in the user layout.
  void backward(std::span<const float> dO, std::span<float> dq, std::span<float> dk,
                std::span<float> dv);

  const PassStats& forwardStats() const;
  const PassStats& backwardStats() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// 64-bit FNV-1a of plan::planToJson(plan).
uint64_t planDigest(const plan::Plan& plan);

/// Compares this rank's plan digest with every other rank's (one allreduce). Throws
/// Error(kInvalidPlan) on every rank when any two differ, naming this rank's digest and the
/// range seen, so that no rank starts a plan the others do not share.
void checkPlanAgreement(const plan::Plan& plan, Transport& transport);

}  // namespace fcp::runtime
