#include "fcp/plan/coloring.h"

#include <algorithm>
#include <bit>
#include <memory>
#include <numeric>

#include "fcp/core/error.h"

namespace fcp::plan {
namespace {

/// Throws for an edge naming a worker outside [0, numWorkers), a self-edge or negative bytes.
void checkEdges(int32_t numWorkers, const std::vector<Edge>& edges) {
  if (numWorkers < 1) throwInvalidArgument("numWorkers ", numWorkers, ": expected at least 1");
  for (size_t i = 0; i < edges.size(); ++i) {
    const Edge& e = edges[i];
    if (e.sender < 0 || e.sender >= numWorkers || e.receiver < 0 || e.receiver >= numWorkers) {
      throwInvalidArgument("transfer ", i, ": sender ", e.sender, " receiver ", e.receiver,
                           ": expected workers in [0, ", numWorkers, ")");
    }
    if (e.sender == e.receiver) {
      throwInvalidArgument("transfer ", i, ": worker ", e.sender, " sends to itself");
    }
    if (e.bytes < 0) throwInvalidArgument("transfer ", i, ": bytes ", e.bytes, " < 0");
  }
}

/// Edge indices in descending `bytes`, ties by index: a stable LSD radix sort on
/// (max − bytes), 8 bits a pass, skipping passes in which every key has the same digit (so
/// equal sizes cost one histogram pass).
std::vector<int32_t> descendingBySize(const std::vector<Edge>& edges) {
  const size_t m = edges.size();
  int64_t maxBytes = 0;
  for (const Edge& e : edges) maxBytes = std::max(maxBytes, e.bytes);
  std::vector<uint64_t> key(m);
  for (size_t i = 0; i < m; ++i) key[i] = static_cast<uint64_t>(maxBytes - edges[i].bytes);
  std::vector<int32_t> order(m), next(m);
  std::iota(order.begin(), order.end(), 0);
  const auto passes = static_cast<int>((std::bit_width(static_cast<uint64_t>(maxBytes)) + 7) / 8);
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 8 * pass;
    size_t count[257] = {};
    for (size_t i = 0; i < m; ++i) ++count[((key[i] >> shift) & 0xff) + 1];
    if (std::find(count + 1, count + 257, m) != count + 257) continue;  // one digit for all
    for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
    for (size_t i = 0; i < m; ++i) {
      const auto e = static_cast<size_t>(order[i]);
      next[count[(key[e] >> shift) & 0xff]++] = order[i];
    }
    order.swap(next);
  }
  return order;
}

/// Alternating-path (Kőnig) edge colouring of a bipartite multigraph with exactly Δ colours.
///
/// Terms: vertices 0..N−1 are senders and N..2N−1 receivers; edges are numbered in the order
/// they are coloured. A colour is *free* at a vertex when none of its coloured edges has it;
/// `free_` holds one bit per (vertex, colour), and `at_[x·Δ + c]` names the edge of colour c at
/// x, valid only while c is not free at x (so the table is never cleared). To colour (u, v):
/// a colour free at both ends is taken when there is one (the lowest, so that edges coloured
/// early, the largest, share rounds). Otherwise a is free at u but not v and b free at v but not
/// u; the a/b path starting at v cannot reach u (u's side is entered by a-edges, and u has
/// none), so swapping a and b on it frees a at v. Before walking a long path we try the cheap
/// case where the path has one edge (some b free at both v and the a-neighbour of v), and walk
/// the two candidate paths (from v, and from u with the roles swapped) in lock step so we pay
/// for the shorter one only.
class Colorer {
 public:
  Colorer(int32_t numVertices, int32_t numColors, size_t numEdges)
      : colors_(numColors),
        words_((static_cast<size_t>(numColors) + 63) / 64),
        free_(static_cast<size_t>(numVertices) * words_, ~uint64_t{0}),
        at_(new int32_t[static_cast<size_t>(numVertices) * static_cast<size_t>(numColors)]),
        ends_(numEdges),
        color_(numEdges, -1) {
    // Bits past Δ in the last word are never free.
    if (numColors % 64 != 0) {
      const uint64_t tail = (uint64_t{1} << (numColors % 64)) - 1;
      for (size_t x = 0; x < static_cast<size_t>(numVertices); ++x) {
        free_[x * words_ + words_ - 1] = tail;
      }
    }
  }

