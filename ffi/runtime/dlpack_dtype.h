// The element types a reservation view may have, by name, with their DLPack type codes
// (DLDataTypeCode of DLPack 1.1: float8_e4m3fn is kDLFloat8_e4m3fn).
#pragma once

#include <cstdint>
#include <string>

#include "kvcm/runtime/errors.h"

namespace kvcm::runtime {

struct DLPackDType {
  const char* name;
  uint8_t code;  // DLDataTypeCode
  uint8_t bits;
};

inline constexpr DLPackDType kViewDTypes[] = {
    {"float32", 2, 32}, {"float16", 2, 16}, {"bfloat16", 4, 16}, {"float8_e4m3fn", 10, 8},
    {"int32", 0, 32},   {"int8", 0, 8},     {"uint8", 1, 8},
};

// The entry of `name`; InvalidArgument naming the argument and the choices otherwise.
inline const DLPackDType& ViewDType(const std::string& name) {
  std::string choices;
  for (const DLPackDType& d : kViewDTypes) {
    if (name == d.name) return d;
    choices += choices.empty() ? d.name : std::string(", ") + d.name;
  }
  throw InvalidArgument("dtype must be one of " + choices + "; got " + name);
}

}  // namespace kvcm::runtime
