// Pieces shared by the CPU (ffi/quantized_allreduce.cc) and GPU (ffi/cuda/quantized_allreduce.cc)
// handlers of the quantized and hierarchical allreduces: attribute binding, spec and size checks,
// metric labels. The algorithms' schedules: ffi/quantized_schedule.h and ffi/ring_schedule.h.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "ffi/collective_handler.h"
#include "ffi/common.h"
#include "kernels/quantized_slices.h"
#include "kernels/quantizer_table.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives::quantized {

namespace ffi = xla::ffi;

// A quantized allreduce's quantizer (kernels::QuantizerSpec as it travels): one dictionary
// attribute, "quantizer", built by jaxcomm/collectives/_attributes.py (quantizer_attributes).
struct QuantizerAttrs {
  int64_t kind;  // kernels::QuantizerKind, a kind of the table (kernels/quantizer_table.h)
  int64_t column_size;
  int64_t sample_size;
  double proportion;
  float tau;
  double max_density;
  int64_t bits;         // block: 8 or 4
  bool stochastic;      // block: stochastic rounding
  bool error_feedback;  // block: false ignores the residual and returns zeros
  int64_t seed;         // block: the stochastic rounding's seed (its low 32 bits)
};

}  // namespace jaxcomm::collectives::quantized

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jaxcomm::collectives::quantized::QuantizerAttrs, ::xla::ffi::StructMember<int64_t>("kind"),
    ::xla::ffi::StructMember<int64_t>("column_size"),
    ::xla::ffi::StructMember<int64_t>("sample_size"),
    ::xla::ffi::StructMember<double>("proportion"), ::xla::ffi::StructMember<float>("tau"),
    ::xla::ffi::StructMember<double>("max_density"), ::xla::ffi::StructMember<int64_t>("bits"),
    ::xla::ffi::StructMember<bool>("stochastic"), ::xla::ffi::StructMember<bool>("error_feedback"),
    ::xla::ffi::StructMember<int64_t>("seed"));

namespace jaxcomm::collectives::quantized {

// The Python API names of the three ops, for errors and metrics (CPU and GPU alike).
constexpr char kQuantizedOp[] = "jaxcomm.compressed_allreduce";
constexpr char kHierarchicalOp[] = "jaxcomm.allreduce(hierarchical=True)";
constexpr char kHierarchicalQuantizedOp[] = "jaxcomm.compressed_allreduce(hierarchical=True)";

// The quantizer's metrics label: its name in the table ("onebit", ...).
inline const char* KindLabel(kernels::QuantizerKind kind) {
  const kernels::Quantizer* q = kernels::FindQuantizer(kind);
  return q == nullptr ? "unknown" : q->name;
}

inline ffi::Error ReadSpec(const char* op, const QuantizerAttrs& q, kernels::QuantizerSpec* spec) {
  if (kernels::FindQuantizer(static_cast<kernels::QuantizerKind>(q.kind)) == nullptr) {
    return ffi_common::InvalidArgument(op, "unknown quantizer kind " + std::to_string(q.kind));
  }
  *spec = kernels::QuantizerSpec{static_cast<kernels::QuantizerKind>(q.kind),
                                 q.column_size,
                                 q.sample_size,
                                 q.proportion,
                                 q.tau,
                                 q.max_density};
  spec->bits = q.bits;
  spec->stochastic = q.stochastic;
  spec->error_feedback = q.error_feedback;
  spec->seed = static_cast<uint32_t>(q.seed);
  const std::string bad = kernels::CheckQuantizerSpec(*spec);
  if (!bad.empty()) return ffi_common::InvalidArgument(op, bad);
  return ffi::Error::Success();
}

inline ffi::Error CheckSizes(const char* op, int64_t n, std::initializer_list<int64_t> others) {
  for (int64_t other : others) {
    if (other != n)
      return ffi_common::InvalidArgument(op, "x, residual and results must have one size");
  }
  return ffi_common::CheckElementCount(op, n);
}

// What the opening checks of a quantized handler establish: the element count n of x (and of
// residual and both results) and the quantizer.
struct QuantizedCall {
  int64_t n = 0;
  kernels::QuantizerSpec spec;
};

// The opening checks of every quantized handler (CPU and GPU, flat and hierarchical): x,
// residual and both results of one size within the kernels' limit, then a usable quantizer
// (into *call, with the size).
inline ffi::Error CheckQuantizedCall(const char* op, const ffi::Buffer<ffi::F32>& x,
                                     const ffi::Buffer<ffi::F32>& residual,
                                     ffi::ResultBuffer<ffi::F32> summed,
                                     ffi::ResultBuffer<ffi::F32> new_residual,
                                     const QuantizerAttrs& quantizer, QuantizedCall* call) {
  call->n = ffi_common::NumElements(x);
  JAXCOMM_RETURN_IF_ERROR(
      CheckSizes(op, call->n,
                 {ffi_common::NumElements(residual), ffi_common::NumElements(*summed),
                  ffi_common::NumElements(*new_residual)}));
  return ReadSpec(op, quantizer, &call->spec);
}

// x, residual and the step in; the sum, the new residual and the token out: the data of a
// quantizer whose stochastic rounding counts steps (BlockQuant).
template <typename Binding>
auto BindSteppedData(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()     // x: local gradient
      .template Arg<ffi::Buffer<ffi::F32>>()     // residual in
      .template Arg<ffi::BufferR0<ffi::S32>>()   // step: the stochastic rounding's counter
      .template Ret<ffi::Buffer<ffi::F32>>()     // summed (identical on all ranks)
      .template Ret<ffi::Buffer<ffi::F32>>()     // new residual
      .template Ret<ffi::BufferR0<ffi::S32>>();  // token out
}

// What the quantized allreduce binds after the common operands (CPU and GPU): its quantizer,
// then the compressed data; kStepped adds the step operand (jaxcomm_blockquant_allreduce and
// jaxcomm_hierarchical_blockquant: BindSteppedData).
template <bool kStepped = false, typename Binding>
auto BindQuantizedData(Binding binding) {
  if constexpr (kStepped) {
    return BindSteppedData(std::move(binding).template Attr<QuantizerAttrs>("quantizer"));
  } else {
    return BindCompressedData(std::move(binding).template Attr<QuantizerAttrs>("quantizer"));
  }
}

// The same for the hierarchical quantized allreduce: the mesh roles first.
template <bool kStepped = false, typename Binding>
auto BindHierarchicalQuantizedData(Binding binding) {
  return BindQuantizedData<kStepped>(std::move(binding).template Attr<HierarchyAttrs>("hierarchy"));
}

// The dense hierarchical allreduce: the mesh roles, then the dense data.
template <typename Binding>
auto BindHierarchicalDenseData(Binding binding) {
  return BindDenseData(std::move(binding).template Attr<HierarchyAttrs>("hierarchy"));
}

}  // namespace jaxcomm::collectives::quantized
