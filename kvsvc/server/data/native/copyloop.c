/* kvsvc's copy loop: copy a run of checksum segments between an engine's
 * mapped blocks and a chunk in the store, and CRC-32C each segment while it
 * is in cache, in one call. Loaded with ctypes (which drops the GIL for the
 * whole call), so a copy thread takes the GIL once per task, not twice per
 * segment. Only libc and the compiler's own headers: the package build
 * (setup.py, as an extension module's file without PyInit) builds it wherever
 * there is a C compiler; kvsvc/server/data/copies.py falls back to Python when
 * it is missing.
 *
 * CRC-32C (Castagnoli, reflected 0x82F63B78), the same value as the `crc32c`
 * package's crc32c(data): with AVX-512 VPCLMULQDQ on x86-64, carry-less
 * folding (buffers of 1 KiB and more); with SSE4.2, three interleaved crc32
 * streams combined with zero-shift tables; elsewhere slicing-by-8 tables.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define POLY 0x82f63b78u
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256

static uint32_t table8[8][256];
static uint32_t shift_long[4][256];
static uint32_t shift_short[4][256];
static int ready;

/* GF(2) 32x32 matrix (columns as words) times a vector. */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1) sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *out, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) out[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends `bytes` zero bytes (a power of two) to a CRC. */
static void zeros_operator(uint32_t *op, size_t bytes) {
    uint32_t a[32], b[32];
    a[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) a[n] = 1u << (n - 1);
    gf2_square(b, a); /* 2 bits */
    gf2_square(a, b); /* 4 bits */
    gf2_square(b, a); /* 8 bits = 1 byte, in b */
    for (size_t have = 1; have < bytes; have <<= 1) {
        gf2_square(a, b);
        memcpy(b, a, sizeof a);
    }
    memcpy(op, b, sizeof b);
}

static void shift_table(uint32_t t[4][256], size_t bytes) {
    uint32_t op[32];
    zeros_operator(op, bytes);
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 0; k < 4; k++) t[k][n] = gf2_times(op, n << (8 * k));
}

static uint32_t shift(uint32_t t[4][256], uint32_t crc) {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^
           t[3][crc >> 24];
}