  void color(int32_t e, int32_t u, int32_t v) {
    ends_[static_cast<size_t>(e)] = {u, v};
    if (int32_t c = firstCommonFree(u, v); c >= 0) return assign(e, c);
    const int32_t a = firstFree(u), b = firstFree(v);
    FCP_CHECK(a >= 0 && b >= 0, "vertex with more than Δ = ", colors_, " edges");
    if (tryShortSwap(e, u, v)) return;
    // Walk v's a/b path and u's b/a path one edge at a time; flip whichever ends first.
    int32_t xv = v, xu = u, cv = a, cu = b;
    while (true) {
      if (isFree(xv, cv)) {
        flipPath(v, a, b);
        return assign(e, a);
      }
      if (isFree(xu, cu)) {
        flipPath(u, b, a);
        return assign(e, b);
      }
      xv = other(edgeAt(xv, cv), xv);
      xu = other(edgeAt(xu, cu), xu);
      cv = cv == a ? b : a;
      cu = cu == a ? b : a;
    }
  }

  std::vector<int32_t> takeColors() { return std::move(color_); }

 private:
  bool isFree(int32_t x, int32_t c) const {
    return (free_[static_cast<size_t>(x) * words_ + static_cast<size_t>(c) / 64] >> (c % 64)) & 1;
  }
  int32_t edgeAt(int32_t x, int32_t c) const {
    return at_[static_cast<size_t>(x) * static_cast<size_t>(colors_) + static_cast<size_t>(c)];
  }
  int32_t other(int32_t e, int32_t x) const {
    const auto& [u, v] = ends_[static_cast<size_t>(e)];
    return u == x ? v : u;
  }
  void setFree(int32_t x, int32_t c, bool isFreeNow) {
    uint64_t& w = free_[static_cast<size_t>(x) * words_ + static_cast<size_t>(c) / 64];
    const uint64_t bit = uint64_t{1} << (c % 64);
    w = isFreeNow ? (w | bit) : (w & ~bit);
  }
  void place(int32_t e, int32_t c) {
    const auto& [u, v] = ends_[static_cast<size_t>(e)];
    color_[static_cast<size_t>(e)] = c;
    for (int32_t x : {u, v}) {
      setFree(x, c, false);
      at_[static_cast<size_t>(x) * static_cast<size_t>(colors_) + static_cast<size_t>(c)] = e;
    }
  }
  void unplace(int32_t e) {
    const auto& [u, v] = ends_[static_cast<size_t>(e)];
    setFree(u, color_[static_cast<size_t>(e)], true);
    setFree(v, color_[static_cast<size_t>(e)], true);
  }
  void assign(int32_t e, int32_t c) { place(e, c); }

  int32_t firstFree(int32_t x) const {
    const uint64_t* f = &free_[static_cast<size_t>(x) * words_];
    for (size_t w = 0; w < words_; ++w) {
      if (f[w]) return static_cast<int32_t>(64 * w + static_cast<size_t>(std::countr_zero(f[w])));
    }
    return -1;
  }
  int32_t firstCommonFree(int32_t x, int32_t y) const {
    const uint64_t* fx = &free_[static_cast<size_t>(x) * words_];
    const uint64_t* fy = &free_[static_cast<size_t>(y) * words_];
    for (size_t w = 0; w < words_; ++w) {
      if (const uint64_t m = fx[w] & fy[w]) {
        return static_cast<int32_t>(64 * w + static_cast<size_t>(std::countr_zero(m)));
      }
    }
    return -1;
  }

  /// One-edge paths: for a colour a free at u, the a-edge f = (v, x) can move to a colour free
  /// at both v and x, which frees a at v. Tried from both ends of e.
  bool tryShortSwap(int32_t e, int32_t u, int32_t v) {
    for (auto [near, far] : {std::pair{u, v}, std::pair{v, u}}) {
      const uint64_t* fn = &free_[static_cast<size_t>(near) * words_];
      for (size_t w = 0; w < words_; ++w) {
        for (uint64_t bits = fn[w]; bits; bits &= bits - 1) {
          const auto a = static_cast<int32_t>(64 * w + static_cast<size_t>(std::countr_zero(bits)));
          const int32_t f = edgeAt(far, a);
          const int32_t c = firstCommonFree(far, other(f, far));
          if (c < 0) continue;
          unplace(f);
          place(f, c);
          assign(e, a);
          return true;
        }
      }
    }
    return false;
  }

  /// Swaps colours a and b along the path that starts at `start` with its a-edge.
  void flipPath(int32_t start, int32_t a, int32_t b) {
    path_.clear();
    for (int32_t x = start, c = a; !isFree(x, c); c = c == a ? b : a) {
      const int32_t f = edgeAt(x, c);
      path_.push_back(f);
      x = other(f, x);
    }
    for (int32_t f : path_) unplace(f);
    for (int32_t f : path_) place(f, color_[static_cast<size_t>(f)] == a ? b : a);
  }

  int32_t colors_;
  size_t words_;
  std::vector<uint64_t> free_;
  std::unique_ptr<int32_t[]> at_;  // uninitialised on purpose, see the class comment
  std::vector<std::pair<int32_t, int32_t>> ends_;
  std::vector<int32_t> color_;
  std::vector<int32_t> path_;
};

}  // namespace

