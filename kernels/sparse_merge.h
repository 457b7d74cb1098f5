// The ⊤ operator of gTop-k (Shi et al. 2019, Definition 1): sum two sparse vectors and keep
// the k entries of largest magnitude. gTop-k applies it once per tree round, so it is linear
// in the input sizes and can run on caller-owned scratch without allocating.
#pragma once

#include <cstdint>
#include <string>

namespace jaxcomm::kernels {

// Why a merge was refused. Input errors name the input ('a' or 'b') and the first offending
// position, so a caller can point at the broken buffer instead of a generic failure.
struct SparseMergeStatus {
  enum class Code {
    kOk,
    kNegativeIndex,    // idx[position] < 0
    kNotAscending,     // idx[position] <= idx[position - 1] (unsorted or duplicate)
    kBadK,             // k outside [1, max(ka, kb)]
    kScratchTooSmall,  // scratch.capacity < ka + kb
  };
  Code code = Code::kOk;
  char input = 0;         // 'a' or 'b' for input errors, 0 otherwise
  int64_t position = -1;  // offending position in that input, -1 otherwise

  std::string message;  // what is wrong and with which values; empty when ok

  bool ok() const { return code == Code::kOk; }
};

// Caller-owned working memory for SparseMergeTopK: three arrays of `capacity` elements each
// (the union of the inputs and the selection keys). capacity >= ka + kb is required; size it
// once for the largest round and reuse it.
struct SparseMergeScratch {
  int32_t* indices = nullptr;
  float* values = nullptr;
  uint32_t* keys = nullptr;
  int64_t capacity = 0;
};

// Number of elements each scratch array needs for inputs of ka and kb entries.
inline int64_t SparseMergeScratchElements(int64_t ka, int64_t kb) { return ka + kb; }

// out = top-k by |value| of (a + b), where a = (idx_a[ka], val_a[ka]) and b = (idx_b[kb],
// val_b[kb]) are sparse vectors with strictly ascending non-negative indices and values at
// a shared index are summed (val_a + val_b).
//
// Exactly k entries are written to out_idx/out_val, in ascending index order. Ties in |sum|
// break toward the lower index, and magnitudes are ordered by MagnitudeKey (kernels/topk.h),
// so NaN > Inf > finite exactly as in TopKAbs. Entries whose sum cancels to 0 are ordinary
// entries of magnitude 0: they are selected only when fewer than k entries are non-zero.
//
// Valid iff 1 <= k <= max(ka, kb) (then the union always has >= k entries). Inputs are
// validated before anything is written to out_*, and are read completely into scratch before
// the first output write, so out_idx/out_val may alias idx_a/val_a or idx_b/val_b (an
// in-place tree round). O(ka + kb) expected time.
SparseMergeStatus SparseMergeTopK(const int32_t* idx_a, const float* val_a, int64_t ka,
                                  const int32_t* idx_b, const float* val_b, int64_t kb, int64_t k,
                                  int32_t* out_idx, float* out_val,
                                  const SparseMergeScratch& scratch);

// Same, allocating its scratch for this call only (for tests and one-off callers).
SparseMergeStatus SparseMergeTopK(const int32_t* idx_a, const float* val_a, int64_t ka,
                                  const int32_t* idx_b, const float* val_b, int64_t kb, int64_t k,
                                  int32_t* out_idx, float* out_val);

}  // namespace jaxcomm::kernels