static void init(void) {
    if (ready) return;
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table8[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            table8[k][n] = (table8[k - 1][n] >> 8) ^ table8[0][table8[k - 1][n] & 0xff];
    shift_table(shift_long, LONG_BLOCK);
    shift_table(shift_short, SHORT_BLOCK);
    ready = 1;
}

static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t len) {
    crc = ~crc;
    for (; len >= 8; p += 8, len -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = table8[7][w & 0xff] ^ table8[6][(w >> 8) & 0xff] ^ table8[5][(w >> 16) & 0xff] ^
              table8[4][(w >> 24) & 0xff] ^ table8[3][(w >> 32) & 0xff] ^
              table8[2][(w >> 40) & 0xff] ^ table8[1][(w >> 48) & 0xff] ^ table8[0][w >> 56];
    }
    while (len--) crc = (crc >> 8) ^ table8[0][(crc ^ *p++) & 0xff];
    return ~crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define HAVE_HW 1

__attribute__((target("sse4.2"))) static uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Three streams of `block` bytes at once (the crc32 instruction has a latency
 * of 3 and a throughput of 1), joined by shifting each over the next's bytes. */
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p,
                                                         size_t len) {
    uint64_t c0 = ~crc;
    for (; len && ((uintptr_t)p & 7); len--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    while (len >= 3 * LONG_BLOCK) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char *end = p + LONG_BLOCK;
        do {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + LONG_BLOCK));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * LONG_BLOCK));
            p += 8;
        } while (p < end);
        c0 = shift(shift_long, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift(shift_long, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * LONG_BLOCK;
        len -= 3 * LONG_BLOCK;
    }
    while (len >= 3 * SHORT_BLOCK) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char *end = p + SHORT_BLOCK;
        do {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + SHORT_BLOCK));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * SHORT_BLOCK));
            p += 8;
        } while (p < end);
        c0 = shift(shift_short, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift(shift_short, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * SHORT_BLOCK;
        len -= 3 * SHORT_BLOCK;
    }
    for (; len >= 8; p += 8, len -= 8) c0 = _mm_crc32_u64(c0, load64(p));
    for (; len; len--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return ~(uint32_t)c0;
}

/* Folding with carry-less multiplies (AVX-512 VPCLMULQDQ: 4 x 128-bit lanes per
 * instruction), several times the crc32 instruction's 8 bytes per cycle.
 * Conventions (reflected CRC): a 32-bit value v stands for the polynomial with
 * bit j <-> x^(31-j); a 128-bit lane loaded from 16 bytes, bit m <-> x^(127-m),
 * so its low 64-bit word A_lo (the earlier bytes) counts x^64 * A_lo. A
 * carry-less product of a 64-bit word A and a 32-bit K is x^33 * A * K in the
 * lane's frame, so moving a lane D bits forward (X * x^D) takes
 * clmul(A_lo, x^(D+31) mod P) ^ clmul(A_hi, x^(D-33) mod P). When every byte is
 * folded into one lane Y (the frame of the last 16 bytes), the CRC state is the
 * crc32 instruction over Y's 16 bytes from 0; the initial state is XORed into
 * the first 4 bytes. Constants are computed at start-up, and the path is used
 * only if it agrees with the crc32-instruction path on a test buffer. */
#define HAVE_FOLD 1
#include <immintrin.h>

#define FOLD_MIN 1024 /* shorter buffers take the crc32-instruction path */

static uint32_t xpow(size_t n) { /* x^n mod P */
    uint32_t v = 0x80000000u;
    while (n--) v = v & 1 ? (v >> 1) ^ POLY : v >> 1;
    return v;
}

static uint64_t fold_k[5][2]; /* (x^(D+31), x^(D-33)) mod P for D = 128, 256, 384, 512, 2048 */

static void fold_init(void) {
    static const size_t dist[5] = {128, 256, 384, 512, 2048};
    for (int i = 0; i < 5; i++) {
        fold_k[i][0] = xpow(dist[i] + 31);
        fold_k[i][1] = xpow(dist[i] - 33);
    }
}

__attribute__((target("pclmul,sse4.2"))) static __m128i fold128(__m128i x, int k) {
    __m128i kv = _mm_set_epi64x((long long)fold_k[k][1], (long long)fold_k[k][0]);
    return _mm_xor_si128(_mm_clmulepi64_si128(x, kv, 0x00), _mm_clmulepi64_si128(x, kv, 0x11));
}

__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) static __m512i fold512(__m512i x,
                                                                                __m512i kv) {
    return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, kv, 0x00),
                            _mm512_clmulepi64_epi128(x, kv, 0x11));
}

/* CRC-32C of len >= 256 bytes at p by folding 4 x 64 bytes at a time. With `copy`
 * (a constant: each caller gets its own code, with no test in the loop), every
 * 256 bytes loaded are also written to d with non-temporal stores, and the CRC is
 * of the registers written; then d is 64-byte aligned and len a multiple of 256
 * (no tail). */
__attribute__((always_inline, target("avx512f,vpclmulqdq,pclmul,sse4.2"))) static inline uint32_t
fold_run(uint32_t crc, unsigned char *d, const unsigned char *p, size_t len, const int copy) {
    __m512i k2048 = _mm512_broadcast_i32x4(
        _mm_set_epi64x((long long)fold_k[4][1], (long long)fold_k[4][0]));
    __m512i k512 = _mm512_broadcast_i32x4(
        _mm_set_epi64x((long long)fold_k[3][1], (long long)fold_k[3][0]));
    __m512i x0 = _mm512_loadu_si512((const void *)p);
    __m512i x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(p + 192));
    if (copy) {
        _mm512_stream_si512((void *)d, x0);
        _mm512_stream_si512((void *)(d + 64), x1);
        _mm512_stream_si512((void *)(d + 128), x2);
        _mm512_stream_si512((void *)(d + 192), x3);
        d += 256;
    }
    x0 = _mm512_xor_si512(x0, _mm512_castsi128_si512(_mm_cvtsi32_si128((int)~crc)));
    p += 256;
    len -= 256;
    for (; len >= 256; p += 256, len -= 256) {
        __m512i a = _mm512_loadu_si512((const void *)p);
        __m512i b = _mm512_loadu_si512((const void *)(p + 64));
        __m512i c = _mm512_loadu_si512((const void *)(p + 128));
        __m512i e = _mm512_loadu_si512((const void *)(p + 192));
        if (copy) {
            _mm512_stream_si512((void *)d, a);
            _mm512_stream_si512((void *)(d + 64), b);
            _mm512_stream_si512((void *)(d + 128), c);
            _mm512_stream_si512((void *)(d + 192), e);
            d += 256;
        }
        x0 = _mm512_xor_si512(fold512(x0, k2048), a);
        x1 = _mm512_xor_si512(fold512(x1, k2048), b);
        x2 = _mm512_xor_si512(fold512(x2, k2048), c);
        x3 = _mm512_xor_si512(fold512(x3, k2048), e);
    }
    x1 = _mm512_xor_si512(x1, fold512(x0, k512));
    x2 = _mm512_xor_si512(x2, fold512(x1, k512));
    x3 = _mm512_xor_si512(x3, fold512(x2, k512));
    for (; !copy && len >= 64; p += 64, len -= 64)
        x3 = _mm512_xor_si512(fold512(x3, k512), _mm512_loadu_si512((const void *)p));
    __m128i y = _mm512_extracti32x4_epi32(x3, 3);
    y = _mm_xor_si128(y, fold128(_mm512_extracti32x4_epi32(x3, 0), 2));
    y = _mm_xor_si128(y, fold128(_mm512_extracti32x4_epi32(x3, 1), 1));
    y = _mm_xor_si128(y, fold128(_mm512_extracti32x4_epi32(x3, 2), 0));
    for (; !copy && len >= 16; p += 16, len -= 16)
        y = _mm_xor_si128(fold128(y, 0), _mm_loadu_si128((const __m128i *)p));
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(y));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(y, 1));
    for (; !copy && len; len--) c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}

