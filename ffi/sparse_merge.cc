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
  const int64_t ka = NumElements(idx_a);
  const int64_t kb = NumElements(idx_b);
  const int64_t k = NumElements(*idx);
  JAXCOMM_RETURN_IF_ERROR(
      SparseMerge(ka, NumElements(val_a), kb, NumElements(val_b), k, NumElements(*val)));
  const kernels::SparseMergeStatus status =
      kernels::SparseMergeTopK(idx_a.typed_data(), val_a.typed_data(), ka, idx_b.typed_data(),
                               val_b.typed_data(), kb, k, idx->typed_data(), val->typed_data(),
                               ThreadScratch(kernels::SparseMergeScratchElements(ka, kb)));
  if (!status.ok()) return InvalidArgument(kSparseMergeOp, status.message);
  return ffi::Error::Success();
}

}  // namespace

JAXCOMM_DEFINE_HANDLER(JaxcommSparseMerge, SparseMergeImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()  // idx_a: ka, ascending
                           .Arg<ffi::Buffer<ffi::F32>>()  // val_a: ka
                           .Arg<ffi::Buffer<ffi::S32>>()  // idx_b: kb, ascending
                           .Arg<ffi::Buffer<ffi::F32>>()  // val_b: kb
                           .Ret<ffi::Buffer<ffi::S32>>()  // idx: k, ascending
                           .Ret<ffi::Buffer<ffi::F32>>()  // val: k, sums at idx
);

}  // namespace jaxcomm::compress_checks
