// Shared device helpers: element conversions with explicit rounding, grid-stride indexing.
// Included by the .cu sources of mpigpu (compiled at run time by NVRTC through cuda.core).
#pragma once
// float16 and bfloat16 are carried as their 16-bit patterns and converted with explicit
// round-to-nearest-even, so the kernels need no CUDA headers (NVRTC has no include path).
struct half_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ float half_to_float(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}
__device__ __forceinline__ half_t float_to_half(float f) {
    half_t h;
    if (f != f) { h.bits = 0x7e00; return h; }  // the canonical NaN (cvt would give 0x7fff)
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_float(bf16_t b) { return __uint_as_float(((unsigned)b.bits) << 16); }
__device__ __forceinline__ bf16_t float_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    bf16_t b;
    if ((u & 0x7fffffffu) > 0x7f800000u) { b.bits = 0x7fc0; return b; }  // NaN: the canonical NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    b.bits = (unsigned short)(u >> 16);
    return b;
}

#define GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

template <typename T> struct IsFloat { static constexpr bool value = false; };
template <> struct IsFloat<half_t> { static constexpr bool value = true; };
template <> struct IsFloat<bf16_t> { static constexpr bool value = true; };
template <> struct IsFloat<float> { static constexpr bool value = true; };
template <> struct IsFloat<double> { static constexpr bool value = true; };

