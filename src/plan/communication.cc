#include "communication.h"

#include <algorithm>
#include <tuple>

#include "fcp/core/error.h"
#include "fcp/plan/coloring.h"

namespace fcp::plan::detail {
namespace {

/// Index of the transfer of `block` to `receiver` in transfers sorted by (block, receiver),
/// or -1.
int32_t findTransfer(const std::vector<Transfer>& transfers, int32_t block, int32_t receiver) {
  const auto it = std::lower_bound(
      transfers.begin(), transfers.end(), std::make_pair(block, receiver),
      [](const Transfer& t, const std::pair<int32_t, int32_t>& key) {
        return std::tie(t.block, t.receiver) < std::tie(key.first, key.second);
      });
  if (it == transfers.end() || it->block != block || it->receiver != receiver) return -1;
  return static_cast<int32_t>(it - transfers.begin());
}

/// The user-layout worker holding global token `token`.
int32_t userWorkerOf(const std::vector<int64_t>& starts, int64_t token) {
  return static_cast<int32_t>(std::upper_bound(starts.begin(), starts.end(), token) -
                              starts.begin() - 1);
}

/// Pairs of each worker: those whose KV is its own (local), and per transfer the pairs that
/// use the transferred block.
struct PairsByNeed {
  std::vector<std::vector<int32_t>> local;       // [worker]
  std::vector<std::vector<int32_t>> byTransfer;  // [transfer]
};

PairsByNeed groupPairs(const Plan& plan) {
  PairsByNeed g;
  g.local.resize(static_cast<size_t>(plan.config.numWorkers));
  g.byTransfer.resize(plan.transfers.size());
  for (size_t p = 0; p < plan.pairs.size(); ++p) {
    const BlockPair& pair = plan.pairs[p];
    const int32_t w = plan.owner[static_cast<size_t>(pair.qBlock)];
    if (plan.owner[static_cast<size_t>(pair.kvBlock)] == w) {
      g.local[static_cast<size_t>(w)].push_back(static_cast<int32_t>(p));
    } else {
      const int32_t t = findTransfer(plan.transfers, pair.kvBlock, w);
      FCP_CHECK(t >= 0, "no transfer of block ", pair.kvBlock, " to worker ", w);
      g.byTransfer[static_cast<size_t>(t)].push_back(static_cast<int32_t>(p));
    }
  }
  return g;
}

/// Local pairs: the first half opens the pipeline, the second closes it.
void placeLocalPairs(const std::vector<int32_t>& local, std::vector<Stage>& stages) {
  const size_t firstHalf = (local.size() + 1) / 2;
  auto& first = stages.front().compute;
  first.insert(first.begin(), local.begin(), local.begin() + static_cast<std::ptrdiff_t>(firstHalf));
  auto& last = stages.back().compute;
  last.insert(last.end(), local.begin() + static_cast<std::ptrdiff_t>(firstHalf), local.end());
}

}  // namespace

std::vector<int64_t> userLayoutStarts(int64_t numTokens, int64_t numWorkers) {
  std::vector<int64_t> starts(static_cast<size_t>(numWorkers + 1));
  for (int64_t r = 0; r <= numWorkers; ++r) {
    // r * numTokens < 2^24 * 2^32: no overflow within the limits buildPlan enforces.
    starts[static_cast<size_t>(r)] = r * numTokens / numWorkers;
  }
  return starts;
}

std::vector<int64_t> sequenceStarts(const Batch& batch) {
  std::vector<int64_t> starts(batch.sequenceLengths.size() + 1, 0);
  for (size_t s = 0; s < batch.sequenceLengths.size(); ++s) {
    starts[s + 1] = starts[s] + batch.sequenceLengths[s];
  }
  return starts;
}

std::vector<int32_t> homeWorkers(const Plan& plan) {
  const auto seq = sequenceStarts(plan.batch);
  const auto user = userLayoutStarts(plan.batch.numTokens(), plan.config.numWorkers);
  std::vector<int32_t> home(plan.blocks.size(), -1);
  std::vector<std::pair<int32_t, int64_t>> counts;  // (user worker, tokens), few per block
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    counts.clear();
    for (const Chunk& c : plan.blocks[b].chunks) {
      int64_t begin = seq[static_cast<size_t>(c.sequence)] + c.begin;
      const int64_t end = seq[static_cast<size_t>(c.sequence)] + c.end;
      while (begin < end) {
        const int32_t w = userWorkerOf(user, begin);
        const int64_t stop = std::min(end, user[static_cast<size_t>(w) + 1]);
        auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& e) { return e.first == w; });
        if (it == counts.end()) {
          counts.push_back({w, stop - begin});
        } else {
          it->second += stop - begin;
        }
        begin = stop;
      }
    }
    std::pair<int32_t, int64_t> best{-1, -1};
    for (const auto& e : counts) {
      if (e.second > best.second || (e.second == best.second && e.first < best.first)) best = e;
    }
    home[b] = best.first;
  }
  return home;
}

