#pragma once
// The reshuffle between the caller's layout and the FCP layout (paper §4.3), for any per-token
// tensor.
//
// Terms. A *piece* is a run of consecutive tokens of one block that one user-layout rank holds.
// A *field* is one tensor that moves: its rows in the caller's layout (read inward, written
// outward), its rows in the FCP layout (a function of local block and token), and the element
// type on each side. Rows travel in the caller's element type (bf16 outputs leave as bf16) and
// are converted where they land or leave. The *index* of a layout lists, per peer, the pieces
// this rank receives as FCP worker (`inbound`) and sends as user worker (`outbound`); the
// dispatched layout's index is the identity (every piece local), so one code path serves both.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "fcp/runtime/executor.h"
#include "fcp/runtime/transport.h"

namespace fcp::runtime::detail {

/// Element type of one side of a field. kRaw moves bytes unchanged (any per-token tensor).
enum class Elem { kRaw, kFp32, kBf16 };
int64_t elemBytes(Elem e);

/// Copies `count` elements from `src` (type `from`) to `dst` (type `to`), converting fp32 <->
/// bf16 where the types differ (kRaw only to kRaw). The one row-copy of the reshuffle.
void copyElements(std::byte* dst, Elem to, const std::byte* src, Elem from, int64_t count);

struct Piece {
  int64_t userOffset = 0;   ///< first token inside the user rank's slice (or the caller's tensor)
  int32_t block = 0;        ///< the block the tokens belong to
  int32_t localBlock = -1;  ///< index among the FCP worker's local blocks (FCP side only)
  int64_t blockOffset = 0;  ///< first token inside that block
  int64_t numTokens = 0;
};

struct LayoutIndex {
  std::vector<std::vector<Piece>> inbound;   ///< [user rank] pieces this rank receives
  std::vector<std::vector<Piece>> outbound;  ///< [fcp rank] pieces this rank sends
  int32_t numLocalBlocks = 0;                ///< blocks this rank owns
  int64_t userTokens = 0;                    ///< rows of the caller's tensors on this rank
};

struct Field {
  const std::byte* user = nullptr;  ///< inward source
  std::byte* userOut = nullptr;     ///< outward destination
  Elem userElem = Elem::kFp32;
  Elem fcpElem = Elem::kFp32;
  int64_t elements = 0;  ///< per token (bytes for kRaw)
  std::function<std::byte*(int32_t local, int64_t token)> fcp;
  int64_t userStride = 0;  ///< bytes from one user row to the next (0: wireBytes())
  int64_t wireBytes() const { return elements * elemBytes(userElem); }
  int64_t userStep() const { return userStride > 0 ? userStride : wireBytes(); }
};

/// What the reshuffle streams share: the transport, this rank, the index, stats and timeline.
struct ReshuffleContext {
  Transport& transport;
  int rank = 0;
  const LayoutIndex& index;
  PassStats* stats = nullptr;
  Timeline* timeline = nullptr;
};

/// The inward reshuffle, one message per block and destination rank (tagged tagBase + block),
/// so that a block can start as soon as its own rows are in, not when a peer's whole share is.
/// start() posts every receive and copies the rows that stay on this rank; send() sends one
/// block's rows to one FCP rank, in the order the caller chooses (a link carries them in that
/// order); sendRest() sends the others; poll() and waitFor() unpack what arrived; finish()
/// sends what is left and waits for everything.
class Inward {
 public:
  Inward(const ReshuffleContext& context, std::vector<Field> fields, int tagBase);
  void start();
  /// Sends block `block`'s rows to FCP rank `peer` unless sent already or it has none there.
  void send(int peer, int32_t block);
  /// Sends every message not sent yet (by peer, then block).
  void sendRest();
  /// Unpacks every message that has arrived (never blocks); returns how many did.
  int poll();
  /// True when every row of local block `local` is in place.
  bool has(int32_t local) const { return missing_[static_cast<size_t>(local)] == 0; }
  /// Blocks until has(local).
  void waitFor(int32_t local);
  void finish();
  /// After an error the transport could not withdraw from: the message buffers are never freed.
  void keepBuffersForever();

 private:
  struct Incoming {
    int peer;
    int32_t block;
    int32_t local;
    std::vector<std::byte> buffer;
    RequestId request;
  };
  void unpack(Incoming& in);
  ReshuffleContext ctx_;
  std::vector<Field> fields_;
  int tagBase_;
  std::vector<Incoming> incoming_;
  std::vector<size_t> pending_;                ///< indices into incoming_ not arrived yet
  std::vector<int32_t> missing_;               ///< per local block: messages still to arrive
  std::vector<std::map<int32_t, bool>> sent_;  ///< [fcp rank] block with rows for it -> sent
  std::vector<std::vector<std::byte>> sendBufs_;
  std::vector<RequestId> sends_;
  double startUs_ = 0, lastArrivalUs_ = 0;
};

/// The outward reshuffle: a block's rows leave (one message per block and user rank, tagged
/// tagBase + block) as soon as its remaining count reaches zero; start() posts every receive
/// and sends the blocks that need nothing; finish() waits and unpacks.
class Outward {
 public:
  /// `remaining`: per local block, the contributions still to come before its rows are final.
  Outward(const ReshuffleContext& context, std::vector<Field> fields, int tagBase,
          std::vector<int64_t> remaining);
  void start();
  /// One contribution to local block `local` is in; it leaves when none remain.
  void countDown(int32_t local);
  void finish();
  /// After an error the transport could not withdraw from: the message buffers are never freed.
  void keepBuffersForever();

 private:
  void blockDone(int32_t local);
  ReshuffleContext ctx_;
  std::vector<Field> fields_;
  int tagBase_;
  std::vector<int64_t> remaining_;
  std::vector<std::vector<std::byte>> sendBufs_;
  std::vector<RequestId> requests_;
  struct Incoming {
    int peer;
    int32_t block;
    std::vector<std::byte> buffer;
    RequestId request;
  };
  std::vector<Incoming> incoming_;
};

}  // namespace fcp::runtime::detail
