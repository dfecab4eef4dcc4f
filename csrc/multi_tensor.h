// multi_tensor.h — fused pack/unpack of many tensors into one flat buffer (CPU).
//
// Gradient bucketing needs "copy these N gradients into the bucket, scaled and
// cast to the communication dtype" and the way back. One call walks a table of
// slots (pointer, count, dtype, offset in the flat buffer) so Python pays one
// crossing per bucket instead of one torch op per tensor, and the scale and
// cast happen in the same pass as the copy.
//
// Python owns every buffer; C++ borrows them for the duration of the call.
// Math: value = to_acc(src) in the source's accumulator type (fp32 for
// fp16/bf16/fp32, fp64 for fp64), times `scale` in that type, rounded once
// into the destination dtype (reduce_math.h conversions, round to nearest
// even). Integer dtypes are copied and cast, never scaled.
#pragma once

#include <cstdint>
#include <vector>

#include "reduce_math.h"

namespace pz {

// One tensor of the table and where it lives in the flat buffer.
struct TensorSlot {
  void* ptr;
  int64_t numel;
  DType dtype;
  int64_t offset;  // in elements of the flat buffer
};

// flat[slot.offset + i] = cast<flat_dtype>(scale * slot.ptr[i]) for every slot.
void multi_tensor_pack(const std::vector<TensorSlot>& srcs, void* flat, DType flat_dtype, int64_t flat_numel,
                       double scale);

// slot.ptr[i] = cast<slot.dtype>(scale * flat[slot.offset + i]) for every slot.
void multi_tensor_unpack(const void* flat, DType flat_dtype, int64_t flat_numel, const std::vector<TensorSlot>& dsts,
                         double scale);

}  // namespace pz
