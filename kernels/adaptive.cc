#include "kernels/adaptive.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "kernels/quantizer_table.h"
#include "kernels/wire.h"

namespace jaxcomm::kernels {
namespace {

constexpr int64_t kMinAdaptiveElementsPerTask = 1 << 16;  // finer than kMinElementsPerTask
constexpr uint32_t kExponentMask = 0x7f800000u;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Which values of one sign a column sends: those strictly beyond `tau`, then the first `ties`
// values equal to tau in index order. An exact selection of q values leaves exactly q - (number
// beyond tau) ties to take, which is how ties go to the lower index; a sampled threshold takes
// every tie.
struct Cut {
  float tau;
  int64_t ties;
};

constexpr Cut kSendNone{kInf, 0};
constexpr int64_t kAllTies = std::numeric_limits<int64_t>::max();

struct ColumnCounts {
  int64_t positives = 0;
  int64_t negatives = 0;
  bool finite = true;
};

// acc = x + r into `acc` (which may be r itself), counting signs and spotting non-finite values
// in the same pass over memory. Separate loops per aliasing case let the compiler vectorize
// each one; a single loop with a possible r == acc overlap would fall back to scalar code.
__attribute__((target_clones("avx2", "default"))) ColumnCounts AccumulateColumn(const float* x,
                                                                                const float* r,
                                                                                float* acc,
                                                                                int64_t len) {
  int64_t positives = 0;
  int64_t negatives = 0;
  uint32_t bad = 0;
  auto visit = [&](float a) {
    positives += a > 0.0f;
    negatives += a < 0.0f;
    bad |= (wire::FloatBits(a) & kExponentMask) == kExponentMask;
  };
  if (r == acc) {
    for (int64_t i = 0; i < len; ++i) {
      const float a = x[i] + acc[i];
      acc[i] = a;
      visit(a);
    }
  } else if (r != nullptr) {
    for (int64_t i = 0; i < len; ++i) {
      const float a = x[i] + r[i];
      acc[i] = a;
      visit(a);
    }
  } else {
    for (int64_t i = 0; i < len; ++i) {
      const float a = x[i];
      acc[i] = a;
      visit(a);
    }
  }
  return {positives, negatives, bad == 0};
}

int64_t FirstNonFinite(const float* acc, int64_t len) {
  for (int64_t i = 0; i < len; ++i) {
    if ((wire::FloatBits(acc[i]) & kExponentMask) == kExponentMask) return i;
  }
  return -1;
}

// Smallest positive float: "values >= kAnyPositive" means "every positive value".
constexpr float kAnyPositive = std::numeric_limits<float>::denorm_min();

// Per task and sign, a bound that the next column's selected values probably reach: the value
// of rank ~2q + 16 in the previous column. Gathering only values beyond it shrinks the
// selection from ~L/2 values to a few dozen; when fewer than q pass (the data changed scale),
// the column is gathered again in full. Hints only decide how much is gathered, never what is
// selected, so results do not depend on how columns are split into tasks.
struct Hints {
  float pos = kAnyPositive;
  float neg = -kAnyPositive;
};

struct Scratch {
  std::vector<float> positives;
  std::vector<float> negatives;
  std::vector<float> sample;
  Hints hints;
};

// Copies the values >= pos_bound and those <= neg_bound (visited through `at`) into the scratch
// arrays; branch-free because the sign of a gradient entry is a coin flip for the predictor.
template <typename At>
void Gather(int64_t count, At at, float pos_bound, float neg_bound, Scratch* s, int64_t* num_pos,
            int64_t* num_neg) {
  float* pos = s->positives.data();
  float* neg = s->negatives.data();
  int64_t p = 0;
  int64_t q = 0;
  for (int64_t j = 0; j < count; ++j) {
    const float a = at(j);
    pos[p] = a;
    p += a >= pos_bound;
    neg[q] = a;
    q += a <= neg_bound;
  }
  *num_pos = p;
  *num_neg = q;
}

// The q-th ranked of values[0, count) (0 < q <= count; `before(a, b)`: a ranks above b) and
// how many of the q first equal it. Partial selection only: O(count) expected. Leaves in *hint
// the value of rank ~2q + 16 for the next column.
template <typename Before>
Cut SelectCut(float* values, int64_t count, int64_t q, Before before, bool take_all_ties,
              float* hint) {
  std::nth_element(values, values + (q - 1), values + count, before);
  const float tau = values[q - 1];
  const int64_t hint_rank = std::min(count, 2 * q + 16);
  if (hint_rank > q) {
    std::nth_element(values + q, values + (hint_rank - 1), values + count, before);
  }
  *hint = values[hint_rank - 1];
  if (take_all_ties) return {tau, kAllTies};
  int64_t beyond = 0;
  for (int64_t j = 0; j < q - 1; ++j) beyond += before(values[j], tau);
  return {tau, q - beyond};
}

// Gathers the candidates of both signs past the hints, then again in full for a sign whose
// hint let fewer than its `want` values through.
template <typename At>
void GatherCandidates(int64_t count, At at, int64_t want_pos, int64_t want_neg, Scratch* s,
                      int64_t* num_pos, int64_t* num_neg) {
  Gather(count, at, s->hints.pos, s->hints.neg, s, num_pos, num_neg);
  const bool redo_pos = *num_pos < want_pos;
  const bool redo_neg = *num_neg < want_neg;
  if (!redo_pos && !redo_neg) return;
  // Gather writes both arrays at every step, so the sign that was fine is gathered again too.
  Gather(count, at, redo_pos ? kAnyPositive : s->hints.pos, redo_neg ? -kAnyPositive : s->hints.neg,
         s, num_pos, num_neg);
}

// Cuts for exact mode: the AdaptiveSignKeep values of largest magnitude per sign.
void ExactCuts(const float* acc, int64_t len, const ColumnCounts& counts, double proportion,
               Scratch* s, Cut* pos_cut, Cut* neg_cut) {
  const int64_t zeros = len - counts.positives - counts.negatives;
  const int64_t keep_pos = AdaptiveSignKeep(counts.positives, zeros, proportion);
  const int64_t keep_neg = AdaptiveSignKeep(counts.negatives, zeros, proportion);
  // Keeping every value of a sign needs no selection: the cut sits at zero.
  *pos_cut = keep_pos == 0 ? kSendNone : Cut{0.0f, 0};
  *neg_cut = keep_neg == 0 ? Cut{-kInf, 0} : Cut{-0.0f, 0};
  const bool select_pos = keep_pos > 0 && keep_pos < counts.positives;
  const bool select_neg = keep_neg > 0 && keep_neg < counts.negatives;
  if (!select_pos && !select_neg) return;
  int64_t num_pos = 0;
  int64_t num_neg = 0;
  GatherCandidates(
      len, [acc](int64_t j) { return acc[j]; }, select_pos ? keep_pos : 0,
      select_neg ? keep_neg : 0, s, &num_pos, &num_neg);
  if (select_pos) {
    *pos_cut = SelectCut(s->positives.data(), num_pos, keep_pos, std::greater<float>(), false,
                         &s->hints.pos);
  }
  if (select_neg) {
    *neg_cut =
        SelectCut(s->negatives.data(), num_neg, keep_neg, std::less<float>(), false, &s->hints.neg);
  }
}

// Cuts for sampled mode: thresholds at rank AdaptiveSignKeep(s±, s0) of the sampled values of
// each sign (s0: sampled zeros).
void SampledCuts(const float* acc, int64_t len, int64_t column, int64_t sample_size,
                 double proportion, Scratch* s, Cut* pos_cut, Cut* neg_cut) {
  float* sample = s->sample.data();
  int64_t sampled_pos = 0;
  int64_t sampled_neg = 0;
  for (int64_t j = 0; j < sample_size; ++j) {
    const float a = acc[wire::SamplePosition(column, j, len)];
    sample[j] = a;
    sampled_pos += a > 0.0f;
    sampled_neg += a < 0.0f;
  }
  const int64_t sampled_zeros = sample_size - sampled_pos - sampled_neg;
  const int64_t keep_pos = AdaptiveSignKeep(sampled_pos, sampled_zeros, proportion);
  const int64_t keep_neg = AdaptiveSignKeep(sampled_neg, sampled_zeros, proportion);
  int64_t num_pos = 0;
  int64_t num_neg = 0;
  GatherCandidates(
      sample_size, [sample](int64_t j) { return sample[j]; }, keep_pos, keep_neg, s, &num_pos,
      &num_neg);
  *pos_cut = keep_pos == 0 ? kSendNone
                           : SelectCut(s->positives.data(), num_pos, keep_pos,
                                       std::greater<float>(), true, &s->hints.pos);
  *neg_cut = keep_neg == 0 ? Cut{-kInf, 0}
                           : SelectCut(s->negatives.data(), num_neg, keep_neg, std::less<float>(),
                                       true, &s->hints.neg);
}

struct TaskOutput {
  std::vector<uint32_t> entries;
  int64_t first_bad = -1;
};

constexpr int64_t kQuietBlock = 16;
typedef float Floats8 __attribute__((vector_size(32)));
typedef int32_t Ints8 __attribute__((vector_size(32)));

// True when no value of the block reaches either cut, the case for ~3 blocks in 4 at π = 64:
// one vector test instead of a mispredicted branch per value. Spelled with vector types
// because the compiler turns the equivalent scalar loop back into scalar code once inlined.
inline bool Quiet(const float* a, float pos_tau, float neg_tau) {
  Floats8 lo;
  Floats8 hi;
  std::memcpy(&lo, a, sizeof(lo));
  std::memcpy(&hi, a + 8, sizeof(hi));
  const Ints8 reached = (lo >= pos_tau) | (lo <= neg_tau) | (hi >= pos_tau) | (hi <= neg_tau);
  int32_t any = 0;
  for (int j = 0; j < 8; ++j) any |= reached[j];
  return any == 0;
}

// Quantizes one column whose acc already sits in `acc` (= residual_out of the column): appends
// its entries, writes its two means into `means`, and turns acc into the residual.
__attribute__((target_clones("avx2", "default"))) void EmitColumn(float* acc, int64_t begin,
                                                                  int64_t len, int64_t capacity,
                                                                  Cut pos_cut, Cut neg_cut,
                                                                  uint32_t* means,
                                                                  std::vector<uint32_t>* entries) {
  const size_t first = entries->size();
  double pos_sum = 0.0;
  double neg_sum = 0.0;
  int64_t pos_sent = 0;
  int64_t neg_sent = 0;
  for (int64_t i = 0; i < len && pos_sent + neg_sent < capacity;) {
    if (i + kQuietBlock <= len && Quiet(acc + i, pos_cut.tau, neg_cut.tau)) {
      i += kQuietBlock;
      continue;
    }
    const int64_t stop = std::min(len, i + kQuietBlock);
    for (; i < stop && pos_sent + neg_sent < capacity; ++i) {
      const float a = acc[i];
      if (a < pos_cut.tau && a > neg_cut.tau) continue;
      if (a > pos_cut.tau || (a == pos_cut.tau && pos_cut.ties > 0 && a > 0.0f)) {
        if (a == pos_cut.tau) --pos_cut.ties;
        pos_sum += a;
        ++pos_sent;
        entries->push_back(wire::Entry(true, begin + i));
      } else if (a < neg_cut.tau || (a == neg_cut.tau && neg_cut.ties > 0 && a < 0.0f)) {
        if (a == neg_cut.tau) --neg_cut.ties;
        neg_sum += a;
        ++neg_sent;
        entries->push_back(wire::Entry(false, begin + i));
      }
    }
  }
  const float pos_mean = pos_sent ? static_cast<float>(pos_sum / pos_sent) : 0.0f;
  const float neg_mean = neg_sent ? static_cast<float>(neg_sum / neg_sent) : 0.0f;
  means[0] = wire::FloatBits(pos_mean);
  means[1] = wire::FloatBits(neg_mean);
  for (size_t j = first; j < entries->size(); ++j) {
    const uint32_t e = (*entries)[j];
    acc[wire::EntryIndex(e) - begin] -= wire::EntryPositive(e) ? pos_mean : neg_mean;
  }
}

}  // namespace

int64_t AdaptiveKeep(int64_t count, double proportion) {
  return static_cast<int64_t>(std::ceil(static_cast<double>(count) / proportion));
}

int64_t AdaptiveSignKeep(int64_t count, int64_t zeros, double proportion) {
  return std::min(count, AdaptiveKeep(count + zeros, proportion));
}

int64_t AdaptiveLayout::ColumnLength(int64_t column) const {
  return std::min(column_size, n - ColumnBegin(column));
}

int64_t AdaptiveLayout::ColumnCapacity(int64_t column) const {
  const int64_t len = ColumnLength(column);
  return std::min(len, 2 * AdaptiveKeep(len, proportion) + 2);
}

int64_t AdaptiveLayout::Capacity() const {
  const int64_t ncols = NumColumns();
  const int64_t full = n / column_size;
  return full * ColumnCapacity(0) + (ncols > full ? ColumnCapacity(ncols - 1) : 0);
}

int64_t AdaptiveExactUsed(const AdaptiveLayout& layout, const int64_t* positives,
                          const int64_t* negatives) {
  int64_t used = layout.HeaderWords();
  for (int64_t c = 0; c < layout.NumColumns(); ++c) {
    const int64_t zeros = layout.ColumnLength(c) - positives[c] - negatives[c];
    used += AdaptiveSignKeep(positives[c], zeros, layout.proportion) +
            AdaptiveSignKeep(negatives[c], zeros, layout.proportion);
  }
  return used;
}

int64_t AdaptiveExactUsed(const AdaptiveLayout& layout, const float* x, const float* residual_in) {
  const int64_t ncols = layout.NumColumns();
  std::vector<int64_t> positives(ncols, 0);
  std::vector<int64_t> negatives(ncols, 0);
  for (int64_t i = 0; i < layout.n; ++i) {
    const float a = residual_in ? x[i] + residual_in[i] : x[i];
    positives[i / layout.column_size] += a > 0.0f;
    negatives[i / layout.column_size] += a < 0.0f;
  }
  return AdaptiveExactUsed(layout, positives.data(), negatives.data());
}

int64_t AdaptiveCompress(const float* x, const float* residual_in, const AdaptiveLayout& layout,
                         int64_t sample_size, uint32_t* packed, float* residual_out,
                         const TaskRunner& run) {
  const int64_t ncols = layout.NumColumns();
  const int num_tasks = static_cast<int>(
      std::min<int64_t>(ncols, NumTasksFor(layout.n, kMinAdaptiveElementsPerTask, kMaxTasks)));
  std::vector<TaskOutput> outputs(num_tasks);
  std::vector<Scratch> scratches(num_tasks);
  // Every allocation happens here, on the calling thread: an exception escaping a task would
  // terminate the pool thread that runs it. Reserving each task's capacity keeps push_back
  // from reallocating.
  const int64_t scratch_size =
      sample_size > 0 ? sample_size : std::min(layout.column_size, layout.n);
  for (int t = 0; t < num_tasks; ++t) {
    const Range columns = TaskRange(ncols, num_tasks, t);
    int64_t capacity = 0;
    if (columns.end > columns.begin) {
      capacity = (columns.end - 1 - columns.begin) * layout.ColumnCapacity(columns.begin) +
                 layout.ColumnCapacity(columns.end - 1);
    }
    outputs[t].entries.reserve(static_cast<size_t>(capacity));
    scratches[t].positives.resize(scratch_size);
    scratches[t].negatives.resize(scratch_size);
    scratches[t].sample.resize(sample_size);
  }
  uint32_t* means = packed + wire::kHeaderWords;

  run(num_tasks, [&](int task) {
    const Range columns = TaskRange(ncols, num_tasks, task);
    TaskOutput& out = outputs[task];
    Scratch& scratch = scratches[task];
    for (int64_t c = columns.begin; c < columns.end; ++c) {
      const int64_t begin = layout.ColumnBegin(c);
      const int64_t len = layout.ColumnLength(c);
      float* acc = residual_out + begin;
      const ColumnCounts counts =
          AccumulateColumn(x + begin, residual_in ? residual_in + begin : nullptr, acc, len);
      if (!counts.finite) {
        // Tasks cover ascending ranges, so each one's first bad index competes for the minimum.
        out.first_bad = begin + FirstNonFinite(acc, len);
        return;
      }
      Cut pos_cut;
      Cut neg_cut;
      if (sample_size > 0) {
        SampledCuts(acc, len, c, sample_size, layout.proportion, &scratch, &pos_cut, &neg_cut);
      } else {
        ExactCuts(acc, len, counts, layout.proportion, &scratch, &pos_cut, &neg_cut);
      }
      EmitColumn(acc, begin, len, layout.ColumnCapacity(c), pos_cut, neg_cut, means + 2 * c,
                 &out.entries);
    }
  });

  for (const TaskOutput& out : outputs) {
    if (out.first_bad >= 0) return out.first_bad;
  }
  // Entries land at prefix offsets in task order: the same bytes for any thread count.
  std::vector<int64_t> offsets(num_tasks + 1, layout.HeaderWords());
  for (int t = 0; t < num_tasks; ++t) {
    offsets[t + 1] = offsets[t] + static_cast<int64_t>(outputs[t].entries.size());
  }
  const int64_t used = offsets[num_tasks];
  packed[0] = static_cast<uint32_t>(used);
  run(num_tasks, [&](int task) {
    const std::vector<uint32_t>& entries = outputs[task].entries;
    std::copy(entries.begin(), entries.end(), packed + offsets[task]);
  });
  std::fill(packed + used, packed + layout.PackedWords(), 0u);
  return -1;
}

std::string AdaptiveDecompress(const uint32_t* packed, int64_t words, const AdaptiveLayout& layout,
                               float* out, bool accumulate) {
  const int64_t header = layout.HeaderWords();
  if (words < header) {
    return "packed has " + std::to_string(words) + " words, fewer than the " +
           std::to_string(header) + " of its header";
  }
  const int64_t used = packed[0];
  if (used < header || used > words) {
    return "packed[0] (used) = " + std::to_string(used) + " is outside [" + std::to_string(header) +
           ", " + std::to_string(words) +
           "]; was it produced by compress with the same compressor and size?";
  }
  const uint32_t* entries = packed + header;
  const int64_t m = used - header;
  // Validate first so that a bad message leaves `out` untouched (it may hold a partial sum).
  int64_t previous = -1;
  int64_t column = -1;
  int64_t in_column = 0;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t index = wire::EntryIndex(entries[j]);
    if (index >= layout.n) {
      return "entry " + std::to_string(j) + " has index " + std::to_string(index) +
             ", out of range for " + std::to_string(layout.n) + " elements";
    }
    if (index <= previous) {
      return "entry indices must be strictly ascending; entry " + std::to_string(j) +
             " has index " + std::to_string(index) + " after " + std::to_string(previous);
    }
    previous = index;
    const int64_t c = index / layout.column_size;
    in_column = c == column ? in_column + 1 : 1;
    column = c;
    if (in_column > layout.ColumnCapacity(c)) {
      return "column " + std::to_string(c) + " holds more than its capacity of " +
             std::to_string(layout.ColumnCapacity(c)) + " entries";
    }
  }
  if (!accumulate) std::fill(out, out + layout.n, 0.0f);
  const uint32_t* means = packed + wire::kHeaderWords;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t index = wire::EntryIndex(entries[j]);
    const int64_t c = index / layout.column_size;
    out[index] += wire::BitsFloat(means[2 * c + (wire::EntryPositive(entries[j]) ? 0 : 1)]);
  }
  return "";
}

