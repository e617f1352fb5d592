// Using FCP from a program of your own (run with mpirun -n <any>): the program owns MPI and
// its communicator, holds an uneven slice of a packed batch of sequences on each rank, runs one
// attention layer forward and backward through FCP, and checks the output against a plain
// single-rank computation of the whole batch.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <random>
#include <vector>

#include "fcp/api/attention.h"
#include "fcp/runtime/mpi_transport.h"

namespace {

constexpr int64_t kHeadsQ = 4, kHeadsKv = 2, kDim = 32;  // grouped-query attention

// Causal attention of every sequence on its own, computed naively in double:
// o[i, h] = softmax_j<=i(q[i, h] . k[j, g] / sqrt(d)) v[j, g] with g the KV head of head h.
std::vector<double> naiveAttention(const std::vector<int64_t>& cuSeqlens,
                                   const std::vector<float>& q, const std::vector<float>& k,
                                   const std::vector<float>& v) {
  const int64_t group = kHeadsQ / kHeadsKv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  std::vector<double> o(q.size(), 0.0);
  for (size_t s = 0; s + 1 < cuSeqlens.size(); ++s) {
    for (int64_t i = cuSeqlens[s]; i < cuSeqlens[s + 1]; ++i) {
      for (int64_t h = 0; h < kHeadsQ; ++h) {
        const float* qi = &q[static_cast<size_t>((i * kHeadsQ + h) * kDim)];
        const int64_t g = h / group;
        std::vector<double> p;
        double max = -INFINITY, sum = 0;
        for (int64_t j = cuSeqlens[s]; j <= i; ++j) {  // causal: keys up to the query
          const float* kj = &k[static_cast<size_t>((j * kHeadsKv + g) * kDim)];
          double dot = 0;
          for (int64_t x = 0; x < kDim; ++x) dot += double{qi[x]} * kj[x];
          p.push_back(dot * scale);
          max = std::max(max, p.back());
        }
        for (double& pj : p) sum += pj = std::exp(pj - max);
        double* oi = &o[static_cast<size_t>((i * kHeadsQ + h) * kDim)];
        for (int64_t j = cuSeqlens[s]; j <= i; ++j) {
          const float* vj = &v[static_cast<size_t>((j * kHeadsKv + g) * kDim)];
          const double w = p[static_cast<size_t>(j - cuSeqlens[s])] / sum;
          for (int64_t x = 0; x < kDim; ++x) oi[x] += w * vj[x];
        }
      }
    }
  }
  return o;
}

// Returns the relative L2 error of FCP's output against the naive one (the same on all ranks).
double run(MPI_Comm comm) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);

  // FCP talks over a duplicate of our communicator; MPI stays ours to initialise and finalise.
  std::unique_ptr<fcp::runtime::Transport> transport =
      fcp::runtime::makeMpiTransport(fcp::runtime::MpiCommHandle{MPI_Comm_c2f(comm)});

  // Three sequences packed into one stream of 900 tokens. Rank r holds the tokens
  // [900 r^2 / n^2, 900 (r+1)^2 / n^2): uneven, and slices start in the middle of sequences.
  fcp::BatchOptions options;
  options.cuSeqlens = {0, 300, 350, 900};
  const int64_t total = options.cuSeqlens.back(), n = size;
  options.localBegin = total * rank * rank / (n * n);
  options.localEnd = total * (rank + 1) * (rank + 1) / (n * n);
  options.numHeadsQ = kHeadsQ;
  options.numHeadsKv = kHeadsKv;
  options.headDim = kDim;
  options.mask = fcp::MaskKind::kCausal;
  options.dtype = fcp::DType::kFp32;
  options.planConfig.blockSize = 128;  // small blocks, so that this tiny batch is spread out
  fcp::AttentionBatch batch(*transport, options);  // plans the batch (collective)

  // Every rank makes the whole batch's inputs from one seed and passes FCP its own rows.
  std::mt19937 rng(2024);
  std::normal_distribution<float> normal;
  auto random = [&](int64_t heads) {
    std::vector<float> x(static_cast<size_t>(total * heads * kDim));
    for (float& e : x) e = normal(rng);
    return x;
  };
  const std::vector<float> q = random(kHeadsQ), k = random(kHeadsKv), v = random(kHeadsKv),
                           dO = random(kHeadsQ);
  const int64_t rows = options.localEnd - options.localBegin;
  auto mine = [&](const std::vector<float>& whole, int64_t heads) -> fcp::ConstTensorRef {
    return {whole.data() + options.localBegin * heads * kDim, fcp::DType::kFp32, rows, heads,
            kDim};
  };
  auto tensor = [&](std::vector<float>& x, int64_t heads) -> fcp::TensorRef {
    x.assign(static_cast<size_t>(rows * heads * kDim), 0.f);
    return {x.data(), fcp::DType::kFp32, rows, heads, kDim};
  };

  // One layer: forward, then backward (dq, dk, dv of our rows).
  std::vector<float> o, dq, dk, dv;
  fcp::AttentionLayer layer;
  layer.forward(batch, mine(q, kHeadsQ), mine(k, kHeadsKv), mine(v, kHeadsKv), tensor(o, kHeadsQ));
  layer.backward(batch, mine(dO, kHeadsQ), tensor(dq, kHeadsQ), tensor(dk, kHeadsKv),
                 tensor(dv, kHeadsKv));

  // Compare our rows of O with the naive result; sum the squares over the ranks.
  const std::vector<double> ref = naiveAttention(options.cuSeqlens, q, k, v);
  double sums[2] = {0, 0};  // |O - ref|^2, |ref|^2
  for (size_t i = 0; i < o.size(); ++i) {
    const double r = ref[static_cast<size_t>(options.localBegin * kHeadsQ * kDim) + i];
    sums[0] += (o[i] - r) * (o[i] - r);
    sums[1] += r * r;
  }
  MPI_Allreduce(MPI_IN_PLACE, sums, 2, MPI_DOUBLE, MPI_SUM, comm);
  return std::sqrt(sums[0] / sums[1]);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  double error = 0;
  try {
    error = run(MPI_COMM_WORLD);
  } catch (const std::exception& e) {  // FCP throws fcp::Error, with a one-line message
    std::fprintf(stderr, "fcp_consumer: rank %d: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  const bool ok = error <= 1e-5;
  if (rank == 0)
    std::printf("fcp_consumer: %d ranks, output O relative L2 error %.2e: %s\n", size, error,
                ok ? "ok" : "MISMATCH");
  MPI_Finalize();
  return ok ? 0 : 1;
}
