// One-shot and two-shot all-reduce over CUDA IPC (NVLink) for the ranks of one node.
//
// Every rank owns one registered allocation, mapped into every peer's address space:
//
//   [ Signals (IPC_SIGNAL_BYTES) | staging buffer 0 | staging buffer 1 ]
//
// A call (one launch) has a call number `e` (the epoch), kept per rank in its own Signals and the
// same on every rank because every rank makes the same calls in the same order. Its parity picks
// the staging buffer. Block b of a rank only ever synchronises with block b of the other ranks:
// the launch configuration is a function of the element count alone, so every rank maps the
// same elements to the same (block, thread), and block b of rank q touches exactly the elements
// that block b of the other ranks need from it or give to it.
//
// One call, block b of rank r (n ranks):
//   1. Copy-in: the block copies its elements of x into staging[e & 1] (skipped when x already
//      lives in registered memory: "direct" mode).
//   2. Start barrier: release-store 2e + direct into every rank q's start[b][r] (direct mode first
//      stores "where my input is, in q's address space" into q's src[b][r]). Then wait until
//      start[b][q] >= 2e for every q (acquire). Rank q's input is its staging[e & 1], unless the
//      flag says direct (2e + 1): then it is src[b][q].
//   3a. One-shot: read the block's elements from every rank's input, reduce in rank order 0..n-1,
//      write them to out.
//   3b. Two-shot: reduce only slice r (its block-b part) from every rank's input; write it into
//      staging[e & 1] (the rank's "result" area) and into out. Mid barrier. Copy slice q (its
//      block-b part) from rank q's result area into out, for every q != r.
//   4. End barrier, only when some rank is in direct mode (see below).
//   5. The last block to finish stores e as the rank's completed call number.
//
// Memory ordering (PTX memory model, scopes as written):
// - Flags are written with st.release.sys by one thread after __syncthreads(): the CTA barrier
//   orders every thread's earlier accesses (copy-in stores, reads of peer data) before the
//   release, and release is cumulative, so a peer that reads the flag with ld.acquire.sys and
//   then passes its own __syncthreads() sees all of them. The src pointer is stored before the
//   release in program order, so it is visible to whoever acquires the flag. Peer data is then
//   read with ordinary loads: the acquire by thread q and the CTA barrier after it order them
//   after the flag for every thread of the block.
// - Data a rank's earlier stream work wrote (user kernels, the previous call) is ordered before
//   this kernel by stream order, hence before its release stores.
// Why no end barrier is needed in staging mode: rank r writes staging[p] (p = e & 1) in call e
// only after its call e-1 completed; call e-1's start barrier completed only after every rank
// had started call e-1, i.e. had finished call e-2, the last call that read staging[p]. A rank
// can be at most one call ahead of any other (it cannot pass the start barrier of call e+1 until
// all ranks have started e+1), which is why the flags compare with >=: a peer may already have
// stored call e+1 into a flag this rank is waiting on for call e.
// Direct mode (x is in registered memory the user owns): the user may overwrite x as soon as the
// call completes on its stream, while peers may still read it; so every rank then runs the end
// barrier, which completes only after every rank has finished reading. Each rank learns every
// peer's mode for call e from the start flag: 2e + 1 is direct; a value of 2(e+1) or more means
// the peer has already finished call e, which a direct peer cannot do before this rank reaches
// the end barrier, so it was in staging mode. All ranks thus agree on running the end barrier.
// For the same reason src[b][q] needs one slot only: it is read for a direct peer, which cannot
// store its next call's src before this rank has read this one.
// In place (out == x) with one-shot, the result first goes to the rank's own staging buffer and
// is copied to out after the end barrier, because peers are still reading x until then.
// Epochs are 64-bit: they never wrap.
#include "common.cuh"

#define IPC_MAX_RANKS 8
#define IPC_MAX_BLOCKS 64
#define IPC_SIGNAL_BYTES 32768
#define IPC_TABLE_OFFSET 16  // where the host writes Signals::peers
#define IPC_MAX_THREADS 512
#define IPC_FLAG_TEMP_RESULT 1  // direct, in place, one-shot: reduce into staging, copy after the end barrier

