// Dense allreduce among ranks that can read each other's memory (ffi/transport/ucx_world.h,
// "Shared memory"): ranks of one process (plain loads) and processes of one host
// (process_vm_readv). Nothing goes through UCX: buffer addresses and completion notices go
// through the notice slots the ranks share (ffi/transport/ucx_world.h, "Notices"), which keep
// the transport's deadlines and dead-peer detection. Three notice rounds per allreduce: "here
// are my buffers", "my slice is final", "I am done reading yours".
//
// Staged: when a member lives in another process and the vector fits a staging area
// (ffi/transport/ucx_world.h, "Staging areas"), each rank first copies its x (but slice r) into
// its area and writes its reduced slice there too; peers then read those with plain loads
// instead of process_vm_readv, whose per-page pinning cost more than the extra copies.
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

// out[slice rank] = sum over group ranks q (in order) of x_q[slice rank]. `step` is the next
// free tag step of `group` (advanced by one: the "here are my buffers" notice). Other slices
// of `out` are left untouched. A rank reads rank q's input as soon as q's notice is there.
ffi::Error DirectReduceScatter(Group& group, const float* x, float* out, int64_t n, uint32_t* step);

// Every rank copies slice q of rank q's `out` into its own, each as soon as q says it is final
// (the addresses are those of the DirectReduceScatter before it), then waits until every peer
// is done with its buffers.
ffi::Error DirectAllgather(Group& group, float* out, int64_t n, uint32_t* step);

// Group rank `root`'s out[0, n) to every rank's out; root waits until every copy is done.
ffi::Error DirectBroadcast(Group& group, int root, float* out, int64_t n, uint32_t* step);

// Reduce-scatter then allgather: out = sum over the group of x (out may alias x).
ffi::Error DirectAllreduce(Group& group, const float* x, float* out, int64_t n);

// The same sum for small vectors, in two notice rounds instead of three: every rank reads
// every input (staged, as above, when the group spans processes) and sums all n elements in
// rank order itself, so every rank computes the same bits; then it waits until no peer reads
// its x any more. Reads (P - 1)·n floats per rank instead of 2(P - 1)/P·n, which pays only
// for latency-bound vectors (ffi/allreduce.h, kSmallAllreduceBytes). out may alias x.
ffi::Error DirectAllreduceOneShot(Group& group, const float* x, float* out, int64_t n);

}  // namespace jaxcomm::collectives
