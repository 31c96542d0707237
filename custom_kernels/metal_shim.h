// metal_shim.h: just enough of the Metal Shading Language for `g++ -std=c++17 -fsyntax-only` to type-check
// kernels rendered exactly as MLX renders them (docs/quants.md §3.4, CI check 1). Not a Metal implementation:
// a syntax/type check of the shared bodies in their Metal instantiation. Run the real compile on a Mac.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>

#define device
#define constant
#define threadgroup
#define thread
#define kernel

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned long ulong;
typedef _Float16 half;
typedef half float16_t;

struct bfloat16_t {  // stand-in for MLX's bfloat16_t (RNE from float)
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) { uint32_t u; std::memcpy(&u, &f, 4); bits = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }
  operator float() const { uint32_t u = (uint32_t)bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
};

struct uint3 { uint x, y, z; };
struct uint2 { uint x, y; };
struct uint4 {
  uint x, y, z, w;
  uint4() = default;
  uint4(uint a, uint b, uint c, uint d) : x(a), y(b), z(c), w(d) {}
};
struct ulong2 { ulong x, y; ulong2(ulong a, ulong b) : x(a), y(b) {} };
struct half2 { half x, y; };
struct float2 {
  float x, y;
  float2() = default;
  float2(float a, float b) : x(a), y(b) {}
  explicit float2(half2 h) : x(h.x), y(h.y) {}
};
struct float4 {
  float x, y, z, w;
  float4() = default;
  float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
  float4(float2 a, float2 b) : x(a.x), y(a.y), z(b.x), w(b.y) {}
};

struct half4 {
  half x, y, z, w;
  half4() = default;
  explicit half4(float4 f) : x((half)f.x), y((half)f.y), z((half)f.z), w((half)f.w) {}
};

template <typename T, typename U>
T as_type(U u) { static_assert(sizeof(T) == sizeof(U), "as_type size"); T t; std::memcpy(&t, &u, sizeof(T)); return t; }

namespace metal {
inline float exp(float x) { return std::exp(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float rint(float x) { return std::nearbyint(x); }
inline float log(float x) { return std::log(x); }
inline float fabs(float x) { return std::fabs(x); }
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
enum memory_order { memory_order_relaxed };
template <typename T> struct atomic { T v; };
template <typename T> T atomic_fetch_add_explicit(atomic<T>* p, T v, memory_order) { T o = p->v; p->v += v; return o; }
inline void threadgroup_barrier(mem_flags) {}
inline void simdgroup_barrier(mem_flags) {}
template <typename T> T simd_sum(T x) { return x; }
template <typename T> T simd_shuffle_xor(T x, ushort) { return x; }
template <typename T> T simd_shuffle_down(T x, ushort) { return x; }
inline uint popcount(uint x) { return (uint)__builtin_popcount(x); }

template <typename T, int R, int C> struct simdgroup_matrix { T e[R * C]; };
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
template <typename T, int R, int C> simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> m; for (int i = 0; i < R * C; ++i) m.e[i] = v; return m;
}
template <typename T, int R, int C>
void simdgroup_load(simdgroup_matrix<T, R, C>& m, const T* src, ulong elements_per_row = C,
                    ulong2 origin = ulong2(0, 0), bool transpose = false) { (void)m; (void)src; (void)elements_per_row; (void)origin; (void)transpose; }
template <typename T, int R, int C>
void simdgroup_store(const simdgroup_matrix<T, R, C>& m, T* dst, ulong elements_per_row = C,
                     ulong2 origin = ulong2(0, 0), bool transpose = false) { (void)m; (void)dst; (void)elements_per_row; (void)origin; (void)transpose; }
template <typename T, int R, int C>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, R, C>& d, const simdgroup_matrix<T, R, C>& a,
                                   const simdgroup_matrix<T, R, C>& b, const simdgroup_matrix<T, R, C>& c) { d = c; (void)a; (void)b; }
}  // namespace metal
using namespace metal;
