/* mpigpu's compiled check-board exchange: one check, or one tiny host allreduce, in one C call.
 *
 * The boards (mpigpu/job/check_board.py, node_mpi_board.py, mpi_board.py) keep their layout and their
 * protocol; this file runs the same steps the Python code runs, without the interpreter between them:
 *
 *   1. copy the packed signature (FIELDS int64) into this rank's slot (the caller wrote the data beside
 *      it), then publish the check number k with a release store;
 *   2. wait until each word in ``waits`` reaches k (acquire): the node's other ranks, or for a node's
 *      non-leader the leader's published k; spin as long as the plan says (the board's Python path's
 *      time), then yield, then sleep 50 us steps (mpigpu.job.shm.wait_at_least's steps);
 *   3. the exchange among nodes, where the board has one: MPI_Allgather or MPI_Allgatherv of slots,
 *      through the function mpi4py's MPI library holds (the plan names it; nothing is linked);
 *   4. a leader publishes k on its node (release);
 *   5. compare every rank's signature with this rank's; where all agree and a fold is given, reduce every
 *      rank's row in rank order into ``fold->result``, exactly as mpigpu.backends.cpu_board does: the first
 *      row, then each next one combined into it; avg divides by the rank count; a float NaN becomes the
 *      canonical NaN. The same operations in the same order give the same bits as the Python path, so
 *      ranks running either path agree bit for bit.
 *
 * Returns 1 (every rank agrees; folded), 0 (a signature differs: nothing is written to the result),
 * minus the MPI error code of the exchange, or UNKNOWN_FOLD. The calling thread has released the GIL
 * (ctypes), so the watchdog's thread can end a job whose rank never arrives.
 *
 * Build: cc -O2 -shared -fPIC -ffp-contract=off -fno-fast-math (mpigpu.job.native_board, into the
 * private cache).
 */

#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep under a strict -std */

#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define VALUES 72 /* FIELDS int64: check_board.FIELDS */
#define DATA 80   /* a slot's data offset: check_board._DATA */

enum { NO_EXCHANGE = 0, ALLGATHER = 1, ALLGATHERV = 2 };
enum { UNKNOWN_FOLD = -1000000 }; /* a dtype this file does not fold: the caller's error (never an MPI code) */
enum { SUM = 0, PROD = 1, MIN = 2, MAX = 3, AVG = 4 };
/* mpigpu.core.dtypes' codes */
enum { F32 = 3, F64 = 4, I8 = 5, U8 = 6, I16 = 7, U16 = 8, I32 = 9, U32 = 10, I64 = 11, U64 = 12 };

/* One parity of one board. Mirrored by mpigpu.job.native_board.Plan: keep the two equal. */
typedef struct {
  int64_t *post_k;     /* where this rank publishes k (NULL: the flat board publishes none) */
  char *post;          /* this rank's slot: signature at +8, data at +DATA */
  int64_t **waits;     /* words to wait on until they reach k, before the exchange */
  int32_t nwaits;
  int32_t exchange;    /* NO_EXCHANGE, ALLGATHER or ALLGATHERV */
  int32_t handle_bytes; /* the MPI's handle width: 4 (MPICH, Intel MPI) or 8 (Open MPI) */
  int32_t nranks;
  void *fn;            /* MPI_Allgather or MPI_Allgatherv */
  const void *send;    /* MPI_IN_PLACE's value, or the node's posts */
  void *recv;
  int64_t count;       /* bytes sent per member */
  const int32_t *counts; /* Allgatherv: bytes per member, and their displacements */
  const int32_t *displs;
  int64_t byte_type;   /* MPI_BYTE's handle */
  int64_t comm;        /* the exchange's communicator's handle */
  int64_t *publish;    /* a leader publishes k here after the exchange (NULL: none) */
  char **rows;         /* every rank's slot, in rank order */
  int64_t spin_ns;     /* how long a wait spins before it yields */
} Plan;