std::vector<ReshufflePiece> buildReshuffle(const Plan& plan) {
  const auto seq = sequenceStarts(plan.batch);
  const auto user = userLayoutStarts(plan.batch.numTokens(), plan.config.numWorkers);
  std::vector<ReshufflePiece> pieces;
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    for (const Chunk& c : plan.blocks[b].chunks) {
      int64_t begin = seq[static_cast<size_t>(c.sequence)] + c.begin;
      const int64_t end = seq[static_cast<size_t>(c.sequence)] + c.end;
      while (begin < end) {
        const int32_t w = userWorkerOf(user, begin);
        const int64_t stop = std::min(end, user[static_cast<size_t>(w) + 1]);
        pieces.push_back({w, plan.owner[b], begin, stop});
        begin = stop;
      }
    }
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const ReshufflePiece& x, const ReshufflePiece& y) { return x.begin < y.begin; });
  return pieces;
}

std::vector<Transfer> buildTransfers(const Plan& plan) {
  std::vector<std::pair<int32_t, int32_t>> needed;  // (KV block, receiver)
  for (const BlockPair& p : plan.pairs) {
    const int32_t receiver = plan.owner[static_cast<size_t>(p.qBlock)];
    if (plan.owner[static_cast<size_t>(p.kvBlock)] != receiver) needed.push_back({p.kvBlock, receiver});
  }
  std::sort(needed.begin(), needed.end());
  needed.erase(std::unique(needed.begin(), needed.end()), needed.end());
  std::vector<Transfer> transfers;
  transfers.reserve(needed.size());
  const int64_t bytesPerToken = plan.config.attention.kvBytesPerToken();
  for (const auto& [block, receiver] : needed) {
    transfers.push_back({block, plan.owner[static_cast<size_t>(block)], receiver,
                         plan.blocks[static_cast<size_t>(block)].numTokens() * bytesPerToken, 0});
  }
  return transfers;
}

void colorTransfers(Plan& plan) {
  std::vector<Edge> edges;
  edges.reserve(plan.transfers.size());
  for (const Transfer& t : plan.transfers) edges.push_back({t.sender, t.receiver, t.bytes});
  const EdgeColoring coloring = colorEdges(static_cast<int32_t>(plan.config.numWorkers), edges);
  plan.numRounds = coloring.numColors;
  for (size_t e = 0; e < edges.size(); ++e) plan.transfers[e].round = coloring.color[e];
}

