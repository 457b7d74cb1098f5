// XLA FFI handler for the ⊤ merge of gTop-k: (idx_a, val_a) ⊤ (idx_b, val_b) -> top-k of the
// sum. k is not an attribute: it is the length of the output buffers the caller asked for.
#include "kernels/sparse_merge.h"

#include <string>
#include <vector>

#include "ffi/common.h"
#include "ffi/compress_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::compress_checks {
namespace {

// Scratch reused by every call on the same thread: a jitted training step calls the merge
// every round, and keeping the buffers avoids an allocation of (ka + kb) * 12 bytes per call.
// It only grows, up to the largest merge seen on that thread.
kernels::SparseMergeScratch ThreadScratch(int64_t elements) {
  thread_local std::vector<int32_t> indices;
  thread_local std::vector<float> values;
  thread_local std::vector<uint32_t> keys;
  if (static_cast<int64_t>(indices.size()) < elements) {
    indices.resize(elements);
    values.resize(elements);
    keys.resize(elements);
  }
  return {indices.data(), values.data(), keys.data(), static_cast<int64_t>(indices.size())};
}

ffi::Error SparseMergeImpl(ffi::Buffer<ffi::S32> idx_a, ffi::Buffer<ffi::F32> val_a,
                           ffi::Buffer<ffi::S32> idx_b, ffi::Buffer<ffi::F32> val_b,
                           ffi::ResultBuffer<ffi::S32> idx, ffi::ResultBuffer<ffi::F32> val) {
  SparseMergeSizes size;
  JAXCOMM_RETURN_IF_ERROR(CheckSparseMerge(idx_a, val_a, idx_b, val_b, idx, val, &size));
  const kernels::SparseMergeStatus status = kernels::SparseMergeTopK(
      idx_a.typed_data(), val_a.typed_data(), size.ka, idx_b.typed_data(), val_b.typed_data(),
      size.kb, size.k, idx->typed_data(), val->typed_data(),
      ThreadScratch(kernels::SparseMergeScratchElements(size.ka, size.kb)));
  if (!status.ok()) return InvalidArgument(kSparseMergeOp, status.message);
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_sparse_merge", SparseMergeImpl, BindSparseMerge(ffi::Ffi::Bind()));

}  // namespace
}  // namespace jaxcomm::compress_checks
