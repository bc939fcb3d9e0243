// Portable 8-wide float32 vectors (GCC/Clang vector extensions) for the row
// loops: loads convert float32/bfloat16/float16 to float32 in registers and
// stores round back once. Each kernel source is compiled once per ISA (see
// CMakeLists.txt): the same code becomes SSE2 or AVX2+FMA+F16C instructions;
// the AVX-512 build runs the elementwise loops 16 wide (ForRowWide, below).
#ifndef JAX_NORMGRAD_CSRC_SIMD_H_
#define JAX_NORMGRAD_CSRC_SIMD_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "common.h"

namespace jax_normgrad {
namespace JNG_ISA {

constexpr int kVec = 8;
typedef float VF __attribute__((vector_size(32)));
typedef uint32_t VU32 __attribute__((vector_size(32)));
typedef int32_t VI32 __attribute__((vector_size(32)));
typedef uint16_t VU16 __attribute__((vector_size(16)));
typedef _Float16 VH __attribute__((vector_size(16)));

// Tags select the vector body or the scalar tail of a row loop; the same
// generic lambda serves both, since float and VF share their operators.
// VecTagL<L> also names one of kLanes independent accumulator lanes (see Acc).
template <int L>
struct VecTagL {};
using VecTag = VecTagL<0>;
struct ScalarTag {};

inline VF Splat(float s) { return VF{} + s; }

// The same 32 bytes as the other type (float32 values <-> their bits).
inline VF AsFloat(VU32 u) {
  VF f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline VU32 AsBits(VF f) {
  VU32 u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Without AVX: the low and high 16-byte halves of v, by shuffles, in
// registers. There the 32 bytes are two SSE registers, and a memcpy from the
// vector's address (as stores did) goes through a stack copy and back.
#if defined(__SSE2__) && !defined(__AVX__)
inline __m128 LowHalf(VF v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3); }
inline __m128 HighHalf(VF v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7); }
#endif

// float16 <-> float32 by integer vector operations, for x86 without F16C:
// GCC converts _Float16 vectors there one element at a time through libgcc
// (~100 cycles each). Same results as the F16C instructions (and libgcc):
// exact widening, round to nearest even, NaN kept with its sign and top
// payload bits and made quiet. After F. Giesen's half_to_float /
// float_to_half_fast3_rtne, with every branch computed and selected.
#if defined(__SSE2__) && !defined(__F16C__)
inline VF HalfBitsToFloat(VU32 h) {
  constexpr uint32_t kExp = 0x7c00u << 13;        // float16's exponent field, shifted
  VU32 o = ((h & 0x7fffu) << 13) + ((127u - 15u) << 23);  // rebias the exponent
  const VU32 e = (h << 13) & kExp;
  const VU32 inf_nan = (VU32)(e == kExp);
  const VU32 nan = inf_nan & (VU32)((h & 0x3ffu) != 0);
  o += inf_nan & ((128u - 16u) << 23);             // exponent all ones
  o |= nan & 0x400000u;                            // quiet
  // Subnormal (and zero): one exponent step up, then subtract 2^-14 as a
  // float, which normalizes exactly.
  const VU32 sub = AsBits(AsFloat(o + (1u << 23)) - Splat(0x1p-14f));
  o = (VU32)(e == 0) ? sub : o;
  return AsFloat(o | ((h & 0x8000u) << 16));
}
inline VU32 FloatToHalfBits(VF v) {
  const VU32 u = AsBits(v);
  const VU32 sign = u & 0x80000000u;
  const VU32 a = u ^ sign;
  // Normal results: rebias, add half an ulp less one plus the kept lsb
  // (round to nearest even), keep the top bits; overflow carries into Inf.
  const VU32 normal = (a + (((uint32_t)(15 - 127) << 23) + 0xfffu) + ((a >> 13) & 1u)) >> 13;
  // Subnormal results: adding 2^-1 aligns the 10 kept bits at the bottom of
  // the mantissa, rounded to nearest even by the float addition itself.
  const VU32 sub = AsBits(AsFloat(a) + Splat(0.5f)) - 0x3f000000u;
  const VU32 inf_nan = (a > 0x7f800000u) ? (0x7e00u | ((a >> 13) & 0x3ffu)) : VU32{} + 0x7c00u;
  VU32 o = (a < (113u << 23)) ? sub : normal;
  o = (a >= ((127u + 16u) << 23)) ? inf_nan : o;
  return o | (sign >> 16);
}
#endif

// The vector of V's size at p, as it is in memory (unaligned).
template <typename V>
inline V LoadVec(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int L>
inline VF Ld(VecTagL<L>, const float* p) {
  return LoadVec<VF>(p);
}
template <int L>
inline VF Ld(VecTagL<L>, const BF16* p) {
#if defined(__AVX2__)
  // The 16 bytes into both halves of a register (vbroadcasti128 from memory
  // is a load alone), then one vpshufb puts word k in the high half of
  // float k: one vector instruction where vpmovzxwd + vpslld were two (and
  // GCC makes six of the generic form below). One-thread loops in L1, in
  // cycles per 8 bfloat16 (with Pack's change): GroupNorm's sum pass 1.12
  // -> 0.79, its variance pass 1.41 -> 1.05; tests/csrc/bf16_conversions.cc
  // checks every bfloat16 against ToFloat.
  const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i to_high_words = _mm256_setr_epi8(
      -1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
      -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
  return (VF)_mm256_castsi256_ps(_mm256_shuffle_epi8(h, to_high_words));
#else
  VU16 h;
  std::memcpy(&h, p, sizeof(h));
  return AsFloat(__builtin_convertvector(h, VU32) << 16);
#endif
}
template <int L>
inline VF Ld(VecTagL<L>, const F16* p) {
#if defined(__F16C__)
  // One vcvtph2ps: GCC 12 converts a _Float16 vector lane by lane (eight
  // scalar conversions and the shuffles between), which made the float16
  // kernels 4-6x slower than the bfloat16 ones.
  return (VF)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__SSE2__)
  VU16 h;
  std::memcpy(&h, p, sizeof(h));
  return HalfBitsToFloat(__builtin_convertvector(h, VU32));
#else
  VH h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, VF);
#endif
}
template <typename T>
inline float Ld(ScalarTag, const T* p) {
  return ToFloat(*p);
}

// Pack(p, v): v rounded to p's storage type, as the bytes of one vector.
inline VF Pack(const float*, VF v) { return v; }
inline VU16 Pack(const BF16*, VF v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  // One vcvtneps2bf16: round to nearest even, NaN made quiet from its high
  // word, as FromFloat<BF16>, except that it flushes subnormal inputs to
  // zero. vfpclassps finds those; a vector with one (never in practice, but
  // the results must not depend on the build) takes the AVX2 rounding below.
  // Subprocess A/B against the AVX2 build (Zen 5, 6 alternating rounds, all
  // six faster unless noted): 8192x1024 backward 1.76 -> 1.60 ms (5 of 6),
  // forward 1.20 -> 0.96; GroupNorm 4x512x64x64 backward 1.18 -> 1.03,
  // forward 1.00 -> 0.79; float32 unchanged (0.97-1.04x).
  if (__builtin_expect(_mm256_fpclass_ps_mask((__m256)v, 0x20 /* subnormal */) == 0, 1))
    return (VU16)_mm256_cvtneps_pbh((__m256)v);
#endif
#if defined(__AVX2__)
  // The rounding below with the result left in each float's high word, so
  // no shift: u + 0x7fff + lsb is u + 0x8000 + (lsb ? 0 : -1), the -1 an
  // equality mask. NaN: u with the quiet bit set, chosen by one unordered
  // compare. One vpshufb gathers the high words of each 128-bit half and
  // vpermq joins the halves. Nine vector instructions where the former
  // (shift, mask, add, add, shift, then vpackusdw + vpermq) took ten, two
  // of them shifts. One-thread loops in L1, cycles per 8 bfloat16: load x
  // and dy, compute, Pack, store 6.65 -> 5.63 (with Ld's change); the
  // output pass of GroupNorm's forward 5.5-6.3 -> 4.5-4.6. Bitwise the same
  // as FromFloat<BF16> on all 2^32 floats (tests/csrc/bf16_conversions.cc
  // checks the ties, carries and NaNs of every high part).
  const __m256i u = _mm256_castps_si256((__m256)v);
  const __m256i lsb_clear =
      _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x10000)), _mm256_setzero_si256());
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), lsb_clear);
  const __m256i nan = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, nan, is_nan);
  const __m256i high_words = _mm256_setr_epi8(
      2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
      2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, high_words), 0x08);
  return (VU16)_mm256_castsi256_si128(packed);
