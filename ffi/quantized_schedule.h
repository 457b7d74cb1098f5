// The schedule of the quantized allreduce (Dryden et al. 2016, §3.4), shared by the CPU handler
// (ffi/quantized_allreduce.cc, over UCX) and the GPU handler (ffi/cuda/quantized_allreduce.cc,
// over NCCL), so the CPU tests exercise the slices, peers and order the GPU runs. Pure C++, no
// transport.
//
// Quantized allreduce of acc = x + residual over P ranks, for one-bit, threshold and adaptive
// quantization (kernels/quantized_slices.h):
//   1. The vector is cut into P slices whose boundaries are multiples of the compressor's
//      column size (kernels::SliceRange), so no column straddles two slices; rank s owns slice s.
//      Every slice's quantized form has a fixed place in a buffer of all P (SliceLayout).
//   2. Every rank quantizes every slice of acc with error feedback (residual = acc - decoded).
//   3. Reduce-scatter by pairwise exchange: at exchange k = 1 .. P-1 rank r sends its quantized
//      slice r+k to its owner and receives the quantized slice r from rank r-k (Exchange). A
//      quantized slice cannot be summed in transit (a ring would requantize at every hop), so
//      each message goes straight to its owner: the same (P-1)/P of the data a ring sends.
//   4. The owner dequantizes the P contributions in rank order into a float sum, requantizes the
//      sum with the same compressor and adds that requantization error to its own residual.
//   5. Allgather of the quantized sums: a ring pass in which rank r starts with slice r
//      (ring::PassStep, CPU), or every owner sending to every other rank with the peers of step
//      3 (GPU: NCCL takes counts on the host, and the slices differ in length).
//   6. Every rank decodes the same P messages in rank order: bit-identical results everywhere.
// Conservation: sum_ranks(x + residual_in) == result + sum_ranks(residual_out) up to rounding.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/quantized_slices.h"

namespace jaxcomm::collectives::quantized {

// Step 1: the P slices of n elements and where the quantized form of each sits (in words) in a
// buffer holding all P, each at its capacity kernels::QuantizedPackedWords.
struct SliceLayout {
  std::vector<kernels::Range> slices;  // elements of slice q
  std::vector<int64_t> offsets;        // P + 1 word offsets: slice q at offsets[q]

  // Lays out n elements over `parts` slices (reusing the vectors' memory).
  void Assign(const kernels::QuantizerSpec& spec, int64_t n, int parts) {
    const int64_t unit = kernels::SliceUnit(spec);
    slices.resize(parts);
    offsets.assign(parts + 1, 0);
    for (int q = 0; q < parts; ++q) {
      slices[q] = kernels::SliceRange(n, parts, q, unit);
      offsets[q + 1] = offsets[q] + kernels::QuantizedPackedWords(spec, Length(q));
    }
  }
  int64_t Begin(int q) const { return slices[q].begin; }
  int64_t Length(int q) const { return slices[q].end - slices[q].begin; }
  int64_t Words(int q) const { return offsets[q + 1] - offsets[q]; }
  int64_t TotalWords() const { return offsets.back(); }
};

// The peers of exchange k (1 <= k < parts) of step 3 (and of the GPU's step 5).
struct Exchange {
  int to;    // receives this rank's quantization of slice `to` (step 5: of this rank's slice)
  int from;  // sends its quantization of this rank's slice (step 5: of slice `from`)
};

inline Exchange PairwiseExchange(int rank, int parts, int k) {
  return {(rank + k) % parts, (rank - k + parts) % parts};
}

}  // namespace jaxcomm::collectives::quantized
