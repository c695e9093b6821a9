// Size arithmetic that cannot wrap: every size or address computed from a caller's numbers (a slot
// size times a slot count, an address plus a length) goes through these, and a result past 2^64 is
// an error (kInvalidArgument where it reaches a caller), never a small number that maps or checks
// as valid.
#pragma once

#include <cstdint>

namespace p2pw {

// *out = a * b; false (and *out unchanged) when the product does not fit.
template <typename T>
inline bool checked_mul(T a, T b, T* out) {
  T r;
  if (__builtin_mul_overflow(a, b, &r)) return false;
  *out = r;
  return true;
}

// *out = a + b; false (and *out unchanged) when the sum does not fit.
template <typename T>
inline bool checked_add(T a, T b, T* out) {
  T r;
  if (__builtin_add_overflow(a, b, &r)) return false;
  *out = r;
  return true;
}

// [addr, addr + length) lies in the address space: its last byte is at most 2^64 - 1 (an empty
// range always does).
inline bool range_fits(uint64_t addr, uint64_t length) {
  return length == 0 || addr <= UINT64_MAX - (length - 1);
}

// n rounded up to a multiple of `unit` (> 0); false when that does not fit.
inline bool checked_round_up(uint64_t n, uint64_t unit, uint64_t* out) {
  uint64_t padded;
  if (!checked_add(n, unit - 1, &padded)) return false;
  *out = padded / unit * unit;
  return true;
}

}  // namespace p2pw