struct Signals {
    u64 epoch;                                       // last completed call of this rank (local only)
    unsigned done;                                   // blocks of the current call that finished (local only)
    unsigned pad;
    u64 peers[IPC_MAX_RANKS];                        // rank q's allocation in this address space (host-written)
    u64 start[IPC_MAX_BLOCKS][IPC_MAX_RANKS];        // written by rank q: 2 x its latest call + direct
    u64 mid[IPC_MAX_BLOCKS][IPC_MAX_RANKS];          // ... at the mid barrier (two-shot)
    u64 end[IPC_MAX_BLOCKS][IPC_MAX_RANKS];          // ... at the end barrier (direct mode)
    u64 src[IPC_MAX_BLOCKS][IPC_MAX_RANKS];          // direct rank q's input, in this address space
};
static_assert(sizeof(Signals) <= IPC_SIGNAL_BYTES, "Signals must fit the reserved area");
// peers follows epoch, done and pad (NVRTC 13.0 has no offsetof in constant expressions)
static_assert(sizeof(u64) + 2 * sizeof(unsigned) == IPC_TABLE_OFFSET, "the host writes the table there");

enum { BARRIER_START = 0, BARRIER_MID = 1, BARRIER_END = 2 };

// Timeout record, in mapped pinned host memory: [0] 1 when set, [1] barrier, [2] rank, [3] peer,
// [4] block, [5] flag value awaited, [6] flag value seen, [7] nanoseconds waited.
__device__ __forceinline__ void store_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 load_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Spin until *flag >= target (acquire); return the value seen. With a timeout, record why and trap.
__device__ __noinline__ u64 wait_flag(const u64* flag, u64 target, int barrier, int rank, int peer, u64 timeout_ns,
                                      volatile u64* record) {
    u64 seen = load_acquire_sys(flag);
    if (seen >= target) return seen;
    const u64 t0 = global_ns();
    while ((seen = load_acquire_sys(flag)) < target) {
        const u64 waited = global_ns() - t0;
        if (timeout_ns != 0 && waited > timeout_ns) {
            record[1] = barrier;
            record[2] = rank;
            record[3] = peer;
            record[4] = blockIdx.x;
            record[5] = target;
            record[6] = seen;
            record[7] = waited;
            __threadfence_system();
            record[0] = 1;
            __threadfence_system();
            __trap();
        }
    }
    return seen;
}

// Block-wide barrier with the same block of every rank. Threads 0..n-1 each talk to one rank.
__device__ __forceinline__ void cross_barrier(Signals* me, Signals* const* sig, int kind, int rank, int n, u64 e,
                                              u64 timeout_ns, volatile u64* record) {
    __syncthreads();
    const int t = threadIdx.x;
    if (t < n) {
        u64 (*theirs)[IPC_MAX_RANKS] = kind == BARRIER_MID ? sig[t]->mid : sig[t]->end;
        u64 (*mine)[IPC_MAX_RANKS] = kind == BARRIER_MID ? me->mid : me->end;
        store_release_sys(&theirs[blockIdx.x][rank], e);
        wait_flag(&mine[blockIdx.x][t], e, kind, rank, t, timeout_ns, record);
    }
    __syncthreads();
}

// 16 bytes of elements. Loads and stores are 16-byte vectors where the address is aligned and
// the pack is complete, element by element otherwise (byte by byte for addresses not aligned
// to the element size), so the element -> thread mapping never depends on alignment.
template <typename T> union Pack {
    uint4 raw;
    T e[16 / sizeof(T)];
};

template <typename T> __device__ __forceinline__ void load_elem(T* dst, const char* src) {
    if (((u64)src % sizeof(T)) == 0) {
        *dst = *(const T*)src;
    } else {
        for (int j = 0; j < (int)sizeof(T); ++j) ((unsigned char*)dst)[j] = (unsigned char)src[j];
    }
}
template <typename T> __device__ __forceinline__ void store_elem(char* dst, const T* src) {
    if (((u64)dst % sizeof(T)) == 0) {
        *(T*)dst = *src;
    } else {
        for (int j = 0; j < (int)sizeof(T); ++j) dst[j] = (char)((const unsigned char*)src)[j];
    }
}

