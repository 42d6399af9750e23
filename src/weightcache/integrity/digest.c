/* wc-mix64-v1 chunk sums on the CPU (see algorithm.py for the definition). Built on first use. */
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the digest reads little-endian words"
#endif

#define SEED 0x243F6A8885A308D3ULL
#define STEP 0x9E3779B97F4A7C15ULL

static inline uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* acc[i] for chunks first .. first + count - 1 of the n bytes at p */
void wc_digest_sums(const unsigned char *p, uint64_t n, uint64_t chunk, uint64_t first, uint64_t count,
                    uint64_t *acc) {
    for (uint64_t c = first; c < first + count; c++) {
        uint64_t start = c * chunk;
        uint64_t len = n - start < chunk ? n - start : chunk;
        const unsigned char *q = p + start;
        uint64_t words = len / 8, k = SEED, s0 = 0, s1 = 0, j = 0;
        for (; j + 1 < words; j += 2, k += 2 * STEP) {
            uint64_t a, b;
            memcpy(&a, q + 8 * j, 8);
            memcpy(&b, q + 8 * j + 8, 8);
            s0 += mix(a ^ k);
            s1 += mix(b ^ (k + STEP));
        }
        for (; j < words; j++, k += STEP) {
            uint64_t a;
            memcpy(&a, q + 8 * j, 8);
            s0 += mix(a ^ k);
        }
        if (len % 8) {
            uint64_t a = 0;
            memcpy(&a, q + 8 * words, len % 8);
            s0 += mix(a ^ k);
        }
        acc[c - first] = s0 + s1;
    }
}
