// Elementwise helpers for the paths whose transport cannot do everything itself:
//   finish_avg_<T>: x = x / n in place (IEEE division for floats, C truncation for integers);
//   widen_<T>:      float16/bfloat16 -> float32 (MPI has no half types);
//   narrow_<T>:     float32 -> float16/bfloat16 with an optional division by n, rounded once.
#include "common.cuh"

template <typename T> __device__ void finish_avg_impl(T* x, i64 count, int n) {
    GRID_STRIDE(i, count) { x[i] = finish<T>(OP_AVG, to_acc<T>(x[i]), n); }
}

template <typename T> __device__ void widen_impl(const T* src, float* dst, i64 count) {
    GRID_STRIDE(i, count) { dst[i] = to_acc<T>(src[i]); }
}

template <typename T> __device__ void narrow_impl(const float* src, T* dst, i64 count, int op, int n) {
    GRID_STRIDE(i, count) { dst[i] = finish<T>(op, src[i], n); }
}

#define DEFINE_FINISH(name, T)                                                       \
    extern "C" __global__ void finish_avg_##name(T* x, i64 count, int n) {          \
        finish_avg_impl<T>(x, count, n);                                             \
    }
MPIGPU_FOR_EACH_TYPE(DEFINE_FINISH)

#define DEFINE_HALF_CASTS(name, T)                                                               \
    extern "C" __global__ void widen_##name(const T* src, float* dst, i64 count) {              \
        widen_impl<T>(src, dst, count);                                                          \
    }                                                                                            \
    extern "C" __global__ void narrow_##name(const float* src, T* dst, i64 count, int op, int n) { \
        narrow_impl<T>(src, dst, count, op, n);                                                  \
    }
DEFINE_HALF_CASTS(float16, half_t)
DEFINE_HALF_CASTS(bfloat16, bf16_t)
