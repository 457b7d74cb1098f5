// Dense allreduce among ranks that can read each other's memory (ffi/transport/ucx_world.h,
// "Shared memory"): ranks of one process (plain loads) and processes of one host
// (process_vm_readv). Nothing goes through UCX: buffer addresses and completion notices go
// through the notice slots the ranks share (ffi/transport/ucx_world.h, "Notices"), which keep
// the transport's deadlines and dead-peer detection. Three notice rounds per allreduce: "here
// are my buffers", "my slice is final", "I am done reading yours".
//
// Reduce-scatter: rank r owns slice r (ring::ChunkBegin) and sums it over every rank's input, in
// rank order and in L2-sized blocks: one read of each input, one write of the output, reduction
// fused with the read (no receive buffer, no second pass). Allgather: rank r copies slice q
// from rank q's output, one copy. Every element is summed once, by its owner, in one fixed
// order, so every rank ends with bit-identical sums.
//
// Memory a peer reads stays valid and unchanged while it reads: a rank overwrites slice q of
// its own buffer only after rank q said it finished reducing slice q, and returns only after
// every peer said it finished copying. So `out` may alias `x`.
#pragma once

#include <cstdint>

#include "ffi/group.h"
#include "ffi/ring_schedule.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {

// Peers' buffer addresses, kept between the phases of one call.
struct DirectPeers {
  std::vector<uint64_t> inputs;   // each rank's x
  std::vector<uint64_t> outputs;  // each rank's out
};

// out[slice rank] = sum over group ranks q (in order) of x_q[slice rank]. `step` is the next
// free tag step of `group` (advanced). Other slices of `out` are left untouched.
ffi::Error DirectReduceScatter(Group& group, const float* x, float* out, int64_t n,
                               DirectPeers* peers, uint32_t* step);

// Every rank copies slice q of rank q's `out` into its own, then waits until every peer is done
// with its buffers.
ffi::Error DirectAllgather(Group& group, float* out, int64_t n, DirectPeers* peers, uint32_t* step);

// Group rank `root`'s out[0, n) to every rank's out; root waits until every copy is done.
ffi::Error DirectBroadcast(Group& group, int root, float* out, int64_t n, uint32_t* step);

// Reduce-scatter then allgather: out = sum over the group of x (out may alias x).
ffi::Error DirectAllreduce(Group& group, const float* x, float* out, int64_t n);

}  // namespace jaxcomm::collectives