#else
  const VU32 u = AsBits(v);
  // Round to nearest even; NaN stays a quiet NaN (as FromFloat<BF16>).
  VI32 is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  VU32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  VU32 nan = (u >> 16) | 0x40u;
  VU32 r = is_nan ? nan : rounded;
  return __builtin_convertvector(r, VU16);
#endif
}
inline VH Pack(const F16*, VF v) {
#if defined(__F16C__)
  // One vcvtps2ph, round to nearest even: the scalar conversion's rounding
  // and NaN handling (the same instruction on one lane), see Ld above.
  return (VH)_mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT);
#elif defined(__SSE2__)
  VH h;
  const VU16 bits = __builtin_convertvector(FloatToHalfBits(v), VU16);
  std::memcpy(&h, &bits, sizeof(h));
  return h;
#else
  return __builtin_convertvector(v, VH);
#endif
}

template <int L, typename T>
inline void St(VecTagL<L>, T* p, VF v) {
  const auto packed = Pack(p, v);
#if defined(__SSE2__) && !defined(__AVX__)
  if constexpr (sizeof(packed) == 32) {
    // By halves (see LowHalf): a memcpy of the whole vector went through
    // the stack on every store.
    _mm_storeu_ps(reinterpret_cast<float*>(p), LowHalf(packed));
    _mm_storeu_ps(reinterpret_cast<float*>(p) + 4, HighHalf(packed));
    return;
  }
#endif
  std::memcpy(p, &packed, sizeof(packed));
}
template <typename T>
inline void St(ScalarTag, T* p, float v) {
  *p = FromFloat<T>(v);
}

