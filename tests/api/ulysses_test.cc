// fcp::UlyssesGroup and UlyssesLayer on thread ranks: nodes of `degree` ranks exchange rows for
// heads, FCP runs across the nodes on each member's share; outputs, LSE and gradients against
// the float64 reference of the whole batch, and the group's errors on every rank.
#include "fcp/api/ulysses.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../runtime/thread_transport.h"
#include "fcp/core/random.h"
#include "fcp/kernels/attention.h"
#include "fcp/runtime/reference.h"

namespace fcp {
namespace {

using runtime::testing::ThreadTransport;
using runtime::testing::ThreadWorld;

/// Runs body(node, across, rank) on nodes × degree thread ranks (rank r: node r / degree, member
/// r % degree); `node` joins a node's members, `across` the members of one index on every node.
/// Rethrows the first rank's exception.
template <typename Body>
void runNodes(int nodes, int degree, Body body) {
  std::vector<std::unique_ptr<ThreadWorld>> inside, across;
  for (int n = 0; n < nodes; ++n) inside.push_back(std::make_unique<ThreadWorld>(degree));
  for (int j = 0; j < degree; ++j) across.push_back(std::make_unique<ThreadWorld>(nodes));
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(nodes * degree));
  for (int r = 0; r < nodes * degree; ++r) {
    threads.emplace_back([&, r] {
      ThreadTransport node(*inside[static_cast<size_t>(r / degree)], r % degree);
      ThreadTransport cross(*across[static_cast<size_t>(r % degree)], r / degree);
      try {
        body(node, cross, r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

struct Case {
  int nodes = 2, degree = 2;
  int64_t hq = 4, hkv = 2, dim = 16;
  DType dtype = DType::kFp32;
  MaskKind mask = MaskKind::kCausal;
  uint64_t seed = 1;
  bool emptyRank = false;
  /// The batch planned ahead (pending()), and the next one planned ahead between this one's
  /// forward and backward; its forward must give the same o.
  bool ahead = false;
};

std::vector<float> randomRows(Rng& rng, int64_t n, DType dtype) {
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) {
    v = static_cast<float>(rng.normal());
    if (dtype == DType::kBf16) v = kernels::fromBf16(kernels::toBf16(v));
  }
  return x;
}

std::vector<std::byte> stored(const float* x, int64_t n, DType dtype) {
  std::vector<std::byte> out(static_cast<size_t>(n * kernels::dtypeBytes(dtype)));
  if (n == 0) return out;
  if (dtype == DType::kFp32) {
    std::memcpy(out.data(), x, out.size());
  } else {
    kernels::toBf16({x, static_cast<size_t>(n)},
                    {reinterpret_cast<uint16_t*>(out.data()), static_cast<size_t>(n)});
  }
  return out;
}

void unstored(const std::vector<std::byte>& in, float* x, DType dtype) {
  const size_t n = in.size() / static_cast<size_t>(kernels::dtypeBytes(dtype));
  if (n == 0) return;
  if (dtype == DType::kFp32) {
    std::memcpy(x, in.data(), in.size());
  } else {
    kernels::fromBf16({reinterpret_cast<const uint16_t*>(in.data()), n}, {x, n});
  }
}

/// The float64 log-sum-exp of every token's scaled scores, [T, hq].
std::vector<double> referenceLse(const Case& c, const std::vector<int64_t>& cu,
                                 const std::vector<float>& q, const std::vector<float>& k) {
  const int64_t total = cu.back(), group = c.hq / c.hkv;
  std::vector<double> lse(static_cast<size_t>(total * c.hq));
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) {
      const int64_t last = c.mask == MaskKind::kCausal ? t + 1 : cu[s + 1];
      for (int64_t h = 0; h < c.hq; ++h) {
        std::vector<double> scores;
        for (int64_t u = cu[s]; u < last; ++u) {
          double dot = 0;
          for (int64_t i = 0; i < c.dim; ++i) {
            dot += static_cast<double>(q[static_cast<size_t>((t * c.hq + h) * c.dim + i)]) *
                   k[static_cast<size_t>((u * c.hkv + h / group) * c.dim + i)];
          }
          scores.push_back(dot / std::sqrt(static_cast<double>(c.dim)));
        }
        const double top = *std::max_element(scores.begin(), scores.end());
        double sum = 0;
        for (const double x : scores) sum += std::exp(x - top);
        lse[static_cast<size_t>(t * c.hq + h)] = top + std::log(sum);
      }
    }
  }
  return lse;
}

void expectMatchesReference(const Case& c) {
  Rng rng(c.seed);
  const std::vector<int64_t> lengths = {300, 17, 1, 250, 90, 211};
  std::vector<int64_t> cu{0};
  for (const int64_t l : lengths) cu.push_back(cu.back() + l);
  const int64_t total = cu.back();
  const int ranks = c.nodes * c.degree;
  std::vector<int64_t> starts{0};
  for (int r = 1; r < ranks; ++r) {
    starts.push_back(static_cast<int64_t>(rng.uniform() * static_cast<double>(total)));
  }
  std::sort(starts.begin(), starts.end());
  if (c.emptyRank) starts[2] = starts[1];  // rank 1 holds nothing
  starts.push_back(total);
  const std::vector<float> q = randomRows(rng, total * c.hq * c.dim, c.dtype),
                           k = randomRows(rng, total * c.hkv * c.dim, c.dtype),
                           v = randomRows(rng, total * c.hkv * c.dim, c.dtype),
                           dO = randomRows(rng, total * c.hq * c.dim, c.dtype);
  std::vector<float> o(q.size()), dq(q.size()), dk(k.size()), dv(k.size());
  std::vector<float> lse(static_cast<size_t>(total * c.hq));
  runNodes(c.nodes, c.degree, [&](runtime::Transport& node, runtime::Transport& across, int r) {
    BatchOptions options;
    options.cuSeqlens = cu;
    options.localBegin = starts[static_cast<size_t>(r)];
    options.localEnd = starts[static_cast<size_t>(r) + 1];
    options.numHeadsQ = c.hq;
    options.numHeadsKv = c.hkv;
    options.headDim = c.dim;
    options.mask = c.mask;
    options.dtype = c.dtype;
    options.planConfig.blockSize = 64;
    UlyssesGroup group(node, options);
    AttentionBatch batch = c.ahead ? group.batch(group.pending(across)) : group.batch(across);
    const int64_t b = options.localBegin, n = options.localEnd - b;
    ASSERT_EQ(group.numUserTokens(), n);
    const int64_t qw = c.hq * c.dim, kw = c.hkv * c.dim;
    auto qs = stored(q.data() + b * qw, n * qw, c.dtype),
         ks = stored(k.data() + b * kw, n * kw, c.dtype),
         vs = stored(v.data() + b * kw, n * kw, c.dtype),
         dOs = stored(dO.data() + b * qw, n * qw, c.dtype);
    std::vector<std::byte> os(qs.size()), dqs(qs.size()), dks(ks.size()), dvs(ks.size());
    UlyssesLayer layer;
    layer.forward(group, batch, {qs.data(), c.dtype, n, c.hq, c.dim},
                  {ks.data(), c.dtype, n, c.hkv, c.dim}, {vs.data(), c.dtype, n, c.hkv, c.dim},
                  {os.data(), c.dtype, n, c.hq, c.dim},
                  {lse.data() + b * c.hq, DType::kFp32, n, c.hq, 1});
    // The layer's bytes are the batch's and the node's exchanges': this rank's rows of q, k, v
    // for every other member, and o and lse of every other member's rows back.
    const int64_t d = c.degree, me = r % d, e = kernels::dtypeBytes(c.dtype);
    const int64_t sq = c.hq / d, skv = std::max<int64_t>(1, c.hkv / d);
    int64_t others = 0;
    for (int64_t m = 0; m < d; ++m) {
      const auto at = static_cast<size_t>(r - me + m);
      if (m != me) others += starts[at + 1] - starts[at];
    }
    EXPECT_EQ(layer.forwardStats().sentBytes - batch.forwardStats().sentBytes,
              n * (sq + 2 * skv) * c.dim * e * (d - 1) + others * sq * (c.dim * e + 4));
    EXPECT_GE(layer.forwardStats().wallMs, batch.forwardStats().wallMs);
    EXPECT_EQ(layer.forwardStats().flops, batch.forwardStats().flops);
    // The next batch, planned while this one's layers run (its group's and its agreement's
    // collectives between this batch's exchanges).
    std::optional<UlyssesGroup> next;
    std::optional<PendingBatch> pending;
    if (c.ahead) {
      next.emplace(node, options);
      pending.emplace(next->pending(across));
    }
    layer.backward(group, batch, {dOs.data(), c.dtype, n, c.hq, c.dim},
                   {dqs.data(), c.dtype, n, c.hq, c.dim}, {dks.data(), c.dtype, n, c.hkv, c.dim},
                   {dvs.data(), c.dtype, n, c.hkv, c.dim});
    if (c.ahead) {
      AttentionBatch later = next->batch(std::move(*pending));
      std::vector<std::byte> again(os.size());
      UlyssesLayer second;
      second.forward(*next, later, {qs.data(), c.dtype, n, c.hq, c.dim},
                     {ks.data(), c.dtype, n, c.hkv, c.dim}, {vs.data(), c.dtype, n, c.hkv, c.dim},
                     {again.data(), c.dtype, n, c.hq, c.dim});
      EXPECT_TRUE(again == os) << "rank " << r << ": the batch planned ahead gave another o";
    }
    unstored(os, o.data() + b * qw, c.dtype);
    unstored(dqs, dq.data() + b * qw, c.dtype);
    unstored(dks, dk.data() + b * kw, c.dtype);
    unstored(dvs, dv.data() + b * kw, c.dtype);
  });
  const AttentionConfig a{c.hq, c.hkv, c.dim, kernels::dtypeBytes(c.dtype), c.mask};
  const runtime::ReferenceResult ref = runtime::referenceAttention(Batch{lengths}, a, q, k, v, dO);
  const double tolerance = c.dtype == DType::kFp32 ? 1e-5 : 2e-2;
  EXPECT_LE(runtime::relativeL2(o, ref.o), tolerance) << "o";
  EXPECT_LE(runtime::relativeL2(dq, ref.dq), tolerance) << "dq";
  EXPECT_LE(runtime::relativeL2(dk, ref.dk), tolerance) << "dk";
  EXPECT_LE(runtime::relativeL2(dv, ref.dv), tolerance) << "dv";
  EXPECT_LE(runtime::relativeL2(lse, referenceLse(c, cu, q, k)),
            c.dtype == DType::kFp32 ? 1e-6 : 1e-3)
      << "lse";
}

TEST(UlyssesTest, TwoNodesOfTwoMatchTheReference) { expectMatchesReference({.emptyRank = true}); }

TEST(UlyssesTest, OneNodeOfFourReplicatesEachKeyValueHeadOnTwoMembers) {
  expectMatchesReference({.nodes = 1, .degree = 4, .mask = MaskKind::kFull, .seed = 2});
}

TEST(UlyssesTest, OneKeyValueHeadOnEveryMemberInBf16) {
  expectMatchesReference({.hkv = 1, .dtype = DType::kBf16, .seed = 3});
}

TEST(UlyssesTest, ABatchPlannedAheadMatchesTheReference) {
  expectMatchesReference({.hkv = 1, .seed = 5, .emptyRank = true, .ahead = true});
}

TEST(UlyssesTest, ADegreeOfOneIsFcpAlone) {
  expectMatchesReference({.nodes = 3, .degree = 1, .hkv = 4, .seed = 4});
}

/// 400 tokens of one sequence, 100 a rank from `at` (a rank's place in the stream), 4 : 2 heads
/// of 8.
BatchOptions tinyOptions(int64_t at) {
  BatchOptions o;
  o.cuSeqlens = {0, 400};
  o.localBegin = at * 100;
  o.localEnd = at * 100 + 100;
  o.numHeadsQ = 4;
  o.numHeadsKv = 2;
  o.headDim = 8;
  return o;
}

TEST(UlyssesTest, TheGroupsErrorsFailTheBatchOnEveryRank) {
  const auto failures = [](int64_t hq, Layout layout, bool swapped) {
    std::vector<std::string> messages(4);
    runNodes(2, 2, [&](runtime::Transport& node, runtime::Transport& across, int r) {
      BatchOptions o;
      o.cuSeqlens = {0, 100, 400};
      const int64_t at = swapped && r < 2 ? 1 - r : r;  // node 0's members swap their ranges
      o.localBegin = at * 100;
      o.localEnd = at * 100 + 100;
      o.numHeadsQ = hq;
      o.numHeadsKv = 1;
      o.headDim = 8;
      o.layout = layout;
      try {
        UlyssesGroup group(node, o);
        AttentionBatch batch = group.batch(across);
      } catch (const Error& e) {
        messages[static_cast<size_t>(r)] = e.what();
      }
    });
    return messages;
  };
  const auto swapped = failures(4, Layout::kTransparent, true);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(swapped[static_cast<size_t>(r)].find(
                  "the node's ranges are [[100, 200), [0, 100)]: expected each member's range to "
                  "end where the next member's begins"),
              std::string::npos)
        << swapped[static_cast<size_t>(r)];
  }
  for (int r = 2; r < 4; ++r) EXPECT_NE(swapped[static_cast<size_t>(r)], "") << r;  // the agreement
  for (const std::string& m : failures(3, Layout::kTransparent, false)) {
    EXPECT_NE(m.find("a node of 2 ranks with 3 query and 1 key/value heads: expected a divisor"),
              std::string::npos)
        << m;
  }
  for (const std::string& m : failures(4, Layout::kDispatched, false)) {
    EXPECT_NE(m.find("expected the transparent layout"), std::string::npos) << m;
  }
  // A setting that differs inside a node (rank 3's block size) is refused there, and the other
  // node hears of it through the agreement across the nodes.
  std::vector<std::string> blocks(4);
  runNodes(2, 2, [&](runtime::Transport& node, runtime::Transport& across, int r) {
    BatchOptions o = tinyOptions(r);
    o.planConfig.blockSize = r == 3 ? 128 : 64;
    try {
      UlyssesGroup(node, o).batch(across);
    } catch (const Error& e) {
      blocks[static_cast<size_t>(r)] = e.what();
    }
  });
  for (const int r : {2, 3}) {
    EXPECT_NE(blocks[static_cast<size_t>(r)].find(
                  "the node's members passed different settings (block size or other planner "
                  "settings): expected the same on every member"),
              std::string::npos)
        << blocks[static_cast<size_t>(r)];
  }
  for (const int r : {0, 1}) EXPECT_NE(blocks[static_cast<size_t>(r)], "") << r;
  // Inside one node, the only one: no agreement across nodes compares anything, so the group
  // does (rank 1's mask gave its heads another attention before).
  std::vector<std::string> masks(2);
  runNodes(1, 2, [&](runtime::Transport& node, runtime::Transport& across, int r) {
    BatchOptions o = tinyOptions(r);
    if (r == 1) o.mask = MaskKind::kFull;
    try {
      UlyssesGroup(node, o).batch(across);
    } catch (const Error& e) {
      masks[static_cast<size_t>(r)] = e.what();
    }
  });
  for (const std::string& m : masks) {
    EXPECT_NE(m.find("the node's members passed different settings (mask)"), std::string::npos)
        << m;
  }
  // What only one index's agreement refuses (rank 2's thread count, a rank's own setting) fails
  // that index; the node's confirmation fails the other index too, rather than leave it to time
  // out in the first exchange.
  // The same planned ahead (pending()), where the agreement comes before the plan.
  const auto made = [](const UlyssesGroup& group, runtime::Transport& across, bool ahead) {
    return ahead ? group.batch(group.pending(across)) : group.batch(across);
  };
  for (const bool ahead : {false, true}) {
    std::vector<std::string> threadCounts(4);
    runNodes(2, 2, [&](runtime::Transport& node, runtime::Transport& across, int r) {
      BatchOptions o = tinyOptions(r);
      o.numThreads = r == 2 ? 0 : 1;
      try {
        made(UlyssesGroup(node, o), across, ahead);
      } catch (const Error& e) {
        threadCounts[static_cast<size_t>(r)] = e.what();
      }
    });
    for (const int r : {0, 2}) {
      EXPECT_NE(threadCounts[static_cast<size_t>(r)].find("thread count"), std::string::npos)
          << ahead << ": " << threadCounts[static_cast<size_t>(r)];
    }
    for (const int r : {1, 3}) {
      EXPECT_NE(threadCounts[static_cast<size_t>(r)].find(
                    "member 0 of the node could not make the batch"),
                std::string::npos)
          << ahead << ": " << threadCounts[static_cast<size_t>(r)];
    }
  }
  // An across transport that does not pair with the nodes: node 0's members swap indices, so
  // rank 0 (member 1 now) meets rank 2 (member 0). Refused on every rank.
  for (const bool ahead : {false, true}) {
    std::vector<std::string> crossed(4);
    {
      ThreadWorld node0(2), node1(2), index0(2), index1(2);
      std::vector<std::thread> threads;
      for (int r = 0; r < 4; ++r) {
        threads.emplace_back([&, r] {
          const int member = r < 2 ? 1 - r : r - 2;  // node 0's ranks 0, 1 are members 1, 0
          ThreadTransport node(r < 2 ? node0 : node1, member);
          ThreadTransport across(r % 2 == 0 ? index0 : index1, r / 2);
          const BatchOptions o = tinyOptions(r < 2 ? member : r);
          try {
            made(UlyssesGroup(node, o), across, ahead);
          } catch (const Error& e) {
            crossed[static_cast<size_t>(r)] = e.what();
          }
        });
      }
      for (auto& t : threads) t.join();
    }
    for (const std::string& m : crossed) {
      EXPECT_NE(m.find("expected the ranks with this rank's index"), std::string::npos)
          << ahead << ": " << m;
    }
  }
  // A call with a tensor of the wrong shape on every rank fails there, before any message.
  std::vector<std::string> shapes(4);
  runNodes(2, 2, [&](runtime::Transport& node, runtime::Transport& across, int r) {
    UlyssesGroup group(node, tinyOptions(r));
    AttentionBatch batch = group.batch(across);
    std::vector<float> x(100 * 4 * 8);
    UlyssesLayer layer;
    try {
      layer.forward(group, batch, {x.data(), DType::kFp32, 100, 2, 8},
                    {x.data(), DType::kFp32, 100, 2, 8}, {x.data(), DType::kFp32, 100, 2, 8},
                    {x.data(), DType::kFp32, 100, 4, 8});
    } catch (const Error& e) {
      shapes[static_cast<size_t>(r)] = e.what();
    }
  });
  for (const std::string& m : shapes) {
    EXPECT_NE(m.find("q is [100, 2, 8] fp32, expected [100, 4, 8] fp32"), std::string::npos) << m;
  }
}

/// A thread transport's messages as they are, and an allreduce of this test's own.
class WithAllreduce : public runtime::Transport {
 public:
  explicit WithAllreduce(runtime::Transport& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int maxTag() const override { return inner_.maxTag(); }
  runtime::RequestId isend(int peer, int tag, std::span<const std::byte> data) override {
    return inner_.isend(peer, tag, data);
  }
  runtime::RequestId irecv(int peer, int tag, std::span<std::byte> data) override {
    return inner_.irecv(peer, tag, data);
  }
  bool test(runtime::RequestId request) override { return inner_.test(request); }
  void wait(runtime::RequestId request) override { inner_.wait(request); }
  [[noreturn]] void abort(int) noexcept override { std::abort(); }  // as ThreadTransport
  using Transport::allreduce;

 private:
  runtime::Transport& inner_;
};

/// Its allreduce throws on this rank, as an MPI transport's does once an earlier collective
/// was abandoned, or one that timed out.
class RefusesAllreduce final : public WithAllreduce {
 public:
  using WithAllreduce::WithAllreduce;
  void allreduce(std::span<int64_t>, runtime::ReduceOp, double) override {
    throw Error(ErrorCode::kTransport, "this rank's across allreduce was refused");
  }
};

/// An allreduce made of messages (gathered at rank 0, sent back), so that it throws after the
/// world's receive timeout, as MPI's and gloo's do, where ThreadTransport's own waits for ever.
class BoundedAllreduce final : public WithAllreduce {
 public:
  using WithAllreduce::WithAllreduce;
  void allreduce(std::span<int64_t> values, runtime::ReduceOp op, double) override {
    const int tag = maxTag();
    if (rank() != 0) {
      wait(isend(0, tag, std::as_bytes(values)));
      wait(irecv(0, tag, std::as_writable_bytes(values)));
      return;
    }
    std::vector<int64_t> other(values.size());
    for (int r = 1; r < size(); ++r) {
      wait(irecv(r, tag, std::as_writable_bytes(std::span<int64_t>(other))));
      for (size_t i = 0; i < values.size(); ++i) {
        values[i] = op == runtime::ReduceOp::kSum   ? values[i] + other[i]
                    : op == runtime::ReduceOp::kMin ? std::min(values[i], other[i])
                                                    : std::max(values[i], other[i]);
      }
    }
    for (int r = 1; r < size(); ++r) wait(isend(r, tag, std::as_bytes(values)));
  }
};

TEST(UlyssesTest, AMemberWhosePairingCheckThrowsStillTellsItsNode) {
  // One node of 2, each member alone across nodes; member 0's across allreduce (the pairing
  // check's) throws. Member 1 must hear of it in the node's confirmation, in line and planning
  // ahead; before, member 0 skipped the confirmation and member 1 waited there.
  for (const bool ahead : {false, true}) {
    ThreadWorld inside(2, std::chrono::seconds(5)), across0(1), across1(1);
    std::vector<std::string> messages(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        ThreadTransport member(inside, r), alone(r == 0 ? across0 : across1, 0);
        BoundedAllreduce node(member);
        RefusesAllreduce refusing(alone);
        runtime::Transport& across = r == 0 ? static_cast<runtime::Transport&>(refusing) : alone;
        BatchOptions o = tinyOptions(r);
        o.cuSeqlens = {0, 200};
        try {
          UlyssesGroup group(node, o);
          ahead ? group.batch(group.pending(across)) : group.batch(across);
        } catch (const Error& e) {
          messages[static_cast<size_t>(r)] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(messages[0], "this rank's across allreduce was refused") << ahead;
    EXPECT_NE(messages[1].find("member 0 of the node could not make the batch"), std::string::npos)
        << ahead << ": " << messages[1];
  }
}

TEST(UlyssesTest, ANodesBudgetIsItsMembersAndItsShareOfTheHeads) {
  runNodes(1, 2, [&](runtime::Transport& node, runtime::Transport&, int r) {
    BatchOptions o = tinyOptions(r);
    o.planConfig.memoryLimitTokens = 300;
    const BatchOptions across = UlyssesGroup(node, o).across();
    EXPECT_EQ(across.planConfig.memoryLimitTokens, 600);  // the worker across nodes is the node
    EXPECT_EQ(across.localBegin, 0);
    EXPECT_EQ(across.localEnd, 200);
    EXPECT_EQ(across.numHeadsQ, 2);
    EXPECT_EQ(across.numHeadsKv, 1);
    EXPECT_EQ(across.localError, "");
  });
}

}  // namespace
}  // namespace fcp
