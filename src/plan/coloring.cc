#include "fcp/plan/coloring.h"

#include <algorithm>
#include <bit>
#include <functional>
#include <memory>
#include <numeric>
#include <span>

#include "communication.h"
#include "fcp/core/error.h"
#include "huge_pages.h"

namespace fcp::plan {
namespace {

/// Throws for an edge naming a worker outside [0, numWorkers), a self-edge or negative bytes.
/// The colouring checks on its degree pass and calls this only to name the first bad edge.
template <typename Edges>
void checkEdges(int32_t numWorkers, const Edges& edges) {
  if (numWorkers < 1) throwInvalidArgument("numWorkers ", numWorkers, ": expected at least 1");
  for (size_t i = 0; i < edges.size(); ++i) {
    const int32_t sender = edges.sender(i), receiver = edges.receiver(i);
    if (sender < 0 || sender >= numWorkers || receiver < 0 || receiver >= numWorkers) {
      throwInvalidArgument("transfer ", i, ": sender ", sender, " receiver ", receiver,
                           ": expected workers in [0, ", numWorkers, ")");
    }
    if (sender == receiver) {
      throwInvalidArgument("transfer ", i, ": worker ", sender, " sends to itself");
    }
    if (edges.bytes(i) < 0)
      throwInvalidArgument("transfer ", i, ": bytes ", edges.bytes(i), " < 0");
  }
}

/// The colouring's view of a list of edges: Edge, or the plan's transfers in place (copying
/// 500K transfers into edges was 8 MB of fresh memory on the planner's longest path).
template <typename T>
struct EdgeView {
  const std::vector<T>& items;
  size_t size() const { return items.size(); }
  int32_t sender(size_t i) const { return items[i].sender; }
  int32_t receiver(size_t i) const { return items[i].receiver; }
  int64_t bytes(size_t i) const { return items[i].bytes; }
};

/// A size class that orders transfers by size to within 1/64: sizes below 128 bytes are
/// their own class; above, the class is the exponent and the six bits after the leading one.
/// Classes grow with size and stay below kSizeClasses.
constexpr int32_t kSizeClasses = 64 + 58 * 64;
int32_t sizeClass(int64_t bytes) {
  const auto b = static_cast<uint64_t>(bytes);
  if (b < 128) return static_cast<int32_t>(b);
  const auto shift = static_cast<int32_t>(std::bit_width(b)) - 7;
  return 64 + 64 * shift + static_cast<int32_t>((b >> shift) - 64);
}

/// Next-fit grouping of one side's vertices into groups of degree sum ≤ cap (a vertex of
/// larger degree alone). Returns each worker's group and sets `numGroups`.
std::vector<int32_t> groupVertices(const std::vector<int32_t>& degree, int32_t cap,
                                   int32_t& numGroups) {
  std::vector<int32_t> group(degree.size());
  numGroups = 0;
  int64_t load = 0;
  for (size_t w = 0; w < degree.size(); ++w) {
    if (numGroups == 0 || load + degree[w] > cap) {
      ++numGroups;
      load = 0;
    }
    load += degree[w];
    group[w] = numGroups - 1;
  }
  return group;
}

/// `v` holding `size` copies of `value`, reusing its storage.
template <typename T>
std::span<T> reset(std::vector<T>& v, size_t size, T value) {
  v.assign(size, value);
  return v;
}

/// Alternating-path (Kőnig) edge colouring of a bipartite multigraph with exactly Δ colours.
///
/// Terms: vertices are numbered on both sides together (here they are groups of workers);
/// edges are numbered in the order they are coloured. A colour is *free* at a vertex when none
/// of its coloured edges has it; `free_` holds one bit per (vertex, colour) and `low_[x]` a
/// word of x's row before which no colour is free. To colour (u, v): the lowest colour free at
/// both ends is taken when there is one (lowest, so that edges coloured early, the largest,
/// share rounds). Otherwise a is free at u but not v and b free at v but not u; the a/b path
/// starting at v cannot reach u (u's side is entered by a-edges, and u has none), so swapping
/// a and b on it frees a at v. Paths need `at_[x·Δ + c]`, the edge of colour c at x (valid only
/// while c is not free at x, so it is never cleared); it is built on the first conflict, since
/// on graphs with slack greedy colouring never conflicts and the table would be the largest
/// memory traffic. Before walking a long path we try paths of one edge (some colour free at
/// both v and the a-neighbour of v, from either end), and walk the two candidate paths (from
/// v, and from u with a and b swapped) in lock step so we pay for the shorter only.
class Colorer {
 public:
  /// `ends[e]` holds edge e's two vertices (sender groups first, then receiver groups), in
  /// colouring order; colours land in `color`, indexed the same way. `freeBits` and `low` are
  /// reused storage for the bitset rows and their hints (resized and reset here).
  Colorer(std::span<const std::pair<int32_t, int32_t>> ends, int32_t numVertices, int32_t numColors,
          std::span<int32_t> color, std::vector<uint64_t>& freeBits, std::vector<int32_t>& low)
      : ends_(ends),
        vertices_(static_cast<size_t>(numVertices)),
        colors_(static_cast<size_t>(numColors)),
        words_((colors_ + 63) / 64),
        free_(reset(freeBits, vertices_ * words_, ~uint64_t{0})),
        low_(reset(low, vertices_, 0)),
        color_(color) {
    // Bits past Δ in the last word are never free.
    if (colors_ % 64 != 0) {
      const uint64_t tail = (uint64_t{1} << (colors_ % 64)) - 1;
      for (size_t x = 0; x < vertices_; ++x) free_[x * words_ + words_ - 1] = tail;
    }
  }