// StStream: St by non-temporal stores, which write whole lines to memory
// without first reading them into the cache (a plain store's read for
// ownership: a fourth memory pass in a backward that reads x and dy and
// writes dx). For outputs too big to stay in cache anyway. p must be
// aligned to the packed vector's size; only inside ParallelFor tasks, which
// end with the fence these stores need (StoreFence in common.h).
template <int L, typename T>
inline void StStream([[maybe_unused]] VecTagL<L> tag, T* p, VF v) {
#if defined(__SSE2__)
  const auto packed = Pack(p, v);
  static_assert(sizeof(packed) == 16 || sizeof(packed) == 32, "one or two 16-byte pieces");
  if constexpr (sizeof(packed) == 32) {
#if defined(__AVX__)
    _mm256_stream_ps(reinterpret_cast<float*>(p), (__m256)packed);
#else
    _mm_stream_ps(reinterpret_cast<float*>(p), LowHalf(packed));
    _mm_stream_ps(reinterpret_cast<float*>(p) + 4, HighHalf(packed));
#endif
  } else {
    __m128i piece;
    std::memcpy(&piece, &packed, 16);
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), piece);
  }
#else
  St(tag, p, v);
#endif
}
template <typename T>
inline void StStream(ScalarTag tag, T* p, float v) {
  St(tag, p, v);
}
// Whether a kernel whose 16-bit output rows could stream (LayerNorm's
// backward; GroupNorm's kernels stream them in every build) should. The
// build stands in for the core: AVX-512 BF16 means Zen 4/5 or Sapphire
// Rapids and later. Zen 5, subprocess A/B of the backward, 6 rounds:
// 8192x1024 bfloat16 1.69 -> 1.40 ms (6 of 6), float16 1.48 -> 1.35 (5),
// 256x32768 bfloat16 3.03 -> 2.77 (5), 16384x512 bfloat16 1.51 -> 1.47
// (3). Zen 3 (the AVX2 build's machines), 8192x1024 bfloat16: 0.8-0.95x
// as fast as plain stores, in three interleaved runs.
#if defined(__AVX512BF16__)
constexpr bool kStreamNarrowRows = true;
#else
constexpr bool kStreamNarrowRows = false;
#endif
// Whether an output row starting at p is written by StStream: when the
// kernel streams its output (StreamOutput) and p is aligned to a vector's
// bytes, as the row loop's vector stores (at multiples of kVec elements from
// p) then all are. Otherwise plain stores, same values.
template <typename T>
inline bool StreamRow(bool stream_output, const T* p) {
  constexpr uintptr_t kBytes = kVec * sizeof(T);
  return stream_output && reinterpret_cast<uintptr_t>(p) % kBytes == 0;
}
// St, or StStream where the row streams (StreamRow).
template <typename Tag, typename T, typename V>
inline void StOut(Tag tag, T* p, V v, bool stream) {
  if (stream) StStream(tag, p, v);
  else St(tag, p, v);
}

