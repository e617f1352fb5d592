// The Python binding of FCP (module fcp._fcp): a thin layer over fcp/api/attention.h. Tensors
// cross as raw pointers with their shapes and row strides (the Python side passes torch tensors'
// data_ptr(), copying only a tensor whose rows are not dense), so nothing is copied here and
// this module needs no libtorch.
//
// Terms. A *callback transport* is a runtime::Transport whose operations call Python functions
// (fcp.torch implements them with torch.distributed on the caller's process group); its
// requests are Python objects kept here until they complete. The GIL is released while FCP
// computes and taken again only inside those callbacks.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "fcp/api/attention.h"
#include "fcp/core/error.h"
#include "fcp/runtime/mpi_transport.h"

namespace py = pybind11;

namespace fcp::python {
namespace {

/// A holder's deleter that destroys with the GIL released when it is held: a PendingBatch
/// dropped unused waits for its planning thread, which on a long-tailed batch at thousands of
/// workers takes seconds, and Python's other threads (data loading, logging) would stop
/// meanwhile. Nothing the destructor runs touches Python. Not while the interpreter shuts down:
/// a daemon thread that let the GIL go then would end as it took it back, inside this frame.
struct WithoutGil {
  template <typename T>
  void operator()(T* p) const {
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing();
#else
    const bool finalizing = _Py_IsFinalizing();
#endif
    std::optional<py::gil_scoped_release> release;
    if (PyGILState_Check() && !finalizing) release.emplace();
    delete p;
  }
};

/// A Transport over Python callables:
///   isend(peer, tag, address, nbytes) -> request     irecv(peer, tag, address, nbytes) -> request
///   test(request) -> bool                            wait(request, timeout_seconds) -> None
///   allreduce(list_of_int64, op_name, timeout_seconds) -> list  (op_name: "sum", "min" or
///                                                    "max"; timeout_seconds 0: the usual)
/// A request is any Python object. Zero-byte messages never reach Python (both sides agree on
/// every size, so both skip them).
class CallbackTransport final : public runtime::Transport {
 public:
  CallbackTransport(int rank, int size, py::object isend, py::object irecv, py::object test,
                    py::object wait, py::object allreduce, double timeoutSeconds)
      : rank_(rank),
        size_(size),
        isend_(std::move(isend)),
        irecv_(std::move(irecv)),
        test_(std::move(test)),
        wait_(std::move(wait)),
        allreduce_(std::move(allreduce)),
        timeoutSeconds_(timeoutSeconds) {
    if (size < 1 || rank < 0 || rank >= size) {
      throwInvalidArgument("transport rank ", rank, " of ", size, ": expected 0 <= rank < size");
    }
  }
  ~CallbackTransport() override {
    py::gil_scoped_acquire gil;
    requests_.clear();
    isend_ = irecv_ = test_ = wait_ = allreduce_ = py::object();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int maxTag() const override { return (1 << 30) - 1; }
  double timeoutSeconds() const noexcept override { return timeoutSeconds_.load(); }
  /// The timeout of the batch being made: a process group's transport serves every batch over
  /// it, each with its own timeout_seconds (fcp/torch.py sets it before each batch's agreement).
  void setTimeoutSeconds(double seconds) noexcept { timeoutSeconds_.store(seconds); }

  runtime::RequestId isend(int peer, int tag, std::span<const std::byte> data) override {
    return post(isend_, peer, tag, const_cast<std::byte*>(data.data()), data.size());
  }
  runtime::RequestId irecv(int peer, int tag, std::span<std::byte> data) override {
    return post(irecv_, peer, tag, data.data(), data.size());
  }
  bool test(runtime::RequestId request) override {
    if (request == kDone) return true;
    py::gil_scoped_acquire gil;
    auto it = requests_.find(request);
    FCP_CHECK(it != requests_.end(), "test of unknown request ", request);
    if (!call<bool>([&] { return test_(it->second.work).cast<bool>(); })) return false;
    requests_.erase(it);
    return true;
  }
  void wait(runtime::RequestId request) override {
    if (request == kDone) return;
    py::gil_scoped_acquire gil;
    auto it = requests_.find(request);
    FCP_CHECK(it != requests_.end(), "wait of unknown request ", request);
    try {
      call<int>([&] {
        wait_(it->second.work, timeoutSeconds_.load());
        return 0;
      });
    } catch (const Error& e) {
      // The callback's own error names no peer (gloo: "Timed out waiting 300000ms for recv
      // operation to complete"): say which message it was, as the MPI transport does.
      const Request& r = it->second;
      throw Error(
          e.code(),
          std::string(e.what()) + " (" + (r.isSend ? "a send of " : "a receive of ") +
              std::to_string(r.bytes) + " bytes " + (r.isSend ? "to" : "from") + " rank " +
              std::to_string(r.peer) + ", tag " + std::to_string(r.tag) +
              ": did that rank raise in this call, stop, run slower than the timeout, make "
              "its FCP calls in another order, or dispatch rows of another shape or dtype?)");
    }
    requests_.erase(it);
  }
  using Transport::allreduce;
  void allreduce(std::span<int64_t> values, runtime::ReduceOp op, double timeoutSeconds) override {
    // The callback bounds it by the batch's timeout, or this one when longer (fcp/torch.py).
    // Withdrawn messages do not stop a collective (gloo never matches one with the other).
    if (!abandonedCollective_.empty())
      runtime::throwAbandoned(rank_, abandonedCollective_, "a new process group");
    py::gil_scoped_acquire gil;
    const char* name = op == runtime::ReduceOp::kSum   ? "sum"
                       : op == runtime::ReduceOp::kMin ? "min"
                                                       : "max";
    const std::vector<int64_t> in(values.begin(), values.end());
    std::vector<int64_t> out;
    try {
      out = call<std::vector<int64_t>>(
          [&] { return allreduce_(in, name, timeoutSeconds).cast<std::vector<int64_t>>(); });
    } catch (const Error& e) {
      // A collective that failed (timed out) stays posted: a late peer would meet it and go on
      // as if agreed, and every later collective would be out of step. Nothing more goes out.
      abandonedCollective_ = e.what();
      throw;
    }
    FCP_CHECK_EQ(out.size(), values.size());
    std::copy(out.begin(), out.end(), values.begin());
  }
  /// torch.distributed cannot cancel a posted isend or irecv: with any pending, their buffers
  /// must be kept (false), and no new request is accepted.
  bool cancelPending() noexcept override {
    try {
      py::gil_scoped_acquire gil;
      if (requests_.empty()) return true;
      requests_.clear();
    } catch (...) {
      return false;
    }
    withdrew_ = true;
    return false;
  }

  [[noreturn]] void abort(int exitCode) noexcept override {
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(exitCode);
  }

 private:
  static constexpr runtime::RequestId kDone = ~runtime::RequestId{0};

  // Runs a Python call; a Python exception becomes Error(kTransport) with its type and message
  // (not its traceback: the error is one line). fcp.Error's message needs no type.
  template <typename T, typename F>
  T call(F f) {
    try {
      return f();
    } catch (py::error_already_set& e) {
      std::string text;
      try {
        const bool ours = py::str(e.type().attr("__module__")).cast<std::string>() == "fcp._fcp";
        text =
            (ours ? std::string() : py::str(e.type().attr("__name__")).cast<std::string>() + ": ") +
            py::str(e.value()).cast<std::string>();
      } catch (...) {
        text = e.what();
      }
      throw Error(ErrorCode::kTransport, "rank " + std::to_string(rank_) + ": " + text);
    }
  }
  runtime::RequestId post(py::object& fn, int peer, int tag, std::byte* data, size_t bytes) {
    if (bytes == 0) return kDone;
    if (withdrew_ || !abandonedCollective_.empty())
      runtime::throwAbandoned(rank_, abandonedCollective_, "a new process group");
    py::gil_scoped_acquire gil;
    py::object work = call<py::object>([&] {
      return fn(peer, tag, reinterpret_cast<uintptr_t>(data), static_cast<int64_t>(bytes));
    });
    const runtime::RequestId id = next_++;
    requests_.emplace(id, Request{std::move(work), &fn == &isend_, peer, tag, bytes});
    return id;
  }

  int rank_, size_;
  py::object isend_, irecv_, test_, wait_, allreduce_;
  std::atomic<double> timeoutSeconds_;
  runtime::RequestId next_ = 1;
  /// A posted message: the callback's request, and what it is, for errors.
  struct Request {
    py::object work;
    bool isSend = false;
    int peer = 0, tag = 0;
    size_t bytes = 0;
  };
  std::map<runtime::RequestId, Request> requests_;
  bool withdrew_ = false;            ///< cancelPending withdrew a request: no new messages
  std::string abandonedCollective_;  ///< why an all-reduce was left posted: nothing new at all
};

DType dtypeOf(const std::string& name) {
  if (name == "fp32") return DType::kFp32;
  if (name == "bf16") return DType::kBf16;
  throwInvalidArgument("unknown dtype '", name, "': expected fp32 or bf16");
}

// A tensor view from (address, dtype, tokens, heads, dim) and its row stride in elements (0:
// contiguous).
TensorRef view(uintptr_t address, const std::string& dtype, int64_t tokens, int64_t heads,
               int64_t dim, int64_t rowStride = 0) {
  return {reinterpret_cast<void*>(address), dtypeOf(dtype), tokens, heads, dim, rowStride};
}

// The bytes from a tensor's first row to the end of its last: the span the batch checks.
size_t extent(int64_t rows, int64_t rowBytes, int64_t stride) {
  return static_cast<size_t>(runtime::rowsExtentBytes(rows, rowBytes, stride));
}

}  // namespace
}  // namespace fcp::python

PYBIND11_MODULE(_fcp, m) {
  using namespace fcp;
  using namespace fcp::python;
  m.doc() = "FCP's C++ library (use the fcp and fcp.torch modules instead)";

  m.attr("__version__") = FCP_VERSION;  // the CMake project's
  m.attr("max_kernel_threads") = runtime::kMaxKernelThreads;
  // fcp.Error, a RuntimeError, is every error FCP raises. Bad input is fcp.InvalidArgument, a
  // ValueError too (a training loop's `except ValueError` catches it); failed or timed-out
  // communication is fcp.TransportError.
  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<Error> invalid(m, "InvalidArgument",
                                      py::make_tuple(error, py::handle(PyExc_ValueError)));
  static py::exception<Error> transportError(m, "TransportError", error);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      switch (e.code()) {
        case ErrorCode::kInvalidArgument:
          invalid(e.what());
          break;
        case ErrorCode::kTransport:
          transportError(e.what());
          break;
        default:
          error(e.what());
      }
    }
  });

  py::class_<runtime::Transport, std::shared_ptr<runtime::Transport>>(m, "Transport")
      .def_property_readonly("rank", &runtime::Transport::rank)
      .def_property_readonly("size", &runtime::Transport::size);

  m.def(
      "callback_transport",
      [](int rank, int size, py::object isend, py::object irecv, py::object test, py::object wait,
         py::object allreduce, double timeoutSeconds) -> std::shared_ptr<runtime::Transport> {
        return std::make_shared<CallbackTransport>(rank, size, std::move(isend), std::move(irecv),
                                                   std::move(test), std::move(wait),
                                                   std::move(allreduce), timeoutSeconds);
      },
      py::arg("rank"), py::arg("size"), py::arg("isend"), py::arg("irecv"), py::arg("test"),
      py::arg("wait"), py::arg("allreduce"), py::arg("timeout_seconds"));
  m.def(
      "set_callback_timeout",
      [](runtime::Transport& transport, double seconds) {
        auto* callbacks = dynamic_cast<CallbackTransport*>(&transport);
        if (callbacks == nullptr)
          throwInvalidArgument("set_callback_timeout: not a callback transport");
        callbacks->setTimeoutSeconds(seconds);
      },
      py::arg("transport"), py::arg("timeout_seconds"));

  m.def(
      "mpi_transport",
      [](int64_t fortranHandle, double timeoutSeconds) -> std::shared_ptr<runtime::Transport> {
        runtime::MpiOptions options;
        options.timeoutSeconds = timeoutSeconds;
        return runtime::makeMpiTransport(runtime::MpiCommHandle{fortranHandle}, options);
      },
      py::arg("fortran_handle"), py::arg("timeout_seconds") = 60.0);

  // What AttentionBatch and PendingBatch are made from (opaque to Python).
  py::class_<BatchOptions>(m, "BatchOptions");
  m.def(
      "batch_options",
      [](std::vector<int64_t> cuSeqlens, int64_t begin, int64_t end, int64_t heads, int64_t kvHeads,
         int64_t headDim, bool causal, const std::string& dtype, bool dispatched,
         const std::string& strategy, int64_t blockSize, int threads, double commRatio,
         double softmaxScale, const std::string& localError) {
        BatchOptions o;
        o.localError = localError;
        o.cuSeqlens = std::move(cuSeqlens);
        o.localBegin = begin;
        o.localEnd = end;
        o.numHeadsQ = heads;
        o.numHeadsKv = kvHeads;
        o.headDim = headDim;
        o.mask = causal ? MaskKind::kCausal : MaskKind::kFull;
        o.dtype = dtypeOf(dtype);
        o.layout = dispatched ? Layout::kDispatched : Layout::kTransparent;
        o.strategy = strategy;
        o.planConfig.blockSize = blockSize;
        o.planConfig.commRatio = commRatio;
        o.numThreads = threads;
        o.softmaxScale = softmaxScale;
        return o;
      },
      py::arg("cu_seqlens"), py::arg("begin"), py::arg("end"), py::arg("heads"),
      py::arg("kv_heads"), py::arg("head_dim"), py::arg("causal"), py::arg("dtype"),
      py::arg("dispatched"), py::arg("strategy"), py::arg("block_size"), py::arg("threads"),
      py::arg("comm_ratio"), py::arg("softmax_scale"), py::arg("local_error") = "");

  // What a batch's agreement compares, one hash per setting, and each setting's name: a Ulysses
  // node's members compare them among themselves (fcp.torch._Ulysses).
  m.def("setting_hashes", [](const BatchOptions& o) { return fcp::detail::settingHashes(o); });
  m.def("setting_name", [](size_t i) { return std::string(fcp::detail::settingName(i)); });

  // Planned on a thread of its own (collective checks first); AttentionBatch(pending) waits.
  // Dropped unused, it waits for its planning to end, with the GIL released (WithoutGil).
  py::class_<PendingBatch, std::unique_ptr<PendingBatch, WithoutGil>>(m, "PendingBatch")
      .def(py::init([](std::shared_ptr<runtime::Transport> transport, const BatchOptions& o) {
             py::gil_scoped_release release;
             return std::unique_ptr<PendingBatch, WithoutGil>(new PendingBatch(*transport, o));
           }),
           py::arg("transport"), py::arg("options"), py::keep_alive<1, 2>())
      .def_property_readonly("ready", &PendingBatch::ready);

  py::class_<AttentionBatch>(m, "AttentionBatch")
      .def(py::init([](std::shared_ptr<runtime::Transport> transport, const BatchOptions& o) {
             py::gil_scoped_release release;
             return std::make_unique<AttentionBatch>(*transport, o);
           }),
           py::arg("transport"), py::arg("options"), py::keep_alive<1, 2>())
      // The pending batch (kept alive with the batch) keeps the transport alive.
      .def(py::init([](PendingBatch& pending) {
             py::gil_scoped_release release;
             return std::make_unique<AttentionBatch>(std::move(pending));
           }),
           py::arg("pending"), py::keep_alive<1, 2>())
      .def_property_readonly("num_user_tokens", &AttentionBatch::numUserTokens)
      .def_property_readonly("num_local_tokens", &AttentionBatch::numLocalTokens)
      .def_property_readonly("num_call_tokens", &AttentionBatch::numCallTokens)
      .def_property_readonly("num_blocks",
                             [](const AttentionBatch& b) { return b.plan().blocks.size(); })
      .def_property_readonly("memory_limit_tokens",
                             [](const AttentionBatch& b) { return b.plan().config.memoryLimit(); })
      .def("local_sequence",
           [](const AttentionBatch& b) {
             auto s = b.localSequence();
             return std::vector<int32_t>(s.begin(), s.end());
           })
      .def("local_position",
           [](const AttentionBatch& b) {
             auto s = b.localPosition();
             return std::vector<int64_t>(s.begin(), s.end());
           })
      .def(
          "dispatch",
          [](AttentionBatch& b, uintptr_t user, uintptr_t local, int64_t rowBytes,
             int64_t userStride, int64_t rowKind) {
            py::gil_scoped_release release;
            b.dispatch({reinterpret_cast<const std::byte*>(user),
                        extent(b.numUserTokens(), rowBytes, userStride)},
                       {reinterpret_cast<std::byte*>(local),
                        static_cast<size_t>(b.numLocalTokens() * rowBytes)},
                       rowBytes, userStride, 0, rowKind);
          },
          py::arg("user"), py::arg("local"), py::arg("row_bytes"), py::arg("user_stride") = 0,
          py::arg("row_kind") = 0)
      .def(
          "undispatch",
          [](AttentionBatch& b, uintptr_t local, uintptr_t user, int64_t rowBytes,
             int64_t localStride, int64_t rowKind) {
            py::gil_scoped_release release;
            b.undispatch({reinterpret_cast<const std::byte*>(local),
                          extent(b.numLocalTokens(), rowBytes, localStride)},
                         {reinterpret_cast<std::byte*>(user),
                          static_cast<size_t>(b.numUserTokens() * rowBytes)},
                         rowBytes, localStride, 0, rowKind);
          },
          py::arg("local"), py::arg("user"), py::arg("row_bytes"), py::arg("local_stride") = 0,
          py::arg("row_kind") = 0)
      .def_property_readonly("failure",
                             [](const AttentionBatch& b) -> std::optional<std::string> {
                               if (b.failure().empty()) return std::nullopt;
                               return b.failure();
                             })
      .def(
          "fail", [](AttentionBatch& b, const std::string& message) { b.fail(message); },
          py::arg("message"))
      .def("stats", [](const AttentionBatch& b) {
        auto d = [](const PassStats& s) {
          py::dict out;
          out["wall_ms"] = s.wallMs;
          out["kernel_ms"] = s.kernelMs;
          out["flops"] = s.flops;
          out["sent_bytes"] = s.sentBytes;
          out["recv_bytes"] = s.recvBytes;
          return out;
        };
        py::dict out;
        out["forward"] = d(b.forwardStats());
        out["backward"] = d(b.backwardStats());
        return out;
      });

  // Shapes: (address, dtype, tokens, heads, dim) per tensor; lse is fp32 [tokens, heads]. The
  // inputs' row strides are in elements (0: contiguous); the outputs are contiguous.
  py::class_<AttentionLayer>(m, "AttentionLayer")
      .def(py::init<>())
      .def(
          "forward",
          [](AttentionLayer& layer, AttentionBatch& batch, const std::string& dtype, int64_t tokens,
             int64_t heads, int64_t kvHeads, int64_t dim, uintptr_t q, uintptr_t k, uintptr_t v,
             uintptr_t o, uintptr_t lse, int64_t qStride, int64_t kStride, int64_t vStride) {
            py::gil_scoped_release release;
            layer.forward(batch, view(q, dtype, tokens, heads, dim, qStride),
                          view(k, dtype, tokens, kvHeads, dim, kStride),
                          view(v, dtype, tokens, kvHeads, dim, vStride),
                          view(o, dtype, tokens, heads, dim), view(lse, "fp32", tokens, heads, 1));
          },
          py::arg("batch"), py::arg("dtype"), py::arg("tokens"), py::arg("heads"),
          py::arg("kv_heads"), py::arg("dim"), py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("o"), py::arg("lse"), py::arg("q_stride") = 0, py::arg("k_stride") = 0,
          py::arg("v_stride") = 0)
      .def(
          "backward",
          [](AttentionLayer& layer, AttentionBatch& batch, const std::string& dtype, int64_t tokens,
             int64_t heads, int64_t kvHeads, int64_t dim, uintptr_t dO, uintptr_t dq, uintptr_t dk,
             uintptr_t dv, int64_t dOStride) {
            py::gil_scoped_release release;
            layer.backward(batch, view(dO, dtype, tokens, heads, dim, dOStride),
                           view(dq, dtype, tokens, heads, dim),
                           view(dk, dtype, tokens, kvHeads, dim),
                           view(dv, dtype, tokens, kvHeads, dim));
          },
          py::arg("batch"), py::arg("dtype"), py::arg("tokens"), py::arg("heads"),
          py::arg("kv_heads"), py::arg("dim"), py::arg("dO"), py::arg("dq"), py::arg("dk"),
          py::arg("dv"), py::arg("dO_stride") = 0);
}
