// Block attention on the CPU: FlashAttention-2 style tiling over one (Q block, KV block) pair.
//
// Terms. Nq, Nk: tokens of the Q and KV blocks; Hq, Hkv: heads; g = Hq / Hkv (GQA group); d: head
// dimension. Inputs are first laid out *group-major*, [Hkv][tokens][g][d], so that the g query
// heads that share a KV head form one matrix with contiguous rows: a Q tile of qTile tokens is a
// (qTile * g) x d matrix and every tile product is one plain GEMM. (With Hkv = 1 this layout is
// the input itself and nothing is copied, unless bf16 input is widened.) The layout holds fp32,
// or bf16 when the tile products go through oneDNN's bf16 GEMM (Bf16Gemm::kNative); then the
// fp32 P and dS tiles are rounded to bf16 before the products that read them. A *task* is the
// unit of the parallel loop: in the forward one (KV head, Q tile) that walks its non-empty K
// tiles with an online softmax; in the backward one (KV head, K tile) that owns its dK, dV rows
// and walks its non-empty Q tiles, adding dQ under a per-Q-tile lock. Each tile product covers
// only the pair's column span (the keys some query of the Q tile can see). Tasks are sorted by
// the key columns they execute, largest first, so that causal work stays balanced over the
// workers.
//
// Scores are kept in the log2 domain: S2 = log2(e) * scale * Q K^T (scale: KernelOptions'
// softmaxScale, by default 1/sqrt(d)), so the softmax uses exp2.
#include "fcp/kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#include "attention_internal.h"
#include "block_mask.h"
#include "fcp/core/error.h"
#include "fcp/kernels/cpu_dispatch.h"
#include "gemm.h"
#include "parallel.h"
#include "vector_ops.h"

namespace fcp::kernels {

std::string_view dtypeName(DType dtype) { return dtype == DType::kBf16 ? "bf16" : "fp32"; }

uint16_t toBf16(float value) {
  uint16_t out;
  detail::vectorOpsPortable().fp32ToBf16(&value, &out, 1);
  return out;
}

float fromBf16(uint16_t value) {
  float out;
  detail::vectorOpsPortable().bf16ToFp32(&value, &out, 1);
  return out;
}

void toBf16(std::span<const float> in, std::span<uint16_t> out) {
  FCP_CHECK_EQ(in.size(), out.size());
  detail::vectorOps().fp32ToBf16(in.data(), out.data(), static_cast<int64_t>(in.size()));
}

void fromBf16(std::span<const uint16_t> in, std::span<float> out) {
  FCP_CHECK_EQ(in.size(), out.size());
  detail::vectorOps().bf16ToFp32(in.data(), out.data(), static_cast<int64_t>(in.size()));
}

int64_t dtypeBytes(DType dtype) { return dtype == DType::kBf16 ? 2 : 4; }

namespace {

using detail::ColumnSpan;
using detail::TileClass;
using detail::TileMap;
using detail::TokenInfo;
using detail::VectorOps;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Rows of a Q tile (tokens x g) and tokens of a K tile; chosen so that the score tile, the
// output accumulator and the K/V tiles stay near the 512 KiB L2 of the reference CPU.
constexpr int64_t kQTileRows = 256;
constexpr int64_t kKTileTokens = 128;

struct Shape {
  int64_t nq, nk;
  int hq, hkv, g, d;
};

void checkView(const TensorView& t, const char* name) {
  if (t.numTokens < 0 || t.numHeads <= 0 || t.headDim <= 0)
    throwInvalidArgument(name, " has shape [", t.numTokens, ", ", t.numHeads, ", ", t.headDim,
                         "], expected tokens >= 0 and heads, head_dim > 0");
  if (t.numTokens > 0 && t.data == nullptr)
    throwInvalidArgument(name, " has ", t.numTokens, " tokens but a null data pointer");
}

Shape checkShapes(const TensorView& q, const TensorView& k, const TensorView& v) {
  checkView(q, "q");
  checkView(k, "k");
  checkView(v, "v");
  if (k.numTokens != v.numTokens || k.numHeads != v.numHeads || k.headDim != v.headDim)
    throwInvalidArgument("v has shape [", v.numTokens, ", ", v.numHeads, ", ", v.headDim,
                         "], expected the shape of k [", k.numTokens, ", ", k.numHeads, ", ",
                         k.headDim, "]");
  if (q.headDim != k.headDim)
    throwInvalidArgument("q head_dim = ", q.headDim, ", expected k's head_dim ", k.headDim);
  if (q.numHeads % k.numHeads != 0)
    throwInvalidArgument("q has ", q.numHeads, " heads, expected a multiple of k's ", k.numHeads);
  if (q.dtype != k.dtype || q.dtype != v.dtype)
    throwInvalidArgument("q, k, v have dtypes ", dtypeName(q.dtype), ", ", dtypeName(k.dtype), ", ",
                         dtypeName(v.dtype), ", expected one dtype");
  return {q.numTokens, k.numTokens, q.numHeads, k.numHeads, q.numHeads / k.numHeads, q.headDim};
}

void checkLike(const TensorView& t, const TensorView& like, const char* name, const char* what) {
  checkView(t, name);
  if (t.numTokens != like.numTokens || t.numHeads != like.numHeads || t.headDim != like.headDim)
    throwInvalidArgument(name, " has shape [", t.numTokens, ", ", t.numHeads, ", ", t.headDim,
                         "], expected the shape of ", what, " [", like.numTokens, ", ",
                         like.numHeads, ", ", like.headDim, "]");
}

// A tensor in group-major layout [Hkv][tokens][g][d]: bf16 when the tile products go through
// the bf16 GEMM (the input must be bf16 then), else fp32 (bf16 input widened). Owns a copy
// unless it aliases the input (Hkv = 1 and the input already has the element type).
struct GroupMajor {
  std::vector<float> f32Storage;
  std::vector<uint16_t> bf16Storage;
  const void* data = nullptr;
  bool bf16 = false;
  int64_t headStride = 0;  // elements between consecutive KV heads

