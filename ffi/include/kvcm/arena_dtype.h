// The DLPack dtype of an arena view, by name (shared by the CPU and CUDA arena bindings).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>

namespace kvcm {

inline nanobind::dlpack::dtype ArenaDType(const std::string& name) {
  using nanobind::dlpack::dtype_code;
  if (name == "float32") return {static_cast<uint8_t>(dtype_code::Float), 32, 1};
  if (name == "float16") return {static_cast<uint8_t>(dtype_code::Float), 16, 1};
  if (name == "bfloat16") return {static_cast<uint8_t>(dtype_code::Bfloat), 16, 1};
  if (name == "int8") return {static_cast<uint8_t>(dtype_code::Int), 8, 1};
  if (name == "uint8") return {static_cast<uint8_t>(dtype_code::UInt), 8, 1};
  if (name == "int32") return {static_cast<uint8_t>(dtype_code::Int), 32, 1};
  throw nanobind::value_error(
      ("dtype must be float32, float16, bfloat16, int8, uint8 or int32, got " + name).c_str());
}

}  // namespace kvcm
