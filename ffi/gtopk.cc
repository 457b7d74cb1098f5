// gTop-k allreduce (Shi et al. 2019, Algorithms 3 and 4) for any number of ranks.
//
// Local top-k with error feedback, then a tree of ⊤ merges (sum two sparse sets, keep the
// top k) to rank 0 and a binomial broadcast of the final k entries: O(k log P) per rank
// instead of TopKAllgather's O(kP). For P not a power of two, the ranks above the largest
// power of two p2 first fold their sets into ranks [0, P - p2) (as recursive halving does),
// and get the result back last (the schedule: ffi/gtopk_schedule.h).
//
// Conservation. The paper puts a rank's local values that are not in the global set back
// into its residual (Alg. 4 line 10). That alone loses contributions dropped by an
// intermediate merge at an index that still made it into the global set through other ranks.
// Each merging rank therefore keeps what it dropped and, after the broadcast, adds back the
// dropped partial sums at indices in the global set. Then exactly:
//   sum_ranks(x + residual_in) == summed + sum_ranks(new_residual)   (up to float rounding).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/collective_handler.h"
#include "ffi/common.h"
#include "ffi/engine.h"
#include "ffi/group.h"
#include "ffi/gtopk_run.h"
#include "kernels/reduce.h"
#include "kernels/sparse_merge.h"
#include "kernels/topk.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {
namespace {

constexpr char kOp[] = "jaxcomm.compressed_allreduce(GTopK)";

// A sparse set on the wire: [k indices][k values], one message.
struct SparseSet {
  std::vector<uint32_t> words;
  int64_t k = 0;
  void Resize(int64_t k_) {
    k = k_;
    words.resize(static_cast<size_t>(2 * k));
  }
  int32_t* indices() { return reinterpret_cast<int32_t*>(words.data()); }
  float* values() { return reinterpret_cast<float*>(words.data() + k); }
  const int32_t* indices() const { return reinterpret_cast<const int32_t*>(words.data()); }
  const float* values() const { return reinterpret_cast<const float*>(words.data() + k); }
  size_t bytes() const { return sizeof(uint32_t) * words.size(); }
};

struct Dropped {
  int32_t index;
  float value;
};

// Entries of (a + b) that the merge result `out` did not keep. All three are index-ascending;
// the sums are formed exactly as SparseMergeTopK forms them (val_a + val_b).
void CollectDropped(const SparseSet& a, const SparseSet& b, const SparseSet& out,
                    std::vector<Dropped>* dropped) {
  int64_t i = 0, j = 0, o = 0;
  while (i < a.k || j < b.k) {
    int32_t index;
    float value;
    if (j >= b.k || (i < a.k && a.indices()[i] < b.indices()[j])) {
      index = a.indices()[i];
      value = a.values()[i++];
    } else if (i >= a.k || b.indices()[j] < a.indices()[i]) {
      index = b.indices()[j];
      value = b.values()[j++];
    } else {
      index = a.indices()[i];
      value = a.values()[i++] + b.values()[j++];
    }
    while (o < out.k && out.indices()[o] < index) ++o;
    if (o < out.k && out.indices()[o] == index) continue;
    dropped->push_back({index, value});
  }
}

class GTopKRun {
 public:
  GTopKRun(Group& group, int64_t k) : group_(group), k_(k) {
    received_.Resize(k);
    merged_.Resize(k);
    scratch_indices_.resize(2 * k);
    scratch_values_.resize(2 * k);
    scratch_keys_.resize(2 * k);
  }

  // Reduces `current` (this rank's local set in, the global set out) across the group, step by
  // step as ffi/gtopk_schedule.h lays out, through the driver the GPU handler runs too
  // (ffi/gtopk_run.h).
  ffi::Error Run(SparseSet* current) {
    current_ = current;
    return gtopk::RunSchedule(kOp, group_, current->bytes(), *this);
  }

  const std::vector<Dropped>& dropped() const { return dropped_; }

  // The sets of gtopk::RunSchedule: one receive buffer for every merge; the global set is
  // received in place of `current`.
  const void* current() { return current_->words.data(); }
  void* merge_input(int /*merge*/) { return received_.words.data(); }
  void* global() { return current_->words.data(); }
  void TakeGlobal() {}

  ffi::Error Merge(int /*merge*/, int from) {
    const kernels::SparseMergeScratch scratch{scratch_indices_.data(), scratch_values_.data(),
                                              scratch_keys_.data(), 2 * k_};
    const kernels::SparseMergeStatus status = kernels::SparseMergeTopK(
        current_->indices(), current_->values(), k_, received_.indices(), received_.values(), k_,
        k_, merged_.indices(), merged_.values(), scratch);
    if (!status.ok()) {
      return ffi_common::InvalidArgument(kOp, "invalid sparse set from group rank " +
                                                  std::to_string(from) + ": " + status.message);
    }
    CollectDropped(*current_, received_, merged_, &dropped_);
    std::swap(current_->words, merged_.words);
    return ffi::Error::Success();
  }

 private:
  Group& group_;
  int64_t k_;
  SparseSet* current_ = nullptr;
  SparseSet received_;
  SparseSet merged_;
  std::vector<int32_t> scratch_indices_;
  std::vector<float> scratch_values_;
  std::vector<uint32_t> scratch_keys_;
  std::vector<Dropped> dropped_;
};

ffi::Error GTopKImpl(const kernels::TaskRunner& run, const Caller& caller, int64_t k,
                     ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual,
                     ffi::ResultBuffer<ffi::F32> summed, ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  std::unique_ptr<Group> group;
  JAXCOMM_RETURN_IF_ERROR(BeginSparseCollective(MakeCallSite(kOp, caller), k, x, residual, summed,
                                                new_residual, &group));

  SparseSet local, current;
  local.Resize(k);
  float* r_out = new_residual->typed_data();
  kernels::TopKAbs(x.typed_data(), residual.typed_data(), n, k, local.indices(), local.values(),
                   r_out, run);
  current = local;
  GTopKRun schedule(*group, k);
  JAXCOMM_RETURN_IF_ERROR(schedule.Run(&current));

  float* out = summed->typed_data();
  std::memset(out, 0, sizeof(float) * n);
  for (int64_t j = 0; j < k; ++j) {
    const int32_t index = current.indices()[j];
    if (index < 0 || index >= n) {
      return ffi_common::InvalidArgument(kOp, "global set holds an out-of-range index");
    }
    out[index] = current.values()[j];
  }
  // Alg. 4 line 10: local values outside the global set return to the residual (whose
  // selected entries TopKAbs zeroed).
  const int32_t* global = current.indices();
  for (int64_t j = 0; j < k; ++j) {
    const int32_t index = local.indices()[j];
    if (!std::binary_search(global, global + k, index)) r_out[index] += local.values()[j];
  }
  // Partial sums this rank dropped at indices that still made it into the global set.
  for (const Dropped& d : schedule.dropped()) {
    if (std::binary_search(global, global + k, d.index)) r_out[d.index] += d.value;
  }
  group->Finish("gtopk", n);
  return ffi::Error::Success();
}

}  // namespace

JAXCOMM_DEFINE_COLLECTIVE("jaxcomm_gtopk", GTopKImpl, BindSparseCollective);

}  // namespace jaxcomm::collectives