// Accumulator type: float16 and bfloat16 reduce in float32 and are rounded once.
template <typename T> struct Acc { typedef T type; };
template <> struct Acc<half_t> { typedef float type; };
template <> struct Acc<bf16_t> { typedef float type; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type to_acc(T v) { return v; }
template <> __device__ __forceinline__ float to_acc<half_t>(half_t v) { return half_to_float(v); }
template <> __device__ __forceinline__ float to_acc<bf16_t>(bf16_t v) { return bf16_to_float(v); }

template <typename T> __device__ __forceinline__ T from_acc(typename Acc<T>::type v) { return (T)v; }
template <> __device__ __forceinline__ half_t from_acc<half_t>(float v) { return float_to_half(v); }
template <> __device__ __forceinline__ bf16_t from_acc<bf16_t>(float v) { return float_to_bf16(v); }

template <typename T> __device__ __forceinline__ double to_double(T v) { return (double)to_acc<T>(v); }

// Reduction ops, numbered like mpigpu.ops.Op order: 0 sum, 1 avg, 2 min, 3 max, 4 prod.
enum { OP_SUM = 0, OP_AVG = 1, OP_MIN = 2, OP_MAX = 3, OP_PROD = 4 };

template <typename A> __device__ __forceinline__ A combine(int op, A a, A b) {
    switch (op) {
        case OP_MIN: return b < a ? b : a;
        case OP_MAX: return b > a ? b : a;
        case OP_PROD: return a * b;
        default: return a + b;  // sum, avg
    }
}
// Float min/max under mpigpu's semantics (mpigpu/ops.py): a NaN operand gives the canonical NaN;
// -0.0 < +0.0. A total order, so the result does not depend on the order of the operands.
__device__ __forceinline__ bool is_negative(float v) { return (__float_as_uint(v) >> 31) != 0; }
__device__ __forceinline__ bool is_negative(double v) { return __double_as_longlong(v) < 0; }
template <typename F> __device__ __forceinline__ F float_max(F a, F b, F nan) {
    if (a != a || b != b) return nan;
    if (a == b) return is_negative(a) ? b : a;  // equal values differ in bits only as -0.0 / +0.0
    return a > b ? a : b;
}
template <typename F> __device__ __forceinline__ F float_min(F a, F b, F nan) {
    if (a != a || b != b) return nan;
    if (a == b) return is_negative(a) ? a : b;
    return a < b ? a : b;
}
template <> __device__ __forceinline__ float combine<float>(int op, float a, float b) {
    switch (op) {
        case OP_MIN: return float_min(a, b, __int_as_float(0x7fc00000));
        case OP_MAX: return float_max(a, b, __int_as_float(0x7fc00000));
        case OP_PROD: return __fmul_rn(a, b);
        default: return __fadd_rn(a, b);
    }
}
template <> __device__ __forceinline__ double combine<double>(int op, double a, double b) {
    switch (op) {
        case OP_MIN: return float_min(a, b, __longlong_as_double(0x7ff8000000000000LL));
        case OP_MAX: return float_max(a, b, __longlong_as_double(0x7ff8000000000000LL));
        case OP_PROD: return __dmul_rn(a, b);
        default: return __dadd_rn(a, b);
    }
}

// avg: IEEE division for floats (below); for integers the exact mean of IntMean.
// Integer results of sum and prod wrap in the element type (as in C and MPI). Integer avg does not
// go through finish(): it is accumulated exactly by IntMean.
template <typename T> __device__ __forceinline__ T finish(int op, typename Acc<T>::type acc, int n) {
    return from_acc<T>(acc);
}
template <> __device__ __forceinline__ half_t finish<half_t>(int op, float acc, int n) {
    return float_to_half(op == OP_AVG ? __fdiv_rn(acc, (float)n) : acc);
}
template <> __device__ __forceinline__ bf16_t finish<bf16_t>(int op, float acc, int n) {
    return float_to_bf16(op == OP_AVG ? __fdiv_rn(acc, (float)n) : acc);
}
template <> __device__ __forceinline__ float finish<float>(int op, float acc, int n) {
    return op == OP_AVG ? __fdiv_rn(acc, (float)n) : acc;
}
template <> __device__ __forceinline__ double finish<double>(int op, double acc, int n) {
    return op == OP_AVG ? __ddiv_rn(acc, (double)n) : acc;
}

// Exact integer average over n ranks (mpigpu.ops.int_avg_parts/int_avg_join): each value is split as
// v = q*n + r with 0 <= r < n (floor division). The sum of the q is in T's range and is kept modulo
// 2^64 (wrapping partial sums are harmless); the sum of the r is below n*n. floor(mean) = sum(q) +
// sum(r)/n; truncation toward zero (C's rule) adds 1 where floor is negative and n does not divide
// sum(r). No step overflows, for any width: the mean of identical values is that value.
template <typename T> struct IntMean {
    static constexpr bool is_signed = (T)(-1) < (T)0;
    u64 q = 0, r = 0;
    __device__ __forceinline__ void add(T v, int n) {
        if constexpr (is_signed) {
            i64 qq = (i64)v / n, rr = (i64)v % n;
            if (rr < 0) { qq -= 1; rr += n; }
            q += (u64)qq;
            r += (u64)rr;
        } else {
            q += (u64)v / (u64)n;
            r += (u64)v % (u64)n;
        }
    }
    __device__ __forceinline__ T result(int n) const {
        u64 mean = q + r / (u64)n;
        if constexpr (is_signed) {
            if ((i64)mean < 0 && r % (u64)n != 0) mean += 1;
            return (T)(i64)mean;
        } else {
            return (T)mean;
        }
    }
};

// Float bits and the order-preserving keys of mpigpu.ops.to_keys/from_keys, for transports whose
// integer MIN/MAX is exact (NCCL, MPI). B holds the bits, K the key (32 bits for the half types:
// NCCL has no 16-bit integers). NaN becomes the canonical NaN, positive for max (above +inf),
// negative for min (below -inf); back from a key, any NaN is the canonical (positive) one.
template <typename T> struct FloatKey;
template <> struct FloatKey<half_t> {
    typedef unsigned short B; typedef unsigned K;
    static constexpr u64 SIGN = 0x8000, EXP = 0x7c00, NAN_BITS = 0x7e00;
};
template <> struct FloatKey<bf16_t> {
    typedef unsigned short B; typedef unsigned K;
    static constexpr u64 SIGN = 0x8000, EXP = 0x7f80, NAN_BITS = 0x7fc0;
};
template <> struct FloatKey<float> {
    typedef unsigned B; typedef unsigned K;
    static constexpr u64 SIGN = 0x80000000ull, EXP = 0x7f800000ull, NAN_BITS = 0x7fc00000ull;
};
template <> struct FloatKey<double> {
    typedef u64 B; typedef u64 K;
    static constexpr u64 SIGN = 0x8000000000000000ull, EXP = 0x7ff0000000000000ull, NAN_BITS = 0x7ff8000000000000ull;
};
template <typename T> __device__ __forceinline__ typename FloatKey<T>::K to_key(typename FloatKey<T>::B bits, int op) {
    typedef FloatKey<T> F;
    const u64 all = F::SIGN | (F::SIGN - 1);
    u64 b = bits;
    if ((b & (F::SIGN - 1)) > F::EXP) b = op == OP_MAX ? F::NAN_BITS : (F::NAN_BITS | F::SIGN);
    return (typename F::K)((b & F::SIGN) ? (~b & all) : (b | F::SIGN));
}
template <typename T> __device__ __forceinline__ typename FloatKey<T>::B from_key(typename FloatKey<T>::K key) {
    typedef FloatKey<T> F;
    const u64 all = F::SIGN | (F::SIGN - 1);
    u64 k = key;
    u64 b = (k & F::SIGN) ? (k ^ F::SIGN) : (~k & all);
    if ((b & (F::SIGN - 1)) > F::EXP) b = F::NAN_BITS;
    return (typename F::B)b;
}

// Instantiate a macro once per supported element type: X(name, C type).
#define MPIGPU_FOR_EACH_TYPE(X)           \
    X(float16, half_t)                    \
    X(bfloat16, bf16_t)            \
    X(float32, float)                     \
    X(float64, double)                    \
    X(int8, signed char)                  \
    X(uint8, unsigned char)               \
    X(int16, short)                       \
    X(uint16, unsigned short)             \
    X(int32, int)                         \
    X(uint32, unsigned int)               \
    X(int64, long long)                   \
    X(uint64, unsigned long long)
