// wc-mix64-v1 chunk sums on the GPU (see algorithm.py for the definition), compiled at run time with NVRTC.
// One CTA sums one tile of one chunk (WC_THREADS * WC_UNROLL * WC_ROUNDS 16-byte units) and adds it to the
// chunk's sum with one atomic: the sum's order is free, so the result does not depend on the schedule.
#ifndef WC_THREADS
#define WC_THREADS 256
#endif
#ifndef WC_UNROLL
#define WC_UNROLL 8
#endif
#ifndef WC_ROUNDS
#define WC_ROUNDS 4
#endif

typedef unsigned long long u64;
#define SEED 0x243F6A8885A308D3ULL
#define STEP 0x9E3779B97F4A7C15ULL

struct alignas(16) u64x2 {
    u64 x, y;
};

__device__ __forceinline__ u64 mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64x2 load(const u64x2* p) {  // streamed once: read-only path, not kept in L1
    u64x2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p));
    return v;
}

extern "C" __global__ void __launch_bounds__(WC_THREADS)
wc_digest_sums(const unsigned char* __restrict__ base, u64 nbytes, u64 chunk_bytes, u64 tiles_per_chunk,
               u64* __restrict__ acc) {
    const u64 chunk = blockIdx.x / tiles_per_chunk;
    const u64 tile = blockIdx.x - chunk * tiles_per_chunk;
    const u64 start = chunk * chunk_bytes;
    const u64 len = nbytes - start < chunk_bytes ? nbytes - start : chunk_bytes;
    const u64 units = len >> 4;
    const u64x2* p = reinterpret_cast<const u64x2*>(base + start);
    u64 s = 0;
    u64 u = tile * (u64)(WC_THREADS * WC_UNROLL * WC_ROUNDS) + threadIdx.x;
    for (int r = 0; r < WC_ROUNDS; r++, u += WC_THREADS * WC_UNROLL) {
        u64x2 v[WC_UNROLL];
#pragma unroll
        for (int k = 0; k < WC_UNROLL; k++) {
            if (u + k * WC_THREADS < units) v[k] = load(p + u + k * WC_THREADS);
        }
        const u64 key = SEED + 2 * u * STEP;  // of word 2u, the first of unit u
#pragma unroll
        for (int k = 0; k < WC_UNROLL; k++) {
            if (u + k * WC_THREADS < units) {
                const u64 kk = key + (u64)(2 * k * WC_THREADS) * STEP;
                s += mix(v[k].x ^ kk) + mix(v[k].y ^ (kk + STEP));
            }
        }
    }
    if (tile == 0 && threadIdx.x == 0 && (len & 15)) {  // the chunk's last bytes, zero-padded to whole words
        const unsigned char* q = base + start + (units << 4);
        const unsigned rem = (unsigned)(len & 15);
        u64 w0 = 0, w1 = 0;
        for (unsigned b = 0; b < rem; b++) {
            const u64 byte = q[b];
            if (b < 8) w0 |= byte << (8 * b); else w1 |= byte << (8 * (b - 8));
        }
        const u64 key = SEED + 2 * units * STEP;
        s += mix(w0 ^ key);
        if (rem > 8) s += mix(w1 ^ (key + STEP));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
    __shared__ u64 part[WC_THREADS / 32];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 t = 0;
#pragma unroll
        for (int w = 0; w < WC_THREADS / 32; w++) t += part[w];
        atomicAdd(acc + chunk, t);
    }
}
