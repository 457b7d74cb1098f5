// The dense allreduce over a group (ffi/allreduce.cc): the algorithm of the jaxcomm_allreduce
// target, and the inter-node phase of the dense hierarchical allreduce
// (ffi/quantized_allreduce.cc).
//
// Which schedule runs depends on where the ranks are and on the vector's size (DenseAllreduce):
//
//   | ranks share memory | bytes        | schedule (metrics label)                            |
//   |--------------------|--------------|-----------------------------------------------------|
//   | no (a transport)   | <= threshold | recursive doubling (dense_doubling)                 |
//   | no                 | larger       | pipelined ring (dense)                              |
//   | yes (one host)     | <= threshold | one-shot direct (dense_direct_oneshot)              |
//   | yes                | larger       | direct reduce-scatter + allgather (dense_direct)    |
//
// threshold: SmallAllreduceBytes().
//
// Small vectors are latency-bound: the ring takes 2(P-1) message steps and the direct
// reduce-scatter + allgather three notice rounds, where recursive doubling takes
// ceil(log2 P) (+2 when P is not a power of two) and the one-shot two. They move more bytes
// (log2(P)·n and (P-1)·n per rank instead of 2(P-1)/P·n), which only pays below a size:
// SmallAllreduceBytes(), measured with benchmarks/small_allreduce.py.
// jaxcomm/cost/algorithm_costs/dense.py reads the same setting through jaxcomm.config
// (tests/test_cost.py compares it with jaxcomm_allreduce_small_bytes).
#pragma once

#include <cstddef>
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

// Vectors of at most this many bytes take the small-vector schedules (see the table above):
// env JAXCOMM_SMALL_ALLREDUCE_BYTES (ffi/transport/settings.h, kSmallAllreduceBytes; 0 turns
// them off). Read once per process.
size_t SmallAllreduceBytes();

// Recursive doubling: ceil(log2 P) exchanges of the whole vector with partner rank ^ 2^s,
// each followed by data = data + received. Float addition commutes, so both partners compute
// the same bits and every rank ends bit-identical. When P is not a power of two, the first
// 2(P - p2) ranks pair up (p2: the largest power of two <= P): the even one hands its x to the
// odd one, which adds (in rank order) and stands for both, and gets the result at the end.
// Same contract as RingAllreduce.
ffi::Error DoublingAllreduce(Group& group, const float* x, float* data, int64_t n,
                             std::vector<float>* scratch);

// The schedule of the table above for `group` and n floats; `algorithm` (optional) gets its
// metrics label. Same contract as RingAllreduce.
ffi::Error DenseAllreduce(Group& group, const float* x, float* data, int64_t n,
                          std::vector<float>* scratch, const char** algorithm = nullptr);

}  // namespace jaxcomm::collectives
