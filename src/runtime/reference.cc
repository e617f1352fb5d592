// Float64 attention, written as plainly as possible so that it is obviously right.
//
// Terms. For one sequence and one Q head h (KV head h / g): S = Q Kᵀ / sqrt(d) with masked
// entries removed, P = softmax(S) row-wise, O = P V. Backward: dP = dO Vᵀ, D = rowsum(dO ∘ O),
// dS = P ∘ (dP − D), dQ = dS K / sqrt(d), dK = dSᵀ Q / sqrt(d), dV = Pᵀ dO.
#include "fcp/runtime/reference.h"

#include <cmath>

#include "fcp/core/error.h"

namespace fcp::runtime {

ReferenceResult referenceAttention(const Batch& batch, const AttentionConfig& a,
                                   std::span<const float> q, std::span<const float> k,
                                   std::span<const float> v, std::span<const float> dO) {
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
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
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
  if (norm == 0) return diff == 0 ? 0 : INFINITY;
  return std::sqrt(diff / norm);
}

}  // namespace fcp::runtime
