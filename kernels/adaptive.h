// Adaptive quantization (Dryden et al. 2016, §3.3) with fused error feedback.
//
// Semantics and the packed layout are defined by the docstrings of jaxcomm/ops/compress.py
// (module docstring) and jaxcomm/algorithms/adaptive.py (class Adaptive); every count
// computed here must agree with that Python code exactly, because XLA sizes the packed
// buffer from it.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/parallel.h"
#include "kernels/quantized_slices.h"

namespace jaxcomm::kernels {

// ceil(count / proportion) in double precision, the same expression Python evaluates, so both
// sides agree on every count even for proportions that are not integers.
int64_t AdaptiveKeep(int64_t count, double proportion);

// How many values of one sign a column sends: min(count, ceil((count + zeros) / proportion)).
// Dryden et al. §3.3 take k as the number of *non-negative* updates and send the largest k/π;
// mirrored for the negative sign, zeros count toward both signs' k, and since a zero carries
// nothing it is never sent (hence the cap at `count`). On a dense gradient this is ceil(count/π);
// it matters for the sparse sum that the owner requantizes in the allreduce (§3.4): counting
// only the nonzeros there kept 1/π of a sum that was already ~P/π sparse, so the owners'
// residuals absorbed almost every contribution and grew until training diverged.
int64_t AdaptiveSignKeep(int64_t count, int64_t zeros, double proportion);

// How n elements split into columns and how many words their packed form takes.
// Requires n >= 1, column_size >= 1, proportion >= 1 (the caller validates).
struct AdaptiveLayout {
  int64_t n;
  int64_t column_size;
  double proportion;

  // Written so that no column_size up to INT64_MAX can overflow.
  int64_t NumColumns() const { return (n - 1) / column_size + 1; }
  int64_t ColumnBegin(int64_t column) const { return column * column_size; }
  int64_t ColumnLength(int64_t column) const;
  // min(L, 2 * ceil(L / proportion) + 2): exact mode never exceeds it; sampled mode is cut
  // to it so that the buffer size stays static.
  int64_t ColumnCapacity(int64_t column) const;
  int64_t Capacity() const;
  // 1 + 2 * ncols + the column means: everything before the first entry.
  int64_t HeaderWords() const { return 1 + 2 * NumColumns(); }
  // Length of the packed buffer (Adaptive.packed_words(n)).
  int64_t PackedWords() const { return HeaderWords() + Capacity(); }
};

// `used` that exact mode (sample_size == 0) produces, given each column's number of positive
// and of negative values of acc (ncols entries each): header + sum over columns of
// AdaptiveSignKeep(k+, zeros) + AdaptiveSignKeep(k-, zeros). Lets collectives and tests size or
// check a message without running the quantizer.
int64_t AdaptiveExactUsed(const AdaptiveLayout& layout, const int64_t* positives,
                          const int64_t* negatives);

// The same prediction computed from the data: acc = x + residual_in (residual_in may be null).
int64_t AdaptiveExactUsed(const AdaptiveLayout& layout, const float* x, const float* residual_in);

// Quantizes acc = x + residual_in (or x when residual_in is null) column by column into
// `packed` (layout.PackedWords() words, format in jaxcomm/ops/compress.py) and writes
// residual_out = acc - decoded, computed from the very floats that were encoded. residual_out
// is required and may alias residual_in (not x).
//
// sample_size == 0 selects exactly; > 0 estimates each column's thresholds from sample_size
// positions drawn with wire::SamplePosition.
//
// Returns -1, or the lowest flat index whose acc is NaN or +-Inf; packed and residual_out are
// then unspecified. The output never depends on how `run` schedules its tasks. Allocates
// (and may throw std::bad_alloc for absurd column_size/sample_size) only on the calling thread.
int64_t AdaptiveCompress(const float* x, const float* residual_in, const AdaptiveLayout& layout,
                         int64_t sample_size, uint32_t* packed, float* residual_out,
                         const TaskRunner& run = RunTasksSerially);

// Decodes packed[0 .. used) into out (n floats): entries get their column's mean of their
// sign, every other element 0 (or, with accumulate, keeps its value and adds the decoded one,
// the reduce step of a quantized allreduce). `words` is how many words `packed` holds; only
// `used` of them are read. Validates the whole message before writing anything and returns
// an empty string, or what is wrong with it.
std::string AdaptiveDecompress(const uint32_t* packed, int64_t words, const AdaptiveLayout& layout,
                               float* out, bool accumulate = false);

// Adaptive's kind number in the quantized allreduce's table (kernels/quantizer_table.h): what
// the "quantizer" FFI attribute carries for it. Its entries (CPU and CUDA) take it from here; no
// other quantizer may have it (kernels/tests/quantizer_table_test.cc checks).
inline constexpr QuantizerKind kAdaptiveKind{2};

// Adaptive's entry of the quantized allreduce's table (kernels/quantizer_table.h).
struct Quantizer;
extern const Quantizer kAdaptiveQuantizer;

}  // namespace jaxcomm::kernels