// Elements first..first+V-1 of the array at `base`, those below `limit` only. The fast path is one
// 16-byte access; the rest (a partial last pack, or an address not 16-byte aligned) is out of line.
template <typename T> __device__ __noinline__ uint4 load_pack_slow(const char* at, i64 valid) {
    Pack<T> p;
    p.raw = make_uint4(0u, 0u, 0u, 0u);
    for (int i = 0; i < 16 / (int)sizeof(T) && i < valid; ++i) load_elem<T>(&p.e[i], at + i * (i64)sizeof(T));
    return p.raw;
}
template <typename T> __device__ __noinline__ void store_pack_slow(char* at, i64 valid, uint4 raw) {
    Pack<T> p;
    p.raw = raw;
    for (int i = 0; i < 16 / (int)sizeof(T) && i < valid; ++i) store_elem<T>(at + i * (i64)sizeof(T), &p.e[i]);
}
template <typename T> __device__ __forceinline__ void load_pack(Pack<T>& p, const char* base, i64 first, i64 limit) {
    constexpr int V = 16 / sizeof(T);
    const char* at = base + first * (i64)sizeof(T);
    if (first + V <= limit && ((u64)at & 15) == 0) {
        p.raw = *(const uint4*)at;
    } else {
        p.raw = load_pack_slow<T>(at, limit - first);
    }
}
template <typename T> __device__ __forceinline__ void store_pack(char* base, i64 first, i64 limit, const Pack<T>& p) {
    constexpr int V = 16 / sizeof(T);
    char* at = base + first * (i64)sizeof(T);
    if (first + V <= limit && ((u64)at & 15) == 0) {
        *(uint4*)at = p.raw;
    } else {
        store_pack_slow<T>(at, limit - first, p.raw);
    }
}

// r = finish(v[0] (op) v[1] (op) ... (op) v[n-1]): rank order, accumulate type, rounded once.
template <typename T, int OP> __device__ __forceinline__ void combine_packs(Pack<T>& r, const Pack<T>* v, int n) {
    typedef typename Acc<T>::type A;
    if constexpr (OP == OP_AVG && !IsFloat<T>::value) {  // exact, no wrap-around (common.cuh)
#pragma unroll
        for (int i = 0; i < 16 / (int)sizeof(T); ++i) {
            IntMean<T> mean;
#pragma unroll
            for (int q = 0; q < IPC_MAX_RANKS; ++q) {
                if (q < n) mean.add(v[q].e[i], n);
            }
            r.e[i] = mean.result(n);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16 / (int)sizeof(T); ++i) {
            A acc = to_acc<T>(v[0].e[i]);
#pragma unroll
            for (int q = 1; q < IPC_MAX_RANKS; ++q) {
                if (q < n) acc = combine<A>(OP, acc, to_acc<T>(v[q].e[i]));
            }
            r.e[i] = finish<T>(OP, acc, n);
        }
    }
}

template <typename T>
__device__ __noinline__ uint4 reduce_pack(const char* const* src, i64 first, i64 limit, int n, int op) {
    Pack<T> v[IPC_MAX_RANKS], r;
#pragma unroll
    for (int q = 0; q < IPC_MAX_RANKS; ++q) {
        if (q < n) load_pack<T>(v[q], src[q], first, limit);
    }
    switch (op) {
        case OP_SUM: combine_packs<T, OP_SUM>(r, v, n); break;
        case OP_AVG: combine_packs<T, OP_AVG>(r, v, n); break;
        case OP_MIN: combine_packs<T, OP_MIN>(r, v, n); break;
        case OP_MAX: combine_packs<T, OP_MAX>(r, v, n); break;
        default: combine_packs<T, OP_PROD>(r, v, n); break;
    }
    return r.raw;
}

// The packs of a range that this thread handles: the same on every rank for the same launch.
#define FOR_MY_PACKS(k, packs) \
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < (packs); k += (i64)gridDim.x * blockDim.x)

