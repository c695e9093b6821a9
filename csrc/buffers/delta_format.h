// The byte-level pieces of a delta record shared by the encoder (delta_codec.cpp) and the checker
// (delta_apply.cpp): little-endian loads and stores, varints, and the checksum's hash.
#pragma once

#include <cstdint>
#include <cstring>

namespace p2pw {
namespace delta_format {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "delta records are read and written as little-endian words");

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full, kP3 = 0x165667B19E3779F9ull;

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
template <typename T>
inline void put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <typename T>
inline T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// memcpy of exactly n bytes, without a library call for the few bytes of most runs (two overlapping
// fixed-size moves), never touching a byte outside either range
inline void copy_exact(uint8_t* d, const uint8_t* s, uint64_t n) {
  if (n > 16) {
    std::memcpy(d, s, n);
  } else if (n >= 8) {
    const uint64_t a = get<uint64_t>(s), b = get<uint64_t>(s + n - 8);
    put(d, a);
    put(d + n - 8, b);
  } else if (n >= 4) {
    const uint32_t a = get<uint32_t>(s), b = get<uint32_t>(s + n - 4);
    put(d, a);
    put(d + n - 4, b);
  } else if (n >= 2) {
    const uint16_t a = get<uint16_t>(s), b = get<uint16_t>(s + n - 2);
    put(d, a);
    put(d + n - 2, b);
  } else if (n) {
    *d = *s;
  }
}

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
// Each step is a bijection of the lane for a fixed word, so one changed word always changes the hash.
inline uint64_t mix(uint64_t acc, uint64_t w) { return rotl(acc + w * kP2, 31) * kP1; }

struct Hasher {
  uint64_t v[4];
  explicit Hasher(uint64_t seed) {
    for (int i = 0; i < 4; ++i) v[i] = seed + kP1 * static_cast<uint64_t>(i + 1);
  }
  void block(const uint8_t* p) {
    for (int i = 0; i < 4; ++i) v[i] = mix(v[i], load64(p + 8 * i));
  }
  // tail: the last n < 32 bytes; total: every byte hashed
  uint64_t finish(const uint8_t* tail, uint64_t n, uint64_t total) const {
    uint64_t h = rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18);
    h ^= total * kP3;
    for (; n >= 8; tail += 8, n -= 8) h = rotl(h ^ mix(0, load64(tail)), 27) * kP1 + kP3;
    if (n) {
      uint64_t w = 0;
      std::memcpy(&w, tail, n);
      h = rotl(h ^ mix(0, w), 27) * kP1 + kP3;
    }
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    return h ^ (h >> 32);
  }
};

// dst := src and the hash of those bytes, in one pass (a DENSE payload).
inline uint64_t copy_and_hash(uint8_t* dst, const uint8_t* src, uint64_t n, uint64_t seed) {
  Hasher h(seed);
  uint64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    std::memcpy(dst + i, src + i, 32);
    h.block(src + i);
  }
  std::memcpy(dst + i, src + i, n - i);
  return h.finish(src + i, n - i, n);
}

inline int varint_len(uint64_t v) {
  int n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}
inline uint8_t* put_varint(uint8_t* p, uint64_t v) {
  if (v < 0x80) {  // most gaps and lengths
    *p = static_cast<uint8_t>(v);
    return p + 1;
  }
  for (; v >= 0x80; v >>= 7) *p++ = static_cast<uint8_t>(v | 0x80);
  *p++ = static_cast<uint8_t>(v);
  return p;
}
// One varint from [*p, end): nullptr and *v set, or the reason it cannot be read.
inline const char* get_varint(const uint8_t** p, const uint8_t* end, uint64_t* v) {
  if (*p != end && **p < 0x80) {  // most gaps and lengths
    *v = *(*p)++;
    return nullptr;
  }
  uint64_t r = 0;
  const uint8_t* q = *p;
  for (int i = 0; i < 10; ++i) {
    if (q == end) return "is cut off by the payload's end";
    const uint8_t b = *q++;
    if (i == 9 && b > 1) return "is longer than 64 bits";
    r |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
    if (!(b & 0x80)) {
      if (b == 0 && i > 0) return "is overlong (a final zero byte)";
      *v = r;
      *p = q;
      return nullptr;
    }
  }
  return "is longer than 10 bytes";
}

// [a, a + an) and [b, b + bn) share a byte
inline bool overlap(const void* a, uint64_t an, const void* b, uint64_t bn) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return an && bn && x < y + bn && y < x + an;
}

}  // namespace delta_format
}  // namespace p2pw