  /// Colours the edges in order.
  void colorAll() {
    // The two bitset rows are the only random accesses of the greedy step; fetching them a
    // few edges ahead overlaps their cache misses.
    constexpr size_t kAhead = 8;
    for (size_t e = 0; e < ends_.size(); ++e) {
      if (e + kAhead < ends_.size()) {
        const auto [u, v] = ends_[e + kAhead];
        __builtin_prefetch(&free_[static_cast<size_t>(u) * words_ +
                                  static_cast<size_t>(low_[static_cast<size_t>(u)])]);
        __builtin_prefetch(&free_[static_cast<size_t>(v) * words_ +
                                  static_cast<size_t>(low_[static_cast<size_t>(v)])]);
      }
      const auto [u, v] = ends_[e];
      if (const int32_t c = firstCommonFree(u, v); c >= 0) [[likely]] {
        place(static_cast<int32_t>(e), c);
      } else {
        done_ = e;
        colorByPath(static_cast<int32_t>(e), u, v);
      }
    }
  }

 private:
  /// Colours edge e = (u, v), which has no colour free at both ends, by recolouring a path.
  /// Kept out of line: inlined, its register pressure slowed the greedy loop by spills.
  [[gnu::noinline]] void colorByPath(int32_t e, int32_t u, int32_t v) {
    if (!at_) buildTable();
    if (tryShortSwap(e, u, v) || tryShortSwap(e, v, u)) return;
    const int32_t a = firstCommonFree(u, u), b = firstCommonFree(v, v);
    FCP_CHECK(a >= 0 && b >= 0, "a vertex has more than Δ = ", colors_, " edges");
    // Walk v's a/b path and u's b/a path one edge at a time; flip whichever ends first.
    for (int32_t xv = v, xu = u, cv = a, cu = b;; cv = a + b - cv, cu = a + b - cu) {
      if (isFree(xv, cv)) {
        flipPath(v, a, b);
        return place(e, a);
      }
      if (isFree(xu, cu)) {
        flipPath(u, b, a);
        return place(e, b);
      }
      xv = other(edgeAt(xv, cv), xv);
      xu = other(edgeAt(xu, cu), xu);
    }
  }

  std::pair<int32_t, int32_t> ends(int32_t e) const { return ends_[static_cast<size_t>(e)]; }
  size_t slot(int32_t x, int32_t c) const { return static_cast<size_t>(x) * colors_ + static_cast<size_t>(c); }
  uint64_t& freeWord(int32_t x, int32_t c) {
    return free_[static_cast<size_t>(x) * words_ + static_cast<size_t>(c) / 64];
  }
  bool isFree(int32_t x, int32_t c) {
    return (freeWord(x, c) >> (c % 64)) & 1;
  }
  int32_t edgeAt(int32_t x, int32_t c) const { return at_[slot(x, c)]; }
  int32_t other(int32_t e, int32_t x) const {
    const auto [u, v] = ends(e);
    return u == x ? v : u;
  }

