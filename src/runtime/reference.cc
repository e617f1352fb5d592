// Float64 attention, written as plainly as possible so that it is obviously right.
//
// Terms. For one sequence and one Q head h (KV head h / g): S = c Q Kᵀ with masked entries
// removed (c the softmax scale, 1/sqrt(d) by default), P = softmax(S) row-wise, O = P V.
// Backward: dP = dO Vᵀ, D = rowsum(dO ∘ O), dS = P ∘ (dP − D), dQ = c dS K, dK = c dSᵀ Q,
// dV = Pᵀ dO.
#include "fcp/runtime/reference.h"

#include <algorithm>
#include <cmath>

#include "fcp/core/error.h"

namespace fcp::runtime {

ReferenceResult referenceAttention(const Batch& batch, const AttentionConfig& a,
                                   std::span<const float> q, std::span<const float> k,
                                   std::span<const float> v, std::span<const float> dO,
                                   double softmaxScale) {
  const int64_t tokens = batch.numTokens(), hq = a.numHeadsQ, hkv = a.numHeadsKv, d = a.headDim;
  const int64_t group = hq / hkv;
  if (static_cast<int64_t>(q.size()) != tokens * hq * d || static_cast<int64_t>(dO.size()) != tokens * hq * d ||
      static_cast<int64_t>(k.size()) != tokens * hkv * d || static_cast<int64_t>(v.size()) != tokens * hkv * d) {
    throwInvalidArgument("reference attention: tensor sizes do not match ", tokens, " tokens");
  }
  ReferenceResult r;
  r.o.assign(q.size(), 0.0);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  const double scale = softmaxScale != 0 ? softmaxScale : 1.0 / std::sqrt(static_cast<double>(d));
  auto qi = [&](int64_t t, int64_t h) { return (t * hq + h) * d; };
  auto ki = [&](int64_t t, int64_t h) { return (t * hkv + h) * d; };
  int64_t begin = 0;
  std::vector<double> p;
  for (const int64_t len : batch.sequenceLengths) {
    p.resize(static_cast<size_t>(len));
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < len; ++i) {
        const int64_t ti = begin + i;
        const int64_t visible = a.mask == MaskKind::kCausal ? i + 1 : len;
        double maxScore = -INFINITY;
        for (int64_t j = 0; j < visible; ++j) {
          double s = 0;
          for (int64_t x = 0; x < d; ++x) s += double(q[qi(ti, h) + x]) * double(k[ki(begin + j, hk) + x]);
          p[j] = s * scale;
          maxScore = std::max(maxScore, p[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < visible; ++j) sum += (p[j] = std::exp(p[j] - maxScore));
        for (int64_t j = 0; j < visible; ++j) p[j] /= sum;
        double* o = &r.o[qi(ti, h)];
        for (int64_t j = 0; j < visible; ++j) {
          for (int64_t x = 0; x < d; ++x) o[x] += p[j] * double(v[ki(begin + j, hk) + x]);
        }
        double delta = 0;
        for (int64_t x = 0; x < d; ++x) delta += double(dO[qi(ti, h) + x]) * o[x];
        for (int64_t j = 0; j < visible; ++j) {
          const int64_t tj = begin + j;
          double dp = 0;
          for (int64_t x = 0; x < d; ++x) dp += double(dO[qi(ti, h) + x]) * double(v[ki(tj, hk) + x]);
          const double ds = p[j] * (dp - delta);
          for (int64_t x = 0; x < d; ++x) {
            r.dq[qi(ti, h) + x] += ds * scale * double(k[ki(tj, hk) + x]);
            r.dk[ki(tj, hk) + x] += ds * scale * double(q[qi(ti, h) + x]);
            r.dv[ki(tj, hk) + x] += p[j] * double(dO[qi(ti, h) + x]);
          }
        }
      }
    }
    begin += len;
  }
  return r;
}

double relativeL2(std::span<const float> a, std::span<const double> b) {
  FCP_CHECK_EQ(a.size(), b.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += b[i] * b[i];
  }
  if (norm == 0) return diff == 0 ? 0 : std::sqrt(diff / static_cast<double>(a.size()));
  return std::sqrt(diff / norm);
}

ReferenceErrors compareWithReference(const ReferenceResult& reference, std::span<const float> o,
                                     std::span<const float> dq, std::span<const float> dk,
                                     std::span<const float> dv) {
  return {relativeL2(o, reference.o), relativeL2(dq, reference.dq), relativeL2(dk, reference.dk),
          relativeL2(dv, reference.dv)};
}

std::vector<float> gatherToRoot(Transport& transport, std::span<const float> mine,
                                std::span<const int64_t> rowStarts, int64_t rowWidth, int tag) {
  const int ranks = transport.size(), rank = transport.rank();
  if (static_cast<int64_t>(rowStarts.size()) != int64_t{ranks} + 1 || rowStarts[0] != 0 ||
      rowWidth < 0) {
    throwInvalidArgument("gather to rank 0: ", rowStarts.size(), " row starts from ",
                         rowStarts.empty() ? -1 : rowStarts[0], ", row width ", rowWidth,
                         ": expected ", ranks + 1, " starts from 0 and a width >= 0");
  }
  // Offsets in floats, checked to rise.
  std::vector<size_t> offset(rowStarts.size());
  for (size_t r = 0; r < rowStarts.size(); ++r) {
    if (r > 0 && rowStarts[r] < rowStarts[r - 1]) {
      throwInvalidArgument("gather to rank 0: rank ", r - 1, "'s rows [", rowStarts[r - 1], ", ",
                           rowStarts[r], "): expected starts that do not fall");
    }
    offset[r] = static_cast<size_t>(rowStarts[r] * rowWidth);
  }
  const auto me = static_cast<size_t>(rank);
  if (mine.size() != offset[me + 1] - offset[me]) {
    throwInvalidArgument("gather to rank 0: rank ", rank, " holds ", mine.size(),
                         " floats: expected ", rowStarts[me + 1] - rowStarts[me], " rows of ",
                         rowWidth);
  }
  if (rank != 0) {
    if (!mine.empty()) transport.wait(transport.isend(0, tag, asBytes(mine)));
    return {};
  }
  std::vector<float> all(offset.back());
  std::vector<RequestId> recvs;
  for (int r = 1; r < ranks; ++r) {
    const auto rs = static_cast<size_t>(r);
    std::span<float> part(all.data() + offset[rs], offset[rs + 1] - offset[rs]);
    if (!part.empty()) recvs.push_back(transport.irecv(r, tag, asWritableBytes(part)));
  }
  std::copy(mine.begin(), mine.end(), all.begin());
  waitAll(transport, recvs);
  return all;
}

}  // namespace fcp::runtime
