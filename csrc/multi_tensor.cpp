// multi_tensor.cpp — the pack/unpack loops of multi_tensor.h.
//
// Single-threaded on purpose: each rank owns about one core, and a bucket is
// packed while that rank's backward or its comm thread wants the others.
#include "multi_tensor.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace pz {
namespace {

// d[i] = cast<D>(scale * s[i]), the product taken in S's accumulator type.
template <typename S, typename D>
void convert(const S* __restrict s, D* __restrict d, int64_t n, double scale) {
  using A = typename Acc<S>::type;
  using AD = typename Acc<D>::type;
  if (scale == 1.0) {
    if constexpr (std::is_same_v<S, D>) {
      std::memcpy(d, s, size_t(n) * sizeof(S));
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = from_acc<D>(AD(to_acc(s[i])));
    }
    return;
  }
  if constexpr (std::is_floating_point_v<A>) {
    const A k = A(scale);
    for (int64_t i = 0; i < n; ++i) d[i] = from_acc<D>(AD(to_acc(s[i]) * k));
  }
}

void check_slots(const std::vector<TensorSlot>& slots, DType flat_dtype, int64_t flat_numel, double scale,
                 const char* what) {
  const bool scaled = scale != 1.0;
  if (scaled && !dtype_is_float(flat_dtype))
    throw std::invalid_argument(std::string(what) + ": scale != 1 needs a floating-point flat buffer, got " +
                                dtype_name(flat_dtype));
  for (size_t k = 0; k < slots.size(); ++k) {
    const TensorSlot& t = slots[k];
    if (int(t.dtype) < 0 || int(t.dtype) >= kNumDTypes)
      throw std::invalid_argument(std::string(what) + ": slot " + std::to_string(k) + " has an unknown dtype code");
    if (t.numel < 0 || t.offset < 0 || t.offset + t.numel > flat_numel)
      throw std::out_of_range(std::string(what) + ": slot " + std::to_string(k) + " [" + std::to_string(t.offset) +
                              ", " + std::to_string(t.offset + t.numel) + ") is outside the flat buffer of " +
                              std::to_string(flat_numel) + " elements");
    if (t.numel > 0 && t.ptr == nullptr)
      throw std::invalid_argument(std::string(what) + ": slot " + std::to_string(k) + " has a null pointer");
    if (scaled && !dtype_is_float(t.dtype))
      throw std::invalid_argument(std::string(what) + ": scale != 1 needs floating-point tensors, slot " +
                                  std::to_string(k) + " is " + dtype_name(t.dtype));
  }
}

char* at(void* base, DType dt, int64_t offset) { return static_cast<char*>(base) + offset * dtype_size(dt); }

}  // namespace

void multi_tensor_pack(const std::vector<TensorSlot>& srcs, void* flat, DType flat_dtype, int64_t flat_numel,
                       double scale) {
  check_slots(srcs, flat_dtype, flat_numel, scale, "multi_tensor_pack");
  for (const TensorSlot& t : srcs) {
    if (t.numel == 0) continue;
    void* dst = at(flat, flat_dtype, t.offset);
    PZ_DISPATCH_DTYPE(t.dtype, S, PZ_DISPATCH_DTYPE(flat_dtype, D,
        convert<S, D>(static_cast<const S*>(t.ptr), static_cast<D*>(dst), t.numel, scale)));
  }
}

void multi_tensor_unpack(const void* flat, DType flat_dtype, int64_t flat_numel, const std::vector<TensorSlot>& dsts,
                         double scale) {
  check_slots(dsts, flat_dtype, flat_numel, scale, "multi_tensor_unpack");
  for (const TensorSlot& t : dsts) {
    if (t.numel == 0) continue;
    const void* src = at(const_cast<void*>(flat), flat_dtype, t.offset);
    PZ_DISPATCH_DTYPE(flat_dtype, S, PZ_DISPATCH_DTYPE(t.dtype, D,
        convert<S, D>(static_cast<const S*>(src), static_cast<D*>(t.ptr), t.numel, scale)));
  }
}

}  // namespace pz