  void place(int32_t e, int32_t c) {
    const auto [u, v] = ends(e);
    color_[static_cast<size_t>(e)] = c;
    const uint64_t bit = uint64_t{1} << (c % 64);
    freeWord(u, c) &= ~bit;
    freeWord(v, c) &= ~bit;
    if (at_) at_[slot(u, c)] = at_[slot(v, c)] = e;
  }
  void unplace(int32_t e) {
    const auto [u, v] = ends(e);
    const int32_t c = color_[static_cast<size_t>(e)];
    const uint64_t bit = uint64_t{1} << (c % 64);
    freeWord(u, c) |= bit;
    freeWord(v, c) |= bit;
    const auto word = static_cast<int32_t>(c / 64);
    low_[static_cast<size_t>(u)] = std::min(low_[static_cast<size_t>(u)], word);
    low_[static_cast<size_t>(v)] = std::min(low_[static_cast<size_t>(v)], word);
  }

  void buildTable() {
    at_.reset(new int32_t[vertices_ * colors_]);  // uninitialised on purpose, see above
    detail::adviseHugePages(at_.get(), vertices_ * colors_ * sizeof(int32_t));
    for (size_t i = 0; i < done_; ++i) {
      const auto e = static_cast<int32_t>(i);
      const auto [u, v] = ends(e);
      const int32_t c = color_[static_cast<size_t>(e)];
      at_[slot(u, c)] = at_[slot(v, c)] = e;
    }
  }

  /// The lowest colour free at both x and y (x == y: free at x), or −1; moves the words
  /// before it past each low_ hint that they are full.
  int32_t firstCommonFree(int32_t x, int32_t y) {
    int32_t& lowX = low_[static_cast<size_t>(x)];
    int32_t& lowY = low_[static_cast<size_t>(y)];
    const uint64_t* fx = &free_[static_cast<size_t>(x) * words_];
    const uint64_t* fy = &free_[static_cast<size_t>(y) * words_];
    while (static_cast<size_t>(lowX) < words_ && fx[lowX] == 0) ++lowX;
    while (static_cast<size_t>(lowY) < words_ && fy[lowY] == 0) ++lowY;
    for (auto w = static_cast<size_t>(std::max(lowX, lowY)); w < words_; ++w) {
      if (const uint64_t m = fx[w] & fy[w]) {
        return static_cast<int32_t>(64 * w + static_cast<size_t>(std::countr_zero(m)));
      }
    }
    return -1;
  }

  /// One-edge paths from `far`'s side: for a colour a free at `near` (so used at `far`), the
  /// a-edge f = (far, x) moves to a colour free at both far and x, which frees a at far.
  bool tryShortSwap(int32_t e, int32_t near, int32_t far) {
    const uint64_t* fn = &free_[static_cast<size_t>(near) * words_];
    int32_t tries = 0;
    for (auto w = static_cast<size_t>(low_[static_cast<size_t>(near)]); w < words_; ++w) {
      for (uint64_t bits = fn[w]; bits; bits &= bits - 1) {
        const auto a = static_cast<int32_t>(64 * w + static_cast<size_t>(std::countr_zero(bits)));
        const int32_t f = edgeAt(far, a);
        const int32_t c = firstCommonFree(far, other(f, far));
        if (c >= 0) {
          unplace(f);
          place(f, c);
          place(e, a);
          return true;
        }
        if (++tries == kShortSwapTries) return false;
      }
    }
    return false;
  }

  /// Swaps colours a and b along the path that starts at `start` with its a-edge.
  void flipPath(int32_t start, int32_t a, int32_t b) {
    path_.clear();
    for (int32_t x = start, c = a; !isFree(x, c); c = a + b - c) {
      const int32_t f = edgeAt(x, c);
      path_.push_back(f);
      x = other(f, x);
    }
    for (int32_t f : path_) unplace(f);
    for (int32_t f : path_) place(f, a + b - color_[static_cast<size_t>(f)]);
  }

