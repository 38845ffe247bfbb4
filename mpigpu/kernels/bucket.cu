// Fused-bucket packing for mpigpu.Averager: one launch copies many arrays into (pack) or out of
// (unpack) one flat bucket, instead of one copy call per array.
//
// The table (int64, 3 * entries + 1 values, in device memory) describes the arrays to copy:
//   ptr[e]    = address of array e                      (table[e])
//   offset[e] = where array e starts in the bucket, in elements   (table[entries + e])
//   start[e]  = elements of arrays 0..e-1, with start[entries] = the total   (table[2 * entries + e])
// Thread j of the flattened copy finds its array by binary search over start[], so work is spread
// evenly however unequal the arrays are. A zero address packs zeros (a parameter with no gradient).
//
//   pack_copy<B>(table, entries, bucket)            same type: bytes of width B (1, 2, 4, 8)
//   unpack_copy<B>(table, entries, bucket)
//   pack_float32_<W>(table, entries, bucket)        compression: float32 -> W (float16, bfloat16),
//                                                   rounded to nearest even
//   unpack_<W>_float32(table, entries, bucket, s)   W -> float32, times s (1, or n for a sum)
#include "common.cuh"

__device__ __forceinline__ int find_entry(const i64* start, int entries, i64 j) {
    int lo = 0, hi = entries - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (start[mid] <= j) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <typename S, typename W> __device__ __forceinline__ W to_wire(S v) { return v; }
template <> __device__ __forceinline__ half_t to_wire<float, half_t>(float v) { return float_to_half(v); }
template <> __device__ __forceinline__ bf16_t to_wire<float, bf16_t>(float v) { return float_to_bf16(v); }

template <typename S, typename W> __device__ void pack_impl(const i64* table, int entries, W* bucket) {
    const i64* offset = table + entries;
    const i64* start = table + 2 * entries;
    const i64 total = start[entries];
    GRID_STRIDE(j, total) {
        const int e = find_entry(start, entries, j);
        const i64 k = j - start[e];
        const S* src = reinterpret_cast<const S*>(table[e]);
        bucket[offset[e] + k] = src != nullptr ? to_wire<S, W>(src[k]) : W{};  // no array: zeros
    }
}

template <typename T> __device__ void unpack_copy_impl(const i64* table, int entries, const T* bucket) {
    const i64* offset = table + entries;
    const i64* start = table + 2 * entries;
    const i64 total = start[entries];
    GRID_STRIDE(j, total) {
        const int e = find_entry(start, entries, j);
        const i64 k = j - start[e];
        T* dst = reinterpret_cast<T*>(table[e]);
        dst[k] = bucket[offset[e] + k];
    }
}

template <typename W> __device__ void unpack_cast_impl(const i64* table, int entries, const W* bucket, float scale) {
    const i64* offset = table + entries;
    const i64* start = table + 2 * entries;
    const i64 total = start[entries];
    GRID_STRIDE(j, total) {
        const int e = find_entry(start, entries, j);
        const i64 k = j - start[e];
        float* dst = reinterpret_cast<float*>(table[e]);
        dst[k] = __fmul_rn(to_acc<W>(bucket[offset[e] + k]), scale);
    }
}

#define DEFINE_COPY(width, T)                                                                        \
    extern "C" __global__ void pack_copy##width(const i64* table, int entries, T* bucket) {         \
        pack_impl<T, T>(table, entries, bucket);                                                     \
    }                                                                                                \
    extern "C" __global__ void unpack_copy##width(const i64* table, int entries, const T* bucket) { \
        unpack_copy_impl<T>(table, entries, bucket);                                                 \
    }
DEFINE_COPY(1, unsigned char)
DEFINE_COPY(2, unsigned short)
DEFINE_COPY(4, unsigned int)
DEFINE_COPY(8, unsigned long long)

#define DEFINE_CAST(name, W)                                                                                 \
    extern "C" __global__ void pack_float32_##name(const i64* table, int entries, W* bucket) {              \
        pack_impl<float, W>(table, entries, bucket);                                                         \
    }                                                                                                        \
    extern "C" __global__ void unpack_##name##_float32(const i64* table, int entries, const W* bucket,      \
                                                       float scale) {                                        \
        unpack_cast_impl<W>(table, entries, bucket, scale);                                                  \
    }
DEFINE_CAST(float16, half_t)
DEFINE_CAST(bfloat16, bf16_t)
