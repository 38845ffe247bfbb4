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
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_float(bf16_t b) { return __uint_as_float(((unsigned)b.bits) << 16); }
__device__ __forceinline__ bf16_t float_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    bf16_t b;
    if ((u & 0x7fffffffu) > 0x7f800000u) { b.bits = (unsigned short)((u >> 16) | 0x40u); return b; }  // NaN stays NaN
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
// IEEE min/max that propagate NaN like NumPy's minimum/maximum.
template <> __device__ __forceinline__ float combine<float>(int op, float a, float b) {
    switch (op) {
        case OP_MIN: return (a != a || b != b) ? __int_as_float(0x7fc00000) : fminf(a, b);
        case OP_MAX: return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
        case OP_PROD: return __fmul_rn(a, b);
        default: return __fadd_rn(a, b);
    }
}
template <> __device__ __forceinline__ double combine<double>(int op, double a, double b) {
    switch (op) {
        case OP_MIN: return (a != a || b != b) ? __longlong_as_double(0x7ff8000000000000LL) : fmin(a, b);
        case OP_MAX: return (a != a || b != b) ? __longlong_as_double(0x7ff8000000000000LL) : fmax(a, b);
        case OP_PROD: return __dmul_rn(a, b);
        default: return __dadd_rn(a, b);
    }
}

// avg: IEEE division for floats; C division (truncation toward zero) for integers.
template <typename A> __device__ __forceinline__ A divide_by(A v, int n) { return v / (A)n; }
template <> __device__ __forceinline__ float divide_by<float>(float v, int n) { return __fdiv_rn(v, (float)n); }
template <> __device__ __forceinline__ double divide_by<double>(double v, int n) { return __ddiv_rn(v, (double)n); }

// Integer sums wrap in the element type (as in C and MPI), so narrow integer results are
// wrapped before averaging: finish() takes the accumulated value and the op.
template <typename T> __device__ __forceinline__ T finish(int op, typename Acc<T>::type acc, int n) {
    if (op == OP_AVG) {
        T wrapped = from_acc<T>(acc);
        return from_acc<T>(divide_by(to_acc<T>(wrapped), n));
    }
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
