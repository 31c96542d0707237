// sim.h: the part of CUDA the kernels use, on the CPU, so the CUDA instantiation of every body runs (slowly)
// where there is no GPU: the "sim" kernel backend (custom_kernels/sim.py), for tests and kernel work.
//
// One block at a time; its threads are fibers on one OS thread (started with ucontext, switched with
// _setjmp/_longjmp), each run until it reaches a barrier or returns. __syncthreads releases a block when every live thread waits at it (threads that returned count
// as arrived, as on current GPUs); __syncwarp and the shuffles release a warp when its live lanes all wait.
// A thread left waiting with nothing to release it is a deadlock (a divergent barrier): ds_sim_launch fails.
// __shared__ is function-static storage: one copy, and blocks never overlap. Warp-collective wmma runs whole
// in every lane (each lane reads, multiplies and stores the full tile; the stores agree).
#pragma once
#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <array>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__

struct uint3 { unsigned x, y, z; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float2 make_float2(float a, float b) { return float2{a, b}; }

template <class T, class U>
inline T ds_sim_bits(U u) { static_assert(sizeof(T) == sizeof(U), "bit cast size"); T t; std::memcpy(&t, &u, sizeof t); return t; }

struct __half {  // converts from and to float like cuda_fp16.h's (round to nearest even)
  uint16_t bits;
  __half() = default;
  __half(float f) : bits(ds_sim_bits<uint16_t>((_Float16)f)) {}
  operator float() const { return (float)ds_sim_bits<_Float16>(bits); }
};
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __ushort_as_half(unsigned short u) { __half h; h.bits = u; return h; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
// PTX's mul.rn.f16x2 on words: each half's product exact in double (two f16 values' product fits its 53 bits),
// rounded once to f16.
inline double ds_sim_h(uint32_t w, int i) { return (double)ds_sim_bits<_Float16>((uint16_t)(w >> (16 * i))); }
inline uint32_t ds_sim_h2(double lo, double hi) {
  return ds_sim_bits<uint16_t>((_Float16)lo) | ((uint32_t)ds_sim_bits<uint16_t>((_Float16)hi) << 16);
}
inline uint32_t ds_sim_hmul2(uint32_t a, uint32_t b) {
  return ds_sim_h2(ds_sim_h(a, 0) * ds_sim_h(b, 0), ds_sim_h(a, 1) * ds_sim_h(b, 1));
}
// fma.rn.f16x2: the product exact in double, the sum rounded there and then to f16 (one rounding wherever the sum
// fits double's 53 bits, as it does for mm's IQ2_XXS decoding: integers below 2^17).
inline uint32_t ds_sim_hfma2(uint32_t a, uint32_t b, uint32_t c) {
  return ds_sim_h2(ds_sim_h(a, 0) * ds_sim_h(b, 0) + ds_sim_h(c, 0), ds_sim_h(a, 1) * ds_sim_h(b, 1) + ds_sim_h(c, 1));
}

inline uint16_t ds_sim_bf16_bits(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  const uint32_t u = ds_sim_bits<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : bits(ds_sim_bf16_bits(f)) {}
  operator float() const { return ds_sim_bits<float>((uint32_t)bits << 16); }
};
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return (float)b; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }

inline float __uint_as_float(uint32_t u) { return ds_sim_bits<float>(u); }
inline uint32_t __float_as_uint(float f) { return ds_sim_bits<uint32_t>(f); }
inline int __popc(uint32_t x) { return __builtin_popcount(x); }
// PRMT: byte i of the result is byte s[i] (low nibble bits 0-2) of the 8-byte pair {b, a}.
inline uint32_t __byte_perm(uint32_t a, uint32_t b, uint32_t s) {
  const uint64_t v = ((uint64_t)b << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7u))) & 255u) << (8 * i);
  return r;
}
template <class T> inline T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }

