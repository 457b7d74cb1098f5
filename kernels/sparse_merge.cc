#include "kernels/sparse_merge.h"

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "kernels/topk.h"

namespace jaxcomm::kernels {
namespace {

using Code = SparseMergeStatus::Code;

SparseMergeStatus Fail(Code code, char input, int64_t position, std::string message) {
  SparseMergeStatus status;
  status.code = code;
  status.input = input;
  status.position = position;
  status.message = std::move(message);
  return status;
}

// Checks one input in a single branch-light pass; only the failing case builds a message.
SparseMergeStatus ValidateIndices(const int32_t* idx, int64_t n, char input) {
  const std::string name = std::string("idx_") + input;
  for (int64_t p = 0; p < n; ++p) {
    if (idx[p] < 0) {
      return Fail(Code::kNegativeIndex, input, p,
                  name + "[" + std::to_string(p) + "] = " + std::to_string(idx[p]) +
                      " is negative; sparse indices must be >= 0");
    }
    if (p > 0 && idx[p] <= idx[p - 1]) {
      return Fail(Code::kNotAscending, input, p,
                  name + " is not strictly ascending at position " + std::to_string(p) + " (" +
                      name + "[" + std::to_string(p - 1) + "] = " + std::to_string(idx[p - 1]) +
                      ", " + name + "[" + std::to_string(p) + "] = " + std::to_string(idx[p]) +
                      "); each input must hold distinct indices in ascending order, as "
                      "topk_abs returns them");
    }
  }
  return SparseMergeStatus();
}

// Appends a run of entries present in one input only.
inline int64_t CopyRun(const int32_t* idx, const float* val, int64_t begin, int64_t end,
                       const SparseMergeScratch& s, int64_t m) {
  for (int64_t p = begin; p < end; ++p, ++m) {
    s.indices[m] = idx[p];
    s.values[m] = val[p];
    s.keys[m] = MagnitudeKey(val[p]);
  }
  return m;
}

}  // namespace

SparseMergeStatus SparseMergeTopK(const int32_t* idx_a, const float* val_a, int64_t ka,
                                  const int32_t* idx_b, const float* val_b, int64_t kb, int64_t k,
                                  int32_t* out_idx, float* out_val,
                                  const SparseMergeScratch& scratch) {
  if (ka < 0 || kb < 0 || k < 1 || k > std::max(ka, kb)) {
    return Fail(Code::kBadK, 0, -1,
                "k = " + std::to_string(k) + " must be in [1, max(ka, kb)] = [1, " +
                    std::to_string(std::max<int64_t>(std::max(ka, kb), 0)) +
                    "] so that the union of the inputs always holds k entries");
  }
  const int64_t needed = SparseMergeScratchElements(ka, kb);
  if (scratch.capacity < needed) {
    return Fail(Code::kScratchTooSmall, 0, -1,
                "scratch holds " + std::to_string(scratch.capacity) +
                    " elements, needs ka + kb = " + std::to_string(needed));
  }
  if (SparseMergeStatus status = ValidateIndices(idx_a, ka, 'a'); !status.ok()) return status;
  if (SparseMergeStatus status = ValidateIndices(idx_b, kb, 'b'); !status.ok()) return status;

  // Linear two-pointer merge of the union into scratch, ascending by index; the magnitude key
  // of each sum is computed while the value is in a register.
  int64_t i = 0, j = 0, m = 0;
  while (i < ka && j < kb) {
    const int32_t ia = idx_a[i];
    const int32_t ib = idx_b[j];
    if (ia < ib) {
      scratch.indices[m] = ia;
      scratch.values[m] = val_a[i++];
    } else if (ib < ia) {
      scratch.indices[m] = ib;
      scratch.values[m] = val_b[j++];
    } else {
      scratch.indices[m] = ia;
      scratch.values[m] = val_a[i++] + val_b[j++];
    }
    scratch.keys[m] = MagnitudeKey(scratch.values[m]);
    ++m;
  }
  m = CopyRun(idx_a, val_a, i, ka, scratch, m);
  m = CopyRun(idx_b, val_b, j, kb, scratch, m);
  // m >= max(ka, kb) >= k: every index of the larger input is in the union.

  if (m == k) {  // nothing to drop (e.g. one input empty and k = the other's size)
    std::copy(scratch.indices, scratch.indices + m, out_idx);
    std::copy(scratch.values, scratch.values + m, out_val);
    return SparseMergeStatus();
  }

  // The k-th largest key; afterwards keys[0, k) hold the k largest, so the number of entries
  // strictly above it is counted there instead of in another pass over all m.
  std::nth_element(scratch.keys, scratch.keys + (k - 1), scratch.keys + m,
                   std::greater<uint32_t>());
  const uint32_t kth = scratch.keys[k - 1];
  const int64_t above =
      std::count_if(scratch.keys, scratch.keys + k, [kth](uint32_t key) { return key > kth; });
  // Entries equal to kth are taken in ascending index order (the scratch's order) until k
  // are chosen: the tie-break toward the lower index.
  int64_t ties_left = k - above;

  int64_t out = 0;
  for (int64_t t = 0; t < m && out < k; ++t) {
    const uint32_t key = MagnitudeKey(scratch.values[t]);
    if (key > kth || (key == kth && ties_left > 0)) {
      ties_left -= key == kth;
      out_idx[out] = scratch.indices[t];
      out_val[out] = scratch.values[t];
      ++out;
    }
  }
  return SparseMergeStatus();
}

SparseMergeStatus SparseMergeTopK(const int32_t* idx_a, const float* val_a, int64_t ka,
                                  const int32_t* idx_b, const float* val_b, int64_t kb, int64_t k,
                                  int32_t* out_idx, float* out_val) {
  const int64_t n = std::max<int64_t>(SparseMergeScratchElements(ka, kb), 0);
  std::vector<int32_t> indices(n);
  std::vector<float> values(n);
  std::vector<uint32_t> keys(n);
  SparseMergeScratch scratch{indices.data(), values.data(), keys.data(), n};
  return SparseMergeTopK(idx_a, val_a, ka, idx_b, val_b, kb, k, out_idx, out_val, scratch);
}

}  // namespace jaxcomm::kernels