/* A fused allreduce's reduction. Mirrored by mpigpu.job.native_board.Fold. */
typedef struct {
  int32_t dtype; /* the dtype codes above */
  int32_t op;    /* SUM, PROD, MIN, MAX, AVG */
  int64_t count; /* elements per row */
  void *result;  /* where the reduction goes */
} Fold;

int64_t mpigpu_board_plan_bytes(void) { return (int64_t)sizeof(Plan); }
int64_t mpigpu_board_fold_bytes(void) { return (int64_t)sizeof(Fold); }

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Until *word >= k: spin ``spin_ns`` (the plan's: 20 us on the node board, 0 on the two-level board, whose
 * waits span an exchange between nodes and must not hold a core the leader needs), then yield on every read
 * until 2 ms, then sleep in 50 us steps: mpigpu.job.shm.wait_at_least's steps, as each board's Python path. */
static void wait_at_least(int64_t *word, int64_t k, int64_t spin_ns) {
  if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= k) return;
  const int64_t start = now_ns();
  int64_t waited = 0;
  for (uint32_t i = 1;; ++i) {
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= k) return;
    if (waited < spin_ns) {
      relax();
      if (i % 64 == 0) waited = now_ns() - start;
      continue;
    }
    waited = now_ns() - start;
    if (waited < 2000000) {
      sched_yield();
    } else {
      struct timespec step = {0, 50000};
      nanosleep(&step, NULL);
    }
  }
}

/* MPI handles are ints (MPICH, Intel MPI) or pointers (Open MPI): the call, typed both ways. */
#define GATHER(H)                                                                                        \
  static int gather_##H(const Plan *p) {                                                                 \
    if (p->exchange == ALLGATHER) {                                                                      \
      typedef int (*fn_t)(const void *, int, H, void *, int, H, H);                                      \
      return ((fn_t)p->fn)(p->send, (int)p->count, (H)(intptr_t)p->byte_type, p->recv, (int)p->count,    \
                           (H)(intptr_t)p->byte_type, (H)(intptr_t)p->comm);                             \
    }                                                                                                    \
    typedef int (*fnv_t)(const void *, int, H, void *, const int *, const int *, H, H);                  \
    return ((fnv_t)p->fn)(p->send, (int)p->count, (H)(intptr_t)p->byte_type, p->recv,                    \
                          (const int *)p->counts, (const int *)p->displs, (H)(intptr_t)p->byte_type,     \
                          (H)(intptr_t)p->comm);                                                         \
  }
typedef int32_t int_handle;
typedef void *pointer_handle;
GATHER(int_handle)
GATHER(pointer_handle)

