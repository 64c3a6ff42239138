// Metal Shading Language, enough of it to compile kernel sources as C++ (g++ -std=c++17).
// Pasted in front of every emulated kernel; see metal_emulator/__init__.py for the limits.
#include <stddef.h>
#include <stdint.h>

#include <type_traits>

extern "C" {
struct emu_thread_info {
  uint32_t thread_position_in_grid[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t grid_origin[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
};
typedef void (*emu_reduce_fn)(const unsigned char* values, int stride, int n, void* out);
void emu_tg_barrier(void);
void emu_simd_barrier(void);
int emu_simd_lane_count(void);
void emu_simd_reduce(const void* mine, unsigned size, emu_reduce_fn fn, void* out);
void emu_simd_shuffle(const void* mine, unsigned size, int mode, int arg, void* out);
int emu_simd_gather(const void* mine, unsigned size, void* all);
void* emu_tg_var(int id, unsigned size, unsigned align);
void emu_fail(const char* msg);
int emu_simd_lane_id(void);
}

// Address spaces and function qualifiers: everything is one flat address space here.
#define device
#define constant
#define thread
#define threadgroup
#define threadgroup_imageblock
#define ray_data
#define object_data
#define METAL_FUNC inline __attribute__((always_inline))
#define METAL_CONST static constexpr const
#define MLX_MTL_CONST static constexpr const
#define STEEL_CONST static constexpr const
#define MLX_MTL_PRAGMA_UNROLL

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;

namespace metal {

// ----------------------------------------------------------------------- bfloat
namespace emu_detail {
inline uint16_t f2bf(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return uint16_t(u >> 16);
}
inline float bf2f(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
}  // namespace emu_detail

struct bfloat;
template <typename U>
struct is_emu_scalar
    : std::integral_constant<bool, std::is_arithmetic<U>::value || std::is_same<U, half>::value ||
                                       std::is_same<U, bfloat>::value> {};

struct bfloat {
  uint16_t bits_;
  bfloat() = default;
  template <typename U, typename = typename std::enable_if<std::is_arithmetic<U>::value || std::is_same<U, half>::value>::type>
  bfloat(U v) : bits_(emu_detail::f2bf(static_cast<float>(v))) {}
  operator float() const { return emu_detail::bf2f(bits_); }
  bfloat operator-() const { return bfloat(-float(*this)); }
};

#define EMU_BF_BINOP(op)                                                                          \
  inline bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); }         \
  template <typename U, typename = typename std::enable_if<std::is_arithmetic<U>::value ||         \
                                                           std::is_same<U, half>::value>::type>   \
  inline float operator op(bfloat a, U b) { return float(a) op static_cast<float>(b); }          \
  template <typename U, typename = typename std::enable_if<std::is_arithmetic<U>::value ||         \
                                                           std::is_same<U, half>::value>::type>   \
  inline float operator op(U a, bfloat b) { return static_cast<float>(a) op float(b); }          \
  inline bfloat& operator op##=(bfloat & a, bfloat b) { return a = bfloat(float(a) op float(b)); } \
  template <typename U>                                                                           \
  inline bfloat& operator op##=(bfloat & a, U b) { return a = bfloat(float(a) op static_cast<float>(b)); }
EMU_BF_BINOP(+)
EMU_BF_BINOP(-)
EMU_BF_BINOP(*)
EMU_BF_BINOP(/)
#undef EMU_BF_BINOP
#define EMU_BF_CMP(op)                                                                          \
  inline bool operator op(bfloat a, bfloat b) { return float(a) op float(b); }                 \
  template <typename U, typename = typename std::enable_if<std::is_arithmetic<U>::value ||       \
                                                           std::is_same<U, half>::value>::type> \
  inline bool operator op(bfloat a, U b) { return float(a) op static_cast<float>(b); }         \
  template <typename U, typename = typename std::enable_if<std::is_arithmetic<U>::value ||       \
                                                           std::is_same<U, half>::value>::type> \
  inline bool operator op(U a, bfloat b) { return static_cast<float>(a) op float(b); }
EMU_BF_CMP(==)
EMU_BF_CMP(!=)
EMU_BF_CMP(<)
EMU_BF_CMP(>)
EMU_BF_CMP(<=)
EMU_BF_CMP(>=)
#undef EMU_BF_CMP

// ----------------------------------------------------------------------- vectors
template <typename T, int N>
struct vec;

#define EMU_VEC_BODY(N)                                                            \
  vec() = default;                                                                 \
  explicit vec(T s) { for (int i = 0; i < N; i++) (*this)[i] = s; }               \
  template <typename U>                                                            \
  explicit vec(const vec<U, N>& o) { for (int i = 0; i < N; i++) (*this)[i] = T(o[i]); } \
  T& operator[](int i) { return (&x)[i]; }                                         \
  const T& operator[](int i) const { return (&x)[i]; }

template <typename T>
struct alignas(sizeof(T) * 2) vec<T, 2> {
  T x, y;
  EMU_VEC_BODY(2)
  vec(T a, T b) : x(a), y(b) {}
};
template <typename T>
struct alignas(sizeof(T) * 4) vec<T, 3> {
  T x, y, z;
  EMU_VEC_BODY(3)
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  vec(vec<T, 2> a, T c) : x(a.x), y(a.y), z(c) {}
};
template <typename T>
struct alignas(sizeof(T) * 4) vec<T, 4> {
  T x, y, z, w;
  EMU_VEC_BODY(4)
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  vec(vec<T, 2> a, vec<T, 2> b) : x(a.x), y(a.y), z(b.x), w(b.y) {}
  vec(vec<T, 3> a, T d) : x(a.x), y(a.y), z(a.z), w(d) {}
};
#undef EMU_VEC_BODY

#define EMU_VEC_BINOP(op)                                                                              \
  template <typename T, int N>                                                                         \
  inline vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) {                                      \
    for (int i = 0; i < N; i++) a[i] = T(a[i] op b[i]);                                                \
    return a;                                                                                          \
  }                                                                                                    \
  template <typename T, int N, typename U, typename = typename std::enable_if<is_emu_scalar<U>::value>::type> \
  inline vec<T, N> operator op(vec<T, N> a, U s) {                                                     \
    for (int i = 0; i < N; i++) a[i] = T(a[i] op T(s));                                                \
    return a;                                                                                          \
  }                                                                                                    \
  template <typename T, int N, typename U, typename = typename std::enable_if<is_emu_scalar<U>::value>::type> \
  inline vec<T, N> operator op(U s, vec<T, N> a) {                                                     \
    for (int i = 0; i < N; i++) a[i] = T(T(s) op a[i]);                                                \
    return a;                                                                                          \
  }                                                                                                    \
  template <typename T, int N, typename U>                                                             \
  inline vec<T, N>& operator op##=(vec<T, N>& a, const U& b) {                                          \
    return a = a op b;                                                                                 \
  }
