// Dense allreduce among ranks that can read each other's memory (ffi/transport/shm.h):
// ranks of one process (plain loads) and processes of one host
// (process_vm_readv). Nothing goes through UCX: buffer addresses and completion notices go
// through the notice slots the ranks share (ffi/transport/shm.h, "Notices"), which keep
// the transport's deadlines and dead-peer detection. Three notice rounds per allreduce: "here
// are my buffers", "my slice is final", "I am done reading yours".
//
// Staged: when a member lives in another process and the vector fits a staging area
// (ffi/transport/shm.h, "Staging areas"), each rank first copies its x (but slice r) into
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
//
// Element types: float32, and the 16-bit formats of ffi/allreduce_half.cc (bfloat16, float16:
// 2 bytes per element read and staged, sums in float32 rounded once). Only the reduction of a
// block differs; waiting, staging and the allgather's copies are the same code over T.
#pragma once

#include <cstdint>

#include "ffi/group.h"
#include "ffi/ring_schedule.h"
#include "kernels/half.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {

// out[slice rank] = sum over group ranks q (in order) of x_q[slice rank]. `step` is the next
// free tag step of `group` (advanced by one: the "here are my buffers" notice). Other slices
// of `out` are left untouched. A rank reads rank q's input as soon as q's notice is there.
ffi::Error DirectReduceScatter(Group& group, const float* x, float* out, int64_t n, uint32_t* step);

// Every rank copies slice q of rank q's `out` into its own, each as soon as q says it is final
// (the addresses are those of the DirectReduceScatter before it), then waits until every peer
// is done with its buffers. `rewritten`: this rank's slice of out changed since the
// reduce-scatter (the multi-leader hierarchical allreduce's inter-node phase); staged, peers
// read the slice from the staging area, so it is staged again first.
ffi::Error DirectAllgather(Group& group, float* out, int64_t n, uint32_t* step,
                           bool rewritten = false);

// Group rank `root`'s out[0, n) to every rank's out; root waits until every copy is done.
// Staged (a member in another process, n fits): the root copies out into its staging area of
// this call, so no direct collective of `group` earlier in the call may still be read from
// it (DirectAllgather's closing round guarantees that).
ffi::Error DirectBroadcast(Group& group, int root, float* out, int64_t n, uint32_t* step);

// Reduce-scatter then allgather: out = sum over the group of x (out may alias x).
ffi::Error DirectAllreduce(Group& group, const float* x, float* out, int64_t n);

// The same sum for small vectors, in two notice rounds instead of three: every rank reads
// every input (staged, as above, when the group spans processes) and sums all n elements in
// rank order itself, so every rank computes the same bits; then it waits until no peer reads
// its x any more. Reads (P - 1)·n floats per rank instead of 2(P - 1)/P·n, which pays only
// for latency-bound vectors (ffi/allreduce.h, SmallAllreduceBytes). out may alias x.
ffi::Error DirectAllreduceOneShot(Group& group, const float* x, float* out, int64_t n);

// The same for 16-bit words of `format`: rank r widens slice r of every rank's x, sums it in
// float32 in rank order starting from 0 and rounds the sum once (round to nearest even), the
// numerics of HalfAllreduce over UCX (ffi/allreduce_half.cc), so both paths give the same bits.
// out may alias x.
ffi::Error DirectHalfAllreduce(Group& group, kernels::HalfFormat format, const uint16_t* x,
                               uint16_t* out, int64_t n);

}  // namespace jaxcomm::collectives
