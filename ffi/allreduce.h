// The dense ring allreduce over a group (ffi/allreduce.cc): the algorithm of the
// jaxcomm_allreduce target, and the inter-node phase of the dense hierarchical allreduce
// (ffi/quantized_allreduce.cc).
#pragma once

#include <cstdint>
#include <vector>

#include "ffi/group.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {

// Allreduce (sum) of x[0, n) across `group` into data[0, n), with the chunks and steps of
// ffi/ring_schedule.h. `data` may be `x` (in place); otherwise the two must not overlap. Every
// rank ends with bit-identical sums: each chunk is reduced in one fixed order, then copied
// around the ring. `scratch` is a reusable receive buffer (resized as needed). Returns the
// first transport error, or an InvalidArgument naming the rank that sent a message of the
// wrong size.
//
// Example (inside a handler, after Group::Begin):
//   thread_local std::vector<float> scratch;
//   JAXCOMM_RETURN_IF_ERROR(RingAllreduce(*group, x, out, n, &scratch));
ffi::Error RingAllreduce(Group& group, const float* x, float* data, int64_t n,
                         std::vector<float>* scratch);

}  // namespace jaxcomm::collectives
