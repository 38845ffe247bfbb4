// Host staging's reduction on the GPU: each GPU reduces its own slice of a chunk by reading that
// slice from every rank's slot in node-shared pinned host memory (mapped: zero-copy over PCIe), and
// writes the result back to host memory. Ranks are combined in fixed order 0..n-1, so the bytes do
// not depend on which GPU computed them.
//
// Memory ordering: the slots were filled by other GPUs' copy engines, completed (event synchronised
// by their owners) before an MPI barrier that precedes this launch. A line of host memory cached in
// this GPU's L2 by an earlier launch could be stale, so the slots are read with ld.global.cv, which
// discards any cached copy and fetches again. The results are plain stores: kernel completion
// (which the host synchronises on before the next barrier) makes them visible to the CPU and to the
// other GPUs' copy engines.
#include "common.cuh"

template <int Bytes> struct Bits;
template <> struct Bits<1> { typedef unsigned char type; };
template <> struct Bits<2> { typedef unsigned short type; };
template <> struct Bits<4> { typedef unsigned int type; };
template <> struct Bits<8> { typedef unsigned long long type; };

__device__ __forceinline__ unsigned char load_cv_bits(const unsigned char* p) {
    unsigned int v;
    asm volatile("ld.global.cv.u8 %0, [%1];" : "=r"(v) : "l"(p));
    return (unsigned char)v;
}
__device__ __forceinline__ unsigned short load_cv_bits(const unsigned short* p) {
    unsigned short v;
    asm volatile("ld.global.cv.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned int load_cv_bits(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.global.cv.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned long long load_cv_bits(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.global.cv.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

struct Vec16 { unsigned int x, y, z, w; };

__device__ __forceinline__ Vec16 load_cv16(const char* p) {
    Vec16 v;
    asm volatile("ld.global.cv.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

template <typename T> __device__ __forceinline__ T load_cv(const char* p) {
    typedef typename Bits<sizeof(T)>::type B;
    union { B bits; T value; } u;
    u.bits = load_cv_bits(reinterpret_cast<const B*>(p));
    return u.value;
}

// One slice: slots points at element 0 of the slice in rank 0's slot; rank r's copy is `stride`
// bytes further. FINAL writes the finished value (avg divided, half types rounded once) as T;
// otherwise the unfinished accumulator (Acc<T>, float32 for the half types) is written, for the
// reduction across nodes that follows on the host.
template <typename T, bool FINAL>
__device__ void reduce_slots(const char* slots, i64 stride, int n, i64 count, int op, int nranks, char* dst) {
    typedef typename Acc<T>::type A;
    if constexpr (!IsFloat<T>::value && FINAL) {
        if (op == OP_AVG) {  // exact (IntMean); one node only: the host backend refuses it across nodes
            GRID_STRIDE(i, count) {
                IntMean<T> mean;
                for (int r = 0; r < n; ++r) mean.add(load_cv<T>(slots + (i64)r * stride + i * (i64)sizeof(T)), nranks);
                reinterpret_cast<T*>(dst)[i] = mean.result(nranks);
            }
            return;
        }
    }
    constexpr int V = 16 / sizeof(T);
    const i64 vecs = count / V;
    GRID_STRIDE(v, vecs) {
        union { Vec16 raw; T e[V]; } in;
        A acc[V];
        in.raw = load_cv16(slots + v * 16);
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = to_acc<T>(in.e[j]);
        for (int r = 1; r < n; ++r) {
            in.raw = load_cv16(slots + (i64)r * stride + v * 16);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = combine<A>(op, acc[j], to_acc<T>(in.e[j]));
        }
        if constexpr (FINAL) {
            union { Vec16 raw; T e[V]; } out;
#pragma unroll
            for (int j = 0; j < V; ++j) out.e[j] = finish<T>(op, acc[j], nranks);
            *reinterpret_cast<Vec16*>(dst + v * 16) = out.raw;
        } else {
            A* partial = reinterpret_cast<A*>(dst) + v * V;
#pragma unroll
            for (int j = 0; j < V; ++j) partial[j] = acc[j];
        }
    }
    // The last count % V elements, one by one.
    GRID_STRIDE(t, count - vecs * V) {
        const i64 i = vecs * V + t;
        A acc = to_acc<T>(load_cv<T>(slots + i * (i64)sizeof(T)));
        for (int r = 1; r < n; ++r) {
            acc = combine<A>(op, acc, to_acc<T>(load_cv<T>(slots + (i64)r * stride + i * (i64)sizeof(T))));
        }
        if constexpr (FINAL) {
            reinterpret_cast<T*>(dst)[i] = finish<T>(op, acc, nranks);
        } else {
            reinterpret_cast<A*>(dst)[i] = acc;
        }
    }
}

#define DEFINE_HOST_KERNELS(name, T)                                                                      \
    extern "C" __global__ void reduce_final_##name(const char* slots, i64 stride, int n, i64 count, int op, \
                                                   int nranks, char* dst) {                             \
        reduce_slots<T, true>(slots, stride, n, count, op, nranks, dst);                                \
    }                                                                                                   \
    extern "C" __global__ void reduce_partial_##name(const char* slots, i64 stride, int n, i64 count,     \
                                                     int op, int nranks, char* dst) {                   \
        reduce_slots<T, false>(slots, stride, n, count, op, nranks, dst);                               \
    }
MPIGPU_FOR_EACH_TYPE(DEFINE_HOST_KERNELS)