__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) static uint32_t crc_fold(
    uint32_t crc, const unsigned char *p, size_t len) {
    return fold_run(crc, NULL, p, len, 0);
}

/* Non-temporal copies. A Store's chunk and a Retrieve's blocks are not read
 * again soon, so their bytes go to memory without the read of every line they
 * overwrite that a cached store costs first (a third of a copy's memory
 * traffic), and the CRC is of the very registers written, in one pass. */
#define NT_MIN 4096 /* shorter copies: cached stores */
#define NT_LOAD_MIN (4u << 20) /* a Retrieve's span streams from this size */

/* d 64-byte aligned, len a multiple of 256 (at least 256): copy and CRC-32C. */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) static uint32_t crc_fold_copy(
    uint32_t crc, unsigned char *d, const unsigned char *p, size_t len) {
    return fold_run(crc, d, p, len, 1);
}

#endif

static int hw, fold, nt;

/* The paths the CRC runs on: 0 tables, 1 the crc32 instruction, 2 that and
 * VPCLMULQDQ folding for buffers of FOLD_MIN bytes and more. */
int kvsvc_crc32c_init(void) {
    init();
#ifdef HAVE_HW
    __builtin_cpu_init();
    hw = __builtin_cpu_supports("sse4.2") != 0;
#ifdef HAVE_FOLD
    if (hw && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
        __builtin_cpu_supports("pclmul")) {
        static unsigned char probe[4099];
        fold_init();
        for (size_t i = 0; i < sizeof probe; i++) probe[i] = (unsigned char)(i * 131 + (i >> 7));
        fold = 1;
        for (size_t n = FOLD_MIN; n <= sizeof probe && fold; n += 333)
            fold = crc_fold(0x12345678u, probe, n) == crc_hw(0x12345678u, probe, n);
    }
#endif
#endif
    nt = fold;
    return hw + fold;
}

uint32_t kvsvc_crc32c(uint32_t crc, const void *data, size_t len) {
    if (!ready) kvsvc_crc32c_init();
#ifdef HAVE_FOLD
    if (fold && len >= FOLD_MIN) return crc_fold(crc, data, len);
#endif
#ifdef HAVE_HW
    if (hw) return crc_hw(crc, data, len);
#endif
    return crc_sw(crc, data, len);
}

/* The crc32-instruction path alone (the tables where there is none), so tests
 * check it on machines that fold. */
uint32_t kvsvc_crc32c_nofold(uint32_t crc, const void *data, size_t len) {
    if (!ready) kvsvc_crc32c_init();
#ifdef HAVE_HW
    if (hw) return crc_hw(crc, data, len);
#endif
    return crc_sw(crc, data, len);
}

/* The table path alone, so tests check it on machines that have the instruction. */
uint32_t kvsvc_crc32c_tables(uint32_t crc, const void *data, size_t len) {
    if (!ready) kvsvc_crc32c_init();
    return crc_sw(crc, data, len);
}

/* Whether copies use non-temporal stores (only where the CRC folds: the Store's
 * one-pass copy needs it); `on` 0 turns them off, for tests and benchmarks that
 * compare both paths. Returns the path now used. */
