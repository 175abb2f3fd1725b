#include "lossverify/cuda/shard_inputs.hpp"
#include "lossverify/kind_api/loss_kind.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lossverify/cuda/storage.hpp"

namespace lossverify::cuda {

ShardInputs generate_shard_inputs(const Case& c, const InputSource& inputs, const RankAssignment& assignment,
                                  VocabRange columns, cudaStream_t stream, bool student) {
  const auto rows = static_cast<std::int64_t>(assignment.rows.size());
  const std::int64_t cols = columns.size();
  const DType dtype = c.inputs.dtype;
  const StorageType type = storage_of(dtype);
  const std::size_t element = dtype_size(dtype);
  // Each row's Philox counter: its token, or (sequence, position) for a CP padding row.
  std::vector<std::int64_t> counters(static_cast<std::size_t>(rows));
  std::vector<int> padding(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < rows; ++i) {
    const LocalRow& r = assignment.rows[static_cast<std::size_t>(i)];
    padding[static_cast<std::size_t>(i)] = r.token < 0;
    counters[static_cast<std::size_t>(i)] =
        r.token >= 0 ? r.token
                     : static_cast<std::int64_t>((static_cast<std::uint64_t>(r.sequence) << 32) +
                                                 static_cast<std::uint64_t>(r.position));
  }
  DeviceBytes d_counters = upload(counters, stream);
  DeviceBytes d_padding = upload(padding, stream);
  ShardInputs out;
  out.student = DeviceBytes(student ? static_cast<std::size_t>(rows * cols) * element : 0);
  GenerateArgs g{c.inputs.seed,
                 static_cast<int>(InputStream::student_logits),
                 d_counters.as<std::int64_t>(),
                 d_padding.as<int>(),
                 rows,
                 columns.begin,
                 columns.end,
                 static_cast<int>(c.inputs.distribution),
                 c.inputs.mean,
                 c.inputs.scale,
                 c.inputs.mean,
                 c.inputs.scale};
  if (student) {
    generate_logits(type, g, out.student.as<void>(), stream);
    LV_CUDA(cudaGetLastError());
  }
  const bool teacher = kind_of(c.loss).inputs().teacher_logits;
  if (teacher) {
    out.teacher = DeviceBytes(static_cast<std::size_t>(rows * cols) * element);
    const TeacherSpec& t = c.inputs.teacher;
    GenerateArgs gt = g;
    if (!t.same_as_student) {
      gt.stream = static_cast<int>(InputStream::teacher_logits);
      gt.mean = t.mean;
      gt.scale = t.scale;
    }
    generate_logits(type, gt, out.teacher.as<void>(), stream);
    LV_CUDA(cudaGetLastError());
  }
  if (student && !c.inputs.overrides.empty()) {
    std::vector<std::byte> row_bytes(static_cast<std::size_t>(cols) * element);
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int64_t t = assignment.rows[static_cast<std::size_t>(i)].token;
      const bool overridden = std::any_of(c.inputs.overrides.begin(), c.inputs.overrides.end(),
                                          [t](const RowOverride& o) { return o.token == t && !o.logits.empty(); });
      if (!overridden) continue;
      dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        inputs.logits(t, columns.begin, columns.end, reinterpret_cast<T*>(row_bytes.data()));
      });
      const std::size_t offset = static_cast<std::size_t>(i * cols) * element;
      LV_CUDA(cudaMemcpyAsync(out.student.as<std::byte>() + offset, row_bytes.data(), row_bytes.size(),
                              cudaMemcpyHostToDevice, stream));
      if (teacher && c.inputs.teacher.same_as_student) {
        LV_CUDA(cudaMemcpyAsync(out.teacher.as<std::byte>() + offset, row_bytes.data(), row_bytes.size(),
                                cudaMemcpyHostToDevice, stream));
      }
    }
  }
  // (d_counters and d_padding are freed when this returns: cudaFree waits for the generation kernels.)
  return out;
}

}  // namespace lossverify::cuda
