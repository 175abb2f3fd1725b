#pragma once
// Writes a safetensors file (the format safetensors.torch.save_file writes and TensorFile reads): an 8-byte
// little-endian header length, the JSON header padded with spaces to a multiple of 8, then the tensors'
// bytes in the order given. The file is written atomically (AtomicFile).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/dump/tensor_file.hpp"

namespace lossverify::dump {

struct TensorToWrite {
  std::string name;
  TensorDType dtype = TensorDType::f32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;  // numel x item size bytes, little-endian
};

template <class T>
TensorToWrite tensor_to_write(std::string name, TensorDType dtype, std::vector<std::int64_t> shape,
                              const std::vector<T>& values) {
  return {std::move(name), dtype, std::move(shape), std::as_bytes(std::span<const T>(values))};
}

// Throws InternalError when a tensor's byte count does not match its shape (a caller's bug) or the file
// cannot be written. `metadata`, when an object, becomes the header's "__metadata__" (string values).
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const nlohmann::json& metadata = nullptr);

}  // namespace lossverify::dump