int kvsvc_copy_nt(int on) {
    if (!ready) kvsvc_crc32c_init();
    nt = on && fold;
    return nt;
}

/* Copy n bytes from p to d and carry `crc` over them: into a chunk (a Store), or
 * out of one into the engine's blocks (a Retrieve, checked after the write). */
static uint32_t copy_piece(unsigned char *d, const unsigned char *p, size_t n, uint32_t crc,
                            int stream) {
    (void)stream;
#ifdef HAVE_FOLD
    if (stream && n >= NT_MIN) {
        size_t head = (64 - ((uintptr_t)d & 63)) & 63;
        memcpy(d, p, head);
        crc = kvsvc_crc32c(crc, d, head);
        size_t mid = (n - head) & ~(size_t)255;
        crc = crc_fold_copy(crc, d + head, p + head, mid);
        memcpy(d + head + mid, p + head + mid, n - head - mid);
        return kvsvc_crc32c(crc, d + head + mid, n - head - mid);
    }
#endif
    memcpy(d, p, n);
    return kvsvc_crc32c(crc, d, n);
}

/* One run of a copy plan: `n` bytes at `addr` in the engine's memory are chunk
 * bytes [pos, pos + n). */
typedef struct {
    uint64_t addr;
    uint64_t pos;
    uint64_t n;
} kvsvc_run;

/* Bytes a store copies before it CRCs them: they are still in L1. */
#define CHASE 32768

/* Copy chunk bytes [lo, hi) between the runs (sorted by pos, contiguous from 0)
 * and the chunk at `chunk`, segment by segment of `seg` bytes (lo a multiple of
 * seg), and CRC each piece right behind its copy, in one pass, while it is in L1
 * (the segment's CRC runs on from piece to piece, in chunk order); with
 * non-temporal stores, of the registers written. Store: digests[i] receives
 * segment lo/seg + i's CRC. Retrieve: each segment is compared with digests[i]
 * once it is written into the blocks; the first that differs stops the span
 * (the blocks it was written into hold bytes that failed: the caller never
 * reports them loaded). Returns -1 when done, else the index (from lo/seg) of
 * the segment that failed, whose CRC is left in *got. */
static long copy_span(const kvsvc_run *runs, size_t nruns, unsigned char *chunk, uint64_t lo,
                      uint64_t hi, uint64_t seg, int to_store, uint32_t *digests, uint32_t *got,
                      int stream) {
    size_t i = 0;
    while (i < nruns && runs[i].pos + runs[i].n <= lo) i++;
    for (uint64_t s = lo, k = 0; s < hi; s += seg, k++) {
        uint64_t e = s + seg < hi ? s + seg : hi;
        uint32_t crc = 0;
        while (i < nruns && runs[i].pos < e) {
            const kvsvc_run *r = &runs[i];
            uint64_t a = r->pos > s ? r->pos : s;
            uint64_t b = r->pos + r->n < e ? r->pos + r->n : e;
            unsigned char *eng = (unsigned char *)(uintptr_t)(r->addr + (a - r->pos));
            for (uint64_t q = a; q < b; q += CHASE) {
                uint64_t m = b - q < CHASE ? b - q : CHASE;
                crc = to_store ? copy_piece(chunk + q, eng + (q - a), m, crc, stream)
                               : copy_piece(eng + (q - a), chunk + q, m, crc, stream);
            }
            if (r->pos + r->n > e) break; /* the run goes on in the next segment */
            i++;
        }
        if (to_store) {
            digests[k] = crc;
        } else if (crc != digests[k]) {
            *got = crc;
            return (long)k;
        }
    }
    return -1;
}

long kvsvc_copy_segments(const kvsvc_run *runs, size_t nruns, unsigned char *chunk, uint64_t lo,
                         uint64_t hi, uint64_t seg, int to_store, uint32_t *digests,
                         uint32_t *got) {
    /* A Store's chunk is written once and read much later: always streamed. A
     * Retrieve's blocks are read by the engine next: a small one stays in cache. */
    int stream = nt && (to_store || hi - lo >= NT_LOAD_MIN);
    long failed = copy_span(runs, nruns, chunk, lo, hi, seg, to_store, digests, got, stream);
#ifdef HAVE_FOLD
    if (stream) _mm_sfence(); /* the streamed bytes are in memory before the caller says so */
#endif
    return failed;
}

/* A range of segments [front, back) as one word, front | back << 32, so that a
 * claim from either end is one compare-and-swap. */
