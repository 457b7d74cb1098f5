// jaxcomm_collective_done's operands (ffi/collective_done.cc, ffi/cuda/collective_done.cc): the
// start's ticket, then its data results, then buffers kept alive; results = the start's data
// results again, aliased.
#pragma once

#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {

// The done's result buffers, checked to alias its operands 1.. (the start's results) in order.
xla::ffi::Error DoneResults(xla::ffi::RemainingArgs args, xla::ffi::RemainingRets rets,
                            std::vector<const void*>* results);

}  // namespace jaxcomm::collectives
