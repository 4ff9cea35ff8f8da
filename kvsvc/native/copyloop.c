/* kvsvc's copy loop: copy a run of checksum segments between an engine's
 * mapped blocks and a chunk in the store, and CRC-32C each segment while it
 * is in cache, in one call. Loaded with ctypes (which drops the GIL for the
 * whole call), so a copy thread takes the GIL once per task, not twice per
 * segment. Only libc and the compiler's own headers: `make` builds it on a
 * fresh machine; kvsvc/copies.py falls back to Python when it is missing.
 *
 * CRC-32C (Castagnoli, reflected 0x82F63B78), the same value as the `crc32c`
 * package's crc32c(data): with SSE4.2 on x86-64, three interleaved streams
 * combined with zero-shift tables; elsewhere slicing-by-8 tables.
 */
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
#endif

static int hw;

/* 1 if the CRC runs on the CPU's crc32 instruction, 0 on tables. */
int kvsvc_crc32c_init(void) {
    init();
#ifdef HAVE_HW
    __builtin_cpu_init();
    hw = __builtin_cpu_supports("sse4.2");
#endif
    return hw;
}

uint32_t kvsvc_crc32c(uint32_t crc, const void *data, size_t len) {
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

/* One run of a copy plan: `n` bytes at `addr` in the engine's memory are chunk
 * bytes [pos, pos + n). */
typedef struct {
    uint64_t addr;
    uint64_t pos;
    uint64_t n;
} kvsvc_run;

/* Copy chunk bytes [lo, hi) between the runs (sorted by pos, contiguous from 0)
 * and the chunk at `chunk`, segment by segment of `seg` bytes (lo a multiple of
 * seg). A store copies a segment into the chunk then CRCs it; a retrieve CRCs
 * the chunk's segment first and copies it out only if it matches `digests`
 * (so the engine's blocks never receive bytes that failed their check).
 * Store: digests[i] receives segment lo/seg + i's CRC. Returns -1 when done,
 * else the index (from lo/seg) of the first segment that failed, whose CRC is
 * left in *got. */
long kvsvc_copy_segments(const kvsvc_run *runs, size_t nruns, unsigned char *chunk, uint64_t lo,
                         uint64_t hi, uint64_t seg, int to_store, uint32_t *digests,
                         uint32_t *got) {
    size_t i = 0;
    while (i < nruns && runs[i].pos + runs[i].n <= lo) i++;
    for (uint64_t s = lo, k = 0; s < hi; s += seg, k++) {
        uint64_t e = s + seg < hi ? s + seg : hi;
        if (!to_store) {
            uint32_t c = kvsvc_crc32c(0, chunk + s, e - s);
            if (c != digests[k]) {
                *got = c;
                return (long)k;
            }
        }
        while (i < nruns && runs[i].pos < e) {
            const kvsvc_run *r = &runs[i];
            uint64_t a = r->pos > s ? r->pos : s;
            uint64_t b = r->pos + r->n < e ? r->pos + r->n : e;
            unsigned char *eng = (unsigned char *)(uintptr_t)(r->addr + (a - r->pos));
            if (to_store)
                memcpy(chunk + a, eng, b - a);
            else
                memcpy(eng, chunk + a, b - a);
            if (r->pos + r->n > e) break; /* the run goes on in the next segment */
            i++;
        }
        if (to_store) digests[k] = kvsvc_crc32c(0, chunk + s, e - s);
    }
    return -1;
}
