/*
 * carver.h: lay out several arrays in one workspace (lib_api gives one scratch buffer per call).
 * With base == nullptr take() only measures, so the same code computes the workspace size and,
 * given the buffer, the pointers: the two can never disagree.
 */
#pragma once
#include <cstddef>

namespace gn_mx {

template <size_t Align>
struct WorkspaceCarver {
  char* base = nullptr;
  size_t off = 0;
  template <typename U>
  U* take(size_t n) {
    off = (off + Align - 1) / Align * Align;
    U* p = base ? reinterpret_cast<U*>(base + off) : nullptr;
    off += n * sizeof(U);
    return p;
  }
};

}  // namespace gn_mx