static int claim(uint64_t *range, uint32_t start, int from_back, uint32_t *segment) {
    uint64_t v = __atomic_load_n(range, __ATOMIC_ACQUIRE);
    for (;;) {
        uint32_t f = (uint32_t)v, b = (uint32_t)(v >> 32);
        /* A range's first segment is always its owner's (a helper waits until the
         * owner has begun): which thread reads it does not depend on timing. */
        if (f >= b || (from_back && f == start)) return 0;
        uint64_t w = from_back ? ((uint64_t)(b - 1) << 32 | f) : ((uint64_t)b << 32 | (f + 1));
        if (__atomic_compare_exchange_n(range, &v, w, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *segment = from_back ? b - 1 : f;
            return 1;
        }
    }
}

/* One task of a chunk's copy shared by several threads (kvsvc_copy_segments per
 * segment, of a chunk of `size` bytes): task `me` copies its own range of
 * segments (ranges[me], starting at starts[me]) from the front, then helps the
 * others from their backs, so that every thread ends within about a segment of
 * the others however late one started; each segment is copied exactly once.
 * owner[s] is set to me + 1 for each segment it copied (digests[s] too, on a
 * Store). `share`: this task's bytes, which decide whether a Retrieve streams,
 * as for one span. On a failed check, no task claims another segment; returns
 * that segment (its CRC in *got), else -1. */
long kvsvc_copy_claim(const kvsvc_run *runs, size_t nruns, unsigned char *chunk, uint64_t size,
                      uint64_t seg, int to_store, uint32_t *digests, uint32_t *got,
                      uint64_t *ranges, const uint32_t *starts, size_t nranges, size_t me,
                      uint8_t *owner, uint64_t share) {
    int stream = nt && (to_store || share >= NT_LOAD_MIN);
    long failed = -1;
    uint32_t s;
    for (;;) {
        int found = claim(&ranges[me], starts[me], 0, &s);
        for (size_t k = 1; !found && k < nranges; k++)
            found = claim(&ranges[(me + k) % nranges], starts[(me + k) % nranges], 1, &s);
        if (!found) break;
        uint64_t lo = (uint64_t)s * seg, hi = lo + seg < size ? lo + seg : size;
        owner[s] = (uint8_t)(me + 1);
        if (copy_span(runs, nruns, chunk, lo, hi, seg, to_store, digests + s, got, stream) >= 0) {
            failed = (long)s;
            for (size_t k = 0; k < nranges; k++) { /* nobody claims more */
                uint64_t v = __atomic_load_n(&ranges[k], __ATOMIC_ACQUIRE);
                while (!__atomic_compare_exchange_n(&ranges[k], &v, (v >> 32) << 32 | (v >> 32), 0,
                                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                }
            }
            break;
        }
    }
#ifdef HAVE_FOLD
    if (stream) _mm_sfence();
#endif
    return failed;
}

/* Guarded copies: a plain shared file a client passed (it cannot be sealed
 * against shrinking) is mapped, and its owner may truncate it under the
 * mapping; touching a page past the new end raises SIGBUS on the copying
 * thread. A guarded copy runs copy_span with this thread's jump buffer set and
 * the engine's runs recorded; the process-wide handler jumps back out when the
 * fault is on such a thread and its address lies in one of those runs, so the
 * copy fails as truncated. Any other SIGBUS goes to the handler installed
 * before ours (Python's faulthandler under pytest), or kills the process as it
 * would have without us. SA_NODEFER: the jump leaves the handler without
 * sigreturn, and SIGBUS must not stay blocked on that thread (a second fault
 * while blocked is fatal), so the jump buffer need not save the signal mask
 * (no sigprocmask call per copy). */
typedef struct {
    sigjmp_buf env;
    volatile int on;
    const kvsvc_run *runs;
    size_t nruns;
} guard_state;

static __thread guard_state guard;
static struct sigaction prev_bus;
static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;

static void on_bus(int sig, siginfo_t *si, void *ctx) {
    guard_state *g = &guard;
    if (g->on && si != NULL && si->si_code > 0) { /* > 0: raised by the kernel for a fault */
        uintptr_t at = (uintptr_t)si->si_addr;
        for (size_t i = 0; i < g->nruns; i++) {
            if (at >= g->runs[i].addr && at - g->runs[i].addr < g->runs[i].n) {
                g->on = 0;
                siglongjmp(g->env, 1);
            }
        }
    }
    if (prev_bus.sa_flags & SA_SIGINFO) {
        if (prev_bus.sa_sigaction != NULL) {
            prev_bus.sa_sigaction(sig, si, ctx);
            return;
        }
    } else if (prev_bus.sa_handler != SIG_DFL && prev_bus.sa_handler != SIG_IGN) {
        prev_bus.sa_handler(sig);
        return;
    }
    /* No handler before ours: the default action. Returning re-runs the faulting
     * instruction, which faults again and now kills the process; a SIGBUS sent
     * by kill() is raised again. */
    signal(SIGBUS, SIG_DFL);
    if (si == NULL || si->si_code <= 0) raise(SIGBUS);
}

/* Our handler is installed, once, and again if something replaced it since
 * (faulthandler enabled later): it then chains to that one. Returns 0 if the
 * handler could not be installed (the caller then does not map). */
int kvsvc_guard_install(void) {
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) != 0) return 0;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_bus) return 1;
    pthread_mutex_lock(&install_lock);
    int ok = 1;
    if (sigaction(SIGBUS, NULL, &cur) != 0) {
        ok = 0;
    } else if (!((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_bus)) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_bus;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        prev_bus = cur;
        ok = sigaction(SIGBUS, &sa, NULL) == 0;
    }
    pthread_mutex_unlock(&install_lock);
    return ok;
}

