// Input patterns and the on-device verifier. Must match mpigpu/patterns.py and mpigpu/verify.py
// bit for bit: the same IEEE operations, each rounded explicitly (no fused multiply-add).
#include "common.cuh"

enum { PATTERN_SEED = 0, PATTERN_EXACT = 1 };

// The seed sample's gradient: rank + 0.001 * i, in float32 (float64 for double).
__device__ __forceinline__ float seed_f32(int rank, i64 i) {
    return __fadd_rn((float)rank, __fmul_rn(0.001f, __ll2float_rn(i)));
}
__device__ __forceinline__ double seed_f64(int rank, i64 i) {
    return __dadd_rn((double)rank, __dmul_rn(0.001, __ll2double_rn(i)));
}

// Small integers whose reductions are exact in every type (see patterns.py).
__device__ __forceinline__ i64 exact_value(bool prod, bool is_signed, int rank, int n, i64 i) {
    if (prod) {
        i64 v = (i % n == rank) ? 2 : 1;
        return (is_signed && ((i + rank) % 2 == 1)) ? -v : v;
    }
    return (i + 3LL * rank) % 9 - (is_signed ? 4 : 0);
}

template <typename T> __device__ __forceinline__ bool signed_type() { return (T)(-1) < (T)0; }
template <> __device__ __forceinline__ bool signed_type<half_t>() { return true; }
template <> __device__ __forceinline__ bool signed_type<bf16_t>() { return true; }

template <typename T> __device__ __forceinline__ T rank_value(int pattern, int op, int rank, int n, i64 i) {
    if (pattern == PATTERN_SEED) return from_acc<T>((typename Acc<T>::type)seed_f32(rank, i));
    return from_acc<T>((typename Acc<T>::type)exact_value(op == OP_PROD, signed_type<T>(), rank, n, i));
}
template <> __device__ __forceinline__ double rank_value<double>(int pattern, int op, int rank, int n, i64 i) {
    if (pattern == PATTERN_SEED) return seed_f64(rank, i);
    return (double)exact_value(op == OP_PROD, true, rank, n, i);
}
template <> __device__ __forceinline__ half_t rank_value<half_t>(int pattern, int op, int rank, int n, i64 i) {
    float v = pattern == PATTERN_SEED ? seed_f32(rank, i) : (float)exact_value(op == OP_PROD, true, rank, n, i);
    return float_to_half(v);
}
template <> __device__ __forceinline__ bf16_t rank_value<bf16_t>(int pattern, int op, int rank, int n,
                                                                             i64 i) {
    float v = pattern == PATTERN_SEED ? seed_f32(rank, i) : (float)exact_value(op == OP_PROD, true, rank, n, i);
    return float_to_bf16(v);
}

template <typename T>
__device__ void fill_impl(T* x, i64 count, i64 offset, int pattern, int op, int rank, int n) {
    GRID_STRIDE(j, count) { x[j] = rank_value<T>(pattern, op, rank, n, offset + j); }
}

// Reference and tolerance in double, as verify.reference() computes them.

template <typename T>
__device__ void count_wrong_impl(const T* got, i64 count, i64 offset, int pattern, int op, int n, double eps,
                                 u64* wrong) {
    u64 local = 0;
    GRID_STRIDE(j, count) {
        const i64 i = offset + j;
        const double value = to_double(got[j]);
        bool ok;
        if constexpr (!IsFloat<T>::value) {
            // Integers: accumulate in the element type (wrapping); avg is the exact mean, truncated.
            T expect;
            if (op == OP_AVG) {
                IntMean<T> mean;
                for (int r = 0; r < n; ++r) mean.add(rank_value<T>(pattern, op, r, n, i), n);
                expect = mean.result(n);
            } else {
                T acc = rank_value<T>(pattern, op, 0, n, i);
                for (int r = 1; r < n; ++r) acc = combine<T>(op, acc, rank_value<T>(pattern, op, r, n, i));
                expect = finish<T>(op, acc, n);
            }
            ok = value == to_double(expect);
        } else {
            double ref = to_double(rank_value<T>(pattern, op, 0, n, i));
            double mag = fabs(ref);
            for (int r = 1; r < n; ++r) {
                const double x = to_double(rank_value<T>(pattern, op, r, n, i));
                switch (op) {
                    case OP_MIN: ref = fmin(ref, x); break;
                    case OP_MAX: ref = fmax(ref, x); break;
                    case OP_PROD: ref = ref * x; break;
                    default: ref = ref + x; mag += fabs(x);
                }
            }
            if (op == OP_PROD) mag = fabs(ref);
            if (op == OP_AVG) { ref = ref / n; mag = mag / n; }
            double tol;
            if (pattern == PATTERN_EXACT) tol = (op == OP_AVG && (n & (n - 1)) != 0) ? eps * fabs(ref) : 0.0;
            else tol = (op == OP_MIN || op == OP_MAX) ? 0.0 : (n + 1) * eps * mag;
            ok = fabs(value - ref) <= tol || (value != value && ref != ref) || (value == ref);
        }
        local += ok ? 0 : 1;
    }
    if (local) atomicAdd(wrong, local);
}

#define DEFINE_PATTERN_KERNELS(name, T)                                                                    \
    extern "C" __global__ void fill_##name(T* x, i64 count, i64 offset, int pattern, int op, int rank,   \
                                           int n) {                                                      \
        fill_impl<T>(x, count, offset, pattern, op, rank, n);                                            \
    }                                                                                                    \
    extern "C" __global__ void count_wrong_##name(const T* got, i64 count, i64 offset, int pattern, int op, \
                                                  int n, double eps, u64* wrong) {                       \
        count_wrong_impl<T>(got, count, offset, pattern, op, n, eps, wrong);                             \
    }
MPIGPU_FOR_EACH_TYPE(DEFINE_PATTERN_KERNELS)

// Elements of `width` bytes that differ between a and b (an out-of-place call's input against its
// snapshot). One kernel for every type: the soak's check compiles nothing after its warm-up.
extern "C" __global__ void count_changed(const unsigned char* a, const unsigned char* b, i64 count, int width,
                                         u64* changed) {
    u64 local = 0;
    GRID_STRIDE(j, count) {
        bool differ = false;
        for (int k = 0; k < width; ++k) differ |= a[j * width + k] != b[j * width + k];
        local += differ ? 1 : 0;
    }
    if (local) atomicAdd(changed, local);
}
