#pragma once
// Private to the plan module: large arrays backed by transparent huge pages where the kernel
// offers them on request.
//
// A large plan touches about 85 MB of fresh memory (4096 workers x 32K tokens), and in a
// fresh process each 4 KiB page costs a fault on first touch: about 28K faults, a fifth of the
// planning time. Asking for huge pages (madvise MADV_HUGEPAGE, honoured when
// /sys/kernel/mm/transparent_hugepage/enabled is "madvise" or "always") makes that one fault
// per 2 MiB. The advice changes no value, only how the memory is mapped; where it is not
// available it is skipped.

#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace fcp::plan::detail {

/// Arrays smaller than this are left alone: they hold no whole huge page.
inline constexpr size_t kHugePageAdviceBytes = size_t{2} << 20;

/// Advises huge pages for the 4 KiB pages that [data, data + bytes) touches. The kernel backs
/// with a huge page each 2 MiB-aligned range wholly inside advised memory: malloc serves
/// arrays this large with their own mapping, which Linux aligns to 2 MiB, and the array starts
/// a few bytes after it (malloc's header), so the range is widened to whole 4 KiB pages
/// rather than narrowed to whole huge pages (which would leave out the first one).
inline void adviseHugePages(const void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < kHugePageAdviceBytes) return;
  constexpr uintptr_t kPage = 4096;
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = begin & ~(kPage - 1);
  const uintptr_t last = (begin + bytes + kPage - 1) & ~(kPage - 1);
  // Best effort: a failure (an old kernel, THP off) leaves ordinary pages.
  (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

/// v.reserve(count), with huge pages advised for the new storage before it is first touched.
template <typename T>
void reserveHuge(std::vector<T>& v, size_t count) {
  v.reserve(count);
  adviseHugePages(v.data(), v.capacity() * sizeof(T));
}

/// v.resize(count) for a vector that is empty: huge pages are advised before the elements
/// are written.
template <typename T>
void resizeHuge(std::vector<T>& v, size_t count) {
  reserveHuge(v, count);
  v.resize(count);
}

}  // namespace fcp::plan::detail