EMU_VEC_BINOP(+)
EMU_VEC_BINOP(-)
EMU_VEC_BINOP(*)
EMU_VEC_BINOP(/)
EMU_VEC_BINOP(%)
EMU_VEC_BINOP(&)
EMU_VEC_BINOP(|)
EMU_VEC_BINOP(^)
EMU_VEC_BINOP(<<)
EMU_VEC_BINOP(>>)
#undef EMU_VEC_BINOP
template <typename T, int N>
inline vec<T, N> operator-(vec<T, N> a) {
  for (int i = 0; i < N; i++) a[i] = T(-a[i]);
  return a;
}
#define EMU_VEC_CMP(op)                                                   \
  template <typename T, int N>                                            \
  inline vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) { \
    vec<bool, N> r;                                                       \
    for (int i = 0; i < N; i++) r[i] = a[i] op b[i];                      \
    return r;                                                             \
  }
EMU_VEC_CMP(==)
EMU_VEC_CMP(!=)
EMU_VEC_CMP(<)
EMU_VEC_CMP(>)
EMU_VEC_CMP(<=)
EMU_VEC_CMP(>=)
#undef EMU_VEC_CMP

#define EMU_VEC_TYPES(T, name) \
  typedef vec<T, 2> name##2;   \
  typedef vec<T, 3> name##3;   \
  typedef vec<T, 4> name##4;
