// The message schedule of gTop-k (Shi et al. 2019, Alg. 3) for any number of ranks, shared by
// the CPU handler (ffi/gtopk.cc, over UCX) and the GPU handler (ffi/cuda/gtopk.cc, over NCCL),
// so the CPU tests exercise the schedule the GPU runs. Pure C++, no transport.
//
// For P ranks and p2 = the largest power of two <= P:
//   1. fold: ranks >= p2 send their set to rank - p2, which merges it;
//   2. a binomial tree of ⊤ merges among ranks [0, p2) to rank 0 (distance 1, 2, 4, ...);
//   3. rank 0's global set is broadcast down the same tree (distance p2/2, ..., 1);
//   4. unfold: ranks [0, P - p2) send the global set back to rank + p2.
// Every operation of step `tag` pairs with one of the same tag at the peer, and each rank runs at
// most one operation per tag, in tag order: no cycle of waits, even with rendezvous sends.
#pragma once

#include <cstdint>
#include <vector>

namespace jaxcomm::collectives::gtopk {

enum class Op {
  kSend,          // send the current set to `peer`
  kReceiveMerge,  // receive a set from `peer`; current = ⊤(current, received)
  kReceiveExact,  // receive the global set from `peer`; current = received
};

struct Step {
  Op op;
  int peer;      // group rank
  uint32_t tag;  // step number, equal at both ends of a message (the CPU's message tag)
};

// The operations of group rank `rank` of `parts`, in order. Empty for parts == 1.
inline std::vector<Step> Schedule(int rank, int parts) {
  std::vector<Step> steps;
  int p2 = 1;
  while (p2 * 2 <= parts) p2 *= 2;
  const int extra = parts - p2;
  uint32_t tag = 0;

  // Fold: ranks >= p2 hand their set to rank - p2.
  if (rank >= p2) {
    steps.push_back({Op::kSend, rank - p2, tag});
  } else if (rank < extra) {
    steps.push_back({Op::kReceiveMerge, rank + p2, tag});
  }
  ++tag;

  // Binomial tree to rank 0 among the first p2 ranks.
  bool sent_up = rank >= p2;
  for (int d = 1; d < p2; d *= 2, ++tag) {
    if (sent_up) continue;
    if (rank % (2 * d) == d) {
      steps.push_back({Op::kSend, rank - d, tag});
      sent_up = true;
    } else if (rank % (2 * d) == 0) {
      steps.push_back({Op::kReceiveMerge, rank + d, tag});
    }
  }

  // Broadcast the global set from rank 0 down the same tree, then to the folded ranks.
  for (int d = p2 / 2; d >= 1; d /= 2, ++tag) {
    if (rank >= p2) continue;
    if (rank % (2 * d) == 0) {
      steps.push_back({Op::kSend, rank + d, tag});
    } else if (rank % (2 * d) == d) {
      steps.push_back({Op::kReceiveExact, rank - d, tag});
    }
  }
  if (rank < extra) {
    steps.push_back({Op::kSend, rank + p2, tag});
  } else if (rank >= p2) {
    steps.push_back({Op::kReceiveExact, rank - p2, tag});
  }
  return steps;
}

// Number of kReceiveMerge steps in `steps` (the merge buffers a rank needs).
inline int CountMerges(const std::vector<Step>& steps) {
  int merges = 0;
  for (const Step& s : steps) merges += s.op == Op::kReceiveMerge ? 1 : 0;
  return merges;
}

}  // namespace jaxcomm::collectives::gtopk