/* copy_span with the guard set: -2 if a page of the runs faulted (the file was
 * truncated under the mapping), else copy_span's result. */
static long guarded_span(const kvsvc_run *runs, size_t nruns, unsigned char *chunk, uint64_t lo,
                         uint64_t hi, uint64_t seg, int to_store, uint32_t *digests,
                         uint32_t *got, int stream) {
    guard_state *g = &guard;
    g->runs = runs;
    g->nruns = nruns;
    if (sigsetjmp(g->env, 0) != 0) return -2; /* on_bus jumped here: g->on is 0 */
    g->on = 1;
    long failed = copy_span(runs, nruns, chunk, lo, hi, seg, to_store, digests, got, stream);
    g->on = 0;
    return failed;
}

/* kvsvc_copy_segments on memory that may fault: -2 when it did. */
long kvsvc_copy_segments_guarded(const kvsvc_run *runs, size_t nruns, unsigned char *chunk,
                                 uint64_t lo, uint64_t hi, uint64_t seg, int to_store,
                                 uint32_t *digests, uint32_t *got) {
    if (!kvsvc_guard_install()) return -2;
    int stream = nt && (to_store || hi - lo >= NT_LOAD_MIN);
    long failed = guarded_span(runs, nruns, chunk, lo, hi, seg, to_store, digests, got, stream);
#ifdef HAVE_FOLD
    if (stream) _mm_sfence();
#endif
    return failed;
}

/* kvsvc_copy_claim on memory that may fault: a fault stops every task as a
 * failed check does, and returns -2. */
long kvsvc_copy_claim_guarded(const kvsvc_run *runs, size_t nruns, unsigned char *chunk,
                              uint64_t size, uint64_t seg, int to_store, uint32_t *digests,
                              uint32_t *got, uint64_t *ranges, const uint32_t *starts,
                              size_t nranges, size_t me, uint8_t *owner, uint64_t share) {
    if (!kvsvc_guard_install()) return -2;
    int stream = nt && (to_store || share >= NT_LOAD_MIN);
    long failed = -1;
    uint32_t s;
    for (;;) {
        int found = claim(&ranges[me], starts[me], 0, &s);
        for (size_t k = 1; !found && k < nranges; k++)
            found = claim(&ranges[(me + k) % nranges], starts[(me + k) % nranges], 1, &s);
        if (!found) break;
        uint64_t lo = (uint64_t)s * seg, hi = lo + seg < size ? lo + seg : size;
        owner[s] = (uint8_t)(me + 1);
        long r = guarded_span(runs, nruns, chunk, lo, hi, seg, to_store, digests + s, got, stream);
        if (r != -1) {
            failed = r == -2 ? -2 : (long)s;
            for (size_t k = 0; k < nranges; k++) { /* nobody claims more */
                uint64_t v = __atomic_load_n(&ranges[k], __ATOMIC_ACQUIRE);
                while (!__atomic_compare_exchange_n(&ranges[k], &v, (v >> 32) << 32 | (v >> 32), 0,
                                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                }
            }
            break;
        }
    }
#ifdef HAVE_FOLD
    if (stream) _mm_sfence();
#endif
    return failed;
}