namespace ds_sim {
enum State { RUN, AT_SYNCTHREADS, AT_SYNCWARP, DONE };
struct Fiber {
  ucontext_t ctx;  // only to start the fiber on its stack; switches are _setjmp/_longjmp (no signal-mask syscall)
  jmp_buf jb;
  State state;
  bool started;
  uint3 tid;
};
struct Block {
  std::vector<Fiber> fibers;
  std::vector<uint64_t> slots;  // one shuffle slot per thread
  std::vector<std::array<uint32_t, 6>> frags;  // one mma operand set per thread
  ucontext_t boot;  // written by the swapcontext that starts a fiber, never resumed
  jmp_buf main;
  int cur = 0;
  uint3 bid, bdim, gdim;
  std::function<void()> body;
};
inline Block* g = nullptr;
constexpr size_t kStack = 128 * 1024;

inline Fiber& me() { return g->fibers[g->cur]; }
inline void wait(State s) {
  me().state = s;
  if (!_setjmp(me().jb)) _longjmp(g->main, 1);
}
inline void entry() {  // a fiber runs its thread of every block of the launch, started once
  for (;;) {
    g->body();
    me().state = DONE;
    if (!_setjmp(me().jb)) _longjmp(g->main, 1);  // resumed here for the next block
  }
}
inline void resume(int i) {
  Fiber& f = g->fibers[i];
  g->cur = i;
  if (_setjmp(g->main)) return;  // back from the fiber's wait or its end
  if (!f.started) {
    f.started = true;
    swapcontext(&g->boot, &f.ctx);
  }
  _longjmp(f.jb, 1);
}

// Runs every thread of the current block to completion; false on a deadlock.
inline bool run_block() {
  const int n = (int)g->fibers.size();
  for (Fiber& f : g->fibers) f.state = RUN;
  for (;;) {
    for (int i = 0; i < n; ++i)
      if (g->fibers[i].state == RUN) resume(i);
    bool released = false, all_done = true, all_sync = true;
    for (int w = 0; w < n; w += 32) {  // a warp whose live lanes all wait at __syncwarp goes on
      bool any = false, all = true;
      for (int i = w; i < n && i < w + 32; ++i) {
        const State s = g->fibers[i].state;
        if (s == DONE) continue;
        any = true;
        all = all && s == AT_SYNCWARP;
      }
      if (any && all) {
        for (int i = w; i < n && i < w + 32; ++i)
          if (g->fibers[i].state == AT_SYNCWARP) g->fibers[i].state = RUN;
        released = true;
      }
    }
    if (released) continue;
    for (const Fiber& f : g->fibers) {
      all_done = all_done && f.state == DONE;
      all_sync = all_sync && (f.state == DONE || f.state == AT_SYNCTHREADS);
    }
    if (all_done) return true;
    if (!all_sync) return false;  // lanes of one warp wait at different barriers
    for (Fiber& f : g->fibers)
      if (f.state == AT_SYNCTHREADS) f.state = RUN;
  }
}

// Runs body on grid blocks of block threads; nullptr or an error message.
inline const char* launch(uint3 grid, uint3 block, std::function<void()> body) {
  Block b;
  const size_t n = (size_t)block.x * block.y * block.z;
  b.fibers.resize(n);
  b.slots.resize(n);
  b.frags.resize(n);
  static std::vector<char*> stacks;  // kept for later launches (uninitialized: no memset of n * kStack)
  while (stacks.size() < n) stacks.push_back(new char[kStack]);
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks[i];
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    f.started = false;
    makecontext(&f.ctx, entry, 0);
  }
  b.bdim = block;
  b.gdim = grid;
  b.body = std::move(body);
  for (unsigned i = 0; i < n; ++i) b.fibers[i].tid = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
  g = &b;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.bid = uint3{x, y, z};
        if (!run_block()) { g = nullptr; return "deadlock: the threads of a warp wait at different barriers"; }
      }
  g = nullptr;
  return nullptr;
}

template <class T> inline T shuffle(T v, int src_lane) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a wide type");
  const int t = g->cur;  // the running thread's index in the block
  uint64_t s = 0;
  std::memcpy(&s, &v, sizeof(T));
  g->slots[t] = s;
  wait(AT_SYNCWARP);  // every lane has written its slot
  T r;
  std::memcpy(&r, &g->slots[(t & ~31) | (src_lane & 31)], sizeof(T));
  wait(AT_SYNCWARP);  // every lane has read before a later shuffle overwrites
  return r;
}