EMU_VEC_TYPES(float, float)
EMU_VEC_TYPES(half, half)
EMU_VEC_TYPES(bfloat, bfloat)
EMU_VEC_TYPES(int, int)
EMU_VEC_TYPES(uint, uint)
EMU_VEC_TYPES(short, short)
EMU_VEC_TYPES(ushort, ushort)
EMU_VEC_TYPES(char, char)
EMU_VEC_TYPES(uchar, uchar)
EMU_VEC_TYPES(bool, bool)
EMU_VEC_TYPES(long, long)
EMU_VEC_TYPES(unsigned long, ulong)
#undef EMU_VEC_TYPES

template <int N>
inline bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; i++)
    if (!v[i]) return false;
  return true;
}
template <int N>
inline bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; i++)
    if (v[i]) return true;
  return false;
}
inline bool all(bool v) { return v; }
inline bool any(bool v) { return v; }

// ----------------------------------------------------------------------- limits
template <typename T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr bool has_infinity = true;
  static constexpr float min() { return __FLT_MIN__; }
  static constexpr float max() { return __FLT_MAX__; }
  static constexpr float lowest() { return -__FLT_MAX__; }
  static constexpr float epsilon() { return __FLT_EPSILON__; }
  static constexpr float infinity() { return __builtin_huge_valf(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
};
template <>
struct numeric_limits<half> {
  static constexpr bool has_infinity = true;
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(0.0009765625f); }
  static constexpr half infinity() { return half(__builtin_huge_valf()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool has_infinity = true;
  static bfloat min() { return bfloat(1.17549435e-38f); }
  static bfloat max() { return bfloat(3.38953139e+38f); }
  static bfloat lowest() { return bfloat(-3.38953139e+38f); }
  static bfloat epsilon() { return bfloat(0.0078125f); }
  static bfloat infinity() { return bfloat(__builtin_huge_valf()); }
  static bfloat quiet_NaN() { return bfloat(__builtin_nanf("")); }
};
#define EMU_INT_LIMITS(T, lo, hi)                        \
  template <>                                            \
  struct numeric_limits<T> {                             \
    static constexpr bool has_infinity = false;          \
    static constexpr T min() { return lo; }              \
    static constexpr T max() { return hi; }              \
    static constexpr T lowest() { return lo; }           \
  };
EMU_INT_LIMITS(bool, false, true)
EMU_INT_LIMITS(int8_t, INT8_MIN, INT8_MAX)
EMU_INT_LIMITS(uint8_t, 0, UINT8_MAX)
EMU_INT_LIMITS(int16_t, INT16_MIN, INT16_MAX)
EMU_INT_LIMITS(uint16_t, 0, UINT16_MAX)
EMU_INT_LIMITS(int32_t, INT32_MIN, INT32_MAX)
EMU_INT_LIMITS(uint32_t, 0, UINT32_MAX)
EMU_INT_LIMITS(int64_t, INT64_MIN, INT64_MAX)
EMU_INT_LIMITS(uint64_t, 0, UINT64_MAX)
#undef EMU_INT_LIMITS

using std::conditional_t;
using std::enable_if_t;
using std::is_floating_point_v;
using std::is_integral_v;
using std::is_same;
using std::is_same_v;
using std::is_signed_v;
using std::is_unsigned_v;
using std::remove_cv_t;

template <typename T, typename U>
inline T as_type(U v) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of the same size");
  T r;
  __builtin_memcpy(&r, &v, sizeof(T));
  return r;
}

// ----------------------------------------------------------------------- math
#define EMU_MATH1(name, fexpr)                                                 \
  inline float name(float x) { return fexpr; }                                 \
  inline half name(half x) { return half(name(float(x))); }                    \
  inline bfloat name(bfloat x) { return bfloat(name(float(x))); }              \
  template <typename T, int N>                                                 \
  inline vec<T, N> name(vec<T, N> v) {                                         \
    for (int i = 0; i < N; i++) v[i] = name(v[i]);                             \
    return v;                                                                  \
  }
#define EMU_MATH_ALL1(X)                        \
  X(exp, __builtin_expf(x))                     \
  X(exp2, __builtin_exp2f(x))                   \
  X(exp10, __builtin_powf(10.0f, x))            \
  X(log, __builtin_logf(x))                     \
  X(log2, __builtin_log2f(x))                   \
  X(log10, __builtin_log10f(x))                 \
  X(log1p, __builtin_log1pf(x))                 \
  X(expm1, __builtin_expm1f(x))                 \
  X(sqrt, __builtin_sqrtf(x))                   \
  X(rsqrt, 1.0f / __builtin_sqrtf(x))           \
  X(sin, __builtin_sinf(x))                     \
  X(cos, __builtin_cosf(x))                     \
  X(tan, __builtin_tanf(x))                     \
  X(asin, __builtin_asinf(x))                   \
  X(acos, __builtin_acosf(x))                   \
  X(atan, __builtin_atanf(x))                   \
  X(sinh, __builtin_sinhf(x))                   \
  X(cosh, __builtin_coshf(x))                   \
  X(tanh, __builtin_tanhf(x))                   \
  X(erf, __builtin_erff(x))                     \
  X(floor, __builtin_floorf(x))                 \
  X(ceil, __builtin_ceilf(x))                   \
  X(round, __builtin_roundf(x))                 \
  X(rint, __builtin_rintf(x))                   \
  X(trunc, __builtin_truncf(x))                 \
  X(fabs, __builtin_fabsf(x))                   \
  X(fract, x - __builtin_floorf(x))             \
  X(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f)) \
  X(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f)))

