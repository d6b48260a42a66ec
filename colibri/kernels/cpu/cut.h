// colibri_cut_requested: whether the host asked the decode bursts running in this process to
// end after their current step (colibri_request_cut, cpu.cc), read once per step.

#pragma once

#include <atomic>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Raised by the host (a frame came in) so that a long burst of decode steps ends after the step
// it is in; lowered when the host has taken what came in. Process-wide: a burst cut short is
// still exact, only shorter.
std::atomic<int32_t> cut_flag{0};

// step [] int32 (the loop's counter: the call is made per step and never hoisted) -> [] int32.
ffi::Error CutRequested(ffi::Buffer<ffi::S32> step, ffi::ResultBuffer<ffi::S32> out) {
  (void)step;
  *out->typed_data() = cut_flag.load(std::memory_order_acquire);
  return ffi::Error::Success();
}

}  // namespace
