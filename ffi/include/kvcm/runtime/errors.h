// The native runtime's errors, free of any binding framework: the Python bindings turn
// InvalidArgument into ValueError, OutOfMemory into MemoryError and DriverError into RuntimeError.
#pragma once

#include <stdexcept>
#include <string>

namespace kvcm::runtime {

// A bad argument (the message names it); nothing was changed.
struct InvalidArgument : std::invalid_argument {
  explicit InvalidArgument(const std::string& message) : std::invalid_argument(message) {}
};

// Memory or address space that could not be had (mmap, memfd, cuMemCreate, ...).
struct OutOfMemory : std::runtime_error {
  explicit OutOfMemory(const std::string& message) : std::runtime_error(message) {}
};

// A driver or system call failed, or the machine lacks a feature (no VMM support, no driver).
struct DriverError : std::runtime_error {
  explicit DriverError(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace kvcm::runtime