/* Integers: sum and prod modulo 2^bits (as NumPy wraps), computed unsigned; min and max as the type orders. */
#define FOLD_INT(T)                                                                                      \
  static void fold_##T(char *const *rows, int32_t n, int64_t count, int32_t op, T *out) {                \
    memcpy(out, rows[0] + DATA, (size_t)count * sizeof(T));                                              \
    for (int32_t r = 1; r < n; ++r) {                                                                    \
      const T *row = (const T *)(rows[r] + DATA);                                                        \
      for (int64_t i = 0; i < count; ++i) {                                                              \
        const T a = out[i], b = row[i];                                                                  \
        switch (op) {                                                                                    \
          case SUM: out[i] = (T)((uint64_t)a + (uint64_t)b); break;                                      \
          case PROD: out[i] = (T)((uint64_t)a * (uint64_t)b); break;                                     \
          case MIN: out[i] = b < a ? b : a; break;                                                       \
          default: out[i] = b > a ? b : a; break;                                                        \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
  }
FOLD_INT(int8_t)
FOLD_INT(uint8_t)
FOLD_INT(int16_t)
FOLD_INT(uint16_t)
FOLD_INT(int32_t)
FOLD_INT(uint32_t)
FOLD_INT(int64_t)
FOLD_INT(uint64_t)

/* Floats: sum, prod or avg (sum, then one IEEE division by the rank count), then every NaN canonical. */
#define FOLD_FLOAT(T, U, SIGN, EXP, NAN_BITS)                                                            \
  static void fold_##T(char *const *rows, int32_t n, int64_t count, int32_t op, T *out) {                \
    memcpy(out, rows[0] + DATA, (size_t)count * sizeof(T));                                              \
    for (int32_t r = 1; r < n; ++r) {                                                                    \
      const T *row = (const T *)(rows[r] + DATA);                                                        \
      if (op == PROD) {                                                                                  \
        for (int64_t i = 0; i < count; ++i) out[i] = out[i] * row[i];                                    \
      } else {                                                                                           \
        for (int64_t i = 0; i < count; ++i) out[i] = out[i] + row[i];                                    \
      }                                                                                                  \
    }                                                                                                    \
    if (op == AVG) {                                                                                     \
      const T ranks = (T)n;                                                                              \
      for (int64_t i = 0; i < count; ++i) out[i] = out[i] / ranks;                                       \
    }                                                                                                    \
    for (int64_t i = 0; i < count; ++i) {                                                                \
      U bits;                                                                                            \
      memcpy(&bits, &out[i], sizeof bits);                                                               \
      if ((bits & ~(U)(SIGN)) > (U)(EXP)) {                                                              \
        bits = (U)(NAN_BITS);                                                                            \
        memcpy(&out[i], &bits, sizeof bits);                                                             \
      }                                                                                                  \
    }                                                                                                    \
  }
FOLD_FLOAT(float, uint32_t, 0x80000000u, 0x7F800000u, 0x7FC00000u)
FOLD_FLOAT(double, uint64_t, 0x8000000000000000ull, 0x7FF0000000000000ull, 0x7FF8000000000000ull)

static int fold(char *const *rows, int32_t n, const Fold *f) {
  switch (f->dtype) {
    case F32: fold_float(rows, n, f->count, f->op, (float *)f->result); return 1;
    case F64: fold_double(rows, n, f->count, f->op, (double *)f->result); return 1;
    case I8: fold_int8_t(rows, n, f->count, f->op, (int8_t *)f->result); return 1;
    case U8: fold_uint8_t(rows, n, f->count, f->op, (uint8_t *)f->result); return 1;
    case I16: fold_int16_t(rows, n, f->count, f->op, (int16_t *)f->result); return 1;
    case U16: fold_uint16_t(rows, n, f->count, f->op, (uint16_t *)f->result); return 1;
    case I32: fold_int32_t(rows, n, f->count, f->op, (int32_t *)f->result); return 1;
    case U32: fold_uint32_t(rows, n, f->count, f->op, (uint32_t *)f->result); return 1;
    case I64: fold_int64_t(rows, n, f->count, f->op, (int64_t *)f->result); return 1;
    case U64: fold_uint64_t(rows, n, f->count, f->op, (uint64_t *)f->result); return 1;
    default: return UNKNOWN_FOLD;
  }
}

/* One check k of ``packed`` on the board ``p`` (this parity's plan), and the fold where ``f`` is given. */
int mpigpu_board_call(const Plan *p, int64_t k, const char *packed, const Fold *f) {
  memcpy(p->post + 8, packed, VALUES);
  if (p->post_k) __atomic_store_n(p->post_k, k, __ATOMIC_RELEASE); /* data and values before k */
  for (int32_t i = 0; i < p->nwaits; ++i) wait_at_least(p->waits[i], k, p->spin_ns);
  if (p->exchange != NO_EXCHANGE) {
    const int rc = p->handle_bytes == 4 ? gather_int_handle(p) : gather_pointer_handle(p);
    if (rc != 0) return -rc;
  }
  if (p->publish) __atomic_store_n(p->publish, k, __ATOMIC_RELEASE); /* the results before k */
  for (int32_t r = 0; r < p->nranks; ++r) {
    if (memcmp(p->rows[r] + 8, packed, VALUES) != 0) return 0;
  }
  return f ? fold(p->rows, p->nranks, f) : 1;
}