void buildStages(Plan& plan) {
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  const int64_t c = plan.config.coalesce;
  const int64_t lag = plan.config.bufferDepth - 1;
  const int64_t groups = (plan.numRounds + c - 1) / c;
  const auto fwdStages = static_cast<size_t>(groups > 0 ? groups + lag : 1);
  const auto bwdStages = static_cast<size_t>(groups > 0 ? groups + lag + 1 : 1);
  plan.forward.assign(n, std::vector<Stage>(fwdStages));
  plan.backward.assign(n, std::vector<Stage>(bwdStages));
  const PairsByNeed need = groupPairs(plan);
  for (size_t t = 0; t < plan.transfers.size(); ++t) {
    const Transfer& tr = plan.transfers[t];
    const auto g = static_cast<size_t>(tr.round / c);
    const auto computeAt = g + static_cast<size_t>(lag);
    const auto id = static_cast<int32_t>(t);
    for (auto* pass : {&plan.forward, &plan.backward}) {
      auto& sender = (*pass)[static_cast<size_t>(tr.sender)];
      auto& receiver = (*pass)[static_cast<size_t>(tr.receiver)];
      sender[g].send.push_back(id);
      receiver[g].recv.push_back(id);
      auto& compute = receiver[computeAt].compute;
      compute.insert(compute.end(), need.byTransfer[t].begin(), need.byTransfer[t].end());
      receiver[computeAt].release.push_back(id);
    }
    plan.backward[static_cast<size_t>(tr.receiver)][computeAt + 1].sendGrad.push_back(id);
    plan.backward[static_cast<size_t>(tr.sender)][computeAt + 1].recvGrad.push_back(id);
  }
  for (size_t w = 0; w < n; ++w) {
    placeLocalPairs(need.local[w], plan.forward[w]);
    placeLocalPairs(need.local[w], plan.backward[w]);
  }
}