template <typename T>
__device__ void allreduce_impl(Signals* me, const u64* x_seen, i64 x_offset, const T* x, T* out, i64 count, i64 slice,
                               i64 stage_bytes, int op, int rank, int n, int flags, u64 timeout_ns,
                               volatile u64* record) {
    constexpr int V = 16 / sizeof(T);
    __shared__ u64 s_epoch;
    __shared__ Signals* s_sig[IPC_MAX_RANKS];
    __shared__ const char* s_src[IPC_MAX_RANKS];
    const int t = threadIdx.x;
    const bool direct = x_seen != nullptr;
    if (t == 0) s_epoch = *(volatile u64*)&me->epoch + 1;
    if (t < n) s_sig[t] = (Signals*)me->peers[t];
    __syncthreads();
    const u64 e = s_epoch;
    const int parity = (int)(e & 1);
    const i64 stage_offset = IPC_SIGNAL_BYTES + parity * stage_bytes;
    char* staging = (char*)me + stage_offset;

    // 1. Copy-in: the elements of x that this block's counterparts on the other ranks will read.
    if (!direct) {
        if (slice == 0) {
            const i64 packs = (count + V - 1) / V;
            FOR_MY_PACKS(k, packs) {
                Pack<T> p;
                load_pack<T>(p, (const char*)x, k * V, count);
                store_pack<T>(staging, k * V, count, p);
            }
        } else {
            const i64 packs = (slice + V - 1) / V;
            for (int s = 0; s < n; ++s) {
                const i64 lo = s * slice, hi = min(count, lo + slice);
                FOR_MY_PACKS(k, packs) {
                    if (lo + k * V >= hi) break;
                    Pack<T> p;
                    load_pack<T>(p, (const char*)x, lo + k * V, hi);
                    store_pack<T>(staging, lo + k * V, hi, p);
                }
            }
        }
    }

    // 2. Start barrier; learn where each rank's input is.
    __syncthreads();
    bool peer_direct = false;
    if (t < n) {
        Signals* peer = s_sig[t];
        if (direct) *(volatile u64*)&peer->src[blockIdx.x][rank] = x_seen[t] + (u64)x_offset;
        store_release_sys(&peer->start[blockIdx.x][rank], 2 * e + (direct ? 1 : 0));
        const u64 seen = wait_flag(&me->start[blockIdx.x][t], 2 * e, BARRIER_START, rank, t, timeout_ns, record);
        peer_direct = seen == 2 * e + 1;
        s_src[t] = peer_direct ? (const char*)*(volatile u64*)&me->src[blockIdx.x][t]
                               : (const char*)peer + stage_offset;
    }
    const bool end_barrier = __syncthreads_or(peer_direct) != 0;

    if (slice == 0) {
        // 3a. One-shot.
        const bool temp = direct && (flags & IPC_FLAG_TEMP_RESULT);
        char* dst = temp ? staging : (char*)out;
        const i64 packs = (count + V - 1) / V;
        FOR_MY_PACKS(k, packs) {
            Pack<T> r;
            r.raw = reduce_pack<T>(s_src, k * V, count, n, op);
            store_pack<T>(dst, k * V, count, r);
        }
        if (end_barrier) cross_barrier(me, s_sig, BARRIER_END, rank, n, e, timeout_ns, record);
        if (temp) {
            FOR_MY_PACKS(k, packs) {
                Pack<T> r;
                load_pack<T>(r, staging, k * V, count);
                store_pack<T>((char*)out, k * V, count, r);
            }
        }
    } else {
        // 3b. Two-shot: reduce-scatter into the result areas, then all-gather from them.
        const i64 packs = (slice + V - 1) / V;
        const i64 lo = rank * slice, hi = min(count, lo + slice);
        FOR_MY_PACKS(k, packs) {
            if (lo + k * V >= hi) break;
            Pack<T> r;
            r.raw = reduce_pack<T>(s_src, lo + k * V, hi, n, op);
            store_pack<T>(staging, lo + k * V, hi, r);
            store_pack<T>((char*)out, lo + k * V, hi, r);
        }
        cross_barrier(me, s_sig, BARRIER_MID, rank, n, e, timeout_ns, record);
        for (int d = 1; d < n; ++d) {
            const int q = (rank + d) % n;  // start with different peers on different ranks
            const char* result = (const char*)s_sig[q] + stage_offset;
            const i64 qlo = q * slice, qhi = min(count, qlo + slice);
            FOR_MY_PACKS(k, packs) {
                if (qlo + k * V >= qhi) break;
                Pack<T> r;
                load_pack<T>(r, result, qlo + k * V, qhi);
                store_pack<T>((char*)out, qlo + k * V, qhi, r);
            }
        }
        if (end_barrier) cross_barrier(me, s_sig, BARRIER_END, rank, n, e, timeout_ns, record);
    }

    // 5. The last block to finish records the call as completed. Every block read the epoch before
    //    its own increment of `done`, so no block can see the new value in this call.
    if (t == 0) {
        const unsigned finished = atomicAdd(&me->done, 1u);
        if (finished == gridDim.x - 1) {
            me->done = 0;
            *(volatile u64*)&me->epoch = e;
        }
    }
}

#define DEFINE_IPC_KERNEL(name, T)                                                                           \
    extern "C" __global__ void __launch_bounds__(IPC_MAX_THREADS)                                           \
        ipc_allreduce_##name(Signals* me, const u64* x_seen, i64 x_offset, const T* x, T* out, i64 count,   \
                             i64 slice, i64 stage_bytes, int op, int rank, int n, int flags, u64 timeout_ns, \
                             u64* record) {                                                                  \
        allreduce_impl<T>(me, x_seen, x_offset, x, out, count, slice, stage_bytes, op, rank, n, flags,      \
                          timeout_ns, record);                                                               \
    }
MPIGPU_FOR_EACH_TYPE(DEFINE_IPC_KERNEL)
