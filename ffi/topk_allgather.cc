// TopKAllReduce (the O(kP) baseline of Shi et al.): local top-k with error feedback, ring
// allgather of every rank's (indices, values), then a dense sum in rank order so all ranks
// end bit-identical.
#include <cstring>
#include <string>
#include <vector>

#include "ffi/collective_handler.h"
#include "ffi/common.h"
#include "ffi/engine.h"
#include "ffi/group.h"
#include "ffi/ring_schedule.h"
#include "kernels/reduce.h"
#include "kernels/topk.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {
namespace {

constexpr char kOp[] = "jaxcomm.compressed_allreduce(TopKAllgather)";

ffi::Error TopKAllgatherImpl(const kernels::TaskRunner& run, const Caller& caller, int64_t k,
                             ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual,
                             ffi::ResultBuffer<ffi::F32> summed,
                             ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  std::unique_ptr<Group> group;
  JAXCOMM_RETURN_IF_ERROR(BeginSparseCollective(MakeCallSite(kOp, caller), k, x, residual, summed,
                                                new_residual, &group));
  const int parts = group->size();
  const int rank = group->rank();
  // slots[q] = [k indices][k values] of group rank q
  const int64_t slot_words = 2 * k;
  thread_local std::vector<uint32_t> slots;
  slots.resize(static_cast<size_t>(slot_words * parts));
  uint32_t* mine = slots.data() + slot_words * rank;
  kernels::TopKAbs(x.typed_data(), residual.typed_data(), n, k, reinterpret_cast<int32_t*>(mine),
                   reinterpret_cast<float*>(mine + k), new_residual->typed_data(), run);

  // Ring allgather in which rank r starts with its own slot.
  const int right = ring::RightOf(rank, parts);
  const int left = ring::LeftOf(rank, parts);
  const size_t slot_bytes = sizeof(uint32_t) * slot_words;
  for (int s = 0; s < parts - 1; ++s) {
    const auto [send_slot, recv_slot] = ring::PassStep(rank, parts, s);
    size_t got = 0;
    JAXCOMM_RETURN_IF_ERROR(group->SendRecv(right, slots.data() + slot_words * send_slot,
                                            slot_bytes, left, slots.data() + slot_words * recv_slot,
                                            slot_bytes, &got, static_cast<uint32_t>(s)));
    if (got != slot_bytes) {
      return ffi_common::InvalidArgument(
          kOp, "a peer sent " + std::to_string(got) + " bytes instead of " +
                   std::to_string(slot_bytes) +
                   "; every rank must pass the same shape and density");
    }
  }

  float* out = summed->typed_data();
  std::memset(out, 0, sizeof(float) * n);
  for (int q = 0; q < parts; ++q) {
    const uint32_t* slot = slots.data() + slot_words * q;
    const auto* indices = reinterpret_cast<const int32_t*>(slot);
    for (int64_t j = 0; j < k; ++j) {
      if (indices[j] < 0 || indices[j] >= n) {
        return ffi_common::InvalidArgument(
            kOp, "received an index out of range from rank " + std::to_string(q));
      }
    }
    kernels::ScatterAdd(out, indices, reinterpret_cast<const float*>(slot + k), k);
  }
  group->Finish("topk_allgather", n);
  return ffi::Error::Success();
}

}  // namespace

JAXCOMM_DEFINE_COLLECTIVE("jaxcomm_topk_allgather", TopKAllgatherImpl, BindSparseCollective);

}  // namespace jaxcomm::collectives
