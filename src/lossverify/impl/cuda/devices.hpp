#pragma once
// The CUDA devices the host sees (compiled where the CUDA toolkit is). Nothing here includes CUDA headers.
namespace lossverify::cuda {

// Device properties the host needs; false (with a reason) when no usable device exists.
bool device_available(int device, char* reason, int reason_size);
int device_count();

}  // namespace lossverify::cuda
