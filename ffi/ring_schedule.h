// The ring schedule, shared by every ring of jaxcomm so that they cut and route the data alike:
// the dense allreduce (ffi/allreduce.cc), the intra-node phases of the hierarchical allreduce
// on the CPU (ffi/quantized_allreduce.cc) and on the GPU (ffi/cuda/quantized_allreduce.cc, whose
// NCCL collectives keep the CPU's chunk ownership), the ring allgather of the quantized
// allreduce (ffi/quantized_schedule.h), and the bytes the metrics report for a dense ring
// (jaxcomm/cost/algorithm_costs/dense.py ring_bytes is its Python twin). Pure C++, no transport.
//
// n elements are cut into P even chunks, the first n % P of them one element longer. Rank r
// sends to its right neighbour r + 1 and receives from its left neighbour r - 1 (mod P). A ring
// pass is P - 1 steps in which every rank forwards what it received at the step before:
//   reduce-scatter: rank r first sends chunk r and adds each received chunk into its own copy;
//     afterwards it holds the full sum of chunk r + 1 (OwnedChunk);
//   allgather: rank r first sends the chunk it owns and keeps each received chunk.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace jaxcomm::collectives::ring {

// First element of chunk `chunk` (0 <= chunk <= parts; chunk == parts gives n).
inline int64_t ChunkBegin(int64_t n, int parts, int chunk) {
  return chunk * (n / parts) + std::min<int64_t>(chunk, n % parts);
}

// Elements of chunk `chunk` (0 <= chunk < parts).
inline int64_t ChunkSize(int64_t n, int parts, int chunk) {
  return ChunkBegin(n, parts, chunk + 1) - ChunkBegin(n, parts, chunk);
}

inline int RightOf(int rank, int parts) { return (rank + 1) % parts; }
inline int LeftOf(int rank, int parts) { return (rank + parts - 1) % parts; }

// The chunk rank `rank` holds the full sum of after the reduce-scatter.
inline int OwnedChunk(int rank, int parts) { return (rank + 1) % parts; }

// The chunks of step `step` (0 <= step < parts - 1) of a ring pass.
struct Step {
  int send_chunk;  // to the right neighbour
  int recv_chunk;  // from the left neighbour
};

// Step `step` of a ring pass in which this rank first sends chunk `first`: it sends what it
// received at step - 1.
inline Step PassStep(int first, int parts, int step) {
  return {(first - step + parts) % parts, (first - step - 1 + parts) % parts};
}

inline Step ReduceScatterStep(int rank, int parts, int step) { return PassStep(rank, parts, step); }

inline Step AllgatherStep(int rank, int parts, int step) {
  return PassStep(OwnedChunk(rank, parts), parts, step);
}

// Bytes rank `rank` sends in a dense ring allreduce of n elements of `element_bytes` each:
// every chunk but its owned one in the reduce-scatter, every chunk but the one its right
// neighbour owns in the allgather; about 2 (P - 1) / P of the vector. It receives what its
// left neighbour sends: DenseRingBytes(n, parts, LeftOf(rank, parts)).
inline uint64_t DenseRingBytes(int64_t n, int parts, int rank,
                               size_t element_bytes = sizeof(float)) {
  if (parts == 1) return 0;
  const int64_t skipped = ChunkSize(n, parts, OwnedChunk(rank, parts)) +
                          ChunkSize(n, parts, OwnedChunk(RightOf(rank, parts), parts));
  return element_bytes * static_cast<uint64_t>(2 * n - skipped);
}

}  // namespace jaxcomm::collectives::ring
