// Helpers shared by every transport.
#include "fcp/runtime/transport.h"

namespace fcp::runtime {

void waitAll(Transport& transport, std::span<const RequestId> requests) {
  for (const RequestId id : requests) transport.wait(id);
}

}  // namespace fcp::runtime
