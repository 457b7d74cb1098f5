// The gTop-k schedule (ffi/gtopk_schedule.h) driven over a Group's transport, written once for
// both handlers: the CPU's (ffi/gtopk.cc: host sets over UCX, kernels/sparse_merge.h) and the
// GPU's (ffi/cuda/gtopk.cc: device sets over NCCL, kernels/cuda_kernels.h). The messages go
// through Group::Send and Group::Recv, so the group's transport (ffi/transport/transport.h)
// decides how they move; the handler plugs in where its sets live and how it merges:
//
//   struct Sets {
//     const void* current();           // this rank's set so far (local, merged, then global)
//     void* merge_input(int merge);    // where the merge-th receive-and-merge receives
//     ffi::Error Merge(int merge, int from);  // current = ⊤(current, merge_input(merge)),
//                                             // keeping what the merge dropped
//     void* global();                  // where the broadcast global set is received
//     void TakeGlobal();               // current = global()
//   };
//
// Every message is one set of `set_bytes`; a shorter one fails naming its sender.
#pragma once

#include <cstddef>
#include <string>

#include "ffi/common.h"
#include "ffi/group.h"
#include "ffi/gtopk_schedule.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives::gtopk {

// Receives one whole set of `set_bytes` from group rank `from` at step `tag` into `into`.
inline ffi::Error ReceiveSet(const char* op, Group& group, int from, uint32_t tag, void* into,
                             size_t set_bytes) {
  size_t got = 0;
  JAXCOMM_RETURN_IF_ERROR(group.Recv(from, into, set_bytes, &got, tag));
  if (got != set_bytes) {
    return ffi_common::InvalidArgument(op, "group rank " + std::to_string(from) + " sent " +
                                               std::to_string(got) + " bytes instead of " +
                                               std::to_string(set_bytes) +
                                               "; every rank must pass the same shape and density");
  }
  return ffi::Error::Success();
}

// Runs this rank's steps of the schedule over `group` (see the file comment for `sets`).
template <typename Sets>
ffi::Error RunSchedule(const char* op, Group& group, size_t set_bytes, Sets& sets) {
  int merge = 0;
  for (const Step& step : Schedule(group.rank(), group.size())) {
    switch (step.op) {
      case Op::kSend:
        JAXCOMM_RETURN_IF_ERROR(group.Send(step.peer, sets.current(), set_bytes, step.tag));
        break;
      case Op::kReceiveMerge:
        JAXCOMM_RETURN_IF_ERROR(
            ReceiveSet(op, group, step.peer, step.tag, sets.merge_input(merge), set_bytes));
        JAXCOMM_RETURN_IF_ERROR(sets.Merge(merge++, step.peer));
        break;
      case Op::kReceiveExact:
        JAXCOMM_RETURN_IF_ERROR(
            ReceiveSet(op, group, step.peer, step.tag, sets.global(), set_bytes));
        sets.TakeGlobal();
        break;
    }
  }
  return ffi::Error::Success();
}

}  // namespace jaxcomm::collectives::gtopk