// Prefetches the cache line at p once per 64 bytes of a row loop (the
// vectors of a step that start a line; p is the element at the vector).
template <int L, typename T>
inline void PrefetchLine(VecTagL<L>, const T* p) {
  if constexpr ((L * kVec * sizeof(T)) % 64 == 0) __builtin_prefetch(p);
}
template <typename T>
inline void PrefetchLine(ScalarTag, const T*) {}
// Whether a row loop should prefetch the next row while it works on this
// one in cache: rows of up to 64 KiB per array. Longer ones are left to the
// hardware prefetcher. Interleaved A/B against the former 16 KiB limit, with
// large outputs streamed past the cache (StStream): rows of 8192 and 16384
// elements 1.1-1.3x faster in the backward and the forward. (Before the
// streaming stores, 64 KiB rows measured 6% slower; 128 KiB rows now
// measure 0.9-1.3x, mixed.) Zen 5 (1 MiB L2), 6 rounds with inputs from
// memory, 128 KiB rows: backward 128x65536 bfloat16 1.25x, 256x32768
// float32 0.92x; forward 0.99-1.08x over two runs. Left at 64 KiB.
template <typename T>
inline bool PrefetchNextRow(int64_t n) {
  return n * static_cast<int64_t>(sizeof(T)) <= (int64_t{64} << 10);
}
// Whether a loop over blocks that reads each block from cache after a first
// pass from memory (GroupNorm's forward: sum, variance, output; y streams
// past the cache) should prefetch the next block during its last pass:
// blocks of up to a quarter of the L2, so a block and the next fit in half
// of it (128 KiB on Zen 3's 512 KiB L2, 256 KiB on Zen 5's 1 MiB). Only
// where loads are issued changes, never a value. Forward of 4x512x64x64 in
// 32 groups, interleaved A/B: Zen 3, bfloat16 (128 KiB blocks) 2.56 -> 2.10
// ms, 5 of 6 rounds faster, float32 (256 KiB) 2.88 -> 2.80, 2 of 6, no
// gain there; Zen 5, float32 with inputs from memory 1.63 -> 1.59 and 1.83
// -> 1.70 in two 6-round runs, 5 of 6 rounds faster in each.
template <typename T>
inline bool PrefetchNextBlock(int64_t n) {
  return n * static_cast<int64_t>(sizeof(T)) <= L2CacheBytes() / 4;
}

// Row loops are unrolled over this many vectors; each gets its own
// accumulator lane, so a reduction is not one serial chain of 4-cycle adds.
constexpr int kLanes = 4;