  /// The tile starting `offset` elements in, as a GEMM operand.
  const void* at(int64_t offset) const {
    if (bf16) return static_cast<const uint16_t*>(data) + offset;
    return static_cast<const float*>(data) + offset;
  }
};

GroupMajor toGroupMajor(const TensorView& t, int groups, bool bf16, const VectorOps& ops) {
  FCP_CHECK(!bf16 || t.dtype == DType::kBf16, "a bf16 group-major copy needs bf16 input");
  GroupMajor out;
  out.bf16 = bf16;
  const int g = t.numHeads / groups;
  const int64_t rowElems = static_cast<int64_t>(g) * t.headDim;
  out.headStride = t.numTokens * rowElems;
  const bool sameType = bf16 == (t.dtype == DType::kBf16);
  if (sameType && groups == 1) {
    out.data = t.data;
    return out;
  }
  if (bf16)
    out.bf16Storage.resize(static_cast<size_t>(out.headStride) * groups);
  else
    out.f32Storage.resize(static_cast<size_t>(out.headStride) * groups);
  const auto* srcF32 = static_cast<const float*>(t.data);
  const auto* srcBf16 = static_cast<const uint16_t*>(t.data);
  for (int h = 0; h < groups; ++h) {
    for (int64_t i = 0; i < t.numTokens; ++i) {
      const int64_t src = (i * t.numHeads + static_cast<int64_t>(h) * g) * t.headDim;
      const int64_t dst = h * out.headStride + i * rowElems;
      if (bf16)
        std::copy_n(srcBf16 + src, rowElems, out.bf16Storage.data() + dst);
      else if (t.dtype == DType::kFp32)
        std::copy_n(srcF32 + src, rowElems, out.f32Storage.data() + dst);
      else
        ops.bf16ToFp32(srcBf16 + src, out.f32Storage.data() + dst, rowElems);
    }
  }
  out.data = bf16 ? static_cast<const void*>(out.bf16Storage.data())
                  : static_cast<const void*>(out.f32Storage.data());
  return out;
}

// Whether this call's tile products go through the bf16 GEMM: bf16 operands and that path on.
bool useBf16Gemm(std::initializer_list<const TensorView*> operands) {
  for (const TensorView* t : operands)
    if (t->dtype != DType::kBf16) return false;
  return activeBf16Gemm() == Bf16Gemm::kNative;
}

// Rounds `rows` rows of `cols` fp32 values (row distance ld) to bf16, for a bf16 GEMM operand.
void roundRowsToBf16(const float* src, uint16_t* dst, int64_t rows, int64_t cols, int64_t ld,
                     const VectorOps& ops) {
  for (int64_t r = 0; r < rows; ++r) ops.fp32ToBf16(src + r * ld, dst + r * ld, cols);
}

// Per-row values ([Nq][Hq] floats) in group-major order [Hkv][Nq][g], times `factor`.
std::vector<float> rowsToGroupMajor(const float* rows, const Shape& s, float factor) {
  std::vector<float> out(static_cast<size_t>(s.nq) * s.hq);
  for (int h = 0; h < s.hkv; ++h)
    for (int64_t i = 0; i < s.nq; ++i)
      for (int j = 0; j < s.g; ++j)
        out[(h * s.nq + i) * s.g + j] = rows[i * s.hq + h * s.g + j] * factor;
  return out;
}

struct Task {
  int kvHead;
  int64_t tile;                   // Q tile (forward) or K tile (backward)
  std::vector<int64_t> partners;  // the non-empty tiles of the other side
  int64_t columns = 0;            // key columns its tile products execute (the partners' spans)
};

// Tasks in decreasing order of work, measured in executed key columns (a causal diagonal tile
// counts its span only), ties by index so that the order is deterministic.
std::vector<Task> makeTasks(const TileMap& map, int numKvHeads, bool perQTile) {
  std::vector<Task> tasks;
  const int64_t own = perQTile ? map.numQTiles : map.numKTiles;
  const int64_t other = perQTile ? map.numKTiles : map.numQTiles;
  for (int h = 0; h < numKvHeads; ++h) {
    for (int64_t t = 0; t < own; ++t) {
      Task task{h, t, {}};
      for (int64_t u = 0; u < other; ++u) {
        const int64_t qt = perQTile ? t : u, kt = perQTile ? u : t;
        if (map.at(qt, kt) == TileClass::kEmpty) continue;
        task.partners.push_back(u);
        task.columns += map.span(qt, kt).end - map.span(qt, kt).begin;
      }
      if (!task.partners.empty()) tasks.push_back(std::move(task));
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.columns > b.columns; });
  return tasks;
}

// Masks a (qTokens * g) x kCols score tile element-wise.
void maskTile(float* s, int64_t ld, const TokenInfo& q, int64_t q0, int64_t qTokens, int g,
              const TokenInfo& k, int64_t k0, int64_t kCols, bool causal, const VectorOps& ops) {
  for (int64_t i = 0; i < qTokens; ++i)
    for (int j = 0; j < g; ++j)
      ops.maskRow(s + (i * g + j) * ld, kCols, q.sequence[q0 + i], q.position[q0 + i],
                  k.sequence.data() + k0, k.position.data() + k0, causal);
}

struct Prepared {
  Shape shape;
  TokenInfo qInfo, kInfo;
  TileMap map;
  int64_t qTileTokens;
  bool causal;
};

Prepared prepare(const TensorView& q, const TensorView& k, const TensorView& v,
                 const BlockMask& mask) {
  Prepared p;
  p.shape = checkShapes(q, k, v);
  p.qInfo = detail::expandSegments(mask.q, p.shape.nq, "q");
  p.kInfo = detail::expandSegments(mask.k, p.shape.nk, "k");
  p.causal = mask.kind == MaskKind::kCausal;
  p.qTileTokens = std::max<int64_t>(1, kQTileRows / p.shape.g);
  p.map = detail::classifyTiles(p.qInfo, p.kInfo, p.causal, p.qTileTokens, kKTileTokens);
  return p;
}

// Writes the empty partial (O = 0, LSE = -inf) to the rows of Q tiles that see no K tile: no
// forward task covers them. Every other row is written by its task.
void fillUntouchedRows(const Prepared& p, float* o, float* lse) {
  const Shape& s = p.shape;
  const int64_t rowFloats = static_cast<int64_t>(s.hq) * s.d;
  for (int64_t qt = 0; qt < p.map.numQTiles; ++qt) {
    bool seesSomething = false;
    for (int64_t kt = 0; kt < p.map.numKTiles; ++kt)
      seesSomething = seesSomething || p.map.at(qt, kt) != TileClass::kEmpty;
    if (seesSomething) continue;
    const int64_t q0 = qt * p.qTileTokens, q1 = std::min(s.nq, q0 + p.qTileTokens);
    std::fill(o + q0 * rowFloats, o + q1 * rowFloats, 0.0f);
    std::fill(lse + q0 * s.hq, lse + q1 * s.hq, kNegInf);
  }
}

}  // namespace

namespace detail {

double runForward(const TensorView& q, const TensorView& k, const TensorView& v,
                  const BlockMask& mask, float* o, float* lse, const KernelOptions& options,
                  bool gemmOnly) {
  const Prepared p = prepare(q, k, v, mask);
  const Shape& s = p.shape;
  const int numThreads = detail::resolveThreads(options.numThreads);
  const float scale = softmaxScaleOf(options, s.d);
  if (s.nq == 0) return 0.0;
  FCP_CHECK(o != nullptr && lse != nullptr, "forward needs output buffers");
  fillUntouchedRows(p, o, lse);
  if (s.nk == 0) return 0.0;

  const VectorOps& ops = detail::vectorOps();
  const bool bf16 = useBf16Gemm({&q});
  const GroupMajor qg = toGroupMajor(q, s.hkv, bf16, ops);
  const GroupMajor kg = toGroupMajor(k, s.hkv, bf16, ops);
  const GroupMajor vg = toGroupMajor(v, s.hkv, bf16, ops);
  const std::vector<Task> tasks = makeTasks(p.map, s.hkv, /*perQTile=*/true);
  const float alpha = kLog2e * scale;
  const int64_t maxRows = p.qTileTokens * s.g;

  struct Scratch {
    std::vector<float> scores, acc, rowMax, rowSum, correction;
    std::vector<uint16_t> scoresBf16;  // P rounded to bf16 for O += P V (bf16 GEMM only)
  };
  std::vector<Scratch> scratch(numThreads);
  std::vector<double> gemmFlops(numThreads, 0.0);
  detail::parallelFor(numThreads, static_cast<int64_t>(tasks.size()), [&](int64_t t, int w) {
    const Task& task = tasks[t];
    Scratch& sc = scratch[w];
    sc.scores.resize(maxRows * kKTileTokens);
    if (bf16) sc.scoresBf16.resize(maxRows * kKTileTokens);
    sc.acc.resize(maxRows * s.d);  // the first O += P V overwrites it (beta = 0)
    sc.rowMax.assign(maxRows, kNegInf);
    sc.rowSum.assign(maxRows, 0.0f);
    sc.correction.resize(maxRows);
    const int64_t q0 = task.tile * p.qTileTokens;
    const int64_t qTokens = std::min(p.qTileTokens, s.nq - q0);
    const int64_t rows = qTokens * s.g;
    const void* qTile = qg.at(task.kvHead * qg.headStride + q0 * s.g * s.d);
    const void* pTile = bf16 ? static_cast<const void*>(sc.scoresBf16.data())
                             : static_cast<const void*>(sc.scores.data());
    bool first = true;
    for (int64_t kt : task.partners) {
      // Only the tile's column span: keys no query of this Q tile can see are not computed.
      const ColumnSpan span = p.map.span(task.tile, kt);
      const int64_t k0 = kt * kKTileTokens + span.begin;
      const int64_t kCols = span.end - span.begin;
      const void* kTile = kg.at(task.kvHead * kg.headStride + k0 * s.d);
      const void* vTile = vg.at(task.kvHead * vg.headStride + k0 * s.d);
      gemmFlops[w] += 4.0 * static_cast<double>(rows * kCols * s.d);
      detail::gemm(bf16, 'N', 'T', rows, kCols, s.d, alpha, qTile, s.d, kTile, s.d, 0.0f,
                   sc.scores.data(), kKTileTokens);
      if (!gemmOnly) {
        if (p.map.at(task.tile, kt) == TileClass::kPartial)
          maskTile(sc.scores.data(), kKTileTokens, p.qInfo, q0, qTokens, s.g, p.kInfo, k0, kCols,
                   p.causal, ops);
        ops.softmaxStep(sc.scores.data(), rows, kCols, kKTileTokens, sc.rowMax.data(),
                        sc.rowSum.data(), sc.correction.data());
        if (!first) ops.scaleRows(sc.acc.data(), rows, s.d, s.d, sc.correction.data());
        if (bf16)
          roundRowsToBf16(sc.scores.data(), sc.scoresBf16.data(), rows, kCols, kKTileTokens, ops);
      }
      detail::gemm(bf16, 'N', 'N', rows, s.d, kCols, 1.0f, pTile, kKTileTokens, vTile, s.d,
                   first ? 0.0f : 1.0f, sc.acc.data(), s.d);
      first = false;
    }
    if (gemmOnly) return;
    // Normalise and scatter back to [Nq][Hq][d]; natural-log LSE.
    for (int64_t i = 0; i < qTokens; ++i) {
      for (int j = 0; j < s.g; ++j) {
        const int64_t r = i * s.g + j;
        const int64_t row = (q0 + i) * s.hq + static_cast<int64_t>(task.kvHead) * s.g + j;
        const float l = sc.rowSum[r];
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float* dst = o + row * s.d;
        const float* src = sc.acc.data() + r * s.d;
        for (int c = 0; c < s.d; ++c) dst[c] = src[c] * inv;
        lse[row] = l > 0.0f ? (sc.rowMax[r] + std::log2(l)) * kLn2 : kNegInf;
      }
    }
  });
  return std::accumulate(gemmFlops.begin(), gemmFlops.end(), 0.0);
}

}  // namespace detail

void mergePartials(int64_t numTokens, int numHeads, int headDim, float* accO, float* accLse,
                   const float* o, const float* lse) {
  if (numTokens < 0 || numHeads <= 0 || headDim <= 0)
    throwInvalidArgument("mergePartials shape [", numTokens, ", ", numHeads, ", ", headDim,
                         "], expected tokens >= 0 and heads, head_dim > 0");
  const VectorOps& ops = detail::vectorOps();
  const int64_t rows = numTokens * numHeads;
  for (int64_t r = 0; r < rows; ++r) {
    const float a = accLse[r];
    const float b = lse[r];
    if (b == kNegInf) continue;  // empty partial: nothing to add
    if (a == kNegInf) {
      std::copy_n(o + r * headDim, headDim, accO + r * headDim);
      accLse[r] = b;
      continue;
    }
    // Weights relative to the larger LSE, so that neither exponential overflows.
    const float m = std::max(a, b);
    const float wa = std::exp(a - m);
    const float wb = std::exp(b - m);
    const float total = wa + wb;
    ops.axpby(wa / total, accO + r * headDim, wb / total, o + r * headDim, headDim);
    accLse[r] = m + std::log(total);
  }
}

void computeDelta(const TensorView& o, const TensorView& dO, float* delta) {
  checkView(o, "o");
  checkLike(dO, o, "dO", "o");
  const VectorOps& ops = detail::vectorOps();
  std::vector<float> a(o.headDim), b(o.headDim);
  const int64_t rows = o.numTokens * o.numHeads;
  auto load = [&](const TensorView& t, int64_t r, std::vector<float>& dst) -> const float* {
    if (t.dtype == DType::kFp32) return static_cast<const float*>(t.data) + r * t.headDim;
    ops.bf16ToFp32(static_cast<const uint16_t*>(t.data) + r * t.headDim, dst.data(), t.headDim);
    return dst.data();
  };
  for (int64_t r = 0; r < rows; ++r) delta[r] = ops.dot(load(o, r, a), load(dO, r, b), o.headDim);
}

namespace detail {

double runBackward(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& dO, const float* lse, const float* delta,
                   const BlockMask& mask, float* dq, float* dk, float* dv,
                   const KernelOptions& options, bool gemmOnly) {
  const Prepared p = prepare(q, k, v, mask);
  const Shape& s = p.shape;
  checkLike(dO, q, "dO", "q");
  const int numThreads = detail::resolveThreads(options.numThreads);
  const float scale = softmaxScaleOf(options, s.d);
  if (s.nq == 0 || s.nk == 0) return 0.0;
  FCP_CHECK(lse && delta && dq && dk && dv, "backward needs lse, delta and gradient buffers");

  const VectorOps& ops = detail::vectorOps();
  const bool bf16 = useBf16Gemm({&q, &dO});
  const GroupMajor qg = toGroupMajor(q, s.hkv, bf16, ops);
  const GroupMajor kg = toGroupMajor(k, s.hkv, bf16, ops);
  const GroupMajor vg = toGroupMajor(v, s.hkv, bf16, ops);
  const GroupMajor dog = toGroupMajor(dO, s.hkv, bf16, ops);
  const std::vector<float> lse2 = rowsToGroupMajor(lse, s, kLog2e);
  const std::vector<float> deltaG = rowsToGroupMajor(delta, s, 1.0f);
  const std::vector<Task> tasks = makeTasks(p.map, s.hkv, /*perQTile=*/false);
  const float alpha = kLog2e * scale;
  const int64_t maxRows = p.qTileTokens * s.g;

  // dQ in group-major layout, shared; each (KV head, Q tile) slice has its own lock.
  std::vector<float> dqg(static_cast<size_t>(s.hkv) * s.nq * s.g * s.d, 0.0f);
  std::unique_ptr<std::mutex[]> locks(new std::mutex[s.hkv * p.map.numQTiles]);

  struct Scratch {
    std::vector<float> p, dp, dk, dv, dq;
    std::vector<uint16_t> roundedBf16;  // P, then dS, rounded for their products (bf16 GEMM)
  };
  std::vector<Scratch> scratch(numThreads);
  std::vector<double> gemmFlops(numThreads, 0.0);
  detail::parallelFor(numThreads, static_cast<int64_t>(tasks.size()), [&](int64_t t, int w) {
    const Task& task = tasks[t];
    Scratch& sc = scratch[w];
    sc.p.resize(maxRows * kKTileTokens);
    sc.dp.resize(maxRows * kKTileTokens);
    if (bf16) sc.roundedBf16.resize(maxRows * kKTileTokens);
    sc.dq.resize(maxRows * s.d);
    sc.dk.assign(kKTileTokens * s.d, 0.0f);
    sc.dv.assign(kKTileTokens * s.d, 0.0f);
    const int64_t kTile0 = task.tile * kKTileTokens;
    const int64_t h = task.kvHead;
    float* pt = sc.p.data();
    float* dpt = sc.dp.data();
    // The fp32 P and dS tiles, or their bf16 roundings, as operands of the GEMMs that read them.
    const void* pOperand = bf16 ? static_cast<const void*>(sc.roundedBf16.data()) : pt;
    const void* dsOperand = bf16 ? static_cast<const void*>(sc.roundedBf16.data()) : dpt;
    for (int64_t qt : task.partners) {
      // Only the tile's column span (see the forward); its rows of dK, dV start at span.begin.
      const ColumnSpan span = p.map.span(qt, task.tile);
      const int64_t k0 = kTile0 + span.begin;
      const int64_t kCols = span.end - span.begin;
      const void* kTile = kg.at(h * kg.headStride + k0 * s.d);
      const void* vTile = vg.at(h * vg.headStride + k0 * s.d);
      float* dkTile = sc.dk.data() + span.begin * s.d;
      float* dvTile = sc.dv.data() + span.begin * s.d;
      const int64_t q0 = qt * p.qTileTokens;
      const int64_t qTokens = std::min(p.qTileTokens, s.nq - q0);
      const int64_t rows = qTokens * s.g;
      const int64_t rowBase = (h * s.nq + q0) * s.g;
      const void* qTile = qg.at(h * qg.headStride + q0 * s.g * s.d);
      const void* doTile = dog.at(h * dog.headStride + q0 * s.g * s.d);
      gemmFlops[w] += 10.0 * static_cast<double>(rows * kCols * s.d);
      detail::gemm(bf16, 'N', 'T', rows, kCols, s.d, alpha, qTile, s.d, kTile, s.d, 0.0f, pt,
                   kKTileTokens);
      if (!gemmOnly) {
        if (p.map.at(qt, task.tile) == TileClass::kPartial)
          maskTile(pt, kKTileTokens, p.qInfo, q0, qTokens, s.g, p.kInfo, k0, kCols, p.causal, ops);
        ops.probabilities(pt, rows, kCols, kKTileTokens, lse2.data() + rowBase);
        if (bf16) roundRowsToBf16(pt, sc.roundedBf16.data(), rows, kCols, kKTileTokens, ops);
      }
      // dV += P^T dO; dP = dO V^T; dS = P (dP - D); dK += scale dS^T Q; dQ += scale dS K.
      detail::gemm(bf16, 'T', 'N', kCols, s.d, rows, 1.0f, pOperand, kKTileTokens, doTile, s.d,
                   1.0f, dvTile, s.d);
      detail::gemm(bf16, 'N', 'T', rows, kCols, s.d, 1.0f, doTile, s.d, vTile, s.d, 0.0f, dpt,
                   kKTileTokens);
      if (!gemmOnly) {
        ops.scoreGradients(pt, dpt, rows, kCols, kKTileTokens, deltaG.data() + rowBase);
        if (bf16) roundRowsToBf16(dpt, sc.roundedBf16.data(), rows, kCols, kKTileTokens, ops);
      }
      detail::gemm(bf16, 'T', 'N', kCols, s.d, rows, scale, dsOperand, kKTileTokens, qTile, s.d,
                   1.0f, dkTile, s.d);
      detail::gemm(bf16, 'N', 'N', rows, s.d, kCols, scale, dsOperand, kKTileTokens, kTile, s.d,
                   0.0f, sc.dq.data(), s.d);
      if (gemmOnly) continue;
      std::lock_guard<std::mutex> lock(locks[h * p.map.numQTiles + qt]);
      ops.add(dqg.data() + rowBase * s.d, sc.dq.data(), rows * s.d);
    }
    if (gemmOnly) return;
    // This task alone owns rows [kTile0, kTile0 + tileCols) of KV head h.
    const int64_t tileCols = std::min(kKTileTokens, s.nk - kTile0);
    for (int64_t i = 0; i < tileCols; ++i) {
      const int64_t row = ((kTile0 + i) * s.hkv + h) * s.d;
      ops.add(dk + row, sc.dk.data() + i * s.d, s.d);
      ops.add(dv + row, sc.dv.data() + i * s.d, s.d);
    }
  });
  // Scatter-add group-major dQ back to [Nq][Hq][d].
  for (int h = 0; h < s.hkv; ++h)
    for (int64_t i = 0; i < s.nq; ++i)
      ops.add(dq + (i * s.hq + static_cast<int64_t>(h) * s.g) * s.d,
              dqg.data() + (h * s.nq + i) * s.g * s.d, static_cast<int64_t>(s.g) * s.d);
  return std::accumulate(gemmFlops.begin(), gemmFlops.end(), 0.0);
}

}  // namespace detail

float softmaxScaleOf(const KernelOptions& options, int headDim) {
  const float scale = options.softmaxScale;
  if (!(scale >= 0) || !std::isfinite(scale)) {
    throwInvalidArgument("softmax scale ", scale, ": expected a finite value >= 0 (0 for 1/sqrt(",
                         headDim, "))");
  }
  return scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(headDim));
}

void forward(const TensorView& q, const TensorView& k, const TensorView& v, const BlockMask& mask,
             float* o, float* lse, const KernelOptions& options) {
  detail::runForward(q, k, v, mask, o, lse, options, /*gemmOnly=*/false);
}

void backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& dO,
              const float* lse, const float* delta, const BlockMask& mask, float* dq, float* dk,
              float* dv, const KernelOptions& options) {
  detail::runBackward(q, k, v, dO, lse, delta, mask, dq, dk, dv, options, /*gemmOnly=*/false);
}

}  // namespace fcp::kernels