int32_t maxDegree(int32_t numWorkers, const std::vector<Edge>& edges) {
  checkEdges(numWorkers, edges);
  std::vector<int32_t> out(static_cast<size_t>(numWorkers)), in(static_cast<size_t>(numWorkers));
  int32_t delta = 0;
  for (const Edge& e : edges) {
    delta = std::max(delta, ++out[static_cast<size_t>(e.sender)]);
    delta = std::max(delta, ++in[static_cast<size_t>(e.receiver)]);
  }
  return delta;
}

EdgeColoring colorEdges(int32_t numWorkers, const std::vector<Edge>& edges) {
  EdgeColoring result;
  result.numColors = maxDegree(numWorkers, edges);
  result.color.assign(edges.size(), 0);
  if (edges.empty()) return result;
  const std::vector<int32_t> order = descendingBySize(edges);
  Colorer colorer(2 * numWorkers, result.numColors, edges.size());
  for (size_t i = 0; i < order.size(); ++i) {
    const Edge& e = edges[static_cast<size_t>(order[i])];
    colorer.color(static_cast<int32_t>(i), e.sender, numWorkers + e.receiver);
  }
  const std::vector<int32_t> colorBySize = colorer.takeColors();
  // Rounds in descending order of their largest edge (ties by colour): edges are numbered by
  // descending size, so a colour's first edge in that numbering is its largest.
  std::vector<int32_t> firstEdge(static_cast<size_t>(result.numColors), -1);
  for (size_t i = 0; i < colorBySize.size(); ++i) {
    int32_t& first = firstEdge[static_cast<size_t>(colorBySize[i])];
    if (first < 0) first = static_cast<int32_t>(i);
  }
  std::vector<int32_t> rank(firstEdge.size());
  std::iota(rank.begin(), rank.end(), 0);
  std::sort(rank.begin(), rank.end(), [&](int32_t x, int32_t y) {
    return std::pair{firstEdge[static_cast<size_t>(x)], x} <
           std::pair{firstEdge[static_cast<size_t>(y)], y};
  });
  std::vector<int32_t> newColor(rank.size());
  for (size_t k = 0; k < rank.size(); ++k) newColor[static_cast<size_t>(rank[k])] = static_cast<int32_t>(k);
  for (size_t i = 0; i < order.size(); ++i) {
    result.color[static_cast<size_t>(order[i])] = newColor[static_cast<size_t>(colorBySize[i])];
  }
  return result;
}

RoundCostBounds roundCostBounds(int32_t numWorkers, const std::vector<Edge>& edges) {
  checkEdges(numWorkers, edges);
  RoundCostBounds bounds;
  // (a) Every round's largest edge is at least the one a worker sends (receives) in it.
  std::vector<int64_t> sent(static_cast<size_t>(numWorkers)), received(sent.size());
  for (const Edge& e : edges) {
    sent[static_cast<size_t>(e.sender)] += e.bytes;
    received[static_cast<size_t>(e.receiver)] += e.bytes;
  }
  for (size_t w = 0; w < sent.size(); ++w) {
    bounds.maxWorkerBytes = std::max({bounds.maxWorkerBytes, sent[w], received[w]});
  }
  // (b) A round holds at most N edges, so the rounds with the k largest maxima hold at most
  // k·N edges: the (k·N+1)-th largest edge lies in a round outside them, whose maximum, and
  // hence the (k+1)-th largest maximum, is at least its size.
  const int32_t delta = maxDegree(numWorkers, edges);
  std::vector<int64_t> bytes(edges.size());
  for (size_t i = 0; i < edges.size(); ++i) bytes[i] = edges[i].bytes;
  std::sort(bytes.begin(), bytes.end(), std::greater<>());
  for (int64_t k = 0; k < delta; ++k) {
    const auto i = static_cast<size_t>(k * numWorkers);
    if (i >= bytes.size()) break;
    bounds.sortedRoundBound += bytes[i];
  }
  return bounds;
}

int64_t sumOfRoundMaxima(const std::vector<Edge>& edges, const EdgeColoring& coloring) {
  if (coloring.color.size() != edges.size()) {
    throwInvalidArgument("colouring of ", coloring.color.size(), " transfers for ", edges.size(),
                         " transfers");
  }
  std::vector<int64_t> roundMax(static_cast<size_t>(std::max(coloring.numColors, 0)), 0);
  for (size_t i = 0; i < edges.size(); ++i) {
    const int32_t c = coloring.color[i];
    if (c < 0 || c >= coloring.numColors) {
      throwInvalidArgument("transfer ", i, ": colour ", c, " outside [0, ", coloring.numColors,
                           ")");
    }
    int64_t& m = roundMax[static_cast<size_t>(c)];
    m = std::max(m, edges[i].bytes);
  }
  return std::accumulate(roundMax.begin(), roundMax.end(), int64_t{0});
}

}  // namespace fcp::plan