// A float32 sum with kLanes vector lanes and a scalar (tail) part, combined
// in a fixed order: deterministic. Add(tag, x) adds into the tag's lane.
struct Acc {
  VF v[kLanes] = {};
  float s = 0.f;
  template <int L>
  void Add(VecTagL<L>, VF x) {
    v[L] += x;
  }
  void Add(ScalarTag, float x) { s += x; }
  // The lanes, then the 8 floats by halves (t[k] += t[k + w] for w = 4, 2,
  // 1), then the scalar part: the same additions in the same order on every
  // ISA. Inlined and in registers: GCC had made the loop below an
  // out-of-line call through the stack, and short rows pay it twice per row
  // (the backward of in-cache 256-element rows was ~20% slower).
  __attribute__((always_inline)) float Sum() const {
    VF u = (v[0] + v[1]) + (v[2] + v[3]);
#if defined(__SSE2__)
    __m128 lo, hi;
    std::memcpy(&lo, &u, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<const char*>(&u) + sizeof(lo), sizeof(hi));
    __m128 q = _mm_add_ps(lo, hi);               // w = 4
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));      // w = 2
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));  // w = 1
    return _mm_cvtss_f32(q) + s;
#else
    float t[kVec];
    std::memcpy(t, &u, sizeof(t));
    for (int w = kVec / 2; w > 0; w /= 2)
      for (int k = 0; k < w; ++k) t[k] += t[k + w];
    return t[0] + s;
#endif
  }
};
static_assert(kLanes == 4, "Acc::Sum combines exactly four lanes");

// Calls body(VecTagL<l>, j) for j = 0, 8, 16, ... while 8 elements remain
// (kLanes vectors per step, lane l = the vector's place in the step; lane 0
// for the last < kLanes vectors), then body(ScalarTag, j) for the tail.
// Always inlined: an out-of-line loop would reach the body's captured
// scalars through a pointer and reload them on every vector (the stores
// might alias them), 30% slower where it happened.
template <typename Body>
__attribute__((always_inline)) inline void ForRow(int64_t n, const Body& body) {
  int64_t j = 0;
  for (; j + kLanes * kVec <= n; j += kLanes * kVec) {
    body(VecTagL<0>{}, j);
    body(VecTagL<1>{}, j + kVec);
    body(VecTagL<2>{}, j + 2 * kVec);
    body(VecTagL<3>{}, j + 3 * kVec);
  }
  for (; j + kVec <= n; j += kVec) body(VecTagL<0>{}, j);
  for (; j < n; ++j) body(ScalarTag{}, j);
}

// ---------------------------------------------------------------------------
// 16-wide vectors for the elementwise loops (ForRowWide) of the avx512bf16
// build. The row reductions stay 8-wide (ForRow, Acc): their summation order
// is the same on every ISA. An elementwise loop computes each element by the
// same operations whatever the width, so it may run on 512-bit vectors and
// give the same bits: the output passes are the kernels' longest (load x,
// parameters, convert, compute, round, store), and half the instructions
// per element make them faster wherever the kernels compute rather than
// wait for memory, as the 16-bit ones do even from memory. One thread,
// 32x1024 in L2, Zen 5, cycles per element: LayerNorm's output pass
// float32 0.36 -> 0.29, bfloat16 0.42 -> 0.28; its whole forward 0.64 ->
// 0.55 and 0.74 -> 0.58. Subprocess A/B, 6 alternating rounds: bfloat16
// and float16 LayerNorm/GroupNorm forward and backward 1.05-1.33x in cache
// (1024x1024, 256x4096, 1024x512, 2x64x32x32; 4-6 of 6 rounds faster).
// From memory, 8192x1024 bfloat16: forward 0.85-1.0 -> 0.68-0.71 ms in a
// tight loop; four A/B runs 0.73-1.61x forward, 0.89-1.33x backward (this
// machine's noise). float32 within noise (memory-bound; in cache
// 0.95-1.10x).
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
#define JNG_WIDE_VECTORS 1
constexpr int kWideVec = 16;
typedef float VW __attribute__((vector_size(64)));

template <int L>
struct WideTagL {};

// All 16 lanes, for the zero-masked forms of the conversions below: GCC
// 12's unmasked ones pass an undefined vector that -Wmaybe-uninitialized
// reports; the same instructions.
constexpr __mmask16 kAllLanes = 0xffff;