// PTX mma.m16n8k16 (f16 or bf16 inputs, f32 accumulation) across a warp, in PTX's fragment layout (mm.h
// ds_mma16816): every lane posts its A and B registers, then computes its own 4 outputs from all of them, the
// products exact and summed in double (the tensor cores' order of summation is their own).
inline double ds_sim_bf(uint32_t w, int i) { return (double)ds_sim_bits<float>((w >> (16 * i)) << 16); }
inline void mma16816(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1,
                     bool bf16) {
  auto h = bf16 ? ds_sim_bf : ds_sim_h;
  const int t = g->cur, w = t & ~31, gid = (t & 31) >> 2, tq = t & 3;
  g->frags[t] = {a0, a1, a2, a3, b0, b1};
  wait(AT_SYNCWARP);  // every lane has posted
  auto a_at = [&](int r, int k) {  // A[r][k]: lane (r % 8)·4 + (k % 8) / 2, register (r ≥ 8) + 2·(k ≥ 8)
    return h(g->frags[w + 4 * (r & 7) + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)], k & 1);
  };
  auto b_at = [&](int k, int n) {  // B[k][n]: lane 4n + (k % 8) / 2, register k ≥ 8
    return h(g->frags[w + 4 * n + ((k & 7) >> 1)][4 + (k >> 3)], k & 1);
  };
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int r = gid + 8 * (i >> 1), n = 2 * tq + (i & 1);
    double s = 0.0;
    for (int k = 0; k < 16; ++k) s += a_at(r, k) * b_at(k, n);
    out[i] = (float)((double)d[i] + s);
  }
  wait(AT_SYNCWARP);  // every lane has read before a later mma overwrites
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// PTX ldmatrix.m8n8.x4 (mm.h ds_ldsm_x4) across a warp: every lane posts its row address, then takes its two
// 16-bit values of each of the four matrices from the rows the other lanes posted.
inline void ldmatrix_x4(uint32_t* r, const void* p, bool trans) {
  const int t = g->cur, w = t & ~31, l = t & 31;
  g->slots[t] = (uint64_t)(uintptr_t)p;
  wait(AT_SYNCWARP);  // every lane has posted
  for (int i = 0; i < 4; ++i) {
    auto row = [&](int j) { return (const uint16_t*)(uintptr_t)g->slots[w + 8 * i + j]; };
    const uint16_t lo = trans ? row(2 * (l & 3))[l >> 2] : row(l >> 2)[2 * (l & 3)];
    const uint16_t hi = trans ? row(2 * (l & 3) + 1)[l >> 2] : row(l >> 2)[2 * (l & 3) + 1];
    r[i] = lo | ((uint32_t)hi << 16);
  }
  wait(AT_SYNCWARP);  // every lane has read before a later exchange overwrites
}
}  // namespace ds_sim

#define threadIdx (::ds_sim::me().tid)
#define blockIdx (::ds_sim::g->bid)
#define blockDim (::ds_sim::g->bdim)
#define gridDim (::ds_sim::g->gdim)
inline void __syncthreads() { ds_sim::wait(ds_sim::AT_SYNCTHREADS); }
inline void __syncwarp(unsigned = 0xffffffffu) { ds_sim::wait(ds_sim::AT_SYNCWARP); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m, int = 32) {
  return ds_sim::shuffle(v, (ds_sim::g->cur & 31) ^ m);
}
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
  const int lane = ds_sim::g->cur & 31;
  return ds_sim::shuffle(v, lane + (int)d < 32 ? lane + (int)d : lane);
}
template <class T> inline T __shfl_sync(unsigned, T v, int src, int = 32) { return ds_sim::shuffle(v, src); }

// cp.async stand-ins (ds_prelude.h under DS_SIM): the copy happens at once; commit and wait do nothing.
inline void ds_sim_copy8(void* dst, const void* src) { std::memcpy(dst, src, 8); }
#define ds_sim_mma16816 ::ds_sim::mma16816
#define ds_sim_ldmatrix_x4 ::ds_sim::ldmatrix_x4

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static constexpr int R = std::is_same<Use, matrix_b>::value ? K : M;
  static constexpr int C = std::is_same<Use, matrix_a>::value ? K : N;
  float x[R * C];
};
template <class U, int M, int N, int K, class T, class L>
inline void fill_fragment(fragment<U, M, N, K, T, L>& f, float v) { for (float& e : f.x) e = v; }
inline float ds_sim_wmma_elem(const __nv_bfloat16& v) { return __bfloat162float(v); }
inline float ds_sim_wmma_elem(const float& v) { return v; }
inline float ds_sim_wmma_elem(const __half& v) { return __half2float(v); }
template <class U, int M, int N, int K, class T, class L, class P>
inline void load_matrix_sync(fragment<U, M, N, K, T, L>& f, const P* p, unsigned ldm) {
  using F = fragment<U, M, N, K, T, L>;
  for (int r = 0; r < F::R; ++r)
    for (int c = 0; c < F::C; ++c)
      f.x[r * F::C + c] = ds_sim_wmma_elem(std::is_same<L, col_major>::value ? p[c * ldm + r] : p[r * ldm + c]);
}
template <int M, int N, int K, class TA, class LA, class TB, class LB, class TC>
inline void mma_sync(fragment<accumulator, M, N, K, TC>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, TC>& c) {
  fragment<accumulator, M, N, K, TC> out;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float s = c.x[i * N + j];
      for (int k = 0; k < K; ++k) s += a.x[i * K + k] * b.x[k * N + j];
      out.x[i * N + j] = s;
    }
  d = out;
}
template <int M, int N, int K, class T>
inline void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) (layout == mem_col_major ? p[j * ldm + i] : p[i * ldm + j]) = f.x[i * N + j];
}
}  // namespace wmma
}  // namespace nvcuda
namespace cooperative_groups {}