#define EMU_MATH2(name, fexpr)                                                       \
  inline float name(float x, float y) { return fexpr; }                              \
  inline half name(half x, half y) { return half(name(float(x), float(y))); }        \
  inline bfloat name(bfloat x, bfloat y) { return bfloat(name(float(x), float(y))); } \
  template <typename T, int N>                                                       \
  inline vec<T, N> name(vec<T, N> a, const vec<T, N>& b) {                           \
    for (int i = 0; i < N; i++) a[i] = name(a[i], b[i]);                             \
    return a;                                                                        \
  }
#define EMU_MATH_ALL2(X)                        \
  X(pow, __builtin_powf(x, y))                  \
  X(powr, __builtin_powf(x, y))                 \
  X(atan2, __builtin_atan2f(x, y))              \
  X(fmod, __builtin_fmodf(x, y))                \
  X(fmax, __builtin_fmaxf(x, y))                \
  X(fmin, __builtin_fminf(x, y))                \
  X(copysign, __builtin_copysignf(x, y))        \
  X(step, (y < x ? 0.0f : 1.0f))                \
  X(divide, x / y)

EMU_MATH_ALL1(EMU_MATH1)
EMU_MATH_ALL2(EMU_MATH2)

// max/min follow fmax/fmin for floating point (a NaN operand yields the other one).
EMU_MATH2(max, __builtin_fmaxf(x, y))
EMU_MATH2(min, __builtin_fminf(x, y))
template <typename T, typename = typename std::enable_if<std::is_integral<T>::value>::type>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T, typename = typename std::enable_if<std::is_integral<T>::value>::type>
inline T min(T a, T b) { return a < b ? a : b; }
template <typename T, typename = typename std::enable_if<std::is_integral<T>::value>::type>
inline T abs(T a) { return a < 0 ? T(-a) : a; }
inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return half(__builtin_fabsf(float(x))); }
inline bfloat abs(bfloat x) { return bfloat(__builtin_fabsf(float(x))); }
template <typename T, int N>
inline vec<T, N> abs(vec<T, N> v) {
  for (int i = 0; i < N; i++) v[i] = abs(v[i]);
  return v;
}
template <typename T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return half(__builtin_fmaf(float(a), float(b), float(c))); }
template <typename T, int N>
inline vec<T, N> fma(vec<T, N> a, const vec<T, N>& b, const vec<T, N>& c) {
  for (int i = 0; i < N; i++) a[i] = fma(a[i], b[i], c[i]);
  return a;
}
template <typename T, typename S>
inline T mix(T x, T y, S a) { return x + (y - x) * a; }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }
template <typename T, int N>
inline vec<T, N> select(vec<T, N> a, const vec<T, N>& b, const vec<bool, N>& c) {
  for (int i = 0; i < N; i++) a[i] = c[i] ? b[i] : a[i];
  return a;
}
template <typename T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(0);
  for (int i = 0; i < N; i++) s = T(s + a[i] * b[i]);
  return s;
}
template <typename T, int N>
inline T length(const vec<T, N>& a) { return sqrt(dot(a, a)); }
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isnan(half x) { return __builtin_isnan(float(x)); }
inline bool isnan(bfloat x) { return __builtin_isnan(float(x)); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isinf(half x) { return __builtin_isinf(float(x)); }
inline bool isinf(bfloat x) { return __builtin_isinf(float(x)); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isfinite(half x) { return __builtin_isfinite(float(x)); }
inline bool isfinite(bfloat x) { return __builtin_isfinite(float(x)); }
inline bool signbit(float x) { return __builtin_signbit(x); }

// fast:: and precise:: variants compute the same thing here.
namespace fast {
EMU_MATH_ALL1(EMU_MATH1)
EMU_MATH_ALL2(EMU_MATH2)
EMU_MATH2(max, __builtin_fmaxf(x, y))
EMU_MATH2(min, __builtin_fminf(x, y))
using metal::abs;
using metal::clamp;
}  // namespace fast
namespace precise {
EMU_MATH_ALL1(EMU_MATH1)
EMU_MATH_ALL2(EMU_MATH2)
EMU_MATH2(max, __builtin_fmaxf(x, y))
EMU_MATH2(min, __builtin_fminf(x, y))
using metal::abs;
using metal::clamp;
}  // namespace precise
#undef EMU_MATH1
#undef EMU_MATH2
#undef EMU_MATH_ALL1
#undef EMU_MATH_ALL2

// ----------------------------------------------------------------------- barriers
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }
inline void threadgroup_barrier(mem_flags) { emu_tg_barrier(); }
inline void simdgroup_barrier(mem_flags) { emu_simd_barrier(); }

// ----------------------------------------------------------------------- simdgroup
namespace emu_detail {
struct op_add { template <typename T> T operator()(T a, T b) const { return T(a + b); } };
struct op_mul { template <typename T> T operator()(T a, T b) const { return T(a * b); } };
struct op_max { template <typename T> T operator()(T a, T b) const { return metal::max(a, b); } };
struct op_min { template <typename T> T operator()(T a, T b) const { return metal::min(a, b); } };
struct op_and { template <typename T> T operator()(T a, T b) const { return T(a & b); } };
struct op_or { template <typename T> T operator()(T a, T b) const { return T(a | b); } };
struct op_xor { template <typename T> T operator()(T a, T b) const { return T(a ^ b); } };

// A pairwise tree over the lanes, the same order for every lane (the GPU returns one
// value to all lanes too).
template <typename T, typename Op>
void reduce(const unsigned char* values, int stride, int n, void* out) {
  T v[32];
  for (int i = 0; i < n; i++) __builtin_memcpy(&v[i], values + i * stride, sizeof(T));
  for (int step = 1; step < n; step *= 2)
    for (int i = 0; i + step < n; i += 2 * step) v[i] = Op()(v[i], v[i + step]);
  __builtin_memcpy(out, &v[0], sizeof(T));
}
template <typename T, typename Op>
inline T simd_reduce(T x) {
  static_assert(sizeof(T) <= 64, "simd operand too large");
  T r;
  emu_simd_reduce(&x, sizeof(T), &reduce<T, Op>, &r);
  return r;
}
template <typename T>
inline T shuffle(T x, int mode, int arg) {
  T r;
  emu_simd_shuffle(&x, sizeof(T), mode, arg, &r);
  return r;
}
template <typename T, typename Op, bool Inclusive>
inline T simd_prefix(T x, T identity, uint lane) {
  T all[32];
  emu_simd_gather(&x, sizeof(T), all);
  T acc = identity;
  for (uint i = 0; i < lane; i++) acc = Op()(acc, all[i]);
  return Inclusive ? Op()(acc, x) : acc;
}
inline uint lane_id() { return uint(emu_simd_lane_id()); }
}  // namespace emu_detail

template <typename T> inline T simd_sum(T x) { return emu_detail::simd_reduce<T, emu_detail::op_add>(x); }
template <typename T> inline T simd_product(T x) { return emu_detail::simd_reduce<T, emu_detail::op_mul>(x); }
template <typename T> inline T simd_max(T x) { return emu_detail::simd_reduce<T, emu_detail::op_max>(x); }
template <typename T> inline T simd_min(T x) { return emu_detail::simd_reduce<T, emu_detail::op_min>(x); }
template <typename T> inline T simd_and(T x) { return emu_detail::simd_reduce<T, emu_detail::op_and>(x); }
template <typename T> inline T simd_or(T x) { return emu_detail::simd_reduce<T, emu_detail::op_or>(x); }
template <typename T> inline T simd_xor(T x) { return emu_detail::simd_reduce<T, emu_detail::op_xor>(x); }
inline bool simd_all(bool x) { return emu_detail::simd_reduce<int, emu_detail::op_and>(x ? 1 : 0) != 0; }
inline bool simd_any(bool x) { return emu_detail::simd_reduce<int, emu_detail::op_or>(x ? 1 : 0) != 0; }
template <typename T> inline T simd_shuffle(T x, ushort lane) { return emu_detail::shuffle(x, 0, lane); }
template <typename T> inline T simd_broadcast(T x, ushort lane) { return emu_detail::shuffle(x, 0, lane); }
template <typename T> inline T simd_broadcast_first(T x) { return emu_detail::shuffle(x, 0, 0); }
template <typename T> inline T simd_shuffle_xor(T x, ushort mask) { return emu_detail::shuffle(x, 1, mask); }
template <typename T> inline T simd_shuffle_down(T x, ushort delta) { return emu_detail::shuffle(x, 2, delta); }
template <typename T> inline T simd_shuffle_up(T x, ushort delta) { return emu_detail::shuffle(x, 3, delta); }
template <typename T> inline T simd_shuffle_rotate_down(T x, ushort delta) { return emu_detail::shuffle(x, 4, delta); }
template <typename T> inline T simd_shuffle_rotate_up(T x, ushort delta) { return emu_detail::shuffle(x, 5, delta); }
template <typename T>
inline T simd_prefix_inclusive_sum(T x) {
  return emu_detail::simd_prefix<T, emu_detail::op_add, true>(x, T(0), emu_detail::lane_id());
}
template <typename T>
inline T simd_prefix_exclusive_sum(T x) {
  return emu_detail::simd_prefix<T, emu_detail::op_add, false>(x, T(0), emu_detail::lane_id());
}
template <typename T>
inline T simd_prefix_inclusive_product(T x) {
  return emu_detail::simd_prefix<T, emu_detail::op_mul, true>(x, T(1), emu_detail::lane_id());
}
template <typename T>
inline T simd_prefix_exclusive_product(T x) {
  return emu_detail::simd_prefix<T, emu_detail::op_mul, false>(x, T(1), emu_detail::lane_id());
}
inline bool simd_is_first() { return emu_detail::lane_id() == 0; }

// ----------------------------------------------------------------------- atomics
enum memory_order { memory_order_relaxed = __ATOMIC_RELAXED, memory_order_seq_cst = __ATOMIC_SEQ_CST };
template <typename T>
struct atomic {
  T val;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;

template <typename T>
inline void atomic_store_explicit(atomic<T>* o, T v, memory_order) { __atomic_store(&o->val, &v, __ATOMIC_SEQ_CST); }
template <typename T>
inline T atomic_load_explicit(const atomic<T>* o, memory_order) {
  T r;
  __atomic_load(&o->val, &r, __ATOMIC_SEQ_CST);
  return r;
}
template <typename T>
inline T atomic_exchange_explicit(atomic<T>* o, T v, memory_order) {
  T r;
  __atomic_exchange(&o->val, &v, &r, __ATOMIC_SEQ_CST);
  return r;
}
template <typename T>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* o, T* expected, T desired, memory_order, memory_order) {
  return __atomic_compare_exchange(&o->val, expected, &desired, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
namespace emu_detail {
template <typename T, typename F>
inline T atomic_update(atomic<T>* o, F f) {
  T old;
  __atomic_load(&o->val, &old, __ATOMIC_SEQ_CST);
  T next = f(old);
  while (!__atomic_compare_exchange(&o->val, &old, &next, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) next = f(old);
  return old;
}
}  // namespace emu_detail
template <typename T, typename U>
inline T atomic_fetch_add_explicit(atomic<T>* o, U v, memory_order) {
  return emu_detail::atomic_update(o, [&](T a) { return T(a + T(v)); });
}
template <typename T, typename U>
inline T atomic_fetch_sub_explicit(atomic<T>* o, U v, memory_order) {
  return emu_detail::atomic_update(o, [&](T a) { return T(a - T(v)); });
}
template <typename T, typename U>
inline T atomic_fetch_max_explicit(atomic<T>* o, U v, memory_order) {
  return emu_detail::atomic_update(o, [&](T a) { return a > T(v) ? a : T(v); });
}
template <typename T, typename U>
inline T atomic_fetch_min_explicit(atomic<T>* o, U v, memory_order) {
  return emu_detail::atomic_update(o, [&](T a) { return a < T(v) ? a : T(v); });
}
template <typename T, typename U>
inline T atomic_fetch_and_explicit(atomic<T>* o, U v, memory_order) {
  return emu_detail::atomic_update(o, [&](T a) { return T(a & T(v)); });
}
template <typename T, typename U>
inline T atomic_fetch_or_explicit(atomic<T>* o, U v, memory_order) {
  return emu_detail::atomic_update(o, [&](T a) { return T(a | T(v)); });
}
template <typename T, typename U>
inline T atomic_fetch_xor_explicit(atomic<T>* o, U v, memory_order) {
  return emu_detail::atomic_update(o, [&](T a) { return T(a ^ T(v)); });
}

}  // namespace metal

using namespace metal;
typedef half float16_t;
typedef bfloat bfloat16_t;

#define MAXFLOAT __FLT_MAX__
#define HUGE_VALF __builtin_huge_valf()
#define INFINITY __builtin_huge_valf()
#define NAN __builtin_nanf("")
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__
#define HALF_MAX 65504.0f
#define M_PI_F 3.14159265358979323846f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LN2_F 0.69314718055994530942f
#define M_SQRT2_F 1.41421356237309504880f

// MLX's `Limits` (from the utils header MLX puts in front of custom kernels).
template <typename U>
struct Limits {
  static inline const U max = metal::numeric_limits<U>::max();
  static inline const U min = metal::numeric_limits<U>::min();
  static inline const U finite_max = metal::numeric_limits<U>::max();
  static inline const U finite_min = metal::numeric_limits<U>::min();
};
#define EMU_FLOAT_LIMITS(T)                                                     \
  template <>                                                                   \
  struct Limits<T> {                                                            \
    static inline const T max = metal::numeric_limits<T>::infinity();           \
    static inline const T min = T(-float(metal::numeric_limits<T>::infinity())); \
    static inline const T finite_max = metal::numeric_limits<T>::max();         \
    static inline const T finite_min = metal::numeric_limits<T>::lowest();      \
  };
EMU_FLOAT_LIMITS(float)
EMU_FLOAT_LIMITS(half)
EMU_FLOAT_LIMITS(bfloat)
#undef EMU_FLOAT_LIMITS

namespace emu {
inline uint3 u3(const uint32_t v[3]) { return uint3(v[0], v[1], v[2]); }
template <typename T>
inline T* tg_var(int id) { return static_cast<T*>(emu_tg_var(id, sizeof(T), alignof(T))); }
}  // namespace emu
