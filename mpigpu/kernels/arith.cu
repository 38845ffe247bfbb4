// Elementwise helpers for the paths whose transport cannot do everything itself (cuda-aware, nccl):
//   finish_avg_<T>:  x = x / n in place for the float types (IEEE division), NaN made canonical;
//   canonical_nan_<T>: every NaN in x becomes the canonical NaN (float32/float64);
//   widen_<T>:       float16/bfloat16 -> float32 (MPI has no half types);
//   narrow_<T>:      float32 -> float16/bfloat16 with an optional division by n, rounded once;
//   to_key_<T>, from_key_<T>: floats <-> order-preserving unsigned keys, so float min/max reduce as
//                    the transport's exact integer MIN/MAX under mpigpu's semantics (common.cuh);
//   iavg_parts_<T>, iavg_join_<T>: integers <-> the 2 x count 64-bit parts (q, r) of an exact
//                    average, which the transport sums as uint64 (common.cuh, IntMean).
#include "common.cuh"

template <typename F> __device__ __forceinline__ F canonical(F v);
template <> __device__ __forceinline__ float canonical<float>(float v) { return v != v ? __int_as_float(0x7fc00000) : v; }
template <> __device__ __forceinline__ double canonical<double>(double v) {
    return v != v ? __longlong_as_double(0x7ff8000000000000LL) : v;
}

template <typename T> __device__ void finish_avg_impl(T* x, i64 count, int n) {
    GRID_STRIDE(i, count) { x[i] = canonical<T>(finish<T>(OP_AVG, to_acc<T>(x[i]), n)); }
}

template <typename T> __device__ void canonical_nan_impl(T* x, i64 count) {
    GRID_STRIDE(i, count) { x[i] = canonical<T>(x[i]); }
}

template <typename T> __device__ void widen_impl(const T* src, float* dst, i64 count) {
    GRID_STRIDE(i, count) { dst[i] = to_acc<T>(src[i]); }
}

template <typename T> __device__ void narrow_impl(const float* src, T* dst, i64 count, int op, int n) {
    GRID_STRIDE(i, count) { dst[i] = finish<T>(op, src[i], n); }  // NaN: canonical (from_acc)
}

// src may be keys itself (float32, float64: the key has the element's width): each thread reads its
// element before writing it.
template <typename T>
__device__ void to_key_impl(const typename FloatKey<T>::B* src, typename FloatKey<T>::K* keys, i64 count, int op) {
    GRID_STRIDE(i, count) { keys[i] = to_key<T>(src[i], op); }
}
template <typename T>
__device__ void from_key_impl(const typename FloatKey<T>::K* keys, typename FloatKey<T>::B* dst, i64 count) {
    GRID_STRIDE(i, count) { dst[i] = from_key<T>(keys[i]); }
}

template <typename T> __device__ void iavg_parts_impl(const T* x, u64* parts, i64 count, int n) {
    GRID_STRIDE(i, count) {
        IntMean<T> one;
        one.add(x[i], n);
        parts[i] = one.q;
        parts[count + i] = one.r;
    }
}
template <typename T> __device__ void iavg_join_impl(const u64* parts, T* out, i64 count, int n) {
    GRID_STRIDE(i, count) {
        IntMean<T> sum;
        sum.q = parts[i];
        sum.r = parts[count + i];
        out[i] = sum.result(n);
    }
}

#define DEFINE_FLOAT_HELPERS(name, T)                                                                            \
    extern "C" __global__ void finish_avg_##name(T* x, i64 count, int n) { finish_avg_impl<T>(x, count, n); }    \
    extern "C" __global__ void canonical_nan_##name(T* x, i64 count) { canonical_nan_impl<T>(x, count); }
DEFINE_FLOAT_HELPERS(float32, float)
DEFINE_FLOAT_HELPERS(float64, double)

#define DEFINE_KEYS(name, T)                                                                                     \
    extern "C" __global__ void to_key_##name(const FloatKey<T>::B* src, FloatKey<T>::K* keys, i64 count, int op) { \
        to_key_impl<T>(src, keys, count, op);                                                                    \
    }                                                                                                            \
    extern "C" __global__ void from_key_##name(const FloatKey<T>::K* keys, FloatKey<T>::B* dst, i64 count) {     \
        from_key_impl<T>(keys, dst, count);                                                                      \
    }
DEFINE_KEYS(float16, half_t)
DEFINE_KEYS(bfloat16, bf16_t)
DEFINE_KEYS(float32, float)
DEFINE_KEYS(float64, double)

#define DEFINE_INT_AVG(name, T)                                                                                  \
    extern "C" __global__ void iavg_parts_##name(const T* x, u64* parts, i64 count, int n) {                     \
        iavg_parts_impl<T>(x, parts, count, n);                                                                  \
    }                                                                                                            \
    extern "C" __global__ void iavg_join_##name(const u64* parts, T* out, i64 count, int n) {                    \
        iavg_join_impl<T>(parts, out, count, n);                                                                 \
    }
DEFINE_INT_AVG(int8, signed char)
DEFINE_INT_AVG(uint8, unsigned char)
DEFINE_INT_AVG(int16, short)
DEFINE_INT_AVG(uint16, unsigned short)
DEFINE_INT_AVG(int32, int)
DEFINE_INT_AVG(uint32, unsigned int)
DEFINE_INT_AVG(int64, long long)
DEFINE_INT_AVG(uint64, unsigned long long)

#define DEFINE_HALF_CASTS(name, T)                                                               \
    extern "C" __global__ void widen_##name(const T* src, float* dst, i64 count) {              \
        widen_impl<T>(src, dst, count);                                                          \
    }                                                                                            \
    extern "C" __global__ void narrow_##name(const float* src, T* dst, i64 count, int op, int n) { \
        narrow_impl<T>(src, dst, count, op, n);                                                  \
    }
DEFINE_HALF_CASTS(float16, half_t)
DEFINE_HALF_CASTS(bfloat16, bf16_t)