template <int L>
inline VW Ld(WideTagL<L>, const float* p) {
  return LoadVec<VW>(p);
}
template <int L>
inline VW Ld(WideTagL<L>, const BF16* p) {
  // vpmovzxwd + vpslld: the word in each float's high half, as Ld's vpshufb.
  const __m512i w = _mm512_maskz_cvtepu16_epi32(kAllLanes, LoadVec<__m256i>(p));
  return (VW)_mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAllLanes, w, 16));
}
template <int L>
inline VW Ld(WideTagL<L>, const F16* p) {
  return (VW)_mm512_maskz_cvtph_ps(kAllLanes, LoadVec<__m256i>(p));
}

// Pack for 16 floats, by the same roundings as the 8-wide Pack.
inline VW Pack(const float*, VW v) { return v; }
inline __m256i Pack(const BF16* p, VW v) {
  if (__builtin_expect(_mm512_fpclass_ps_mask((__m512)v, 0x20 /* subnormal */) == 0, 1))
    return (__m256i)_mm512_cvtneps_pbh((__m512)v);
  // A subnormal: both halves by the 8-wide Pack's exact rounding.
  const VU16 lo = Pack(p, VF(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)));
  const VU16 hi = Pack(p, VF(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
  return _mm256_set_m128i((__m128i)hi, (__m128i)lo);
}
inline __m256i Pack(const F16*, VW v) {
  return _mm512_maskz_cvtps_ph(kAllLanes, (__m512)v, _MM_FROUND_TO_NEAREST_INT);
}

template <int L, typename T>
inline void St(WideTagL<L>, T* p, VW v) {
  const auto packed = Pack(p, v);
  std::memcpy(p, &packed, sizeof(packed));
}
// p aligned to the packed vector's size (64 or 32 bytes; see ForRowWide).
template <int L, typename T>
inline void StStream(WideTagL<L>, T* p, VW v) {
  const auto packed = Pack(p, v);
  if constexpr (sizeof(packed) == 64) {
    _mm512_stream_ps(reinterpret_cast<float*>(p), (__m512)packed);
  } else {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), packed);
  }
}
template <int L, typename T>
inline void PrefetchLine(WideTagL<L>, const T* p) {
  if constexpr ((L * kWideVec * sizeof(T)) % 64 == 0) __builtin_prefetch(p);
}
#endif

// Calls body(tag, j) over a row of n elements, as ForRow, for a body that is
// elementwise (no reduction across j; each element's value independent of
// the vector width). The avx512bf16 build runs it on 16-wide vectors, two per
// step, after one 8-wide vector where `out` (the row's output, of
// `out_bytes`-byte elements; null for none) is aligned to 8 elements but not
// 16, so that streaming stores (StreamRow) stay aligned; then 8-wide and
// scalar tails. Other builds: ForRow.
template <typename Body>
__attribute__((always_inline)) inline void ForRowWideOf([[maybe_unused]] const void* out,
                                                        [[maybe_unused]] uintptr_t out_bytes,
                                                        int64_t n, const Body& body) {
#if defined(JNG_WIDE_VECTORS)
  int64_t j = 0;
  const uintptr_t narrow_bytes = kVec * out_bytes, wide_bytes = kWideVec * out_bytes;
  if (out && (reinterpret_cast<uintptr_t>(out) & (wide_bytes - 1)) == narrow_bytes && n >= kVec) {
    body(VecTagL<0>{}, j);
    j += kVec;
  }
  for (; j + 2 * kWideVec <= n; j += 2 * kWideVec) {
    body(WideTagL<0>{}, j);
    body(WideTagL<1>{}, j + kWideVec);
  }
  for (; j + kWideVec <= n; j += kWideVec) body(WideTagL<0>{}, j);
  for (; j + kVec <= n; j += kVec) body(VecTagL<0>{}, j);
  for (; j < n; ++j) body(ScalarTag{}, j);
#else
  ForRow(n, body);
#endif
}
template <typename T, typename Body>
__attribute__((always_inline)) inline void ForRowWide(const T* out, int64_t n, const Body& body) {
  ForRowWideOf(out, sizeof(T), n, body);
}

