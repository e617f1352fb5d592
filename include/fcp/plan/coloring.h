#pragma once
/// The congestion-free solver (§4.2, Appendix B): the transfer graph cut into exactly Δ rounds.
///
/// Senders and receivers are the same N workers on the two sides of a bipartite multigraph;
/// an edge is one KV block sent from one worker to another. A round is a matching: each worker
/// sends at most one and receives at most one block. Δ, the largest number of edges at any
/// vertex, is the least number of rounds, and a bipartite multigraph always has a proper edge
/// colouring with exactly Δ colours (Kőnig).

#include <cstdint>
#include <vector>

namespace fcp::plan {

/// One transfer: worker `sender` sends `bytes` to worker `receiver` (sender != receiver).
struct Edge {
  int32_t sender = 0;
  int32_t receiver = 0;
  int64_t bytes = 0;
  friend bool operator==(const Edge&, const Edge&) = default;
};

/// A round for every edge: color[e] in [0, numColors), numColors = Δ, and no two edges of one
/// round share a sender or a receiver.
struct EdgeColoring {
  int32_t numColors = 0;
  std::vector<int32_t> color;
  friend bool operator==(const EdgeColoring&, const EdgeColoring&) = default;
};

/// Δ: the largest number of edges any worker sends or receives (0 for no edges).
int32_t maxDegree(int32_t numWorkers, const std::vector<Edge>& edges);

/// Colours `edges` with exactly Δ colours. Deterministic: the same edges in the same order
/// give the same colouring. Throws Error(kInvalidArgument) for an edge naming a worker outside
/// [0, numWorkers) or a worker sending to itself.
EdgeColoring colorEdges(int32_t numWorkers, const std::vector<Edge>& edges);

/// The two weighted lower bounds on Σ over rounds of the round's largest edge (see the .cc),
/// and that sum for a colouring.
struct RoundCostBounds {
  int64_t maxWorkerBytes = 0;   ///< the most bytes any worker sends or receives
  int64_t sortedRoundBound = 0; ///< Σ_k size of the ((k−1)·N+1)-th largest edge
};
RoundCostBounds roundCostBounds(int32_t numWorkers, const std::vector<Edge>& edges);
int64_t sumOfRoundMaxima(const std::vector<Edge>& edges, const EdgeColoring& coloring);

}  // namespace fcp::plan