void validateCommunication(const Plan& plan, Violations& v) {
  const int64_t n = plan.config.numWorkers;
  // Transfers: exactly those the pairs need.
  const std::vector<Transfer> expected = buildTransfers(plan);
  if (expected.size() != plan.transfers.size()) {
    v.add("plan has ", plan.transfers.size(), " transfers but its pairs need ", expected.size());
    return;
  }
  for (size_t t = 0; t < expected.size(); ++t) {
    const Transfer& a = plan.transfers[t];
    const Transfer& e = expected[t];
    if (a.block != e.block || a.sender != e.sender || a.receiver != e.receiver || a.bytes != e.bytes) {
      v.add("transfer ", t, " (block ", a.block, " ", a.sender, " -> ", a.receiver, ", ", a.bytes,
            " bytes) is not the needed (block ", e.block, " ", e.sender, " -> ", e.receiver, ", ",
            e.bytes, " bytes)");
      return;
    }
  }
  // Rounds: exactly Δ, each a matching.
  std::vector<Edge> edges;
  for (const Transfer& t : plan.transfers) edges.push_back({t.sender, t.receiver, t.bytes});
  const int32_t delta = maxDegree(static_cast<int32_t>(n), edges);
  if (plan.numRounds != delta) v.add("plan has ", plan.numRounds, " rounds, but Δ = ", delta);
  std::vector<std::tuple<int32_t, int32_t, int32_t>> bySender, byReceiver;  // (round, worker, id)
  for (size_t t = 0; t < plan.transfers.size(); ++t) {
    const Transfer& tr = plan.transfers[t];
    if (tr.round < 0 || tr.round >= plan.numRounds) {
      v.add("transfer ", t, " is in round ", tr.round, ", not one of 0..", plan.numRounds - 1);
    }
    bySender.push_back({tr.round, tr.sender, static_cast<int32_t>(t)});
    byReceiver.push_back({tr.round, tr.receiver, static_cast<int32_t>(t)});
  }
  for (auto* list : {&bySender, &byReceiver}) {
    std::sort(list->begin(), list->end());
    for (size_t i = 1; i < list->size(); ++i) {
      const auto& [r0, w0, t0] = (*list)[i - 1];
      const auto& [r1, w1, t1] = (*list)[i];
      if (r0 == r1 && w0 == w1) {
        v.add("round ", r1, " is not a matching: worker ", w1, (list == &bySender ? " sends" : " receives"),
              " transfers ", t0, " and ", t1);
      }
    }
  }
  if (!v.empty()) return;
  if (plan.config.coalesce <= 0 || plan.config.bufferDepth < 2) {
    v.add("coalesce ", plan.config.coalesce, " / buffer depth ", plan.config.bufferDepth,
          ": expected >= 1 / >= 2");
    return;
  }

  // Stages, both passes: replay every worker's stages.
  const int64_t bufferLimit = plan.config.bufferDepth * plan.config.coalesce;
  for (const bool backward : {false, true}) {
    const auto& stages = backward ? plan.backward : plan.forward;
    const char* pass = backward ? "backward" : "forward";
    if (static_cast<int64_t>(stages.size()) != n) {
      v.add(pass, " stages cover ", stages.size(), " workers, not ", n);
      continue;
    }
    const size_t numT = plan.transfers.size();
    std::vector<int64_t> sentAt(numT, -1), recvAt(numT, -1), releasedAt(numT, -1),
        lastUse(numT, -1), gradSentAt(numT, -1), gradRecvAt(numT, -1);
    std::vector<int64_t> computedAt(plan.pairs.size(), -1);
    auto mark = [&](std::vector<int64_t>& at, int32_t id, size_t limit, int64_t stage, const char* what,
                    int64_t worker) {
      if (id < 0 || static_cast<size_t>(id) >= limit) {
        v.add(pass, " worker ", worker, " stage ", stage, " names ", what, " ", id, " out of range");
        return false;
      }
      if (at[static_cast<size_t>(id)] >= 0) {
        v.add(pass, ": ", what, " ", id, " happens twice");
        return false;
      }
      at[static_cast<size_t>(id)] = stage;
      return true;
    };
    for (int64_t w = 0; w < n; ++w) {
      int64_t held = 0;
      bool overflowed = false;
      const auto& ws = stages[static_cast<size_t>(w)];
      for (int64_t s = 0; s < static_cast<int64_t>(ws.size()); ++s) {
        const Stage& st = ws[static_cast<size_t>(s)];
        if (static_cast<int64_t>(st.send.size()) > plan.config.coalesce ||
            static_cast<int64_t>(st.recv.size()) > plan.config.coalesce ||
            static_cast<int64_t>(st.sendGrad.size()) > plan.config.coalesce ||
            static_cast<int64_t>(st.recvGrad.size()) > plan.config.coalesce) {
          v.add(pass, " worker ", w, " stage ", s, " moves more than ", plan.config.coalesce,
                " blocks one way");
        }
        for (int32_t t : st.send) {
          if (mark(sentAt, t, numT, s, "send of transfer", w) &&
              plan.transfers[static_cast<size_t>(t)].sender != w) {
            v.add(pass, ": worker ", w, " sends transfer ", t, " that is not its own");
          }
        }
        for (int32_t t : st.recv) {
          if (mark(recvAt, t, numT, s, "receive of transfer", w) &&
              plan.transfers[static_cast<size_t>(t)].receiver != w) {
            v.add(pass, ": worker ", w, " receives transfer ", t, " meant for another");
          }
        }
        held += static_cast<int64_t>(st.recv.size());
        if (held > bufferLimit && !overflowed) {  // once per worker: the first stage says it
          overflowed = true;
          v.add(pass, " worker ", w, " holds ", held, " remote blocks at stage ", s,
                ", over buffer depth ", plan.config.bufferDepth, " x coalesce ", plan.config.coalesce);
        }
        for (int32_t p : st.compute) {
          if (!mark(computedAt, p, plan.pairs.size(), s, "pair", w)) continue;
          const BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
          if (plan.owner[static_cast<size_t>(pair.qBlock)] != w) {
            v.add(pass, ": worker ", w, " computes pair ", p, " whose Q block it does not own");
            continue;
          }
          if (plan.owner[static_cast<size_t>(pair.kvBlock)] == w) continue;
          const int32_t t = findTransfer(plan.transfers, pair.kvBlock, static_cast<int32_t>(w));
          if (t < 0 || recvAt[static_cast<size_t>(t)] < 0 || recvAt[static_cast<size_t>(t)] >= s ||
              releasedAt[static_cast<size_t>(t)] >= 0) {
            v.add(pass, ": worker ", w, " computes pair ", p, " at stage ", s,
                  " before its KV block ", pair.kvBlock, " arrived (or after its buffer was freed)");
            continue;
          }
          lastUse[static_cast<size_t>(t)] = s;
        }
        for (int32_t t : st.release) {
          if (mark(releasedAt, t, numT, s, "release of transfer", w)) --held;
        }
        for (int32_t t : st.sendGrad) {
          if (mark(gradSentAt, t, numT, s, "dK/dV partial of transfer", w) &&
              (plan.transfers[static_cast<size_t>(t)].receiver != w || lastUse[static_cast<size_t>(t)] < 0 ||
               lastUse[static_cast<size_t>(t)] >= s)) {
            v.add(pass, ": worker ", w, " sends the dK/dV partial of transfer ", t,
                  " before computing with it, or it is not its to send");
          }
        }
        for (int32_t t : st.recvGrad) {
          if (mark(gradRecvAt, t, numT, s, "dK/dV return of transfer", w) &&
              plan.transfers[static_cast<size_t>(t)].sender != w) {
            v.add(pass, ": worker ", w, " receives a dK/dV partial of a block it does not own");
          }
        }
      }
    }
    for (size_t t = 0; t < numT; ++t) {
      if (sentAt[t] < 0 || recvAt[t] < 0 || sentAt[t] != recvAt[t]) {
        v.add(pass, ": transfer ", t, " is sent at stage ", sentAt[t], " and received at stage ",
              recvAt[t], ": expected once each, in the same stage");
      }
      if (releasedAt[t] < 0) v.add(pass, ": the buffer of transfer ", t, " is never freed");
      if (backward && (gradSentAt[t] < 0 || gradSentAt[t] != gradRecvAt[t])) {
        v.add(pass, ": the dK/dV partial of transfer ", t, " is sent at stage ", gradSentAt[t],
              " and received at stage ", gradRecvAt[t], ": expected once each, in the same stage");
      }
      if (!backward && gradSentAt[t] >= 0) v.add("forward stages send a dK/dV partial");
    }
    for (size_t p = 0; p < plan.pairs.size(); ++p) {
      if (computedAt[p] < 0) v.add(pass, ": pair ", p, " is never computed");
    }
  }

  // Reshuffle: the pieces tile the stream, each inside one user slice and one chunk of a
  // block owned by its fcpWorker.
  const auto seq = sequenceStarts(plan.batch);
  const auto user = userLayoutStarts(plan.batch.numTokens(), n);
  std::vector<std::tuple<int64_t, int64_t, int32_t>> chunks;  // (begin, end, owner)
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    for (const Chunk& c : plan.blocks[b].chunks) {
      chunks.push_back({seq[static_cast<size_t>(c.sequence)] + c.begin,
                        seq[static_cast<size_t>(c.sequence)] + c.end, plan.owner[b]});
    }
  }
  std::sort(chunks.begin(), chunks.end());
  int64_t next = 0;
  for (size_t i = 0; i < plan.reshuffle.size(); ++i) {
    const ReshufflePiece& piece = plan.reshuffle[i];
    if (piece.begin != next || piece.end <= piece.begin) {
      v.add("reshuffle piece ", i, " covers [", piece.begin, ", ", piece.end, ") but the next token is ", next);
      return;
    }
    next = piece.end;
    const int32_t holder = userWorkerOf(user, piece.begin);
    if (holder != piece.userWorker || piece.end > user[static_cast<size_t>(holder) + 1]) {
      v.add("reshuffle piece ", i, " says user worker ", piece.userWorker, " but tokens from ",
            piece.begin, " are held by ", holder);
    }
    auto it = std::upper_bound(chunks.begin(), chunks.end(),
                               std::make_tuple(piece.begin, INT64_MAX, INT32_MAX));
    if (it == chunks.begin()) {
      v.add("reshuffle piece ", i, " starts before every block");
      continue;
    }
    --it;
    if (std::get<0>(*it) > piece.begin || std::get<1>(*it) < piece.end || std::get<2>(*it) != piece.fcpWorker) {
      v.add("reshuffle piece ", i, " sends tokens [", piece.begin, ", ", piece.end, ") to worker ",
            piece.fcpWorker, ", not to the owner of their block");
    }
  }
  if (next != plan.batch.numTokens()) {
    v.add("reshuffle stops at token ", next, " of ", plan.batch.numTokens());
  }
}

}  // namespace fcp::plan::detail