// ---- entry of the quantized allreduce (kernels/quantizer_table.h) ------------------------
namespace {

AdaptiveLayout AdaptiveLayoutOf(const QuantizerSpec& spec, int64_t n) {
  return AdaptiveLayout{n, spec.column_size, spec.proportion};
}

std::string AdaptiveCheckSpec(const QuantizerSpec& spec) {
  if (!std::isfinite(spec.proportion) || spec.proportion < 1.0) {
    return "Adaptive proportion must be finite and >= 1, got " + std::to_string(spec.proportion);
  }
  if (spec.column_size < 1) return "Adaptive column_size must be >= 1";
  if (spec.sample_size < 0) return "sample_size must be >= 0";
  return "";
}

int64_t AdaptiveSliceUnit(const QuantizerSpec& spec) { return spec.column_size; }

int64_t AdaptiveSliceWords(const QuantizerSpec& spec, int64_t n) {
  return AdaptiveLayoutOf(spec, n).PackedWords();
}

QuantizeStatus AdaptiveQuantizeSlice(const QuantizerSpec& spec, const float* x,
                                     const float* residual_in, int64_t n, uint32_t* packed,
                                     float* residual_out, const TaskRunner& run) {
  QuantizeStatus status;
  status.nonfinite_index = AdaptiveCompress(x, residual_in, AdaptiveLayoutOf(spec, n),
                                            spec.sample_size, packed, residual_out, run);
  return status;
}

std::string AdaptiveDequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed,
                                         int64_t words, int64_t n, float* out,
                                         std::vector<float>*) {
  return AdaptiveDecompress(packed, words, AdaptiveLayoutOf(spec, n), out, /*accumulate=*/true);
}

}  // namespace

const Quantizer kAdaptiveQuantizer = {
    kAdaptiveKind,
    "adaptive",
    AdaptiveCheckSpec,
    AdaptiveSliceUnit,
    AdaptiveSliceWords,
    AdaptiveQuantizeSlice,
    AdaptiveDequantizeAccumulate,
};

}  // namespace jaxcomm::kernels