  /// How many colours tryShortSwap tries from each end before walking a long path.
  static constexpr int32_t kShortSwapTries = 4;

  std::span<const std::pair<int32_t, int32_t>> ends_;
  size_t vertices_;
  size_t colors_;
  size_t words_;
  std::span<uint64_t> free_;
  std::span<int32_t> low_;
  std::span<int32_t> color_;
  size_t done_ = 0;  // edges [0, done_) are coloured
  std::unique_ptr<int32_t[]> at_;
  std::vector<int32_t> path_;
};

/// The renumbering that puts rounds in descending order of their largest transfer, ties by
/// colour (usually the identity: large edges are coloured first, with the lowest free colour);
/// `colorInOrder[at]` is the colour of edge `original[at]`.
template <typename Edges>
std::vector<int32_t> roundsByLargestTransfer(const Edges& edges, int32_t numColors,
                                             std::span<const int32_t> original,
                                             std::span<const int32_t> colorInOrder) {
  std::vector<int64_t> roundMax(static_cast<size_t>(numColors), 0);
  for (size_t at = 0; at < original.size(); ++at) {
    int64_t& m = roundMax[static_cast<size_t>(colorInOrder[at])];
    m = std::max(m, edges.bytes(static_cast<size_t>(original[at])));
  }
  std::vector<int32_t> rank(roundMax.size());
  std::iota(rank.begin(), rank.end(), 0);
  std::stable_sort(rank.begin(), rank.end(), [&](int32_t x, int32_t y) {
    return roundMax[static_cast<size_t>(x)] > roundMax[static_cast<size_t>(y)];
  });
  std::vector<int32_t> renumber(rank.size());
  for (size_t k = 0; k < rank.size(); ++k) {
    renumber[static_cast<size_t>(rank[k])] = static_cast<int32_t>(k);
  }
  return renumber;
}

/// Scratch that colorEdges reuses from call to call on one thread. The per-edge arrays are
/// 16 bytes per edge (16 MB for 1M transfers); fresh ones cost a page fault and a kernel
/// zeroing per 4 KiB on first touch, which was about as much time as the colouring itself.
/// Every element is written before it is read, so nothing is cleared between calls. The
/// memory stays with the thread, sized for the largest call it made.
struct Workspace {
  std::vector<std::pair<int32_t, int32_t>> ends;
  std::vector<int32_t> original;
  std::vector<int32_t> colorInOrder;
  std::vector<uint64_t> freeBits;
  std::vector<int32_t> low;
};

Workspace& workspace() {
  thread_local Workspace ws;
  return ws;
}

/// The first `size` elements of `v`, grown (never shrunk) to hold them; contents unspecified.
template <typename T>
std::span<T> grow(std::vector<T>& v, size_t size) {
  if (v.size() < size) {
    v.clear();  // nothing to keep: the new storage is allocated without copying
    detail::resizeHuge(v, size);
  }
  return {v.data(), size};
}

}  // namespace

namespace {

template <typename Edges>
int32_t maxDegreeOf(int32_t numWorkers, const Edges& edges) {
  checkEdges(numWorkers, edges);
  std::vector<int32_t> out(static_cast<size_t>(numWorkers)), in(static_cast<size_t>(numWorkers));
  int32_t delta = 0;
  for (size_t i = 0; i < edges.size(); ++i) {
    delta = std::max(delta, ++out[static_cast<size_t>(edges.sender(i))]);
    delta = std::max(delta, ++in[static_cast<size_t>(edges.receiver(i))]);
  }
  return delta;
}

}  // namespace

int32_t maxDegree(int32_t numWorkers, const std::vector<Edge>& edges) {
  return maxDegreeOf(numWorkers, EdgeView<Edge>{edges});
}

int32_t detail::maxTransferDegree(int32_t numWorkers, const std::vector<Transfer>& transfers) {
  return maxDegreeOf(numWorkers, EdgeView<Transfer>{transfers});
}

namespace {

/// Colours `edges` with exactly Δ colours, setColor(i, colour) for each edge i; returns Δ.
template <typename Edges, typename SetColor>
int32_t colorEdgesOf(int32_t numWorkers, const Edges& edges, SetColor setColor) {
  if (numWorkers < 1) checkEdges(numWorkers, edges);  // names the bad count
  if (edges.size() == 0) return 0;
  const auto n = static_cast<size_t>(numWorkers);
  // Validation, degrees, Δ, and a counting sort of the edges by descending size class (ties by
  // index), in one pass over the input.
  std::vector<int32_t> outDegree(n), inDegree(n);
  std::vector<int32_t> start(kSizeClasses + 1, 0);
  const auto workers = static_cast<uint32_t>(numWorkers);
  for (size_t i = 0; i < edges.size(); ++i) {
    // Unsigned compares catch negative ids too; a bad edge stops the pass before it indexes.
    const auto s = static_cast<uint32_t>(edges.sender(i));
    const auto r = static_cast<uint32_t>(edges.receiver(i));
    const int64_t bytes = edges.bytes(i);
    if (s >= workers || r >= workers || s == r || bytes < 0) checkEdges(numWorkers, edges);
    ++outDegree[s];
    ++inDegree[r];
    ++start[static_cast<size_t>(kSizeClasses - sizeClass(bytes))];
  }
  const int32_t delta = std::max(*std::max_element(outDegree.begin(), outDegree.end()),
                                 *std::max_element(inDegree.begin(), inDegree.end()));
  std::partial_sum(start.begin(), start.end(), start.begin());
  // Merging workers into groups of degree sum ≤ Δ/2 keeps every colouring of the group graph
  // proper for the workers, bounds the vertex count (and the path table) by O(E/Δ + N) and,
  // since two such groups together have < Δ edges, never makes greedy colouring fail between
  // them: only edges at a worker of degree > Δ/2 can need a path.
  const int32_t cap = std::max(1, delta / 2);
  int32_t senderGroups = 0, receiverGroups = 0;
  const std::vector<int32_t> senderGroup = groupVertices(outDegree, cap, senderGroups);
  const std::vector<int32_t> receiverGroup = groupVertices(inDegree, cap, receiverGroups);
  // The edges in colouring order as group pairs, so the colouring loop reads them in sequence.
  Workspace& ws = workspace();
  const auto ends = grow(ws.ends, edges.size());
  const auto original = grow(ws.original, edges.size());
  const auto colorInOrder = grow(ws.colorInOrder, edges.size());
  for (size_t i = 0; i < edges.size(); ++i) {
    const auto at = static_cast<size_t>(
        start[static_cast<size_t>(kSizeClasses - 1 - sizeClass(edges.bytes(i)))]++);
    ends[at] = {senderGroup[static_cast<size_t>(edges.sender(i))],
                senderGroups + receiverGroup[static_cast<size_t>(edges.receiver(i))]};
    original[at] = static_cast<int32_t>(i);
  }
  Colorer(ends, senderGroups + receiverGroups, delta, colorInOrder, ws.freeBits, ws.low).colorAll();
  const std::vector<int32_t> renumber =
      roundsByLargestTransfer(edges, delta, original, colorInOrder);
  for (size_t at = 0; at < ends.size(); ++at) {
    setColor(static_cast<size_t>(original[at]), renumber[static_cast<size_t>(colorInOrder[at])]);
  }
  return delta;
}

}  // namespace

EdgeColoring colorEdges(int32_t numWorkers, const std::vector<Edge>& edges) {
  EdgeColoring result;
  detail::resizeHuge(result.color, edges.size());
  result.numColors = colorEdgesOf(numWorkers, EdgeView<Edge>{edges},
                                  [&](size_t i, int32_t c) { result.color[i] = c; });
  return result;
}

int32_t detail::colorTransferRounds(int32_t numWorkers, std::vector<Transfer>& transfers) {
  return colorEdgesOf(numWorkers, EdgeView<Transfer>{transfers},
                      [&](size_t i, int32_t c) { transfers[i].round = c; });
}

RoundCostBounds roundCostBounds(int32_t numWorkers, const std::vector<Edge>& edges) {
  checkEdges(numWorkers, EdgeView<Edge>{edges});
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
