// Quantized allreduce (Dryden et al. 2016, §3.4) and hierarchical allreduce (IBM slides).
//
// Quantized allreduce: steps 1-6 of ffi/quantized_schedule.h over UCX. Messages carry their
// `used` words only (variable length), and the allgather (step 5) is a ring.
//
// Hierarchical allreduce over a ("node", "local") mesh: a process is a node, its devices are
// its local ranks (in-process UCX: shared memory / self transport).
//   multi-leader (default): ring reduce-scatter inside the node, so local rank l holds the node
//     sum of chunk (l + 1) % L; every local rank allreduces its chunk across nodes (dense ring
//     or quantized as above); ring allgather inside the node. Every local rank talks to the
//     network with 1/L of the data, so the inter-node phase runs L transfers in parallel.
//   single-leader (leaders=1): reduce-scatter inside the node and gather to local rank 0, the
//     leader allreduces the whole vector across nodes, then sends it to every local rank.
// With a compressor, acc = x + residual is reduced densely inside the node and only the
// inter-node phase quantizes; its error lands in the residual of the rank that quantized it,
// so conservation holds over all N * L ranks.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/allreduce.h"
#include "ffi/collective_handler.h"
#include "ffi/common.h"
#include "ffi/direct_allreduce.h"
#include "ffi/engine.h"
#include "ffi/group.h"
#include "ffi/quantized_common.h"
#include "ffi/quantized_schedule.h"
#include "ffi/ring_schedule.h"
#include "kernels/quantized_slices.h"
#include "kernels/quantizer_table.h"
#include "kernels/reduce.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {
namespace {

using kernels::QuantizerSpec;

using quantized::CheckSizes;
using quantized::kHierarchicalOp;
using quantized::kHierarchicalQuantizedOp;
using quantized::KindLabel;
using quantized::kQuantizedOp;
using quantized::QuantizerAttrs;
using ring::ChunkBegin;
using ring::ChunkSize;

ffi::Error Invalid(const char* op, const std::string& message) {
  return ffi_common::InvalidArgument(op, message);
}

// Reusable per-thread buffers (each device's calls run on one thread at a time).
struct QuantizedScratch {
  quantized::SliceLayout layout;
  std::vector<uint32_t> mine;      // this rank's quantized slices, in the layout's places
  std::vector<uint32_t> gathered;  // the quantized sums of every slice, same places
  std::vector<uint32_t> incoming;  // P contributions to the owned slice
  std::vector<int64_t> words;      // received length (words) of each contribution / sum
  std::vector<float> sum;
  std::vector<float> error;
  std::vector<float> decode;
};

// Quantized allreduce (ffi/quantized_schedule.h) of acc = x + residual_in (residual_in may be null)
// over `group`. Writes the sum to `out` and the new residual to `residual_out` (n floats each).
// `out` may alias `x`: x is only read (step 2) before out is first written (step 6).
ffi::Error QuantizedAllreduce(Group& group, const QuantizerSpec& spec, const float* x,
                              const float* residual_in, int64_t n, float* out, float* residual_out,
                              const kernels::TaskRunner& run) {
  thread_local QuantizedScratch s;
  const int parts = group.size();
  const int rank = group.rank();
  // 1. The slices and their places.
  const quantized::SliceLayout& layout = s.layout;
  s.layout.Assign(spec, n, parts);
  s.mine.resize(layout.TotalWords());
  s.gathered.resize(layout.TotalWords());
  s.words.assign(parts, 0);

  // 2. Quantize every slice with error feedback. A counter-based stochastic rounding
  // (BlockQuant) draws from this rank's stream at the slice's own element indices.
  QuantizerSpec slice_spec = spec;
  slice_spec.stream = static_cast<uint32_t>(rank);
  for (int q = 0; q < parts; ++q) {
    const int64_t b = layout.Begin(q);
    slice_spec.first_index = b;
    const kernels::QuantizeStatus status = kernels::QuantizeSlice(
        slice_spec, x + b, residual_in ? residual_in + b : nullptr, layout.Length(q),
        s.mine.data() + layout.offsets[q], residual_out + b, run);
    if (!status.ok()) return ffi_common::NonFinite(group.name(), b + status.nonfinite_index);
  }

  // 3. Pairwise reduce-scatter: contributions to my slice, one per source rank.
  const int64_t my_begin = layout.Begin(rank);
  const int64_t m = layout.Length(rank);
  const int64_t my_words = layout.Words(rank);
  s.incoming.resize(static_cast<size_t>(my_words * parts));
  uint32_t step = 0;
  for (int k = 1; k < parts; ++k, ++step) {
    const auto [dst, src] = quantized::PairwiseExchange(rank, parts, k);
    const uint32_t* send = s.mine.data() + layout.offsets[dst];
    size_t got = 0;
    JAXCOMM_RETURN_IF_ERROR(group.SendRecv(dst, send, sizeof(uint32_t) * send[0], src,
                                           s.incoming.data() + my_words * src,
                                           sizeof(uint32_t) * my_words, &got, step));
    if (got % sizeof(uint32_t) != 0) {
      return Invalid(group.name(), "group rank " + std::to_string(src) + " sent " +
                                       std::to_string(got) + " bytes, not whole words");
    }
    s.words[src] = static_cast<int64_t>(got / sizeof(uint32_t));
  }
  s.words[rank] = s.mine[layout.offsets[rank]];

  // 4. The owner sums the P contributions in rank order, requantizes, keeps the error.
  s.sum.assign(static_cast<size_t>(m), 0.0f);
  for (int q = 0; q < parts; ++q) {
    const uint32_t* message =
        q == rank ? s.mine.data() + layout.offsets[rank] : s.incoming.data() + my_words * q;
    const std::string bad =
        kernels::DequantizeAccumulate(spec, message, s.words[q], m, s.sum.data(), &s.decode);
    if (!bad.empty()) {
      return Invalid(group.name(), "the quantized slice from group rank " + std::to_string(q) +
                                       " is malformed (" + bad +
                                       "); every rank must pass the same shape and compressor");
    }
  }
  s.error.resize(static_cast<size_t>(m));
  slice_spec.stream = static_cast<uint32_t>(parts);  // the owners' sums: stream P
  slice_spec.first_index = my_begin;
  const kernels::QuantizeStatus status =
      kernels::QuantizeSlice(slice_spec, s.sum.data(), nullptr, m,
                             s.gathered.data() + layout.offsets[rank], s.error.data(), run);
  if (!status.ok()) {
    return Invalid(group.name(), "the sum over the group overflowed to Inf at flat index " +
                                     std::to_string(my_begin + status.nonfinite_index));
  }
  kernels::AddInto(residual_out + my_begin, s.error.data(), m);
  s.words[rank] = s.gathered[layout.offsets[rank]];

  // 5. Ring allgather of the quantized sums, `used` words each; rank r starts with slice r.
  const int right = ring::RightOf(rank, parts);
  const int left = ring::LeftOf(rank, parts);
  for (int k = 0; k < parts - 1; ++k, ++step) {
    const auto [send_slice, recv_slice] = ring::PassStep(rank, parts, k);
    const uint32_t* send = s.gathered.data() + layout.offsets[send_slice];
    size_t got = 0;
    JAXCOMM_RETURN_IF_ERROR(group.SendRecv(right, send, sizeof(uint32_t) * s.words[send_slice],
                                           left, s.gathered.data() + layout.offsets[recv_slice],
                                           sizeof(uint32_t) * layout.Words(recv_slice), &got,
                                           step));
    if (got % sizeof(uint32_t) != 0) {
      return Invalid(group.name(), "group rank " + std::to_string(left) + " sent " +
                                       std::to_string(got) + " bytes, not whole words");
    }
    s.words[recv_slice] = static_cast<int64_t>(got / sizeof(uint32_t));
  }

  // 6. Decode every quantized sum.
  std::fill(out, out + n, 0.0f);
  for (int q = 0; q < parts; ++q) {
    const std::string bad =
        kernels::DequantizeAccumulate(spec, s.gathered.data() + layout.offsets[q], s.words[q],
                                      layout.Length(q), out + layout.Begin(q), &s.decode);
    if (!bad.empty()) {
      return Invalid(group.name(), "the quantized sum of slice " + std::to_string(q) +
                                       " is malformed (" + bad + ")");
    }
  }
  group.CountDenseEquivalent(ring::DenseRingBytes(n, parts, rank));
  return ffi::Error::Success();
}

// The flat quantized allreduce of one call; `step` is the step operand's value (0 without).
// Without error feedback (BlockQuant(error_feedback=False)) the residual is neither read nor
// kept: acc = x, and the new residual is zero.
ffi::Error RunQuantized(const kernels::TaskRunner& run, const Caller& caller,
                        const QuantizerAttrs& quantizer, const ffi::Buffer<ffi::F32>& x,
                        const ffi::Buffer<ffi::F32>& residual, int32_t step,
                        ffi::ResultBuffer<ffi::F32> summed,
                        ffi::ResultBuffer<ffi::F32> new_residual) {
  quantized::QuantizedCall call;
  JAXCOMM_RETURN_IF_ERROR(quantized::CheckQuantizedCall(kQuantizedOp, x, residual, summed,
                                                        new_residual, quantizer, &call));
  call.spec.step = static_cast<uint32_t>(step);
  std::unique_ptr<Group> group;
  JAXCOMM_RETURN_IF_ERROR(Group::Begin(MakeCallSite(kQuantizedOp, caller), &group));
  const bool feedback = call.spec.error_feedback;
  float* residual_out = new_residual->typed_data();
  JAXCOMM_RETURN_IF_ERROR(QuantizedAllreduce(*group, call.spec, x.typed_data(),
                                             feedback ? residual.typed_data() : nullptr, call.n,
                                             summed->typed_data(), residual_out, run));
  if (!feedback) std::fill(residual_out, residual_out + call.n, 0.0f);
  group->Finish(KindLabel(call.spec.kind), call.n);
  return ffi::Error::Success();
}

ffi::Error QuantizedAllreduceImpl(const kernels::TaskRunner& run, const Caller& caller,
                                  const QuantizerAttrs& quantizer, ffi::Buffer<ffi::F32> x,
                                  ffi::Buffer<ffi::F32> residual,
                                  ffi::ResultBuffer<ffi::F32> summed,
                                  ffi::ResultBuffer<ffi::F32> new_residual) {
  return RunQuantized(run, caller, quantizer, x, residual, 0, summed, new_residual);
}

JAXCOMM_DEFINE_COLLECTIVE("jaxcomm_quantized_allreduce", QuantizedAllreduceImpl,
                          quantized::BindQuantizedData);

// The same with the step operand of BlockQuant's stochastic rounding.
ffi::Error BlockQuantAllreduceImpl(const kernels::TaskRunner& run, const Caller& caller,
                                   const QuantizerAttrs& quantizer, ffi::Buffer<ffi::F32> x,
                                   ffi::Buffer<ffi::F32> residual, ffi::BufferR0<ffi::S32> step,
                                   ffi::ResultBuffer<ffi::F32> summed,
                                   ffi::ResultBuffer<ffi::F32> new_residual) {
  return RunQuantized(run, caller, quantizer, x, residual, step.typed_data()[0], summed,
                      new_residual);
}

JAXCOMM_DEFINE_COLLECTIVE("jaxcomm_blockquant_allreduce", BlockQuantAllreduceImpl,
                          quantized::BindQuantizedData</*stepped=*/true>);

// ---- hierarchical ------------------------------------------------------------------------

// Ring reduce-scatter of data[0, n) in L = group.size() even chunks (ffi/ring_schedule.h):
// afterwards group rank r holds the full sum of chunk (r + 1) % L (other chunks hold partial
// sums).
ffi::Error RingReduceScatter(Group& group, float* data, int64_t n, std::vector<float>* scratch,
                             uint32_t* step) {
  const int parts = group.size();
  const int rank = group.rank();
  auto begin = [&](int c) { return ChunkBegin(n, parts, c); };
  auto size = [&](int c) { return ChunkSize(n, parts, c); };
  scratch->resize(static_cast<size_t>(std::max<int64_t>(1, size(0))));
  for (int k = 0; k < parts - 1; ++k, ++*step) {
    const auto [send_chunk, recv_chunk] = ring::ReduceScatterStep(rank, parts, k);
    size_t got = 0;
    JAXCOMM_RETURN_IF_ERROR(group.SendRecv(
        ring::RightOf(rank, parts), data + begin(send_chunk), sizeof(float) * size(send_chunk),
        ring::LeftOf(rank, parts), scratch->data(), sizeof(float) * scratch->size(), &got, *step));
    if (got != sizeof(float) * size(recv_chunk)) {
      return Invalid(group.name(),
                     "a local rank sent a chunk of the wrong size; every rank must "
                     "pass the same shape");
    }
    kernels::AddInto(data + begin(recv_chunk), scratch->data(), size(recv_chunk));
  }
  return ffi::Error::Success();
}

// Ring allgather matching RingReduceScatter: group rank r starts with chunk (r + 1) % L.
ffi::Error RingAllgather(Group& group, float* data, int64_t n, uint32_t* step) {
  const int parts = group.size();
  const int rank = group.rank();
  auto begin = [&](int c) { return ChunkBegin(n, parts, c); };
  auto size = [&](int c) { return ChunkSize(n, parts, c); };
  for (int k = 0; k < parts - 1; ++k, ++*step) {
    const auto [send_chunk, recv_chunk] = ring::AllgatherStep(rank, parts, k);
    size_t got = 0;
    JAXCOMM_RETURN_IF_ERROR(group.SendRecv(ring::RightOf(rank, parts), data + begin(send_chunk),
                                           sizeof(float) * size(send_chunk),
                                           ring::LeftOf(rank, parts), data + begin(recv_chunk),
                                           sizeof(float) * size(recv_chunk), &got, *step));
    if (got != sizeof(float) * size(recv_chunk)) {
      return Invalid(group.name(), "a local rank sent a chunk of the wrong size");
    }
  }
  return ffi::Error::Success();
}

// The three groups of one hierarchical call: the whole (node x local) group that records the
// metrics, the ranks of this node, and the ranks with this local index on every node.
struct HierarchicalGroups {
  std::unique_ptr<Group> all, local, node;
};

ffi::Error BeginHierarchical(const char* op, const Caller& caller, const HierarchyAttrs& hierarchy,
                             HierarchicalGroups* groups) {
  const int64_t axes = static_cast<int64_t>(caller.attrs.mesh_axis_sizes.size());
  const ffi::Span<const int64_t> reduce_axes = caller.attrs.reduce_axes;
  const int64_t node_axis = hierarchy.node_axis;
  const int64_t local_axis = hierarchy.local_axis;
  if (node_axis < 0 || node_axis >= axes || local_axis < 0 || local_axis >= axes ||
      node_axis == local_axis || !reduce_axes[node_axis] || !reduce_axes[local_axis]) {
    return Invalid(op, "node_axis and local_axis must be two distinct reduced mesh axes");
  }
  // Every rank begins the same three groups in the same order, so sequence numbers agree.
  thread_local std::vector<int64_t> local_mask, node_mask;
  local_mask.assign(reduce_axes.begin(), reduce_axes.end());
  node_mask = local_mask;
  local_mask[node_axis] = 0;
  node_mask[local_axis] = 0;
  const CallSite all = MakeCallSite(op, caller);
  CallSite local = all, node = all;
  local.reduce_axes = ffi::Span<const int64_t>(local_mask.data(), local_mask.size());
  node.reduce_axes = ffi::Span<const int64_t>(node_mask.data(), node_mask.size());
  JAXCOMM_RETURN_IF_ERROR(Group::Begin(all, &groups->all));
  JAXCOMM_RETURN_IF_ERROR(Group::Begin(local, &groups->local));
  return Group::Begin(node, &groups->node);
}

// Allreduce of data[0, n) across nodes: dense (ffi/allreduce.h's schedules), or quantized with the
// residual of the quantized part in residual_out (zero elsewhere is the caller's job).
ffi::Error InterNode(Group& node, const QuantizerSpec* spec, float* data, int64_t n,
                     float* residual_out, const kernels::TaskRunner& run) {
  thread_local std::vector<float> scratch;
  // Nodes of one host (tests, benchmarks) reduce through shared memory.
  if (spec == nullptr) return DenseAllreduce(node, data, data, n, &scratch);
  return QuantizedAllreduce(node, *spec, data, nullptr, n, data, residual_out, run);
}

// Hierarchical allreduce (see the file comment): out[0, n) gets the total of every rank's x
// (out may alias x). Marks its phases on g.all.
ffi::Error HierarchicalAllreduce(HierarchicalGroups& g, const QuantizerSpec* spec, int64_t leaders,
                                 const float* x, float* out, int64_t n, float* residual_out,
                                 const kernels::TaskRunner& run) {
  Group& local = *g.local;
  const int parts = local.size();
  const int rank = local.rank();
  if (parts > 1 && local.SharesMemoryWithAll()) {
    // The node's ranks read each other's memory (ffi/direct_allreduce.h): rank l reduces
    // slice l of the node sum straight from its peers' inputs.
    uint32_t step = 0;
    JAXCOMM_RETURN_IF_ERROR(DirectReduceScatter(local, x, out, n, &step));
    g.all->MarkPhase("intra_reduce_scatter");
    const int64_t begin = ChunkBegin(n, parts, rank);
    const int64_t size = ChunkSize(n, parts, rank);
    if (leaders > 1) {
      JAXCOMM_RETURN_IF_ERROR(InterNode(*g.node, spec, out + begin, size,
                                        residual_out ? residual_out + begin : nullptr, run));
      g.all->MarkPhase("inter_node");
      JAXCOMM_RETURN_IF_ERROR(DirectAllgather(local, out, n, &step, /*rewritten=*/true));
      g.all->MarkPhase("intra_allgather");
      return ffi::Error::Success();
    }
    JAXCOMM_RETURN_IF_ERROR(DirectAllgather(local, out, n, &step));
    if (rank == 0) JAXCOMM_RETURN_IF_ERROR(InterNode(*g.node, spec, out, n, residual_out, run));
    g.all->MarkPhase("inter_node");
    JAXCOMM_RETURN_IF_ERROR(DirectBroadcast(local, 0, out, n, &step));
    g.all->MarkPhase("intra_broadcast");
    return ffi::Error::Success();
  }
  if (out != x) std::memcpy(out, x, sizeof(float) * n);
  thread_local std::vector<float> scratch;
  uint32_t step = 0;
  JAXCOMM_RETURN_IF_ERROR(RingReduceScatter(local, out, n, &scratch, &step));
  g.all->MarkPhase("intra_reduce_scatter");
  const int owned = (rank + 1) % parts;
  const int64_t begin = ChunkBegin(n, parts, owned);
  const int64_t size = ChunkSize(n, parts, owned);
  if (leaders > 1 || parts == 1) {
    JAXCOMM_RETURN_IF_ERROR(InterNode(*g.node, spec, out + begin, size,
                                      residual_out ? residual_out + begin : nullptr, run));
    g.all->MarkPhase("inter_node");
    JAXCOMM_RETURN_IF_ERROR(RingAllgather(local, out, n, &step));
    g.all->MarkPhase("intra_allgather");
    return ffi::Error::Success();
  }
  // Single leader: gather the reduced chunks on local rank 0, allreduce there, send back.
  const uint32_t gather_step = step++;
  const uint32_t bcast_step = step++;
  if (rank != 0) {
    JAXCOMM_RETURN_IF_ERROR(local.Send(0, out + begin, sizeof(float) * size, gather_step));
    size_t got = 0;
    JAXCOMM_RETURN_IF_ERROR(local.Recv(0, out, sizeof(float) * n, &got, bcast_step));
    if (got != sizeof(float) * n) return Invalid(local.name(), "the leader sent a short vector");
    return ffi::Error::Success();
  }
  for (int q = 1; q < parts; ++q) {
    const int c = (q + 1) % parts;
    const int64_t b = ChunkBegin(n, parts, c);
    const int64_t len = ChunkSize(n, parts, c);
    size_t got = 0;
    JAXCOMM_RETURN_IF_ERROR(local.Recv(q, out + b, sizeof(float) * len, &got, gather_step));
    if (got != sizeof(float) * len) return Invalid(local.name(), "a local rank sent a short chunk");
  }
  JAXCOMM_RETURN_IF_ERROR(InterNode(*g.node, spec, out, n, residual_out, run));
  g.all->MarkPhase("inter_node");
  for (int q = 1; q < parts; ++q) {
    JAXCOMM_RETURN_IF_ERROR(local.Send(q, out, sizeof(float) * n, bcast_step));
  }
  return ffi::Error::Success();
}

ffi::Error HierarchicalDenseImpl(const kernels::TaskRunner& run, const Caller& caller,
                                 const HierarchyAttrs& hierarchy, ffi::Buffer<ffi::F32> x,
                                 ffi::ResultBuffer<ffi::F32> out) {
  const int64_t leaders = hierarchy.leaders;
  const int64_t n = ffi_common::NumElements(x);
  JAXCOMM_RETURN_IF_ERROR(CheckSizes(kHierarchicalOp, n, {ffi_common::NumElements(*out)}));
  HierarchicalGroups g;
  JAXCOMM_RETURN_IF_ERROR(BeginHierarchical(kHierarchicalOp, caller, hierarchy, &g));
  kernels::AdviseHugePages(out->typed_data(), sizeof(float) * n);
  JAXCOMM_RETURN_IF_ERROR(HierarchicalAllreduce(g, nullptr, leaders, x.typed_data(),
                                                out->typed_data(), n, nullptr, run));
  g.all->Absorb(*g.local);
  g.all->Absorb(*g.node);
  g.all->Finish(leaders > 1 ? "hierarchical_dense" : "hierarchical_dense_leader", n);
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_COLLECTIVE("jaxcomm_hierarchical_allreduce", HierarchicalDenseImpl,
                          quantized::BindHierarchicalDenseData);

// The hierarchical quantized allreduce of one call (`step` as for RunQuantized).
ffi::Error RunHierarchicalQuantized(const kernels::TaskRunner& run, const Caller& caller,
                                    const HierarchyAttrs& hierarchy,
                                    const QuantizerAttrs& quantizer, const ffi::Buffer<ffi::F32>& x,
                                    const ffi::Buffer<ffi::F32>& residual, int32_t step,
                                    ffi::ResultBuffer<ffi::F32> summed,
                                    ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t leaders = hierarchy.leaders;
  quantized::QuantizedCall call;
  JAXCOMM_RETURN_IF_ERROR(quantized::CheckQuantizedCall(kHierarchicalQuantizedOp, x, residual,
                                                        summed, new_residual, quantizer, &call));
  call.spec.step = static_cast<uint32_t>(step);
  HierarchicalGroups g;
  JAXCOMM_RETURN_IF_ERROR(BeginHierarchical(kHierarchicalQuantizedOp, caller, hierarchy, &g));
  float* out = summed->typed_data();
  const float* xs = x.typed_data();
  const float* rs = residual.typed_data();
  const bool feedback = call.spec.error_feedback;
  if (feedback) {
    for (int64_t i = 0; i < call.n; ++i) out[i] = xs[i] + rs[i];
  } else if (out != xs) {
    std::memcpy(out, xs, sizeof(float) * call.n);
  }
  // Only the part this rank quantizes gets an error; the dense phases lose nothing.
  float* residual_out = new_residual->typed_data();
  std::fill(residual_out, residual_out + call.n, 0.0f);
  JAXCOMM_RETURN_IF_ERROR(
      HierarchicalAllreduce(g, &call.spec, leaders, out, out, call.n, residual_out, run));
  if (!feedback) std::fill(residual_out, residual_out + call.n, 0.0f);
  g.all->Absorb(*g.local);
  g.all->Absorb(*g.node);
  const std::string label =
      std::string("hierarchical_") + KindLabel(call.spec.kind) + (leaders > 1 ? "" : "_leader");
  g.all->Finish(label.c_str(), call.n);
  return ffi::Error::Success();
}

ffi::Error HierarchicalQuantizedImpl(const kernels::TaskRunner& run, const Caller& caller,
                                     const HierarchyAttrs& hierarchy,
                                     const QuantizerAttrs& quantizer, ffi::Buffer<ffi::F32> x,
                                     ffi::Buffer<ffi::F32> residual,
                                     ffi::ResultBuffer<ffi::F32> summed,
                                     ffi::ResultBuffer<ffi::F32> new_residual) {
  return RunHierarchicalQuantized(run, caller, hierarchy, quantizer, x, residual, 0, summed,
                                  new_residual);
}

JAXCOMM_DEFINE_COLLECTIVE("jaxcomm_hierarchical_quantized", HierarchicalQuantizedImpl,
                          quantized::BindHierarchicalQuantizedData);

ffi::Error HierarchicalBlockQuantImpl(const kernels::TaskRunner& run, const Caller& caller,
                                      const HierarchyAttrs& hierarchy,
                                      const QuantizerAttrs& quantizer, ffi::Buffer<ffi::F32> x,
                                      ffi::Buffer<ffi::F32> residual, ffi::BufferR0<ffi::S32> step,
                                      ffi::ResultBuffer<ffi::F32> summed,
                                      ffi::ResultBuffer<ffi::F32> new_residual) {
  return RunHierarchicalQuantized(run, caller, hierarchy, quantizer, x, residual,
                                  step.typed_data()[0], summed, new_residual);
}

JAXCOMM_DEFINE_COLLECTIVE("jaxcomm_hierarchical_blockquant", HierarchicalBlockQuantImpl,
                          quantized::BindHierarchicalQuantizedData</*stepped=*/true>);

}  // namespace
}  // namespace jaxcomm::collectives

// ctypes entry point for jaxcomm/_ffi.py (quantizer_kinds): the quantizer table
// (kernels/quantizer_table.h) as the JSON object {name: kind}, so that no Python module spells
// a kind number. Copies it into `buffer` and returns its full length (call again with a larger
// buffer when the return value >= capacity). Names are plain identifiers (the table's test
// checks), so they need no escaping.
JAXCOMM_C_API int64_t jaxcomm_quantizers_json(char* buffer, int64_t capacity) {
  std::string json = "{";
  for (const jaxcomm::kernels::Quantizer* q : jaxcomm::kernels::Quantizers()) {
    if (json.size() > 1) json += ", ";
    json += "\"" + std::string(q->name) + "\": " + std::to_string(static_cast<int64_t>(q->kind));
  }
  json += "}";
  return jaxcomm::ffi_common::CopyJson(json, buffer, capacity);
}