// a * b + c, as one FMA in the builds that have it (the rounding GCC's
// contraction of the expression gives there) and a multiply and an add in
// the others: for a loop whose multiply and add a branch separates, where
// GCC would contract nothing.
inline float MulAdd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}
inline VF MulAdd(VF a, VF b, VF c) {
#if defined(__FMA__)
  return (VF)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
#if defined(JNG_WIDE_VECTORS)
inline VW MulAdd(VW a, VW b, VW c) { return (VW)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#endif

// A pointer to elements of T or of float32, which of the two chosen at run
// time: an operand that is in x's dtype T or in float32 (the y of a 16-bit x
// with a float32 result, the dy of its backward). A loop compiled for x's
// dtype alone loads and stores through it (Ld, St, StOut, PrefetchLine below),
// a branch per vector that every vector of a call takes the same way, where
// each dtype of the operand would be a copy of the loop; for T = float there
// is one type and no branch. Input and output alike (an input is never
// stored to). A branch between a multiply and the add of its result keeps
// GCC from contracting the two into one FMA, which rounds differently in
// the builds with FMA: where one would, MulAdd makes the FMA explicit.
template <typename T>
class XOrF32 {
 public:
  XOrF32() = default;
  XOrF32(const void* p, bool f32)
      : p_(static_cast<char*>(const_cast<void*>(p))), f32_(std::is_same_v<T, float> || f32) {}
  bool f32() const { return std::is_same_v<T, float> || f32_; }
  uintptr_t elem_bytes() const { return f32() ? sizeof(float) : sizeof(T); }
  XOrF32 operator+(int64_t k) const {
    XOrF32 r = *this;
    r.p_ += k * static_cast<int64_t>(elem_bytes());
    return r;
  }
  T* as_x() const { return reinterpret_cast<T*>(p_); }
  float* as_f32() const { return reinterpret_cast<float*>(p_); }
  const void* get() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  char* p_ = nullptr;
  bool f32_ = false;
};

// The XOrF32 view of `data`, an operand of dtype `dtype` beside x's
// `x_dtype`: an error naming `what` unless that is x's dtype or float32.
template <typename T>
ffi::Error XOrF32Of(ffi::DataType dtype, ffi::DataType x_dtype, const char* what,
                    const void* data, XOrF32<T>* out) {
  if (dtype != x_dtype && dtype != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string(what) + ": dtype must be x's or float32");
  *out = XOrF32<T>(data, dtype != x_dtype);
  return ffi::Error::Success();
}

template <typename Tag, typename T>
inline auto Ld(Tag tag, XOrF32<T> p) {
  if constexpr (!std::is_same_v<T, float>) {
    if (!p.f32()) return Ld(tag, static_cast<const T*>(p.as_x()));
  }
  return Ld(tag, static_cast<const float*>(p.as_f32()));
}
template <typename Tag, typename T, typename V>
inline void St(Tag tag, XOrF32<T> p, V v) {
  if constexpr (!std::is_same_v<T, float>) {
    if (!p.f32()) return St(tag, p.as_x(), v);
  }
  St(tag, p.as_f32(), v);
}
template <typename Tag, typename T, typename V>
inline void StOut(Tag tag, XOrF32<T> p, V v, bool stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (!p.f32()) return StOut(tag, p.as_x(), v, stream);
  }
  StOut(tag, p.as_f32(), v, stream);
}
template <typename Tag, typename T>
inline void PrefetchLine(Tag tag, XOrF32<T> p) {
  if constexpr (!std::is_same_v<T, float>) {
    if (!p.f32()) return PrefetchLine(tag, static_cast<const T*>(p.as_x()));
  }
  PrefetchLine(tag, static_cast<const float*>(p.as_f32()));
}
template <typename T>
inline bool StreamRow(bool stream_output, XOrF32<T> p) {
  return p.f32() ? StreamRow(stream_output, p.as_f32()) : StreamRow(stream_output, p.as_x());
}
template <typename T, typename Body>
__attribute__((always_inline)) inline void ForRowWide(XOrF32<T> out, int64_t n, const Body& body) {
  ForRowWideOf(out.get(), out.elem_bytes(), n, body);
}

}  // namespace JNG_ISA
}  // namespace jax_normgrad

#endif  // JAX_NORMGRAD_CSRC_SIMD_H_
