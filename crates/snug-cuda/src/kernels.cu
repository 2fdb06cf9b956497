// snug's CUDA kernels, compiled at run time by NVRTC for the device's
// architecture (see docs/CUDA.md). Every kernel computes an output value
// from one row of its input in an order fixed by that row's shape alone:
// a row's bits never depend on how many rows share the launch.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// A kernel may be launched while the one before it in the stream is
// still running (programmatic dependent launch, sm_90 and later; see
// docs/CUDA.md, "Launches that overlap"). Each kernel calls this before it
// reads or writes any buffer: it waits until the kernel before has
// finished and its writes are visible, then lets the next kernel be
// launched. Only reads of the weights, which nothing writes, may come
// before it. Launched the ordinary way, both instructions return at once.
__device__ __forceinline__ void after_previous() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A measuring knob (set with -D when timing only): kernels of the kinds in
// mask SKIP return at once, so that a decode step timed without them
// shows what they cost inside it: 1 norms, 2 one-row products, 4
// attention, 8 rotation and KV writes, 16 quantization and the gated
// activation. The outputs are then wrong.
#ifndef SKIP
#define SKIP 0
#endif
#define SKIPS(bit) \
    if (SKIP & (bit)) return

// ggml's type ids.
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_Q2_K 10
#define T_Q3_K 11
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_MXFP4 39
#define T_BF16 30

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Little-endian loads from a weight row. Every block of every type has an
// even size and every field an even offset, and rows start at even
// addresses, so 16-bit loads are aligned; ld32a is for the types whose
// blocks keep 4-byte alignment (Q4_1, Q4_K, Q5_K).
__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }

__device__ __forceinline__ u32 ld32(const u8* p) {
    const u16* h = (const u16*)p;
    return (u32)h[0] | ((u32)h[1] << 16);
}

__device__ __forceinline__ u32 ld32a(const u8* p) { return *(const u32*)p; }

// Four bytes from any address (MXFP4's 17-byte blocks).
__device__ __forceinline__ u32 ld32b(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// Half of an E8M0 scale, 2^(e - 128), as the CPU computes it
// (quant::e8m0_half; the two smallest exponents as subnormals).
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// The 16 levels of IQ4_NL and IQ4_XS, and MXFP4's (its E2M1 values
// doubled), as signed bytes, four to a word (quant::IQ4_LEVELS,
// quant::MXFP4_LEVELS).
#define IQ4_T0 0xBFAD9881u
#define IQ4_T1 0xF6EADDCFu
#define IQ4_T2 0x26190D01u
#define IQ4_T3 0x71594535u
#define MXFP4_T0 0x03020100u
#define MXFP4_T1 0x0C080604u
#define MXFP4_T2 0xFDFEFF00u
#define MXFP4_T3 0xF4F8FAFCu

// Four codes (one 0..15 in each byte of `n`) looked up in a table of 16
// signed bytes: byte k of the result is the level of byte k's code.
template <int TY>
__device__ __forceinline__ u32 levels4(u32 n) {
    const bool mx = TY == T_MXFP4;
    u32 sel = (n & 0x7u) | ((n >> 4) & 0x70u) | ((n >> 8) & 0x700u) | ((n >> 12) & 0x7000u);
    u32 lo = __byte_perm(mx ? MXFP4_T0 : IQ4_T0, mx ? MXFP4_T1 : IQ4_T1, sel);
    u32 hi = __byte_perm(mx ? MXFP4_T2 : IQ4_T2, mx ? MXFP4_T3 : IQ4_T3, sel);
    u32 m = ((n >> 3) & 0x01010101u) * 0xFFu;
    return (lo & ~m) | (hi & m);
}

// One level of a table, as levels4 (for the dequantizers).
template <int TY>
__device__ __forceinline__ int level1(int code) {
    return (int)(signed char)(levels4<TY>((u32)code) & 0xFFu);
}

// Q3_K's sixteen 6-bit scales of a super-block (its twelve scale bytes
// as three words), each less 32: scale g (quant::q3k_scales).
__device__ __forceinline__ int q3k_scale(u32 a0, u32 a1, u32 tmp, int g) {
    int k = g >> 2;
    u32 w = k == 0   ? (a0 & 0x0F0F0F0Fu) | ((tmp & 0x03030303u) << 4)
            : k == 1 ? (a1 & 0x0F0F0F0Fu) | (((tmp >> 2) & 0x03030303u) << 4)
            : k == 2 ? ((a0 >> 4) & 0x0F0F0F0Fu) | (((tmp >> 4) & 0x03030303u) << 4)
                     : ((a1 >> 4) & 0x0F0F0F0Fu) | (((tmp >> 6) & 0x03030303u) << 4);
    return (int)((w >> (8 * (g & 3))) & 0xFFu) - 32;
}

// IQ4_XS's 6-bit scale of block j (0..8) of a super-block, less 32
// (quant::iq4xs_scale).
__device__ __forceinline__ int iq4xs_scale(const u8* sb, int j) {
    u32 sh = ld16(sb + 2);
    u32 lo = (sb[4 + (j >> 1)] >> (4 * (j & 1))) & 0x0Fu;
    u32 hi = (sh >> (2 * j)) & 3u;
    return (int)(lo | (hi << 4)) - 32;
}

// Q4_K and Q5_K: the 6-bit scale and min of sub-block j of 8.
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// scale_min_k4 from the twelve scale bytes held as three words.
// (Selects, not an indexed array, which would go to local memory unless
// every index is known when compiling.)
__device__ __forceinline__ int kbyte(const u32* w, int k) {
    u32 x = k < 4 ? w[0] : k < 8 ? w[1] : w[2];
    return (int)((x >> (8 * (k & 3))) & 0xFFu);
}

__device__ __forceinline__ void scale_min_w(int j, const u32* w, int* sc, int* m) {
    if (j < 4) {
        *sc = kbyte(w, j) & 63;
        *m = kbyte(w, j + 4) & 63;
    } else {
        *sc = (kbyte(w, j + 4) & 0xF) | ((kbyte(w, j - 4) >> 6) << 4);
        *m = (kbyte(w, j + 4) >> 4) | ((kbyte(w, j) >> 6) << 4);
    }
}

// The 32 weights of chunk `c` (elements 32c .. 32c+32) of a row of type TY.
template <int TY>
__device__ __forceinline__ void chunk(const u8* row, int c, float* w) {
    if (TY == T_F32) {
        const float* p = (const float*)row + 32 * c;
        for (int i = 0; i < 32; i++) w[i] = p[i];
    } else if (TY == T_F16) {
        const u16* p = (const u16*)row + 32 * c;
        for (int i = 0; i < 32; i++) w[i] = h2f(p[i]);
    } else if (TY == T_BF16) {
        const u16* p = (const u16*)row + 32 * c;
        for (int i = 0; i < 32; i++) w[i] = __uint_as_float(((u32)p[i]) << 16);
    } else if (TY == T_Q4_0) {
        const u8* b = row + 18 * c;
        float d = h2f(ld16(b));
        for (int i = 0; i < 16; i++) {
            w[i] = (float)((b[2 + i] & 0xF) - 8) * d;
            w[i + 16] = (float)((b[2 + i] >> 4) - 8) * d;
        }
    } else if (TY == T_Q4_1) {
        const u8* b = row + 20 * c;
        float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
        for (int i = 0; i < 16; i++) {
            w[i] = fmaf((float)(b[4 + i] & 0xF), d, m);
            w[i + 16] = fmaf((float)(b[4 + i] >> 4), d, m);
        }
    } else if (TY == T_Q5_0) {
        const u8* b = row + 22 * c;
        float d = h2f(ld16(b));
        u32 qh = ld32(b + 2);
        for (int i = 0; i < 16; i++) {
            int lo = (b[6 + i] & 0xF) | (((qh >> i) << 4) & 0x10);
            int hi = (b[6 + i] >> 4) | ((qh >> (i + 12)) & 0x10);
            w[i] = (float)(lo - 16) * d;
            w[i + 16] = (float)(hi - 16) * d;
        }
    } else if (TY == T_Q5_1) {
        const u8* b = row + 24 * c;
        float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
        u32 qh = ld32(b + 4);
        for (int i = 0; i < 16; i++) {
            int lo = (b[8 + i] & 0xF) | (((qh >> i) << 4) & 0x10);
            int hi = (b[8 + i] >> 4) | ((qh >> (i + 12)) & 0x10);
            w[i] = fmaf((float)lo, d, m);
            w[i + 16] = fmaf((float)hi, d, m);
        }
    } else if (TY == T_Q8_0) {
        const u8* b = row + 34 * c;
        float d = h2f(ld16(b));
        for (int i = 0; i < 32; i++) w[i] = (float)(i8)b[2 + i] * d;
    } else if (TY == T_Q4_K) {
        const u8* b = row + 144 * (c >> 3);
        int j = c & 7;
        float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
        int sc, m;
        scale_min_k4(j, b + 4, &sc, &m);
        float d1 = d * (float)sc, m1 = dmin * (float)m;
        const u8* q = b + 16 + 32 * (j >> 1);
        int shift = (j & 1) * 4;
        for (int i = 0; i < 32; i++) w[i] = fmaf(d1, (float)((q[i] >> shift) & 0xF), -m1);
    } else if (TY == T_Q5_K) {
        const u8* b = row + 176 * (c >> 3);
        int j = c & 7;
        float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
        int sc, m;
        scale_min_k4(j, b + 4, &sc, &m);
        float d1 = d * (float)sc, m1 = dmin * (float)m;
        const u8* qh = b + 16;
        const u8* q = b + 48 + 32 * (j >> 1);
        int shift = (j & 1) * 4;
        u8 u = (u8)(1 << j);
        for (int i = 0; i < 32; i++) {
            int v = ((q[i] >> shift) & 0xF) + ((qh[i] & u) ? 16 : 0);
            w[i] = fmaf(d1, (float)v, -m1);
        }
    } else if (TY == T_Q6_K) {
        const u8* b = row + 210 * (c >> 3);
        int e0 = 32 * (c & 7);  // first element in the super-block
        int n = e0 >> 7, quarter = (e0 & 127) >> 5;
        const u8* ql = b + 64 * n;
        const u8* qh = b + 128 + 32 * n;
        const i8* sc = (const i8*)(b + 192) + 8 * n;
        float d = h2f(ld16(b + 208));
        for (int l = 0; l < 32; l++) {
            int is = l >> 4;
            int q;
            if (quarter == 0) q = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
            else if (quarter == 1) q = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            else if (quarter == 2) q = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            else q = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            w[l] = d * (float)sc[is + 2 * quarter] * (float)(q - 32);
        }
    } else if (TY == T_IQ4_NL || TY == T_MXFP4) {
        const bool mx = TY == T_MXFP4;
        const u8* b = row + (mx ? 17 : 18) * c;
        float d = mx ? e8m0_half(b[0]) : h2f(ld16(b));
        const u8* q = b + (mx ? 1 : 2);
        for (int i = 0; i < 16; i++) {
            w[i] = d * (float)level1<TY>(q[i] & 0xF);
            w[i + 16] = d * (float)level1<TY>(q[i] >> 4);
        }
    } else if (TY == T_IQ4_XS) {
        const u8* b = row + 136 * (c >> 3);
        int j = c & 7;
        float dl = h2f(ld16(b)) * (float)iq4xs_scale(b, j);
        const u8* q = b + 8 + 16 * j;
        for (int i = 0; i < 16; i++) {
            w[i] = dl * (float)level1<TY>(q[i] & 0xF);
            w[i + 16] = dl * (float)level1<TY>(q[i] >> 4);
        }
    } else if (TY == T_Q2_K || TY == T_Q3_K) {
        // Groups of 16: g = 2 (c & 7) and the next, in half (c & 7) / 4,
        // at bits 2 ((c & 7) % 4) of their sixteen bytes.
        const bool q3 = TY == T_Q3_K;
        const u8* b = row + (q3 ? 110 : 84) * (c >> 3);
        int j = c & 7, half = j >> 2, k = j & 3;
        float d = h2f(ld16(b + (q3 ? 108 : 80)));
        for (int part = 0; part < 2; part++) {
            int g = 2 * j + part;
            const u8* q = b + (q3 ? 32 : 16) + 32 * half + 16 * part;
            if (q3) {
                float dl = d * (float)q3k_scale(ld32(b + 96), ld32(b + 100), ld32(b + 104), g);
                const u8* hm = b + 16 * part;
                for (int l = 0; l < 16; l++) {
                    int lv = ((q[l] >> (2 * k)) & 3) - ((hm[l] >> (4 * half + k)) & 1 ? 0 : 4);
                    w[16 * part + l] = dl * (float)lv;
                }
            } else {
                float dmin = h2f(ld16(b + 82));
                float dl = d * (float)(b[g] & 0xF), ml = dmin * (float)(b[g] >> 4);
                for (int l = 0; l < 16; l++) w[16 * part + l] = dl * (float)((q[l] >> (2 * k)) & 3) - ml;
            }
        }
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    // A butterfly: every lane ends with the same bits (each step adds the
    // same two values in either order).
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Activations quantized as the CPU quantizes them (snug_kernels::dot):
// 32 int8 levels, the block's scale `d`, `s` (`d * sum`, rounded to f16
// in the q8_1 format) and the levels' sum. 48 bytes, as the CPU's BlockQ8.
struct Q8 {
    int qs[8];
    float d;
    float s;
    int sum;
    int pad;
};

__device__ __forceinline__ int warp_sum_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float f16_round(float x) { return h2f(f2h(x)); }

// `round_even(y)` clamped to -128..127 (NaN to 0), as the CPU's cast.
__device__ __forceinline__ int level(float y) { return min(127, max(-128, __float2int_rn(y))); }

// One block of 32 values quantized by a warp, lane i holding value i:
// q8_0 (q81 = 0) or q8_1 (q81 = 1).
__device__ __forceinline__ void q8_block(float v, int q81, Q8* out) {
    int lane = threadIdx.x & 31;
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int q = level(v * id);
    ((i8*)out->qs)[lane] = (i8)q;
    int sum = warp_sum_int(q);
    if (lane == 0) {
        out->d = f16_round(d);
        out->sum = sum;
        out->s = q81 ? f16_round(d * (float)sum) : 0.0f;
        out->pad = 0;
    }
}

// q8_0 (q81 = 0) and q8_1 (q81 = 1): a warp per block of 32, `blocks` in all.
extern "C" __global__ void quantize_q8(const float* x, u64 blocks, int q81, Q8* out) {
    after_previous();
    SKIPS(16);
    u64 blk = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= blocks) return;
    q8_block(x[blk * 32 + (threadIdx.x & 31)], q81, out + blk);
}

// q8_K of the 256 values at `x` into the eight blocks at `out`, by a block
// of 256 threads (every thread calls it). The scale comes from the first
// element of largest magnitude, with its sign.
__device__ void q8k_super(const float* x, Q8* out) {
    __shared__ float wmax[8];
    __shared__ int widx[8];
    int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    // The calls before have read the shared values.
    __syncthreads();
    float v = x[t];
    float a = fabsf(v);
    float m = warp_max(a);
    if (lane == 0) wmax[warp] = m;
    __syncthreads();
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, wmax[i]);
    unsigned hit = __ballot_sync(0xffffffffu, amax > 0.0f && a == amax);
    if (lane == 0) widx[warp] = hit ? 32 * warp + __ffs(hit) - 1 : 1 << 30;
    __syncthreads();
    int first = 1 << 30;
    for (int i = 0; i < 8; i++) first = min(first, widx[i]);
    Q8* ob = out + warp;
    if (!(amax > 0.0f) || first >= 256) {
        ((i8*)ob->qs)[lane] = 0;
        if (lane == 0) {
            ob->d = 0.0f;
            ob->s = 0.0f;
            ob->sum = 0;
            ob->pad = 0;
        }
        return;
    }
    float iscale = -127.0f / x[first];
    float d = 1.0f / iscale;
    int q = level(iscale * v);
    ((i8*)ob->qs)[lane] = (i8)q;
    int sum = warp_sum_int(q);
    if (lane == 0) {
        ob->d = d;
        ob->s = d * (float)sum;
        ob->sum = sum;
        ob->pad = 0;
    }
}

// q8_K of the 256 values at `x` into the eight blocks at `out`, by one
// warp: lane i holds elements 32k + i, as thread 32k + i does in
// q8k_super, and the same steps give the same values.
__device__ __forceinline__ void q8k_warp(const float* x, Q8* out) {
    int lane = threadIdx.x & 31;
    float v[8];
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        v[k] = x[32 * k + lane];
        m = fmaxf(m, fabsf(v[k]));
    }
    float amax = warp_max(m);
    int first = 1 << 30;
#pragma unroll
    for (int k = 7; k >= 0; k--) {
        unsigned hit = __ballot_sync(0xffffffffu, amax > 0.0f && fabsf(v[k]) == amax);
        if (hit) first = 32 * k + __ffs(hit) - 1;
    }
    if (!(amax > 0.0f) || first >= 256) {
#pragma unroll
        for (int k = 0; k < 8; k++) {
            ((i8*)out[k].qs)[lane] = 0;
            if (lane == 0) {
                out[k].d = 0.0f;
                out[k].s = 0.0f;
                out[k].sum = 0;
                out[k].pad = 0;
            }
        }
        return;
    }
    float iscale = -127.0f / x[first];
    float d = 1.0f / iscale;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        int q = level(iscale * v[k]);
        ((i8*)out[k].qs)[lane] = (i8)q;
        int sum = warp_sum_int(q);
        if (lane == 0) {
            out[k].d = d;
            out[k].s = d * (float)sum;
            out[k].sum = sum;
            out[k].pad = 0;
        }
    }
}

// q8_K: a block of 256 threads per 256 elements.
extern "C" __global__ void quantize_q8k(const float* x, Q8* out) {
    after_previous();
    SKIPS(16);
    u64 sb = blockIdx.x;
    q8k_super(x + sb * 256, out + sb * 8);
}

// The activation formats (ActFormat on the CPU).
#define FMT_Q8_0 0
#define FMT_Q8_1 1
#define FMT_Q8_K 2

// Copies 16 bytes from global to shared memory without waiting (where the
// architecture can); att_wait() waits for all of them, cp_wait1() for all
// but the last group committed.
__device__ __forceinline__ void att_copy16(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
#else
    *(uint4*)dst = *(const uint4*)src;
#endif
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }

// Waits until at most one group of copies is in flight.
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;"); }

// Quantized products: a warp per output for a few rows of activations
// (matvec_body), tensor cores for many (matmul_mma_body further down).
#define MM_WARPS 4
#define QM_RT 4

__device__ __forceinline__ int isum4(int v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float fold8(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    return v + __shfl_xor_sync(0xffffffffu, v, 16);
}

// The high bits of four consecutive elements, bit i of qh for element
// i, moved to bit 4 of each byte.
__device__ __forceinline__ u32 high4(u32 qh, int first) {
    u32 r = 0;
    for (int k = 0; k < 4; k++) r |= ((qh >> (first + k)) & 1u) << (8 * k + 4);
    return r;
}

// A weight row's elements 4t..4t+3 (lo) and 16+4t..16+4t+3 (hi) of
// block b (a 32-element type), with its scale and minimum.
template <int TY>
__device__ __forceinline__ void wblock(const u8* row, int b, int t, int* lo, int* hi, float* d, float* m) {
    if (TY == T_Q4_0) {
        const u8* blk = row + 18 * (u64)b;
        *d = h2f(ld16(blk));
        u32 q = ld32(blk + 2 + 4 * t);
        *lo = (int)__vsub4(q & 0x0F0F0F0Fu, 0x08080808u);
        *hi = (int)__vsub4((q >> 4) & 0x0F0F0F0Fu, 0x08080808u);
    } else if (TY == T_Q4_1) {
        const u8* blk = row + 20 * (u64)b;
        *d = h2f(ld16(blk));
        *m = h2f(ld16(blk + 2));
        u32 q = ld32a(blk + 4 + 4 * t);
        *lo = (int)(q & 0x0F0F0F0Fu);
        *hi = (int)((q >> 4) & 0x0F0F0F0Fu);
    } else if (TY == T_Q5_0) {
        const u8* blk = row + 22 * (u64)b;
        *d = h2f(ld16(blk));
        u32 qh = ld32(blk + 2), q = ld32(blk + 6 + 4 * t);
        *lo = (int)__vsub4((q & 0x0F0F0F0Fu) | high4(qh, 4 * t), 0x10101010u);
        *hi = (int)__vsub4(((q >> 4) & 0x0F0F0F0Fu) | high4(qh, 16 + 4 * t), 0x10101010u);
    } else if (TY == T_Q5_1) {
        const u8* blk = row + 24 * (u64)b;
        *d = h2f(ld16(blk));
        *m = h2f(ld16(blk + 2));
        u32 qh = ld32(blk + 4), q = ld32(blk + 8 + 4 * t);
        *lo = (int)((q & 0x0F0F0F0Fu) | high4(qh, 4 * t));
        *hi = (int)(((q >> 4) & 0x0F0F0F0Fu) | high4(qh, 16 + 4 * t));
    } else if (TY == T_IQ4_NL || TY == T_MXFP4) {
        const bool mx = TY == T_MXFP4;
        const u8* blk = row + (mx ? 17 : 18) * (u64)b;
        *d = mx ? e8m0_half(blk[0]) : h2f(ld16(blk));
        u32 q = mx ? ld32b(blk + 1 + 4 * t) : ld32(blk + 2 + 4 * t);
        *lo = (int)levels4<TY>(q & 0x0F0F0F0Fu);
        *hi = (int)levels4<TY>((q >> 4) & 0x0F0F0F0Fu);
    } else {
        const u8* blk = row + 34 * (u64)b;
        *d = h2f(ld16(blk));
        *lo = (int)ld32(blk + 2 + 4 * t);
        *hi = (int)ld32(blk + 18 + 4 * t);
    }
}

// Read-only weight loads that do not stay in L1 (each weight byte is read
// once per launch; L1 is left to the activations, which every output
// reads). `ldw4` needs a 16-byte aligned address, `ldw` a 4-byte one.
__device__ __forceinline__ uint4 ldw4(const u8* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ u32 ldw(const u8* p) {
    u32 v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Sixteen bytes from a 2-byte aligned address, as four words: the five
// aligned words around them, shifted (the fifth word lies inside the
// block wherever this is used).
__device__ __forceinline__ void ld16u(const u8* p, u32* out) {
    u64 a = (u64)p;
    const u8* b = (const u8*)(a & ~3ull);
    u32 sh = (u32)(a & 3) * 8;
    u32 w0 = ldw(b), w1 = ldw(b + 4), w2 = ldw(b + 8), w3 = ldw(b + 12), w4 = ldw(b + 16);
    out[0] = __funnelshift_r(w0, w1, sh);
    out[1] = __funnelshift_r(w1, w2, sh);
    out[2] = __funnelshift_r(w2, w3, sh);
    out[3] = __funnelshift_r(w3, w4, sh);
}

// A lane's share of one block of weights, loaded before any of it is used
// (see matvec_body); which fields hold what depends on the type.
struct WShare {
    uint4 a, b, c;
    float d, m;
    int s0, s1;
};

// Tuning knobs (set with -D when measuring variants): steps of a warp
// whose weight loads are issued together, and the blocks of the one-row
// product each multiprocessor should hold (__launch_bounds__).
#ifndef MV_U
#define MV_U 2
#endif
#ifndef MV_BLOCKS
#define MV_BLOCKS 1
#endif

// Bytes [p, p + n) into L2, as far as they lie on 16-byte boundaries.
__device__ __forceinline__ void prefetch_l2(const u8* p, u64 n) {
#if __CUDA_ARCH__ >= 900
    u64 a = ((u64)p + 15) & ~15ull, e = ((u64)p + n) & ~15ull;
    while (e > a) {
        u32 len = (u32)min(e - a, (u64)(1u << 16));
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(len) : "memory");
        a += len;
    }
#endif
}

// Loads lane `lane`'s share of block `b` (32-element types: lane t = lane
// & 3 of block b; K-quants: lane l = lane & 7 of super-block b).
template <int TY>
__device__ __forceinline__ void wshare(const u8* row, int b, int lane, WShare* s) {
    if (TY == T_Q4_K || TY == T_Q5_K) {
        int l = lane & 7;
        const u8* sb = row + (TY == T_Q4_K ? 144 : 176) * (u64)b;
        s->a = ldw4(sb);
        s->b = ldw4(sb + (TY == T_Q4_K ? 16 : 48) + 16 * l);
        if (TY == T_Q5_K) s->c = ldw4(sb + 16 + 16 * (l & 1));
    } else if (TY == T_Q2_K) {
        // Lane l: bytes 16 (l & 1).. of half l / 4 of the levels (blocks
        // 2 (l >> 1) and the next), the two groups' scale bytes, d, dmin.
        int l = lane & 7, p = l >> 1, half = l & 1;
        const u8* sb = row + 84 * (u64)b;
        const u8* q = sb + 16 + 32 * (p >> 1) + 16 * half;
        s->a = make_uint4(ldw(q), ldw(q + 4), ldw(q + 8), ldw(q + 12));
        s->s0 = sb[4 * p + half];
        s->s1 = sb[4 * p + 2 + half];
        u32 dm = ldw(sb + 80);
        s->d = h2f((u16)(dm & 0xFFFFu));
        s->m = h2f((u16)(dm >> 16));
    } else if (TY == T_Q3_K) {
        // As Q2_K, plus the sixteen bytes of the high-bit mask; the scale
        // words in c.
        int l = lane & 7, p = l >> 1, half = l & 1;
        const u8* sb = row + 110 * (u64)b;
        const u8* q = sb + 32 + 32 * (p >> 1) + 16 * half;
        s->a = make_uint4(ld32(q), ld32(q + 4), ld32(q + 8), ld32(q + 12));
        const u8* hm = sb + 16 * half;
        s->b = make_uint4(ld32(hm), ld32(hm + 4), ld32(hm + 8), ld32(hm + 12));
        s->c = make_uint4(ld32(sb + 96), ld32(sb + 100), ld32(sb + 104), 0u);
        s->d = h2f(ld16(sb + 108));
    } else if (TY == T_IQ4_XS) {
        // The sixteen code bytes of blocks 2 (l >> 1) and the next, and
        // their scales.
        int l = lane & 7, p = l >> 1;
        const u8* sb = row + 136 * (u64)b;
        const u8* qa = sb + 8 + 32 * p;
        s->a = make_uint4(ldw(qa), ldw(qa + 4), ldw(qa + 8), ldw(qa + 12));
        s->b = make_uint4(ldw(qa + 16), ldw(qa + 20), ldw(qa + 24), ldw(qa + 28));
        s->s0 = iq4xs_scale(sb, 2 * p);
        s->s1 = iq4xs_scale(sb, 2 * p + 1);
        s->d = h2f(ld16(sb));
    } else if (TY == T_Q6_K) {
        int l = lane & 7, n = l >> 2, k = l & 3, qa = k >> 1;
        const u8* sb = row + 210 * (u64)b;
        u32 v[4];
        ld16u(sb + 64 * n + 16 * k, v);
        s->a = make_uint4(v[0], v[1], v[2], v[3]);
        ld16u(sb + 128 + 32 * n + 16 * (k & 1), v);
        s->b = make_uint4(v[0], v[1], v[2], v[3]);
        const i8* sc = (const i8*)(sb + 192) + 8 * n + (k & 1) + 2 * qa;
        s->s0 = sc[0];
        s->s1 = sc[4];
        s->d = h2f(ld16(sb + 208));
    } else {
        int lo, hi;
        wblock<TY>(row, b, lane & 3, &lo, &hi, &s->d, &s->m);
        s->s0 = lo;
        s->s1 = hi;
    }
}

// Elements 4i..4i+3 of a lane's sixteen bytes, as low and high nibbles.
__device__ __forceinline__ u32 word(uint4 v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Quantized weights times quantized activations for one row of up to 4
// rows of activations, in the CPU's order (snug_kernels::dot): block b's
// exact integer dot goes, as a float, into accumulator b % 8 (super-block
// b % 8 for K-quants) with a fused multiply-add, and the eight
// accumulators are summed as ((0+1)+(2+3))+((4+5)+(6+7)). A warp per
// output. 32-element types: lanes 4g..4g+3 take block 8i+g of step i
// (accumulator g), each four elements of its halves. K-quants: lanes
// 8G..8G+7 take super-block 4i+G (accumulator G + 4 (i % 2)), each
// sixteen bytes of its quantized levels. The integer sums of a block's
// lanes add exactly; the weight loads of MV_U steps are in flight
// together.
template <int TY>
__device__ __forceinline__ void matvec_body(const u8* w, u64 row_bytes, int nblk, int o, const Q8* a, int nab,
                                            int r0, int nr, float* res) {
    const bool K = TY == T_Q4_K || TY == T_Q5_K || TY == T_Q6_K || TY == T_Q2_K || TY == T_Q3_K || TY == T_IQ4_XS;
    // K-quants that subtract a minimum per group.
    const bool KMIN = TY == T_Q4_K || TY == T_Q5_K || TY == T_Q2_K;
    const int per = K ? 4 : 8;
    int lane = threadIdx.x & 31;
    int grp = K ? lane >> 3 : lane >> 2;
    const u8* row = w + row_bytes * (u64)o;
    const Q8* ar = a + (u64)r0 * nab;
    int steps = (nblk + per - 1) / per;
    float acc[QM_RT][2];
#pragma unroll
    for (int r = 0; r < QM_RT; r++) acc[r][0] = acc[r][1] = 0.0f;
    for (int i0 = 0; i0 < steps; i0 += MV_U) {
        WShare ws[MV_U] = {};
#pragma unroll
        for (int u = 0; u < MV_U; u++) {
            int b = per * (i0 + u) + grp;
            if (b < nblk) wshare<TY>(row, b, lane, &ws[u]);
        }
        // The first steps' weights are loaded before the kernel ahead
        // has finished (after_previous).
        if (i0 == 0) after_previous();
#pragma unroll
        for (int u = 0; u < MV_U; u++) {
            int i = i0 + u;
            if (i >= steps) break;
            int b = per * i + grp;
            bool live = b < nblk;
            const WShare& s = ws[u];
            if (K) {
                int l = lane & 7;
                int slot = i & 1;
                // Which activation blocks the lane's bytes meet, and at
                // which sixteen bytes of them.
                int ba, bb, half;
                int sa = 0, sb = 0, ma = 0, mb = 0;
                float d = 0.0f, dmin = 0.0f;
                u32 wa[4], wb[4];
                if (TY == T_Q2_K || TY == T_Q3_K || TY == T_IQ4_XS) {
                    // Lane l: elements 16 (l & 1).. of blocks 2 (l >> 1)
                    // and the next, each block's in its own group.
                    int p = l >> 1;
                    ba = 2 * p;
                    bb = ba + 1;
                    half = l & 1;
                    d = s.d;
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        u32 q = word(s.a, j);
                        if (TY == T_IQ4_XS) {
                            u32 qb = word(s.b, j);
                            wa[j] = levels4<TY>(half ? (q >> 4) & 0x0F0F0F0Fu : q & 0x0F0F0F0Fu);
                            wb[j] = levels4<TY>(half ? (qb >> 4) & 0x0F0F0F0Fu : qb & 0x0F0F0F0Fu);
                        } else {
                            // Blocks 2p and 2p + 1 are bits 2 (ba % 4) and
                            // 2 (bb % 4) of the same bytes.
                            u32 la = (q >> (2 * (ba & 3))) & 0x03030303u, lb = (q >> (2 * (bb & 3))) & 0x03030303u;
                            if (TY == T_Q3_K) {
                                // A clear bit of the mask takes 4 off.
                                u32 h = word(s.b, j);
                                la = __vsub4(la | (((h >> ba) & 0x01010101u) << 2), 0x04040404u);
                                lb = __vsub4(lb | (((h >> bb) & 0x01010101u) << 2), 0x04040404u);
                            }
                            wa[j] = la;
                            wb[j] = lb;
                        }
                    }
                    if (TY == T_Q2_K) {
                        sa = s.s0 & 0xF;
                        ma = s.s0 >> 4;
                        sb = s.s1 & 0xF;
                        mb = s.s1 >> 4;
                        dmin = s.m;
                    } else if (TY == T_Q3_K) {
                        sa = q3k_scale(s.c.x, s.c.y, s.c.z, 2 * ba + half);
                        sb = q3k_scale(s.c.x, s.c.y, s.c.z, 2 * bb + half);
                    } else {
                        sa = s.s0;
                        sb = s.s1;
                    }
                } else if (TY == T_Q6_K) {
                    int n = l >> 2, k = l & 3, qa = k >> 1;
                    ba = 4 * n + qa;
                    bb = ba + 2;
                    half = k & 1;
                    sa = s.s0;
                    sb = s.s1;
                    d = s.d;
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        u32 q = word(s.a, j), h = word(s.b, j);
                        u32 lo = (q & 0x0F0F0F0Fu) | (((h >> (2 * qa)) & 0x03030303u) << 4);
                        u32 hi = ((q >> 4) & 0x0F0F0F0Fu) | (((h >> (2 * qa + 4)) & 0x03030303u) << 4);
                        wa[j] = __vsub4(lo, 0x20202020u);
                        wb[j] = __vsub4(hi, 0x20202020u);
                    }
                } else {
                    int p = l >> 1;
                    ba = 2 * p;
                    bb = ba + 1;
                    half = l & 1;
                    if (live) {
                        d = h2f((u16)(s.a.x & 0xFFFFu));
                        dmin = h2f((u16)(s.a.x >> 16));
                        // The 6-bit scales and minimums of sub-blocks 0-3
                        // and 4-7 as bytes (scale_min_k4's fields), then
                        // the lane's two.
                        u32 q0 = s.a.y, q1 = s.a.z, q2 = s.a.w;
                        u32 scw = p < 2 ? q0 & 0x3F3F3F3Fu : (q2 & 0x0F0F0F0Fu) | (((q0 >> 6) & 0x03030303u) << 4);
                        u32 mnw = p < 2 ? q1 & 0x3F3F3F3Fu
                                        : ((q2 >> 4) & 0x0F0F0F0Fu) | (((q1 >> 6) & 0x03030303u) << 4);
                        int sh = 16 * (p & 1);
                        sa = (int)((scw >> sh) & 0xFFu);
                        sb = (int)((scw >> (sh + 8)) & 0xFFu);
                        ma = (int)((mnw >> sh) & 0xFFu);
                        mb = (int)((mnw >> (sh + 8)) & 0xFFu);
                    }
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        u32 q = word(s.b, j);
                        u32 lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
                        if (TY == T_Q5_K) {
                            u32 h = word(s.c, j);
                            lo |= ((h >> ba) & 0x01010101u) << 4;
                            hi |= ((h >> bb) & 0x01010101u) << 4;
                        }
                        wa[j] = lo;
                        wb[j] = hi;
                    }
                }
#pragma unroll
                for (int r = 0; r < QM_RT; r++) {
                    if (r >= nr) break;
                    int isum = 0, msum = 0;
                    float da = 0.0f;
                    if (live) {
                        const Q8* ab = ar + (u64)r * nab + 8 * b;
                        da = ab[0].d;
                        int4 xa = ((const int4*)ab[ba].qs)[half], xb = ((const int4*)ab[bb].qs)[half];
                        int pa = __dp4a((int)wa[0], xa.x, 0);
                        pa = __dp4a((int)wa[1], xa.y, pa);
                        pa = __dp4a((int)wa[2], xa.z, pa);
                        pa = __dp4a((int)wa[3], xa.w, pa);
                        int pb = __dp4a((int)wb[0], xb.x, 0);
                        pb = __dp4a((int)wb[1], xb.y, pb);
                        pb = __dp4a((int)wb[2], xb.z, pb);
                        pb = __dp4a((int)wb[3], xb.w, pb);
                        isum = sa * pa + sb * pb;
                        if (TY == T_Q2_K) {
                            // Minimums per 16: the lane's sixteen
                            // activations of each block, summed.
                            int ta = __dp4a(xa.x, 0x01010101, __dp4a(xa.y, 0x01010101, 0));
                            ta = __dp4a(xa.z, 0x01010101, __dp4a(xa.w, 0x01010101, ta));
                            int tb = __dp4a(xb.x, 0x01010101, __dp4a(xb.y, 0x01010101, 0));
                            tb = __dp4a(xb.z, 0x01010101, __dp4a(xb.w, 0x01010101, tb));
                            msum = ma * ta + mb * tb;
                        } else if (KMIN && half == 0) {
                            msum = ma * ab[ba].sum + mb * ab[bb].sum;
                        }
                    }
                    isum += __shfl_xor_sync(0xffffffffu, isum, 1);
                    isum += __shfl_xor_sync(0xffffffffu, isum, 2);
                    isum += __shfl_xor_sync(0xffffffffu, isum, 4);
                    if (KMIN) {
                        msum += __shfl_xor_sync(0xffffffffu, msum, 1);
                        msum += __shfl_xor_sync(0xffffffffu, msum, 2);
                        msum += __shfl_xor_sync(0xffffffffu, msum, 4);
                    }
                    if (live) {
                        float v = fmaf((float)isum, d * da, slot ? acc[r][1] : acc[r][0]);
                        if (KMIN) v = fmaf(-(dmin * da), (float)msum, v);
                        if (slot) acc[r][1] = v;
                        else acc[r][0] = v;
                    }
                }
            } else {
                int t = lane & 3;
#pragma unroll
                for (int r = 0; r < QM_RT; r++) {
                    if (r >= nr) break;
                    int sdot = 0;
                    float ad = 0.0f, as = 0.0f;
                    if (live) {
                        const Q8* q = ar + (u64)r * nab + b;
                        sdot = __dp4a(s.s1, q->qs[4 + t], __dp4a(s.s0, q->qs[t], 0));
                        ad = q->d;
                        as = q->s;
                    }
                    sdot = isum4(sdot);
                    if (live) {
                        acc[r][0] = fmaf((float)sdot, s.d * ad, acc[r][0]);
                        if (TY == T_Q4_1 || TY == T_Q5_1) acc[r][0] = fmaf(s.m, as, acc[r][0]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QM_RT; r++) {
        if (r >= nr) break;
        if (K) {
            // Lane 8G+l holds accumulators G and G+4.
            float p = acc[r][0] + __shfl_xor_sync(0xffffffffu, acc[r][0], 8);
            float q = acc[r][1] + __shfl_xor_sync(0xffffffffu, acc[r][1], 8);
            p = p + __shfl_xor_sync(0xffffffffu, p, 16);
            q = q + __shfl_xor_sync(0xffffffffu, q, 16);
            res[r] = p + q;
        } else {
            res[r] = fold8(acc[r][0]);
        }
    }
}

// Up to three matrices of one type and width times the same activations
// in one launch (queries, keys and values; gate and up): warp o of the
// grid computes output o of the three matrices' outputs in turn.
#define MATVEC(NAME, TY)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128, MV_BLOCKS)                                         \
        NAME(const u8* w0, const u8* w1, const u8* w2, u64 row_bytes, int nblk,                           \
                                    int outs0, int outs1, int outs2, const Q8* a, int nab, int n,         \
                                    float* y0, float* y1, float* y2) {                                    \
        if (SKIP & 2) {                                                                                   \
            after_previous();                                                                             \
            return;                                                                                       \
        }                                                                                                 \
        int o = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);                                              \
        const u8* w = w0;                                                                                 \
        float* y = y0;                                                                                    \
        int outs = outs0;                                                                                 \
        if (o >= outs0) {                                                                                 \
            o -= outs0;                                                                                   \
            w = w1;                                                                                       \
            y = y1;                                                                                       \
            outs = outs1;                                                                                 \
            if (o >= outs1) {                                                                             \
                o -= outs1;                                                                               \
                w = w2;                                                                                   \
                y = y2;                                                                                   \
                outs = outs2;                                                                             \
                if (o >= outs2) return;                                                                   \
            }                                                                                             \
        }                                                                                                 \
        int r0 = blockIdx.y * QM_RT, nr = min(QM_RT, n - r0);                                             \
        float res[QM_RT];                                                                                 \
        matvec_body<TY>(w, row_bytes, nblk, o, a, nab, r0, nr, res);                                      \
        if ((threadIdx.x & 31) == 0)                                                                      \
            for (int r = 0; r < nr; r++) y[(u64)(r0 + r) * outs + o] = res[r];                            \
    }
MATVEC(matvec_q4_0, T_Q4_0)
MATVEC(matvec_q4_1, T_Q4_1)
MATVEC(matvec_q5_0, T_Q5_0)
MATVEC(matvec_q5_1, T_Q5_1)
MATVEC(matvec_q8_0, T_Q8_0)
MATVEC(matvec_q4_k, T_Q4_K)
MATVEC(matvec_q5_k, T_Q5_K)
MATVEC(matvec_q6_k, T_Q6_K)
MATVEC(matvec_q2_k, T_Q2_K)
MATVEC(matvec_q3_k, T_Q3_K)
MATVEC(matvec_iq4_nl, T_IQ4_NL)
MATVEC(matvec_iq4_xs, T_IQ4_XS)
MATVEC(matvec_mxfp4, T_MXFP4)

// The same products for many rows, on tensor cores: each block's integer
// dot products of a 16-row by 8-output tile are one int8 `mma` (exact
// 32-bit sums, 16 elements at a time where a K-quant scales halves of a
// block apart), then every (row, output) takes exactly the steps of
// matvec_body with them. A warp computes 16 rows by 16 outputs; a block
// of 4 warps, 16 rows by 64 outputs. (Q4_K and Q5_K use mmt_body below.)
__device__ __forceinline__ void mma32(int* d, int a0, int a1, int a2, int a3, int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

__device__ __forceinline__ void mma16(int* d, int a0, int a1, int b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

// The scale and minimum of block b of a 32-element type.
template <int TY>
__device__ __forceinline__ void wscale(const u8* row, int b, float* d, float* m) {
    int ts = TY == T_Q4_0 || TY == T_IQ4_NL ? 18
             : TY == T_Q4_1                 ? 20
             : TY == T_Q5_0                 ? 22
             : TY == T_Q5_1                 ? 24
             : TY == T_MXFP4                ? 17
                                            : 34;
    const u8* blk = row + ts * (u64)b;
    *d = TY == T_MXFP4 ? e8m0_half(blk[0]) : h2f(ld16(blk));
    if (TY == T_Q4_1 || TY == T_Q5_1) *m = h2f(ld16(blk + 2));
}

// Elements 4t..4t+3 (lo) and 16+4t..16+4t+3 (hi) of block j of a K-quant
// super-block.
template <int TY>
__device__ __forceinline__ void kblock(const u8* sb, int j, int t, int* lo, int* hi) {
    if (TY == T_Q4_K || TY == T_Q5_K) {
        const u8* q = sb + (TY == T_Q4_K ? 16 : 48) + 32 * (j >> 1);
        int sh = 4 * (j & 1);
        u32 a = (ld32a(q + 4 * t) >> sh) & 0x0F0F0F0Fu, b = (ld32a(q + 16 + 4 * t) >> sh) & 0x0F0F0F0Fu;
        if (TY == T_Q5_K) {
            a |= ((ld32a(sb + 16 + 4 * t) >> j) & 0x01010101u) << 4;
            b |= ((ld32a(sb + 32 + 4 * t) >> j) & 0x01010101u) << 4;
        }
        *lo = (int)a;
        *hi = (int)b;
    } else {
        int h = j >> 2, k = j & 3;
        const u8* ql = sb + 64 * h + ((k & 1) ? 32 : 0);
        const u8* qh = sb + 128 + 32 * h;
        int sh = (k & 2) ? 4 : 0;
        u32 a = (ld32(ql + 4 * t) >> sh) & 0x0F0F0F0Fu, b = (ld32(ql + 16 + 4 * t) >> sh) & 0x0F0F0F0Fu;
        a |= ((ld32(qh + 4 * t) >> (2 * k)) & 0x03030303u) << 4;
        b |= ((ld32(qh + 16 + 4 * t) >> (2 * k)) & 0x03030303u) << 4;
        *lo = (int)__vsub4(a, 0x20202020u);
        *hi = (int)__vsub4(b, 0x20202020u);
    }
}

__device__ __forceinline__ int kscale(int ty, const u8* sb, int j, int half, int* m) {
    if (ty == T_Q6_K) {
        *m = 0;
        return ((const i8*)(sb + 192))[2 * j + half];
    }
    int sc, mn;
    scale_min_k4(j, sb + 4, &sc, &mn);
    *m = mn;
    return sc;
}

template <int TY>
__device__ void matmul_mma_body(const u8* w, u64 row_bytes, int nblk, int outs, const Q8* a, int nab, int n,
                                float* y) {
    const bool K = TY == T_Q4_K || TY == T_Q5_K || TY == T_Q6_K;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, t = lane & 3;
    // Row tiles are x, so the blocks launched together share weights.
    int o0 = (blockIdx.y * 4 + warp) * 16;
    if (o0 >= outs) return;
    int r0 = blockIdx.x * 16;
    // Rows this lane loads (A) and owns in the results (C): r0+g, r0+g+8.
    int ra = min(r0 + g, n - 1), rb = min(r0 + g + 8, n - 1);
    const Q8* aa = a + (u64)ra * nab;
    const Q8* ab = a + (u64)rb * nab;
    // Weight rows this lane loads (B): o0+g and o0+8+g; results' outputs:
    // o0 + 8s + 2t + c.
    const u8* wl[2] = {w + row_bytes * (u64)min(o0 + g, outs - 1), w + row_bytes * (u64)min(o0 + 8 + g, outs - 1)};
    const u8* wc[2][2];
    #pragma unroll
    for (int s2 = 0; s2 < 2; s2++)
        #pragma unroll
        for (int c = 0; c < 2; c++) wc[s2][c] = w + row_bytes * (u64)min(o0 + 8 * s2 + 2 * t + c, outs - 1);
    // acc[s][e][k]: subtile s, element e (c0..c3), accumulator k.
    float acc[2][4][8];
    #pragma unroll
    for (int s2 = 0; s2 < 2; s2++)
        #pragma unroll
        for (int e = 0; e < 4; e++)
            for (int k = 0; k < 8; k++) acc[s2][e][k] = 0.0f;
    for (int b0 = 0; b0 < nblk; b0 += 8) {
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int b = b0 + u;
            if (b >= nblk) break;
            if (!K) {
                int lo[2], hi[2];
                float dd, mm;
                #pragma unroll
                for (int s2 = 0; s2 < 2; s2++) wblock<TY>(wl[s2], b, t, &lo[s2], &hi[s2], &dd, &mm);
                const Q8* qa = aa + b;
                const Q8* qb = ab + b;
                int a0 = qa->qs[t], a1 = qb->qs[t], a2 = qa->qs[4 + t], a3 = qb->qs[4 + t];
                float da[2] = {qa->d, qb->d}, sa[2] = {qa->s, qb->s};
                #pragma unroll
                for (int s2 = 0; s2 < 2; s2++) {
                    int dv[4];
                    mma32(dv, a0, a1, a2, a3, lo[s2], hi[s2]);
#pragma unroll
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float dw, mw = 0.0f;
                        wscale<TY>(wc[s2][e & 1], b, &dw, &mw);
                        int r = e >> 1;
                        acc[s2][e][u] = fmaf((float)dv[e], dw * da[r], acc[s2][e][u]);
                        if (TY == T_Q4_1 || TY == T_Q5_1) acc[s2][e][u] = fmaf(mw, sa[r], acc[s2][e][u]);
                    }
                }
            } else {
                int ts = TY == T_Q4_K ? 144 : TY == T_Q5_K ? 176 : 210;
                int isum[2][4], msum[2][4];
                #pragma unroll
                for (int s2 = 0; s2 < 2; s2++)
                    #pragma unroll
                    for (int e = 0; e < 4; e++) isum[s2][e] = msum[s2][e] = 0;
                const Q8* qa = aa + 8 * b;
                const Q8* qb = ab + 8 * b;
                // Q4_K and Q5_K: each output's twelve scale bytes, read
                // once per super-block as three aligned words.
                u32 sw[2][2][3];
                if (TY != T_Q6_K) {
                    #pragma unroll
                    for (int s2 = 0; s2 < 2; s2++)
                        #pragma unroll
                        for (int c = 0; c < 2; c++) {
                            const u8* q = wc[s2][c] + (u64)ts * b + 4;
                            sw[s2][c][0] = ld32a(q);
                            sw[s2][c][1] = ld32a(q + 4);
                            sw[s2][c][2] = ld32a(q + 8);
                        }
                }
                #pragma unroll
                for (int j = 0; j < 8; j++) {
                    int lo[2], hi[2];
                    #pragma unroll
                    for (int s2 = 0; s2 < 2; s2++) kblock<TY>(wl[s2] + (u64)ts * b, j, t, &lo[s2], &hi[s2]);
                    int a0 = qa[j].qs[t], a1 = qb[j].qs[t], a2 = qa[j].qs[4 + t], a3 = qb[j].qs[4 + t];
                    int sums[2] = {qa[j].sum, qb[j].sum};
                    #pragma unroll
                    for (int s2 = 0; s2 < 2; s2++) {
                        int d0[4], d1[4];
                        if (TY == T_Q6_K) {
                            mma16(d0, a0, a1, lo[s2]);
                            mma16(d1, a2, a3, hi[s2]);
                        } else {
                            mma32(d0, a0, a1, a2, a3, lo[s2], hi[s2]);
                        }
                        #pragma unroll
                        for (int c = 0; c < 2; c++) {
                            const u8* sbw = wc[s2][c] + (u64)ts * b;
                            int m0, m1, sc0;
                            if (TY == T_Q6_K) sc0 = kscale(TY, sbw, j, 0, &m0);
                            else scale_min_w(j, sw[s2][c], &sc0, &m0);
                            int sc1 = TY == T_Q6_K ? kscale(TY, sbw, j, 1, &m1) : sc0;
                            #pragma unroll
                            for (int r = 0; r < 2; r++) {
                                int e = 2 * r + c;
                                if (TY == T_Q6_K) isum[s2][e] += sc0 * d0[e] + sc1 * d1[e];
                                else isum[s2][e] += sc0 * d0[e];
                                msum[s2][e] += m0 * sums[r];
                            }
                        }
                    }
                }
                float da[2] = {qa[0].d, qb[0].d};
                #pragma unroll
                for (int s2 = 0; s2 < 2; s2++) {
                    #pragma unroll
                    for (int c = 0; c < 2; c++) {
                        const u8* sbw = wc[s2][c] + (u64)ts * b;
                        float d = h2f(ld16(sbw + (TY == T_Q6_K ? 208 : 0)));
                        float dmin = TY == T_Q6_K ? 0.0f : h2f(ld16(sbw + 2));
                        #pragma unroll
                        for (int r = 0; r < 2; r++) {
                            int e = 2 * r + c;
                            acc[s2][e][u] = fmaf((float)isum[s2][e], d * da[r], acc[s2][e][u]);
                            if (TY != T_Q6_K) acc[s2][e][u] = fmaf(-(dmin * da[r]), (float)msum[s2][e], acc[s2][e][u]);
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int s2 = 0; s2 < 2; s2++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = r0 + g + 8 * (e >> 1), o = o0 + 8 * s2 + 2 * t + (e & 1);
            const float* v = acc[s2][e];
            float sum = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
            if (r < n && o < outs) y[(u64)r * outs + o] = sum;
        }
    }
}

// Q4_K and Q5_K on tensor cores with their tiles staged in shared memory:
// a block of MMT_WR x MMT_WO warps computes MMT_RB rows by MMT_OB
// outputs, a warp MMT_R tiles of 16 rows by MMT_S tiles of 8 outputs (its
// lanes own rows and outputs as in matmul_mma_body). The block copies
// each super-block's activations and weights of its tile into shared
// memory with asynchronous copies while it computes the one before (two
// stages), and blocks of neighbouring rows are launched together (x is
// the row tile), so a weight block read from memory serves them from L2.
//
// Each sub-block's sum of levels times activations is one tensor-core
// product of the raw levels (MMT_RAW), multiplied by its 6-bit scale on
// the CUDA cores and added into isum = X; with MMT_RAW=1, msum = Z is a
// second product with each sub-block's minimum spread over its 32 bytes
// as the weight; with MMT_RAW=2 (the default), the minimum times the
// activations' sub-block sum, which quantization stored beside them, on
// the CUDA cores instead. A block is 2 x 2 warps, each 2 row tiles by 2
// output tiles (MMT_S=2, MMT_WO=2: 4.5% off the 7B shape's prefill on an
// H100, the 1.5B's within 1%, against 4 warps of one output tile each).
// MMT_RAW=0 keeps the older way: the scale split as 8 sh + sl multiplied
// into the weight bytes, X and Y both on tensor cores, isum = X + 8 Y. All
// exact, so each (row, output) then takes matvec_body's float steps with
// them. The super-blocks are visited class by class (class k:
// super-blocks k, k+8, ... in order), and each class is folded in as soon
// as the sum ((0+1)+(2+3))+((4+5)+(6+7)) can take it: four floats per
// (row, output) are live instead of eight. A lane's part of an mma is
// eight contiguous elements (the integer sum of 32 products does not
// depend on which lane holds which, as long as rows and outputs agree).
#ifndef MMT_R
#define MMT_R 2
#endif
#ifndef MMT_S
#define MMT_S 2
#endif
#ifndef MMT_WR
#define MMT_WR 2
#endif
#ifndef MMT_WO
#define MMT_WO 2
#endif
#ifndef MMT_BLOCKS
#define MMT_BLOCKS 2
#endif
// Pairs of sub-blocks unrolled together (1, 2 or 4).
#ifndef MMT_JP
#define MMT_JP 4
#endif
// How a sub-block's scale and minimum come in. 0: the scale's low and high
// three bits multiplied into the weight bytes (two products, X and Y) and
// the minimum broadcast into a third (Z). 1: the raw levels in one product
// of its own, multiplied by the scale as an integer (IMAD), the minimum as
// in 0. 2: as 1, and the minimum times the activations' sub-block sum
// (IMAD) instead of a product. The integer sums are the same in all three.
#ifndef MMT_RAW
#define MMT_RAW 2
#endif
#define MMT_PRAGMA(x) _Pragma(#x)
#define MMT_UNROLL(n) MMT_PRAGMA(unroll n)
// `body` for each (row tile i, output tile s, element e) of a lane.
#define MMT_EACH(body)                                  \
    MMT_UNROLL(MMT_R) for (int i = 0; i < MMT_R; i++)    \
        MMT_UNROLL(MMT_S) for (int s = 0; s < MMT_S; s++) \
            MMT_UNROLL(4) for (int e = 0; e < 4; e++) { body; }
#define MMT_RB (16 * MMT_R * MMT_WR)
#define MMT_OB (8 * MMT_S * MMT_WO)
#define MMT_T (32 * MMT_WR * MMT_WO)
// Bytes per row of a stage's activations (eight 48-byte blocks, padded so
// the eight rows of a fragment load fall in different banks) and per
// output of its weights (a super-block, padded likewise for Q4_K).
#define MMT_AS 416
#define MMT_WS(TY) ((TY) == T_Q4_K ? 160 : 192)
#define MMT_STAGE(TY) (MMT_RB * MMT_AS + MMT_OB * MMT_WS(TY))
#define MMT_NA ((MMT_RB * 24 + MMT_T - 1) / MMT_T)
#define MMT_NW ((MMT_OB * 11 + MMT_T - 1) / MMT_T)

// d += a b, with b unsigned bytes.
__device__ __forceinline__ void mma32u(int* d, int a0, int a1, int a2, int a3, int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d = a b, with b unsigned bytes.
__device__ __forceinline__ void mma32u0(int* d, int a0, int a1, int a2, int a3, int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

// A super-block's eight 6-bit scales (sc[0]: sub-blocks 0-3, sc[1]: 4-7)
// and minimums as bytes, from the 12 packed bytes at `p`.
__device__ __forceinline__ void k_scales(const u8* p, u32* sc, u32* mn) {
    const u32* qw = (const u32*)p;
    u32 w0 = qw[0], w1 = qw[1], w2 = qw[2];
    sc[0] = w0 & 0x3F3F3F3Fu;
    sc[1] = (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
    mn[0] = w1 & 0x3F3F3F3Fu;
    mn[1] = ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
}

// A thread's share of the copies of a stage: its 16-byte pieces of the
// activations (the eight blocks of a row's super-block lie together) and
// of the weights, as offsets from super-block 0 (32-bit: the launch
// checks that the activations and the matrix are under 4 GiB) and
// offsets into the stage, found once. (A thread whose last piece is past
// the end copies the tile's last piece again.)
struct MmtCopies {
    u32 a[MMT_NA], w[MMT_NW];
    u32 da[MMT_NA], dw[MMT_NW];
};

template <int TY>
__device__ __forceinline__ void mmt_plan(MmtCopies* p, u64 row_bytes, int outs, int nab, int n, int r0, int o0) {
    const int WP = TY == T_Q4_K ? 9 : 11;  // 16-byte pieces of a super-block
    #pragma unroll
    for (int k = 0; k < MMT_NA; k++) {
        int i = min((int)threadIdx.x + k * MMT_T, MMT_RB * 24 - 1);
        int r = i / 24, c = i % 24;
        p->a[k] = (u32)min(r0 + r, n - 1) * (u32)nab * 48u + 16 * c;
        p->da[k] = r * MMT_AS + 16 * c;
    }
    #pragma unroll
    for (int k = 0; k < MMT_NW; k++) {
        int i = min((int)threadIdx.x + k * MMT_T, MMT_OB * WP - 1);
        int o = i / WP, c = i % WP;
        p->w[k] = (u32)(row_bytes * (u64)min(o0 + o, outs - 1)) + 16 * c;
        p->dw[k] = MMT_RB * MMT_AS + o * MMT_WS(TY) + 16 * c;
    }
}

// Super-block b of the block's rows and outputs into `st`.
template <int TY>
__device__ __forceinline__ void mmt_load(u8* st, const MmtCopies* p, const u8* w, const Q8* a, int b) {
    const int TS = TY == T_Q4_K ? 144 : 176;
    const u8* ab = (const u8*)a + 384 * (u64)b;
    const u8* wb = w + TS * (u64)b;
    #pragma unroll
    for (int k = 0; k < MMT_NA; k++) att_copy16(st + p->da[k], ab + p->a[k]);
    #pragma unroll
    for (int k = 0; k < MMT_NW; k++) att_copy16(st + p->dw[k], wb + p->w[k]);
}

template <int TY>
__device__ void mmt_body(const u8* w, u64 row_bytes, int nblk, int outs, const Q8* a, int nab, int n, float* y) {
    extern __shared__ __align__(16) u8 smem_t[];
    const int WS = MMT_WS(TY), STAGE = MMT_STAGE(TY);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, t = lane & 3;
    int wr = warp / MMT_WO, wo = warp % MMT_WO;
    int r0 = blockIdx.x * MMT_RB, o0 = blockIdx.y * MMT_OB;
    // This warp's rows and outputs within the tile.
    int ra = wr * 16 * MMT_R, oa = wo * 8 * MMT_S;
    float cur[MMT_R][MMT_S][4], fa[MMT_R][MMT_S][4], fb[MMT_R][MMT_S][4], fc[MMT_R][MMT_S][4];
    MMT_EACH(fa[i][s][e] = fb[i][s][e] = fc[i][s][e] = 0.0f)
    MmtCopies plan;
    mmt_plan<TY>(&plan, row_bytes, outs, nab, n, r0, o0);
    mmt_load<TY>(smem_t, &plan, w, a, 0);
    cp_commit();
    int q = 0;
    for (int k = 0; k < 8; k++) {
        MMT_EACH(cur[i][s][e] = 0.0f)
        for (int b = k; b < nblk; b += 8, q++) {
            // The next super-block in this order goes into the other
            // stage while this one is computed.
            int next = b + 8 < nblk ? b + 8 : k + 1 < 8 && k + 1 < nblk ? k + 1 : -1;
            if (next >= 0) mmt_load<TY>(smem_t + ((q + 1) & 1) * STAGE, &plan, w, a, next);
            cp_commit();
            cp_wait1();
            __syncthreads();
            const u8* A = smem_t + (q & 1) * STAGE;
            const u8* W = A + MMT_RB * MMT_AS;
            int X[MMT_R][MMT_S][4], Y[MMT_R][MMT_S][4], Z[MMT_R][MMT_S][4];
            MMT_EACH(X[i][s][e] = Y[i][s][e] = Z[i][s][e] = 0)
            // The scales and minimums of the output whose levels this lane
            // loads (oa + 8s + g), as bytes: scales' low three bits
            // (sub-blocks 0-3, 4-7), high three bits, minimums; and Q5_K's
            // high bits of the lane's eight elements.
            u32 sl[MMT_S][2], sh3[MMT_S][2], mn[MMT_S][2];
            uint2 qh[MMT_S];
#if MMT_RAW
            // The scales and minimums of the outputs of this lane's sums
            // (oa + 8s + 2t + c).
            u32 scc[MMT_S][2][2], mnc[MMT_S][2][2];
            #pragma unroll
            for (int s = 0; s < MMT_S; s++)
                #pragma unroll
                for (int c = 0; c < 2; c++) k_scales(W + (oa + 8 * s + 2 * t + c) * WS + 4, scc[s][c], mnc[s][c]);
#endif
            #pragma unroll
            for (int s = 0; s < MMT_S; s++) {
                const u8* row = W + (oa + 8 * s + g) * WS;
                u32 sc[2];
                k_scales(row + 4, sc, mn[s]);
                #pragma unroll
                for (int k = 0; k < 2; k++) {
                    sl[s][k] = sc[k] & 0x07070707u;
                    sh3[s][k] = (sc[k] >> 3) & 0x07070707u;
                }
                if (TY == T_Q5_K) qh[s] = *(const uint2*)(row + 16 + 8 * t);
            }
            MMT_UNROLL(MMT_JP)
            for (int jp = 0; jp < 4; jp++) {
                uint2 wq[MMT_S];
                #pragma unroll
                for (int s = 0; s < MMT_S; s++)
                    wq[s] = *(const uint2*)(W + (oa + 8 * s + g) * WS + (TY == T_Q4_K ? 16 : 48) + 32 * jp + 8 * t);
                #pragma unroll
                for (int jj = 0; jj < 2; jj++) {
                    int j = 2 * jp + jj;
                    int bl[MMT_S][2], bh[MMT_S][2], bm[MMT_S];
                    #pragma unroll
                    for (int s = 0; s < MMT_S; s++) {
                        // Byte j & 3 of the word alone (l, h), and in every
                        // byte (the minimum).
                        u32 k4 = 2 * (jp & 1) + jj;
                        bm[s] = (int)__byte_perm(jp < 2 ? mn[s][0] : mn[s][1], 0, k4 * 0x1111u);
                        u32 q0 = (wq[s].x >> (4 * jj)) & 0x0F0F0F0Fu, q1 = (wq[s].y >> (4 * jj)) & 0x0F0F0F0Fu;
                        if (TY == T_Q5_K) {
                            q0 |= ((qh[s].x >> j) & 0x01010101u) << 4;
                            q1 |= ((qh[s].y >> j) & 0x01010101u) << 4;
                        }
#if MMT_RAW
                        bl[s][0] = (int)q0;
                        bl[s][1] = (int)q1;
#else
                        u32 l = __byte_perm(jp < 2 ? sl[s][0] : sl[s][1], 0, 0x4440u | k4);
                        u32 h = __byte_perm(jp < 2 ? sh3[s][0] : sh3[s][1], 0, 0x4440u | k4);
                        // Bytes times at most 7: no carries between them.
                        bl[s][0] = (int)(q0 * l);
                        bl[s][1] = (int)(q1 * l);
                        bh[s][0] = (int)(q0 * h);
                        bh[s][1] = (int)(q1 * h);
#endif
                    }
#if MMT_RAW
                    // Sub-block j's scale and minimum of outputs 2t, 2t + 1.
                    int scj[MMT_S][2], mnj[MMT_S][2];
                    #pragma unroll
                    for (int s = 0; s < MMT_S; s++)
                        #pragma unroll
                        for (int c = 0; c < 2; c++) {
                            scj[s][c] = (int)__byte_perm(scc[s][c][j >> 2], 0, 0x4440u | (j & 3));
                            mnj[s][c] = (int)__byte_perm(mnc[s][c][j >> 2], 0, 0x4440u | (j & 3));
                        }
#endif
                    #pragma unroll
                    for (int i = 0; i < MMT_R; i++) {
                        const u8* pa = A + (ra + 16 * i + g) * MMT_AS + 48 * j;
                        int2 x = *(const int2*)(pa + 8 * t), z = *(const int2*)(pa + 8 * MMT_AS + 8 * t);
#if MMT_RAW == 2
                        // The sub-block sums of rows g and g + 8.
                        int as[2] = {*(const int*)(pa + 40), *(const int*)(pa + 8 * MMT_AS + 40)};
#endif
                        #pragma unroll
                        for (int s = 0; s < MMT_S; s++) {
#if MMT_RAW
                            int p[4];
                            mma32u0(p, x.x, z.x, x.y, z.y, bl[s][0], bl[s][1]);
                            #pragma unroll
                            for (int e = 0; e < 4; e++) X[i][s][e] += scj[s][e & 1] * p[e];
#if MMT_RAW == 2
                            (void)bm[s];
                            #pragma unroll
                            for (int e = 0; e < 4; e++) Z[i][s][e] += mnj[s][e & 1] * as[e >> 1];
#else
                            mma32u(Z[i][s], x.x, z.x, x.y, z.y, bm[s], bm[s]);
#endif
#else
                            mma32u(X[i][s], x.x, z.x, x.y, z.y, bl[s][0], bl[s][1]);
                            mma32u(Y[i][s], x.x, z.x, x.y, z.y, bh[s][0], bh[s][1]);
                            mma32u(Z[i][s], x.x, z.x, x.y, z.y, bm[s], bm[s]);
#endif
                        }
                    }
                }
            }
            #pragma unroll
            for (int i = 0; i < MMT_R; i++) {
                const u8* pa = A + (ra + 16 * i + g) * MMT_AS;
                float da[2] = {*(const float*)(pa + 32), *(const float*)(pa + 8 * MMT_AS + 32)};
                #pragma unroll
                for (int s = 0; s < MMT_S; s++)
                    #pragma unroll
                    for (int c = 0; c < 2; c++) {
                        u32 dd = *(const u32*)(W + (oa + 8 * s + 2 * t + c) * WS);
                        float d = h2f((u16)(dd & 0xFFFFu)), dmin = h2f((u16)(dd >> 16));
                        #pragma unroll
                        for (int h = 0; h < 2; h++) {
                            int e = 2 * h + c;
                            int isum = MMT_RAW ? X[i][s][e] : X[i][s][e] + 8 * Y[i][s][e];
                            cur[i][s][e] = fmaf((float)isum, d * da[h], cur[i][s][e]);
                            cur[i][s][e] = fmaf(-(dmin * da[h]), (float)Z[i][s][e], cur[i][s][e]);
                        }
                    }
            }
            // Every warp is done with this stage before it is refilled.
            __syncthreads();
        }
        // Class k into ((0+1)+(2+3))+((4+5)+(6+7)), classes in order: fa
        // holds 0, 0+1, (0+1)+(2+3), then the whole sum; fb holds 2, then
        // 4, then 4+5; fc holds 6.
        MMT_EACH(
            float v = cur[i][s][e];
            if (k == 0) fa[i][s][e] = v;
            else if (k == 1) fa[i][s][e] = fa[i][s][e] + v;
            else if (k == 2) fb[i][s][e] = v;
            else if (k == 3) fa[i][s][e] = fa[i][s][e] + (fb[i][s][e] + v);
            else if (k == 4) fb[i][s][e] = v;
            else if (k == 5) fb[i][s][e] = fb[i][s][e] + v;
            else if (k == 6) fc[i][s][e] = v;
            else fa[i][s][e] = fa[i][s][e] + (fb[i][s][e] + (fc[i][s][e] + v))
        )
    }
    MMT_EACH(
        int r = r0 + ra + 16 * i + g + 8 * (e >> 1);
        int o = o0 + oa + 8 * s + 2 * t + (e & 1);
        if (r < n && o < outs) y[(u64)r * outs + o] = fa[i][s][e]
    )
}

#define MMT(NAME, TY)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MMT_T, MMT_BLOCKS) NAME(const u8* w, u64 row_bytes, int nblk, \
                                                                        int outs, const Q8* a, int nab, int n, \
                                                                        float* y) {                      \
        after_previous();                                                                                \
        mmt_body<TY>(w, row_bytes, nblk, outs, a, nab, n, y);                                             \
    }
MMT(mmt_q4_k, T_Q4_K)
MMT(mmt_q5_k, T_Q5_K)

#define MATMUL_MMA(NAME, TY)                                                                          \
    extern "C" __global__ void NAME(const u8* w, u64 row_bytes, int nblk, int outs, const Q8* a, int nab, \
                                    int n, float* y) {                                                \
        after_previous();                                                                             \
        matmul_mma_body<TY>(w, row_bytes, nblk, outs, a, nab, n, y);                                  \
    }
MATMUL_MMA(mma_q4_0, T_Q4_0)
MATMUL_MMA(mma_q4_1, T_Q4_1)
MATMUL_MMA(mma_q5_0, T_Q5_0)
MATMUL_MMA(mma_q5_1, T_Q5_1)
MATMUL_MMA(mma_q8_0, T_Q8_0)
MATMUL_MMA(mma_q4_k, T_Q4_K)
MATMUL_MMA(mma_q5_k, T_Q5_K)
MATMUL_MMA(mma_q6_k, T_Q6_K)
MATMUL_MMA(mma_iq4_nl, T_IQ4_NL)
MATMUL_MMA(mma_mxfp4, T_MXFP4)

// Float weights times f32 activations in the CPU's dot_f32 order: element
// i into lane i % 16 (fused), the lanes folded as lane k plus lane k + 8,
// then ((0+1)+(2+3))+((4+5)+(6+7)). A warp per output; each half-warp
// takes every other row of the tile.
template <int TY>
__device__ __forceinline__ float wf(const u8* row, int i) {
    if (TY == T_F32) return ((const float*)row)[i];
    if (TY == T_F16) return h2f(((const u16*)row)[i]);
    return __uint_as_float(((u32)((const u16*)row)[i]) << 16);
}

template <int TY>
__device__ void matmul_f_body(const u8* w, u64 row_bytes, int cols, int outs, const float* x, int n, float* y) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = blockIdx.x * MM_WARPS + warp;
    if (o >= outs) return;
    int r0 = blockIdx.y * QM_RT;
    int nr = min(QM_RT, n - r0);
    const u8* row = w + row_bytes * (u64)o;
    int l = lane & 15, half = lane >> 4;
    for (int r = 0; r < QM_RT; r += 2) {
        int rr = r + half;
        float acc = 0.0f;
        if (rr < nr) {
            const float* xr = x + (u64)(r0 + rr) * cols;
            for (int i = l; i < cols; i += 16) acc = fmaf(wf<TY>(row, i), xr[i], acc);
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 8);
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        acc += __shfl_xor_sync(0xffffffffu, acc, 4);
        if (l == 0 && rr < nr) y[(u64)(r0 + rr) * outs + o] = acc;
    }
}

#define MATMUL_F(NAME, TY)                                                                       \
    extern "C" __global__ void NAME(const u8* w, u64 row_bytes, int cols, int outs, const float* x, \
                                    int n, float* y) {                                           \
        after_previous();                                                                        \
        matmul_f_body<TY>(w, row_bytes, cols, outs, x, n, y);                                    \
    }
MATMUL_F(matmul_f32, T_F32)
MATMUL_F(matmul_f16, T_F16)
MATMUL_F(matmul_bf16, T_BF16)

// Rows `tokens[r]` of a table of type TY, as f32: a block per row, a
// thread per chunk of 32.
template <int TY>
__device__ void rows_body(const u8* w, u64 row_bytes, int cols, const u32* tokens, float* out) {
    int r = blockIdx.x;
    const u8* row = w + row_bytes * (u64)tokens[r];
    for (int c = threadIdx.x; c < (cols >> 5); c += blockDim.x) {
        float v[32];
        chunk<TY>(row, c, v);
        for (int i = 0; i < 32; i++) out[(u64)r * cols + 32 * c + i] = v[i];
    }
}

#define ROWS(NAME, TY)                                                                                   \
    extern "C" __global__ void NAME(const u8* w, u64 row_bytes, int cols, const u32* tokens, float* out) { \
        after_previous();                                                                                  \
        rows_body<TY>(w, row_bytes, cols, tokens, out);                                                  \
    }
ROWS(rows_f32, T_F32)
ROWS(rows_f16, T_F16)
ROWS(rows_bf16, T_BF16)
ROWS(rows_q4_0, T_Q4_0)
ROWS(rows_q4_1, T_Q4_1)
ROWS(rows_q5_0, T_Q5_0)
ROWS(rows_q5_1, T_Q5_1)
ROWS(rows_q8_0, T_Q8_0)
ROWS(rows_q4_k, T_Q4_K)
ROWS(rows_q5_k, T_Q5_K)
ROWS(rows_q6_k, T_Q6_K)
ROWS(rows_q2_k, T_Q2_K)
ROWS(rows_q3_k, T_Q3_K)
ROWS(rows_iq4_nl, T_IQ4_NL)
ROWS(rows_iq4_xs, T_IQ4_XS)
ROWS(rows_mxfp4, T_MXFP4)

// RMS norm of each row of `dim` in the CPU's order
// (snug_kernels::vec::sum_squares): element i's square into lane i % 8
// (fused), the lanes summed as ((0+1)+(2+3))+((4+5)+(6+7)), then
// `x * scale * w` into `out` (which may be `x`). Where `add` is given, each
// row of `x` first becomes `x + add` (the residual sum, written back). A
// block of 256 per row (512 for wide rows with NORM_EARLY; lib.rs,
// norm_threads): the row is staged in shared memory by every thread (the
// loads in flight at once), then eight threads run the eight sums.
// NORM_EARLY 1 (the default; lib.rs reads it too): a norm's weights are
// loaded before the kernel ahead has finished, into registers where the
// row is at most NORM_W elements a thread, else asked into L2, and rows
// wider than 2,048 take blocks of 512 threads. With 0, each weight is
// loaded where it is used, after the wait, one memory round trip per turn
// of the loop (a 7B shape's decode step 15% slower on an H100; CUDA.md).
#ifndef NORM_EARLY
#define NORM_EARLY 1
#endif
#ifndef NORM_W
#define NORM_W 16
#endif
__device__ __forceinline__ void rms_norm_body(float* x, const float* add, float* out, const float* w, int dim,
                                              float eps, int fmt, Q8* q8) {
    extern __shared__ float xs[];
    __shared__ float scale_s;
    // NORM_EARLY: the weights, which nothing writes, loaded before the
    // kernel ahead has finished.
    const int bd = blockDim.x;
    float wr[NORM_W];
    bool held = NORM_EARLY && dim <= NORM_W * bd;
    if (held) {
#pragma unroll
        for (int j = 0; j < NORM_W; j++) wr[j] = (int)threadIdx.x + j * bd < dim ? w[threadIdx.x + j * bd] : 0.0f;
    } else if (NORM_EARLY && threadIdx.x == 0) {
        prefetch_l2((const u8*)w, (u64)dim * 4);
    }
    after_previous();
    SKIPS(1);
    u64 off = (u64)blockIdx.x * dim;
    // Eight elements a thread in flight before any is stored (a store to
    // `x` could otherwise alias the next loads, one round trip each).
    int i = threadIdx.x;
    for (; i + 7 * bd < dim; i += 8 * bd) {
        float v[8], a[8];
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = x[off + i + j * bd];
        if (add) {
#pragma unroll
            for (int j = 0; j < 8; j++) a[j] = add[off + i + j * bd];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                v[j] = v[j] + a[j];
                x[off + i + j * bd] = v[j];
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) xs[i + j * bd] = v[j];
    }
    for (; i < dim; i += bd) {
        float v = x[off + i];
        if (add) {
            v = v + add[off + i];
            x[off + i] = v;
        }
        xs[i] = v;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        float s = 0.0f;
        if (lane < 8) {
            // Sixteen of the lane's elements loaded before they are
            // added (the same additions, in the same order).
            int i = lane;
            for (; i + 8 * 15 < dim; i += 8 * 16) {
                float v[16];
#pragma unroll
                for (int j = 0; j < 16; j++) v[j] = xs[i + 8 * j];
#pragma unroll
                for (int j = 0; j < 16; j++) s = fmaf(v[j], v[j], s);
            }
            for (; i < dim; i += 8) s = fmaf(xs[i], xs[i], s);
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        if (lane == 0) scale_s = 1.0f / sqrtf(s / (float)dim + eps);
    }
    __syncthreads();
    float scale = scale_s;
    if (held) {
#pragma unroll
        for (int j = 0; j < NORM_W; j++) {
            int k = threadIdx.x + j * bd;
            if (k < dim) {
                float v = xs[k] * scale * wr[j];
                out[off + k] = v;
                if (q8) xs[k] = v;
            }
        }
    } else if (NORM_EARLY) {
        // Eight weights in flight at a time (a store to `out` could alias
        // them).
        int k = threadIdx.x;
        for (; k + 7 * bd < dim; k += 8 * bd) {
            float wv[8];
#pragma unroll
            for (int j = 0; j < 8; j++) wv[j] = w[k + j * bd];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float v = xs[k + j * bd] * scale * wv[j];
                out[off + k + j * bd] = v;
                if (q8) xs[k + j * bd] = v;
            }
        }
        for (; k < dim; k += bd) {
            float v = xs[k] * scale * w[k];
            out[off + k] = v;
            if (q8) xs[k] = v;
        }
    } else {
        for (int k = threadIdx.x; k < dim; k += bd) {
            float v = xs[k] * scale * w[k];
            out[off + k] = v;
            if (q8) xs[k] = v;
        }
    }
    if (!q8) return;
    // The normalized row quantized for the product that reads it, as
    // quantize_q8 and quantize_q8k would from `out`.
    __syncthreads();
    Q8* qr = q8 + (u64)blockIdx.x * (dim >> 5);
    if (fmt == FMT_Q8_K) {
        for (int sb = threadIdx.x >> 5; sb < (dim >> 8); sb += blockDim.x >> 5) q8k_warp(xs + 256 * sb, qr + 8 * sb);
    } else {
        int lane = threadIdx.x & 31;
        for (int blk = threadIdx.x >> 5; blk < (dim >> 5); blk += blockDim.x >> 5)
            q8_block(xs[32 * blk + lane], fmt, qr + blk);
    }
}

extern "C" __global__ void rms_norm(float* x, const float* add, float* out, const float* w, int dim, float eps) {
    rms_norm_body(x, add, out, w, dim, eps, 0, nullptr);
}

// rms_norm, then the row quantized in format `fmt` into `q8` (a block of
// 256 or 512 threads per row, as rms_norm).
extern "C" __global__ void norm_q8(float* x, const float* add, float* out, const float* w, int dim, float eps,
                                   int fmt, Q8* q8) {
    rms_norm_body(x, add, out, w, dim, eps, fmt, q8);
}

extern "C" __global__ void scale(float* x, u64 len, float by) {
    after_previous();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] *= by;
}

extern "C" __global__ void add(float* to, const float* from, u64 len) {
    after_previous();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) to[i] += from[i];
}

extern "C" __global__ void add_bias(float* x, const float* b, int width, u64 len) {
    after_previous();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] += b[i % width];
}

// Each row's query and key heads rotated to its position, and its keys and
// values stored as write_kv_f16 stores them, in one launch. Pair p of a
// head is (a[p], b[p]), turned by the angle whose cosine and sine are
// cs[2 (r pairs + p)] and the next (computed by the host as the CPU
// computes them). Thread t of a row rotates pair t % pairs of query head
// t / pairs, or of a key head (then stores the pair's two keys), or
// stores one value and, where that dimension is not rotated (`rotated[d]`
// is 0), its key. With `kc` and `vc` null nothing is stored (a coded cache:
// write_kv_coded stores the rotated keys after).
extern "C" __global__ void rope_write_kv(float* q, float* k, const float* v, const float* cs, int heads,
                                         int kv_heads, int hd, const int* pa, const int* pb, int pairs,
                                         const int* rotated, const u32* page, const u32* slot, int layer,
                                         int layers, int pt, u16* kc, u16* vc) {
    after_previous();
    SKIPS(8);
    int r = blockIdx.x;
    int nq = heads * pairs, nk = kv_heads * pairs, kvd = kv_heads * hd;
    int total = nq + nk + kvd;
    for (int t = blockIdx.y * blockDim.x + threadIdx.x; t < total; t += gridDim.y * blockDim.x) {
        if (t < nq + nk) {
            int h = t / pairs, i = t % pairs;
            float* x = h < heads ? q + ((u64)r * heads + h) * hd : k + ((u64)r * kv_heads + (h - heads)) * hd;
            float c = cs[2 * ((u64)r * pairs + i)], s = cs[2 * ((u64)r * pairs + i) + 1];
            int a = pa[i], b = pb[i];
            float x0 = x[a], x1 = x[b];
            float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
            x[a] = y0;
            x[b] = y1;
            if (h >= heads && kc) {
                u64 base = ((((u64)page[r] * layers + layer) * kv_heads + (h - heads)) * pt + slot[r]) * hd;
                kc[base + a] = f2h(y0);
                kc[base + b] = f2h(y1);
            }
        } else {
            int e = t - nq - nk;
            if (!vc) continue;
            int h = e / hd, d = e % hd;
            u64 at = ((((u64)page[r] * layers + layer) * kv_heads + h) * pt + slot[r]) * hd + d;
            vc[at] = f2h(v[(u64)r * kvd + e]);
            if (!rotated[d]) kc[at] = f2h(k[(u64)r * kvd + e]);
        }
    }
}

// Keys and values of each row into its page's slot, as f16. The cache's
// layout is the CPU's: element ((page * layers + layer) * kv_heads + head)
// * page_tokens + slot, times head_dim.
extern "C" __global__ void write_kv_f16(const float* k, const float* v, const u32* page, const u32* slot,
                                        int layer, int layers, int kv_heads, int pt, int hd, u16* kc,
                                        u16* vc) {
    after_previous();
    SKIPS(8);
    int r = blockIdx.x;
    int kvd = kv_heads * hd;
    for (int t = blockIdx.y * blockDim.x + threadIdx.x; t < kvd; t += gridDim.y * blockDim.x) {
        int h = t / hd, d = t % hd;
        u64 at = ((((u64)page[r] * layers + layer) * kv_heads + h) * pt + slot[r]) * hd + d;
        kc[at] = f2h(k[(u64)r * kvd + t]);
        vc[at] = f2h(v[(u64)r * kvd + t]);
    }
}

// KV formats (KvFormat): f16 elements, or codes of the rotated vector and
// an f16 scale per vector (Q8: int8 codes; TQ4: 4-bit codes into a
// 16-level codebook, element 2i in the low nibble of byte i).
#define KV_F16 0
#define KV_Q8 1
#define KV_TQ4 2
#define NO_TWIN 0xffffffffu

// x <- H x (unnormalized Walsh-Hadamard) for the hd (a power of two)
// values at x in shared memory, thread d of the block taking the pairs
// (d, d + s) whose lower index it is, stage after stage: every butterfly
// is the CPU's (tq4::hadamard), each a + b and a - b rounded once.
__device__ __forceinline__ void hadamard_shared(float* x, int hd) {
    int d = threadIdx.x;
    for (int s = 1; s < hd; s <<= 1) {
        for (int i = d; i < hd; i += blockDim.x)
            if (!(i & s)) {
                float a = x[i], b = x[i + s];
                x[i] = a + b;
                x[i + s] = a - b;
            }
        __syncthreads();
    }
}

__device__ __forceinline__ bool sign_of(const u64* signs, int i) { return (signs[i >> 6] >> (i & 63)) & 1; }

// A cache with a coded part, as its kernels read it (CudaKv's KvDesc):
// keys, key scales, values, value scales (codes, or f16 elements where a
// part is F16), the twins, the rotation's signs per (layer, KV head), the
// TQ4 codebook; for TQ4 keys, the key basis (kvbasis: offset m and weight
// w per (layer, KV head, dimension)), the layer's rotary pairs and the
// dimensions they leave alone, and its offset tables: within[j pt + t]
// the cosine of pair j's angle at t positions into a page, then the
// sines; starts[page np + j] the cosine at a page's start, then the sines.
struct KvDesc {
    u8* k;
    u16* ks;
    u8* v;
    u16* vs;
    u16* tk;
    u16* tv;
    const u64* signs;
    const float* book;
    const float* bm;
    const float* bw;
    const int* bpairs;
    const int* bfixed;
    const float* within;
    const float* starts;
    float rs;
    int kf;
    int vf;
    int np;
    int nfixed;
    int n_pages;
};

// Each row's keys and values of `layer` into its slot, in the cache's
// formats, as the CPU's KvStorage::write stores them: a block per (row,
// KV head, keys or values), thread d holding element d. TQ4 keys are first
// put in the key basis' terms, (k - rope(m, pos)) * w, the offset turned
// by the row's cosines and sines `cs` as the query and key were. A coded
// vector is rotated (signs, Hadamard, times rs = 1 / sqrt(hd),
// tq4::rotate); then Q8 takes the scale max|x| / 127 rounded to f16 and
// each element's round-to-even code of x / scale clamped to +-127; TQ4
// takes each element's nearest level of the unit vector (the count of
// cell bounds below it) and the least-squares scale <x, c> / |c|^2, its
// sums taken in element order. Where the row's page has a twin, the vector
// also goes there as f16, as it came.
extern "C" __global__ void write_kv_coded(const float* k, const float* v, const u32* page, const u32* slot,
                                          const u32* twin, int layer, int layers, int kv_heads, int pt, int hd,
                                          const float* cs, int pairs, KvDesc kv) {
    after_previous();
    SKIPS(8);
    __shared__ float x[256];
    __shared__ int code[256];
    __shared__ float red[8];
    int r = blockIdx.x, h = blockIdx.y, is_v = blockIdx.z, d = threadIdx.x;
    int fmt = is_v ? kv.vf : kv.kf;
    u8* codes = is_v ? kv.v : kv.k;
    u16* scales = is_v ? kv.vs : kv.ks;
    u64 vec = (((u64)page[r] * layers + layer) * kv_heads + h) * pt + slot[r];
    float val = d < hd ? (is_v ? v : k)[((u64)r * kv_heads + h) * hd + d] : 0.0f;
    if (d < hd && twin[r] != NO_TWIN) {
        u64 tvec = (((u64)twin[r] * layers + layer) * kv_heads + h) * pt + slot[r];
        (is_v ? kv.tv : kv.tk)[tvec * hd + d] = f2h(val);
    }
    if (fmt == KV_F16) {
        if (d < hd) ((u16*)codes)[vec * hd + d] = f2h(val);
        return;
    }
    u64 lh = ((u64)layer * kv_heads + h) * hd;
    if (!is_v && kv.bm) {
        // x = rope(m, pos), then (k - x) * w (kvbasis::to_coded).
        if (d < hd) x[d] = kv.bm[lh + d];
        __syncthreads();
        for (int i = d; i < pairs; i += blockDim.x) {
            float c = cs[2 * ((u64)r * pairs + i)], sn = cs[2 * ((u64)r * pairs + i) + 1];
            int a = kv.bpairs[2 * i], b = kv.bpairs[2 * i + 1];
            float x0 = x[a], x1 = x[b];
            x[a] = x0 * c - x1 * sn;
            x[b] = x0 * sn + x1 * c;
        }
        __syncthreads();
        if (d < hd) val = (val - x[d]) * kv.bw[lh + d];
        __syncthreads();
    }
    const u64* sg = kv.signs + ((u64)layer * kv_heads + h) * ((hd + 63) >> 6);
    if (d < hd) x[d] = sign_of(sg, d) ? -val : val;
    __syncthreads();
    hadamard_shared(x, hd);
    if (d < hd) x[d] = x[d] * kv.rs;
    __syncthreads();
    if (fmt == KV_Q8) {
        float a = d < hd ? fabsf(x[d]) : 0.0f;
        a = warp_max(a);
        if ((d & 31) == 0) red[d >> 5] = a;
        __syncthreads();
        float amax = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) amax = fmaxf(amax, red[w]);
        u16 s16 = f2h(amax / 127.0f);
        float sc = h2f(s16);
        bool finite = !(isinf(sc) || isnan(sc));
        if (d < hd) {
            int c = 0;
            if (sc != 0.0f && finite) c = min(127, max(-127, __float2int_rn(x[d] * (1.0f / sc))));
            ((signed char*)codes)[vec * hd + d] = (signed char)c;
        }
        if (d == 0) scales[vec] = finite ? s16 : 0;
        return;
    }
    // TQ4.
    if (d == 0) {
        float sq = 0.0f;
        for (int i = 0; i < hd; i++) sq = sq + x[i] * x[i];
        red[0] = sqrtf(sq);
    }
    __syncthreads();
    float norm = red[0];
    u8* cv = codes + vec * (hd / 2);
    if (norm == 0.0f || isinf(norm) || isnan(norm)) {
        if (d < hd / 2) cv[d] = 0x88;
        if (d == 0) scales[vec] = 0;
        return;
    }
    if (d < hd) {
        float u = x[d] * (1.0f / norm);
        int c = 0;
        for (int j = 0; j < 15; j++) c += (0.5f * (kv.book[j] + kv.book[j + 1])) < u;
        code[d] = c;
    }
    __syncthreads();
    if (d < hd / 2) cv[d] = (u8)(code[2 * d] | (code[2 * d + 1] << 4));
    if (d == 0) {
        float dot = 0.0f, sq = 0.0f;
        for (int i = 0; i < hd; i++) {
            float l = kv.book[code[i]];
            dot = dot + x[i] * l;
            sq = sq + l * l;
        }
        scales[vec] = f2h(sq > 0.0f ? dot / sq : 0.0f);
    }
}

// e^x as snug's CPU kernels compute it (ops::exp_fixed).
__device__ __forceinline__ float exp_fixed(float x) {
    x = fminf(fmaxf(x, -87.0f), 88.0f);
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    const float c[8] = {1.0f, 1.0f, 0.5f, 1.0f / 6.0f, 1.0f / 24.0f, 1.0f / 120.0f, 1.0f / 720.0f, 1.0f / 5040.0f};
    float p = c[7];
    for (int i = 6; i >= 0; i--) p = fmaf(p, r, c[i]);
    return p * __int_as_float(((int)n + 127) << 23);
}

// Attention over f16 pages in the CPU's order (snug_kernels::kv): a block
// of ATT_THREADS per (row, query head). Thread t scores positions start+t,
// start+t+ATT_THREADS, ..., each `q . k` summed with element i in lane
// i % 16 and folded as the CPU's dot_f32, times `scale`; the softmax takes
// exp_fixed(s - max), sums the exponentials with score i into lane i % 16
// (each in order; one warp) and folds them, and multiplies each by the
// sum's reciprocal. The values then go through shared memory a tile of
// positions at a time (every thread's loads in flight together), and
// thread t sums dimensions 2t and 2t+1 (head_dim <= 256) over the
// positions in order with fused multiply-adds.
#define ATT_THREADS 128
#define ATT_TILE_BYTES 16384

__device__ __forceinline__ void att_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;");
#endif
}

// Attention for `per` (at most NR) rows from `ra` on that share a page
// table and a first position, for query head blockIdx.y: each key and
// value is loaded once for all of them, and each row takes the steps above
// over its own positions (its scores in its row of `scores`; warp r % 4
// sums row r's exponentials).
#ifndef ATT_ROWS
#define ATT_ROWS 4
#endif
// 1: the value sums go through positions once for all the rows of a group
// (each value loaded once); 0: row by row.
#ifndef ATT_PVJ
#define ATT_PVJ 0
#endif

template <int NR>
__device__ __forceinline__ void attend_set(const float* q, const u32* table, const u32* row_table,
                                           const u32* row_start, const u32* row_end, int heads, int kv_heads,
                                           int hd, int layer, int layers, int pt, const u16* kc, const u16* vc,
                                           float scale, float* scores, int ctx, float* out, int ra, int per,
                                           float* smem) {
    __shared__ float red[NR][ATT_THREADS / 32];
    __shared__ float inv_s[NR];
    float* qs = smem;                                      // NR * hd
    u16* vt = (u16*)(smem + NR * hd);                // a tile of values
    float* wt = smem + NR * hd + ATT_TILE_BYTES / 4;  // their weights, per row
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int h = blockIdx.y;
    int g = h / (heads / kv_heads);
    for (int i = 0; i < per; i++)
        for (int d = tid; d < hd; d += ATT_THREADS) qs[i * hd + d] = q[((u64)(ra + i) * heads + h) * hd + d];
    __syncthreads();
    const u32* pages = table + row_table[ra];
    int start = row_start[ra];
    int end[NR];
    int maxend = start;
    #pragma unroll
    for (int i = 0; i < NR; i++) {
        end[i] = i < per ? (int)row_end[ra + i] : start;
        maxend = max(maxend, end[i]);
    }
    float m[NR];
    #pragma unroll
    for (int i = 0; i < NR; i++) m[i] = -__int_as_float(0x7f800000);
    for (int p = start + tid; p < maxend; p += ATT_THREADS) {
        u64 base = ((((u64)pages[p / pt] * layers + layer) * kv_heads + g) * pt + (p % pt)) * hd;
        float l16[NR][16];
        #pragma unroll
        for (int i = 0; i < NR; i++)
            #pragma unroll
            for (int e = 0; e < 16; e++) l16[i][e] = 0.0f;
        const uint4* k4 = (const uint4*)(kc + base);
        // The key's loads, KU pieces of 8 dimensions at a time, are in
        // flight together before any is used: a lone row (decode) has the
        // registers for a head of 128 dimensions at once.
        constexpr int KU = NR == 1 ? 16 : 2;
        for (int d0 = 0; d0 < hd; d0 += 8 * KU) {
            uint4 kk[KU];
#pragma unroll
            for (int j = 0; j < KU; j++) kk[j] = d0 + 8 * j < hd ? k4[d0 / 8 + j] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int j = 0; j < KU; j += 2) {
                if (d0 + 8 * j >= hd) break;
                u32 w[8] = {kk[j].x, kk[j].y, kk[j].z, kk[j].w, kk[j + 1].x, kk[j + 1].y, kk[j + 1].z, kk[j + 1].w};
                int b0 = d0 + 8 * j;
#pragma unroll
                for (int e = 0; e < 16; e++) {
                    float kv = h2f((u16)(w[e >> 1] >> (16 * (e & 1))));
#pragma unroll
                    for (int i = 0; i < NR; i++) l16[i][e] = fmaf(qs[i * hd + b0 + e], kv, l16[i][e]);
                }
            }
        }
        #pragma unroll
        for (int i = 0; i < NR; i++) {
            if (i < per && p < end[i]) {
                float f[8];
                #pragma unroll
                for (int e = 0; e < 8; e++) f[e] = l16[i][e] + l16[i][e + 8];
                float s = (((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]))) * scale;
                scores[((u64)(ra + i) * heads + h) * ctx + (p - start)] = s;
                m[i] = fmaxf(m[i], s);
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < NR; i++) {
        float v = warp_max(m[i]);
        if (lane == 0) red[i][warp] = v;
    }
    __syncthreads();
    #pragma unroll
    for (int i = 0; i < NR; i++) {
        if (i >= per) break;
        float mm = red[i][0];
        for (int k = 1; k < ATT_THREADS / 32; k++) mm = fmaxf(mm, red[i][k]);
        float* sc = scores + ((u64)(ra + i) * heads + h) * ctx;
        for (int k = tid; k < end[i] - start; k += ATT_THREADS) sc[k] = exp_fixed(sc[k] - mm);
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < NR; r++) {
        // Warp r % 4 sums row r's exponentials as attend_f16's warp 0 does.
        if (r >= per || warp != r % (ATT_THREADS / 32)) continue;
        const float* sc = scores + ((u64)(ra + r) * heads + h) * ctx;
        int n = end[r] - start;
        float sum = 0.0f;
        for (int i = lane & 15; i < n; i += 16) sum += sc[i];
        sum += __shfl_xor_sync(0xffffffffu, sum, 8);
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        if (lane == 0) inv_s[r] = 1.0f / sum;
    }
    __syncthreads();
    int per_row = hd / 8;  // 16-byte pieces of a value row
    int tile = ATT_TILE_BYTES / (hd * 2);
    bool owner = 2 * tid < hd;
    float acc[NR][2];
    #pragma unroll
    for (int i = 0; i < NR; i++) acc[i][0] = acc[i][1] = 0.0f;
    for (int p0 = start; p0 < maxend; p0 += tile) {
        int np = min(tile, maxend - p0);
        for (int i = tid; i < np * per_row; i += ATT_THREADS) {
            int p = p0 + i / per_row;
            const u16* src = vc + ((((u64)pages[p / pt] * layers + layer) * kv_heads + g) * pt + (p % pt)) * hd +
                             8 * (i % per_row);
            att_copy16(vt + 8 * i, src);
        }
        #pragma unroll
        for (int i = 0; i < NR; i++) {
            if (i >= per) break;
            const float* sc = scores + ((u64)(ra + i) * heads + h) * ctx;
            int ni = min(np, end[i] - p0);
            for (int j = tid; j < ni; j += ATT_THREADS) wt[i * tile + j] = sc[p0 - start + j] * inv_s[i];
        }
        att_wait();
        __syncthreads();
        if (owner) {
            const u32* v2 = (const u32*)vt + tid;
#if ATT_PVJ
            // Positions outer: each value is loaded once for the rows; row
            // i takes the positions before its end, in order.
            int ni[NR], nmax = 0;
            #pragma unroll
            for (int i = 0; i < NR; i++) {
                ni[i] = i < per ? min(np, end[i] - p0) : 0;
                nmax = max(nmax, ni[i]);
            }
            for (int j = 0; j < nmax; j++) {
                u32 two = v2[j * (hd / 2)];
                float v0 = h2f((u16)(two & 0xffffu)), v1 = h2f((u16)(two >> 16));
                #pragma unroll
                for (int i = 0; i < NR; i++) {
                    if (j < ni[i]) {
                        float wgt = wt[i * tile + j];
                        acc[i][0] = fmaf(wgt, v0, acc[i][0]);
                        acc[i][1] = fmaf(wgt, v1, acc[i][1]);
                    }
                }
            }
#else
            #pragma unroll
            for (int i = 0; i < NR; i++) {
                // Row i's positions before its end, in order.
                int ni = i < per ? min(np, end[i] - p0) : 0;
                for (int j = 0; j < ni; j++) {
                    u32 two = v2[j * (hd / 2)];
                    float wgt = wt[i * tile + j];
                    acc[i][0] = fmaf(wgt, h2f((u16)(two & 0xffffu)), acc[i][0]);
                    acc[i][1] = fmaf(wgt, h2f((u16)(two >> 16)), acc[i][1]);
                }
            }
#endif
        }
        __syncthreads();
    }
    if (owner) {
        #pragma unroll
        for (int i = 0; i < NR; i++) {
            if (i < per) {
                float* o = out + ((u64)(ra + i) * heads + h) * hd;
                o[2 * tid] = acc[i][0];
                o[2 * tid + 1] = acc[i][1];
            }
        }
    }
}

// A block per row and query head (decode, verify).
extern "C" __global__ void attend_f16(const float* q, const u32* table, const u32* row_table,
                                      const u32* row_start, const u32* row_end, int heads, int kv_heads,
                                      int hd, int layer, int layers, int pt, const u16* kc, const u16* vc,
                                      float scale, float* scores, int ctx, float* out, int n_rows) {
    after_previous();
    SKIPS(4);
    extern __shared__ float smem[];
    if ((int)blockIdx.x < n_rows)
        attend_set<1>(q, table, row_table, row_start, row_end, heads, kv_heads, hd, layer, layers, pt, kc, vc, scale,
                      scores, ctx, out, blockIdx.x, 1, smem);
}

// In a prefill, a block per group of ATT_ROWS rows and query head: rows of
// one sequence that share a first position (the rows of one prompt, where
// no window starts them apart) go together; other groups a row at a time.
extern "C" __global__ void attend_f16_rows(const float* q, const u32* table, const u32* row_table,
                                           const u32* row_start, const u32* row_end, int heads, int kv_heads,
                                           int hd, int layer, int layers, int pt, const u16* kc, const u16* vc,
                                           float scale, float* scores, int ctx, float* out, int n_rows) {
    after_previous();
    SKIPS(4);
    extern __shared__ float smem[];
    int r0 = blockIdx.x * ATT_ROWS;
    int nr = min(ATT_ROWS, n_rows - r0);
    bool share = true;
    for (int i = 1; i < nr; i++) share = share && row_table[r0 + i] == row_table[r0] && row_start[r0 + i] == row_start[r0];
    int sets = share ? 1 : nr;
    for (int k = 0; k < sets; k++) {
        if (share)
            attend_set<ATT_ROWS>(q, table, row_table, row_start, row_end, heads, kv_heads, hd, layer, layers, pt, kc,
                                 vc, scale, scores, ctx, out, r0, nr, smem);
        else
            attend_set<1>(q, table, row_table, row_start, row_end, heads, kv_heads, hd, layer, layers, pt, kc, vc,
                          scale, scores, ctx, out, r0 + k, 1, smem);
        __syncthreads();
    }
}

// In a prefill, attention for a group of NR rows of one sequence from one
// first position and query head blockIdx.y, with the work spread over the
// block's threads as a product's tiles are (ATT_TILED; the bits of
// attend_set's, row by row):
//
// - Scores: the block's 8 groups of 16 lanes take 4 positions each of a
//   tile of 32 whose keys are staged in shared memory. Lane e of a group
//   keeps lane e's share of the rows' queries (elements e, e + 16, ...)
//   in registers and sums q . k's elements e, e + 16, ... in order into
//   one accumulator per (row, position): the CPU's lane e. The
//   accumulators then go through shared memory so that one thread holds
//   a score's 16 lanes and folds them as attend_set does.
// - Softmax as attend_set.
// - Values: thread t sums dimensions 2t' and 2t' + 1 (t' = t mod hd/2)
//   for a set of the rows, a weight read once for each row and a value
//   once for the set, each (row, dimension) over the positions in order
//   with fused multiply-adds.
//
// ATT_TILED=1 selects it (attend_f16_tiled64, 128, 256). They compile
// without spills (124-128 registers), but their bits have not yet been
// checked against the CPU's on a device, so the default stays 0
// (attend_f16_rows).
#ifndef ATT_TILED
#define ATT_TILED 0
#endif
// Positions of a tile of keys, and of a group of lanes in it.
#define ATT_TP 32
#define ATT_PT 4
template <int NR, int KS>
__device__ __forceinline__ void attend_tiled(const float* q, const u32* table, const u32* row_table,
                                             const u32* row_start, const u32* row_end, int heads, int kv_heads,
                                             int layer, int layers, int pt, const u16* kc, const u16* vc,
                                             float scale, float* scores, int ctx, float* out, int ra, int per,
                                             float* smem) {
    constexpr int HD = 16 * KS;
    constexpr int KST = HD + 8;            // a staged key's halves (rows 16 bytes apart in banks)
    constexpr int NSC = NR * ATT_TP;       // scores of a tile
    constexpr int TBS = NSC + 4;           // a lane's row of accumulators
    constexpr int SPT = NSC / ATT_THREADS;  // scores a thread folds
    constexpr int TILE = ATT_TILE_BYTES / (HD * 2);
    constexpr int SETS = ATT_THREADS / (HD / 2);  // row sets of the value sums
    constexpr int RS = NR / SETS;                 // rows of a set
    static_assert(SPT >= 1 && NSC % ATT_THREADS == 0, "scores per thread");
    static_assert(RS >= 1 && NR % SETS == 0, "rows per value set");
    __shared__ float mx[NR], inv_s[NR];
    u16* kt = (u16*)smem;                              // ATT_TP keys
    float* tb = smem + ATT_TP * KST / 2;               // 16 lanes x TBS
    u16* vt = (u16*)smem;                              // a tile of values (after the scores)
    float* wt = smem + ATT_TILE_BYTES / 4;             // their weights, [position][row]
    int tid = threadIdx.x, grp = tid >> 4, e = tid & 15, lane = tid & 31;
    int h = blockIdx.y;
    int g = h / (heads / kv_heads);
    const u32* pages = table + row_table[ra];
    int start = row_start[ra];
    int end[NR];
    int maxend = start;
#pragma unroll
    for (int i = 0; i < NR; i++) {
        end[i] = i < per ? (int)row_end[ra + i] : start;
        maxend = max(maxend, end[i]);
    }
    float qr[NR][KS];
#pragma unroll
    for (int i = 0; i < NR; i++)
#pragma unroll
        for (int k = 0; k < KS; k++) qr[i][k] = i < per ? q[((u64)(ra + i) * heads + h) * HD + e + 16 * k] : 0.0f;
    // The row and positions whose scores this thread folds.
    int fr = (tid * SPT) / ATT_TP, ft = (tid * SPT) % ATT_TP;
    int fend = fr < per ? (int)row_end[ra + fr] : start;
    float m = -__int_as_float(0x7f800000);
    for (int p0 = start; p0 < maxend; p0 += ATT_TP) {
        for (int i = tid; i < ATT_TP * (HD / 8); i += ATT_THREADS) {
            int t = i / (HD / 8), c = i % (HD / 8), p = p0 + t;
            if (p < maxend) {
                const u16* src =
                    kc + ((((u64)pages[p / pt] * layers + layer) * kv_heads + g) * pt + (p % pt)) * HD + 8 * c;
                att_copy16(kt + t * KST + 8 * c, src);
            }
        }
        att_wait();
        __syncthreads();
        float acc[NR][ATT_PT];
#pragma unroll
        for (int i = 0; i < NR; i++)
#pragma unroll
            for (int j = 0; j < ATT_PT; j++) acc[i][j] = 0.0f;
        const u16* kg = kt + grp * ATT_PT * KST + e;
#pragma unroll
        for (int k = 0; k < KS; k++) {
            float kv[ATT_PT];
#pragma unroll
            for (int j = 0; j < ATT_PT; j++) kv[j] = h2f(kg[j * KST + 16 * k]);
#pragma unroll
            for (int i = 0; i < NR; i++)
#pragma unroll
                for (int j = 0; j < ATT_PT; j++) acc[i][j] = fmaf(qr[i][k], kv[j], acc[i][j]);
        }
#pragma unroll
        for (int i = 0; i < NR; i++)
            *(float4*)(tb + e * TBS + i * ATT_TP + grp * ATT_PT) =
                make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        __syncthreads();
        float l[SPT][16];
#pragma unroll
        for (int k = 0; k < 16; k++) {
            if (SPT == 2) {
                float2 two = *(const float2*)(tb + k * TBS + tid * 2);
                l[0][k] = two.x;
                l[SPT - 1][k] = two.y;
            } else {
#pragma unroll
                for (int s = 0; s < SPT; s++) l[s][k] = tb[k * TBS + tid * SPT + s];
            }
        }
#pragma unroll
        for (int s = 0; s < SPT; s++) {
            int p = p0 + ft + s;
            if (p < fend) {
                float f[8];
#pragma unroll
                for (int k = 0; k < 8; k++) f[k] = l[s][k] + l[s][k + 8];
                float sc = (((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]))) * scale;
                scores[((u64)(ra + fr) * heads + h) * ctx + (p - start)] = sc;
                m = fmaxf(m, sc);
            }
        }
        // The next tile's copies into kt come after this tile's last reads
        // of it (the barrier above), its writes of tb after every thread's
        // folds (the barrier after its copies).
    }
    // Each row's maximum: its ATT_TP / SPT threads are neighbours in a warp.
#pragma unroll
    for (int o = ATT_TP / SPT / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((tid % (ATT_TP / SPT)) == 0) mx[fr] = m;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < NR; i++) {
        if (i >= per) break;
        float mm = mx[i];
        float* sc = scores + ((u64)(ra + i) * heads + h) * ctx;
        for (int k = tid; k < end[i] - start; k += ATT_THREADS) sc[k] = exp_fixed(sc[k] - mm);
    }
    __syncthreads();
    int warp = tid >> 5;
#pragma unroll
    for (int r = 0; r < NR; r++) {
        // Warp r % 4 sums row r's exponentials as attend_f16's warp 0 does.
        if (r >= per || warp != r % (ATT_THREADS / 32)) continue;
        const float* sc = scores + ((u64)(ra + r) * heads + h) * ctx;
        int n = end[r] - start;
        float sum = 0.0f;
        for (int i = lane & 15; i < n; i += 16) sum += sc[i];
        sum += __shfl_xor_sync(0xffffffffu, sum, 8);
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        if (lane == 0) inv_s[r] = 1.0f / sum;
    }
    __syncthreads();
    constexpr int PR = HD / 8;  // 16-byte pieces of a value row
    int dp = tid % (HD / 2), r0 = (tid / (HD / 2)) * RS;
    int vend[RS];
#pragma unroll
    for (int i = 0; i < RS; i++) vend[i] = r0 + i < per ? (int)row_end[ra + r0 + i] : start;
    float acc[RS][2];
#pragma unroll
    for (int i = 0; i < RS; i++) acc[i][0] = acc[i][1] = 0.0f;
    for (int p0 = start; p0 < maxend; p0 += TILE) {
        int np = min(TILE, maxend - p0);
        for (int i = tid; i < np * PR; i += ATT_THREADS) {
            int p = p0 + i / PR;
            const u16* src = vc + ((((u64)pages[p / pt] * layers + layer) * kv_heads + g) * pt + (p % pt)) * HD +
                             8 * (i % PR);
            att_copy16(vt + 8 * i, src);
        }
#pragma unroll
        for (int i = 0; i < NR; i++) {
            if (i >= per) break;
            const float* sc = scores + ((u64)(ra + i) * heads + h) * ctx;
            int ni = min(np, end[i] - p0);
            for (int j = tid; j < ni; j += ATT_THREADS) wt[j * NR + i] = sc[p0 - start + j] * inv_s[i];
        }
        att_wait();
        __syncthreads();
        // Row i of the set takes the positions before its end, in order:
        // all of the set's rows up to the first end, then each its own.
        int ni[RS], lo = np, hi = 0;
#pragma unroll
        for (int i = 0; i < RS; i++) {
            ni[i] = max(0, min(np, vend[i] - p0));
            lo = min(lo, ni[i]);
            hi = max(hi, ni[i]);
        }
        const u32* v2 = (const u32*)vt + dp;
        const float* w = wt + r0;
        int j = 0;
        for (; j < lo; j++) {
            u32 two = v2[j * (HD / 2)];
            float v0 = h2f((u16)(two & 0xffffu)), v1 = h2f((u16)(two >> 16));
            float wr[RS];
            if (RS % 4 == 0) {
#pragma unroll
                for (int i = 0; i < RS; i += 4) {
                    float4 f = *(const float4*)(w + j * NR + i);
                    wr[i] = f.x;
                    wr[(i + 1) % RS] = f.y;
                    wr[(i + 2) % RS] = f.z;
                    wr[(i + 3) % RS] = f.w;
                }
            } else {
#pragma unroll
                for (int i = 0; i < RS; i++) wr[i] = w[j * NR + i];
            }
#pragma unroll
            for (int i = 0; i < RS; i++) {
                acc[i][0] = fmaf(wr[i], v0, acc[i][0]);
                acc[i][1] = fmaf(wr[i], v1, acc[i][1]);
            }
        }
        for (; j < hi; j++) {
            u32 two = v2[j * (HD / 2)];
            float v0 = h2f((u16)(two & 0xffffu)), v1 = h2f((u16)(two >> 16));
#pragma unroll
            for (int i = 0; i < RS; i++) {
                if (j < ni[i]) {
                    float wgt = w[j * NR + i];
                    acc[i][0] = fmaf(wgt, v0, acc[i][0]);
                    acc[i][1] = fmaf(wgt, v1, acc[i][1]);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < RS; i++) {
        if (r0 + i < per) {
            float* o = out + ((u64)(ra + r0 + i) * heads + h) * HD;
            o[2 * dp] = acc[i][0];
            o[2 * dp + 1] = acc[i][1];
        }
    }
}

// attend_f16_rows with attend_tiled<NR, HD / 16> for the groups that
// share (`group` rows, at most NR), one kernel per head width (each with
// only its own registers: 128-132).
template <int NR, int HD>
__device__ __forceinline__ void attend_tiled_rows(const float* q, const u32* table, const u32* row_table,
                                                  const u32* row_start, const u32* row_end, int heads, int kv_heads,
                                                  int layer, int layers, int pt, const u16* kc, const u16* vc,
                                                  float scale, float* scores, int ctx, float* out, int n_rows,
                                                  int group) {
    after_previous();
    SKIPS(4);
    extern __shared__ float smem[];
    int r0 = blockIdx.x * group;
    int nr = min(group, n_rows - r0);
    bool share = nr <= NR;
    for (int i = 1; i < nr; i++) share = share && row_table[r0 + i] == row_table[r0] && row_start[r0 + i] == row_start[r0];
    if (share) {
        attend_tiled<NR, HD / 16>(q, table, row_table, row_start, row_end, heads, kv_heads, layer, layers, pt, kc, vc,
                                  scale, scores, ctx, out, r0, nr, smem);
        return;
    }
    for (int k = 0; k < nr; k++) {
        attend_set<1>(q, table, row_table, row_start, row_end, heads, kv_heads, HD, layer, layers, pt, kc, vc, scale,
                      scores, ctx, out, r0 + k, 1, smem);
        __syncthreads();
    }
}

#define ATTEND_TILED(NAME, NR, HD)                                                                                     \
    extern "C" __global__ void NAME(const float* q, const u32* table, const u32* row_table, const u32* row_start,   \
                                    const u32* row_end, int heads, int kv_heads, int hd, int layer, int layers,     \
                                    int pt, const u16* kc, const u16* vc, float scale, float* scores, int ctx,      \
                                    float* out, int n_rows, int group) {                                            \
        attend_tiled_rows<NR, HD>(q, table, row_table, row_start, row_end, heads, kv_heads, layer, layers, pt, kc, \
                                  vc, scale, scores, ctx, out, n_rows, group);                                      \
    }
ATTEND_TILED(attend_f16_tiled64, 8, 64)
ATTEND_TILED(attend_f16_tiled128, 8, 128)
ATTEND_TILED(attend_f16_tiled256, 4, 256)

// Attention over pages with a coded part (keys and values in F16, Q8 or
// TQ4, TQ4 keys against the key basis), in the CPU's order for such caches
// (snug_kernels::kv::coded), a block of
// ATT_THREADS per (row, query head). The CPU goes through the pages in
// order with a running softmax; here the steps that do not depend on the
// pages before run for every page at once, and the chains that do
// (running maximum, running sum, the value sums) run in the CPU's order:
//
// - Query: where keys are coded, the query (divided by the basis'
//   weights, for TQ4 keys) rotated as keys are (signs, Hadamard, times
//   rs), in the keys' lane order; the exact window's twins and plain keys
//   take it as it is. For TQ4 keys, the offset's terms too (per rotary
//   pair X and Y, and C; kvbasis::Trig::prepare).
// - Scores (thread per position): lane-order element i of q . k into
//   lane i % 16 by fused multiply-adds in order, folded as
//   ((l0+l8)+(l1+l9))+...; times the key's scale (coded keys), plus the
//   key offset's part (TQ4 keys), times `scale`.
// - Page maxima (a warp per page), then the chain through the pages (one
//   warp, which loads 32 pages' maxima at once and takes the steps in
//   order): the running maximum grows to the page's (`>`), and where it
//   grows the factor exp_fixed(old - new) is kept for the page (0: it did
//   not grow).
// - Exponentials exp_fixed(score - running maximum) (a warp per page),
//   summed with the page's position t in lane t % 16 and folded; each
//   becomes its value's weight (times the value's scale where the value is
//   coded). The warp then chains the sums: times the factor where the
//   maximum grew, plus the page's sum.
// - Values (thread per dimension): page by page, the sums times the
//   factor where the maximum grew, then weight times value added by fused
//   multiply-adds in position order (ATT_VB positions' loads in flight
//   together): twins' and plain values into the output, coded ones into a
//   rotated-domain sum, rotated back at the end (Hadamard, times rs,
//   signs) and added to the output; the output times the reciprocal of the
//   sum.
//
// `runs` holds three floats per (row, head, page): maximum, factor, sum.
#ifndef ATT_VB
#define ATT_VB 16
#endif
__device__ __forceinline__ float fold_lanes(const float* l) {
    float f[8];
#pragma unroll
    for (int e = 0; e < 8; e++) f[e] = l[e] + l[e + 8];
    return ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
}

// Lane-order slot of coordinate e of a TQ4 vector of hd (kv::coded's
// Kind::lane): the even coordinates of each 32 are read as one chunk of 16
// lanes (low nibbles), the odd ones as the next (high nibbles).
__device__ __forceinline__ int tq4_lane(int e, int hd) {
    if (hd == 16) return e / 2 + 8 * (e % 2);
    return 32 * (e / 32) + 16 * (e % 2) + (e % 32) / 2;
}

// The weighted values of `n` consecutive vectors from `v0` (of format
// KIND at `base`) added to a thread's two sums (elements e0 and e1), in
// position order, ATT_VB positions at a time: the batch's loads are issued
// before any is used (no branch between them), then each is converted and
// added.
template <int KIND>
__device__ __forceinline__ void value_pages(const u8* base, u64 v0, int n, int hd, int e0, int e1, const float* w,
                                            const float* lv, float* s0, float* s1) {
    float a0 = *s0, a1 = *s1;
    for (int p = 0; p < n; p += ATT_VB) {
        int m = min(ATT_VB, n - p);
        u32 r0[ATT_VB], r1[ATT_VB];
        float wt[ATT_VB];
#pragma unroll
        for (int i = 0; i < ATT_VB; i++) {
            u64 vec = v0 + p + min(i, m - 1);
            wt[i] = w[p + min(i, m - 1)];
            if (KIND == KV_F16) {
                r0[i] = ((const u16*)base)[vec * hd + e0];
                r1[i] = ((const u16*)base)[vec * hd + e1];
            } else if (KIND == KV_Q8) {
                r0[i] = base[vec * hd + e0];
                r1[i] = base[vec * hd + e1];
            } else {
                r0[i] = base[vec * (hd / 2) + (e0 >> 1)];
                r1[i] = base[vec * (hd / 2) + (e1 >> 1)];
            }
        }
#pragma unroll
        for (int i = 0; i < ATT_VB; i++) {
            float x0, x1;
            if (KIND == KV_F16) {
                x0 = h2f((u16)r0[i]);
                x1 = h2f((u16)r1[i]);
            } else if (KIND == KV_Q8) {
                x0 = (float)(signed char)r0[i];
                x1 = (float)(signed char)r1[i];
            } else {
                x0 = lv[(e0 & 1) ? (r0[i] >> 4) : (r0[i] & 15)];
                x1 = lv[(e1 & 1) ? (r1[i] >> 4) : (r1[i] & 15)];
            }
            if (i < m) {
                a0 = fmaf(wt[i], x0, a0);
                a1 = fmaf(wt[i], x1, a1);
            }
        }
    }
    *s0 = a0;
    *s1 = a1;
}

extern "C" __global__ void attend_coded(const float* q, const u32* table, const u32* twins, const u32* row_table,
                                        const u32* row_start, const u32* row_end, int heads, int kv_heads, int hd,
                                        int layer, int layers, int pt, KvDesc kv, float scale, float* scores,
                                        float* runs, int ctx, int max_pages, float* out, int n_rows) {
    after_previous();
    SKIPS(4);
    __shared__ float qs[256], qr[256], rot[256], lv[16], xy[256], inv_s, c0;
    int r = blockIdx.x;
    if (r >= n_rows) return;
    int h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int nwarps = blockDim.x >> 5;
    int g = h / (heads / kv_heads);
    int kf = kv.kf, vf = kv.vf;
    const u32* pages = table + row_table[r];
    const u32* tw = twins + row_table[r];
    int start = row_start[r], end = row_end[r];
    int own = (end - 1) / pt, p0 = start / pt, np = own - p0 + 1;
    const u64* sg = kv.signs + ((u64)layer * kv_heads + g) * ((hd + 63) >> 6);
    u64 lh = ((u64)layer * kv_heads + g) * hd;
    bool basis = kf == KV_TQ4 && kv.bm;
    for (int d = tid; d < hd; d += blockDim.x) {
        float x = q[((u64)r * heads + h) * hd + d];
        qs[d] = x;
        // Coded keys: the query divided by the basis' weights (TQ4 keys),
        // then rotated.
        float y = basis ? x / kv.bw[lh + d] : x;
        rot[d] = sign_of(sg, d) ? -y : y;
    }
    if (tid < 16) lv[tid] = kv.book[tid];
    if (basis) {
        // The offset's terms (kvbasis::Trig::prepare): per pair j, X and
        // Y; and C, the unrotated dimensions' part, summed in order.
        const float* m = kv.bm + lh;
        for (int j = tid; j < kv.np; j += blockDim.x) {
            int a = kv.bpairs[2 * j], b = kv.bpairs[2 * j + 1];
            float qa = q[((u64)r * heads + h) * hd + a], qb = q[((u64)r * heads + h) * hd + b];
            xy[j] = qa * m[a] + qb * m[b];
            xy[kv.np + j] = qb * m[a] - qa * m[b];
        }
        if (tid == 0) {
            float c = -0.0f;
            for (int i = 0; i < kv.nfixed; i++) {
                int d = kv.bfixed[i];
                c = c + q[((u64)r * heads + h) * hd + d] * m[d];
            }
            c0 = c;
        }
    }
    __syncthreads();
    if (kf != KV_F16) {
        hadamard_shared(rot, hd);
        for (int d = tid; d < hd; d += blockDim.x) {
            float y = rot[d] * kv.rs;
            qr[kf == KV_TQ4 ? tq4_lane(d, hd) : d] = y;
        }
        __syncthreads();
    }
    float* sc = scores + ((u64)r * heads + h) * ctx;
    float* run = runs + ((u64)r * heads + h) * max_pages * 3;
    // The twin page `idx` of the sequence is read from, or NO_TWIN.
#define TWIN_OF(idx) (((idx) == 0 || (idx) == own) ? tw[idx] : NO_TWIN)
#define VEC(pg, p) ((((u64)(pg) * layers + layer) * kv_heads + g) * pt + ((p) % pt))
    for (int p = start + tid; p < end; p += blockDim.x) {
        int idx = p / pt;
        u32 t = TWIN_OF(idx);
        float l16[16];
#pragma unroll
        for (int e = 0; e < 16; e++) l16[e] = 0.0f;
        float s;
        if (t != NO_TWIN || kf == KV_F16) {
            const u16* kp = t != NO_TWIN ? kv.tk + VEC(t, p) * hd : (const u16*)kv.k + VEC(pages[idx], p) * hd;
            const uint4* k4 = (const uint4*)kp;
            for (int d0 = 0; d0 < hd; d0 += 16) {
                uint4 a = k4[d0 / 8], b = k4[d0 / 8 + 1];
                u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int e = 0; e < 16; e++)
                    l16[e] = fmaf(qs[d0 + e], h2f((u16)(w[e >> 1] >> (16 * (e & 1)))), l16[e]);
            }
            s = fold_lanes(l16) * scale;
        } else if (kf == KV_Q8) {
            u64 vec = VEC(pages[idx], p);
            const uint4* k4 = (const uint4*)(kv.k + vec * hd);
            for (int d0 = 0; d0 < hd; d0 += 16) {
                uint4 a = k4[d0 / 16];
                u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
                for (int e = 0; e < 16; e++)
                    l16[e] = fmaf(qr[d0 + e], (float)(signed char)(w[e >> 2] >> (8 * (e & 3))), l16[e]);
            }
            s = fold_lanes(l16) * h2f(kv.ks[vec]);
        } else {
            // TQ4: lane i of chunk 2c takes byte 16c + i's low nibble, of
            // chunk 2c + 1 its high nibble (a vector of 16: bytes 0..7, low
            // nibbles in lanes 0..7, high in 8..15).
            u64 vec = VEC(pages[idx], p);
            const u8* kb = kv.k + vec * (hd / 2);
            if (hd == 16) {
                uint2 a = *(const uint2*)kb;
                u32 w[2] = {a.x, a.y};
#pragma unroll
                for (int e = 0; e < 16; e++) {
                    u32 byte = (w[(e & 7) >> 2] >> (8 * (e & 3))) & 0xff;
                    l16[e] = fmaf(qr[e], lv[e < 8 ? (byte & 15) : (byte >> 4)], l16[e]);
                }
            } else {
                for (int c2 = 0; c2 < hd / 32; c2++) {
                    uint4 a = ((const uint4*)kb)[c2];
                    u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
                    for (int e = 0; e < 16; e++)
                        l16[e] = fmaf(qr[32 * c2 + e], lv[(w[e >> 2] >> (8 * (e & 3))) & 15], l16[e]);
#pragma unroll
                    for (int e = 0; e < 16; e++)
                        l16[e] = fmaf(qr[32 * c2 + 16 + e], lv[(w[e >> 2] >> (8 * (e & 3) + 4)) & 15], l16[e]);
                }
            }
            s = fold_lanes(l16) * h2f(kv.ks[vec]);
            if (basis) {
                // The offset's part at t = p % pt into page idx: the pairs'
                // (X, Y) turned to the page's start (kvbasis::Trig::shift),
                // times the cosines and sines of t, each summed over the
                // pairs in order; plus C.
                int t = p % pt, n = kv.np;
                const float* sc_ = kv.starts + (u64)idx * n;
                const float* ss_ = kv.starts + (u64)kv.n_pages * n + (u64)idx * n;
                const float* wc = kv.within;
                const float* wsn = kv.within + (u64)n * pt;
                float ax = 0.0f, ay = 0.0f;
                for (int j = 0; j < n; j++) {
                    float x = xy[j], y = xy[n + j], c = sc_[j], sn = ss_[j];
                    float xs = x * c + y * sn, ys = y * c - x * sn;
                    ax = fmaf(xs, wc[j * pt + t], ax);
                    ay = fmaf(ys, wsn[j * pt + t], ay);
                }
                s = s + ((ax + ay) + c0);
            }
        }
        if (t == NO_TWIN && kf != KV_F16) s = s * scale;
        sc[p - start] = s;
    }
    __syncthreads();
    for (int k = warp; k < np; k += nwarps) {
        int idx = p0 + k;
        int a = max(start, idx * pt), b = min(end, (idx + 1) * pt);
        float m = -__int_as_float(0x7f800000);
        for (int p = a + lane; p < b; p += 32) m = fmaxf(m, sc[p - start]);
        m = warp_max(m);
        if (lane == 0) run[3 * k] = m;
    }
    __syncthreads();
    if (warp == 0) {
        // The chain, 32 pages at a time: each lane loads one page's
        // maximum, every lane follows the chain through the 32 (the same
        // steps), and lane j keeps page j's.
        float was = -__int_as_float(0x7f800000);
        for (int base = 0; base < np; base += 32) {
            int k = base + lane;
            float pm = k < np ? run[3 * k] : 0.0f;
            float mine = 0.0f, factor = 0.0f;
            for (int j = 0; j < 32 && base + j < np; j++) {
                float pj = __shfl_sync(0xffffffffu, pm, j);
                float grown = pj > was ? pj : was;
                float f = grown > was ? exp_fixed(was - grown) : 0.0f;
                if (lane == j) {
                    mine = grown;
                    factor = f;
                }
                was = grown;
            }
            if (k < np) {
                run[3 * k] = mine;
                run[3 * k + 1] = factor;
            }
        }
    }
    __syncthreads();
    for (int k = warp; k < np; k += nwarps) {
        int idx = p0 + k;
        int a = max(start, idx * pt), b = min(end, (idx + 1) * pt);
        float gm = run[3 * k];
        bool scaled = vf != KV_F16 && TWIN_OF(idx) == NO_TWIN;
        u64 v0 = VEC(pages[idx], 0);
        float acc = 0.0f;
        for (int p = a; p < b; p += 32) {
            int pp = p + lane;
            float e = 0.0f;
            if (pp < b) {
                e = exp_fixed(sc[pp - start] - gm);
                sc[pp - start] = scaled ? e * h2f(kv.vs[v0 + (pp % pt)]) : e;
            }
            float other = __shfl_down_sync(0xffffffffu, e, 16);
            if (pp < b) acc = acc + e;
            if (pp + 16 < b) acc = acc + other;
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 8);
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        acc += __shfl_xor_sync(0xffffffffu, acc, 4);
        if (lane == 0) run[3 * k + 2] = acc;
    }
    __syncthreads();
    if (warp == 0) {
        float sum = 0.0f;
        for (int base = 0; base < np; base += 32) {
            int k = base + lane;
            float fk = k < np ? run[3 * k + 1] : 0.0f, sk = k < np ? run[3 * k + 2] : 0.0f;
            for (int j = 0; j < 32 && base + j < np; j++) {
                float f = __shfl_sync(0xffffffffu, fk, j), ps = __shfl_sync(0xffffffffu, sk, j);
                if (f != 0.0f) sum = sum * f;
                sum = sum + ps;
            }
        }
        if (lane == 0) inv_s = 1.0f / sum;
    }
    // Dimensions tid and tid + blockDim.x (head_dim <= 256).
    int d1 = tid + blockDim.x;
    bool on0 = tid < hd, on1 = d1 < hd;
    float o0 = 0.0f, o1 = 0.0f, a0 = 0.0f, a1 = 0.0f;
    // Each page's factor is loaded while the page before is worked on.
    float f_next = run[1];
    for (int k = 0; k < np; k++) {
        int idx = p0 + k;
        int a = max(start, idx * pt), b = min(end, (idx + 1) * pt);
        float f = f_next;
        if (k + 1 < np) f_next = run[3 * (k + 1) + 1];
        if (f != 0.0f) {
            o0 = o0 * f;
            o1 = o1 * f;
            a0 = a0 * f;
            a1 = a1 * f;
        }
        // The page's values, ATT_VB positions at a time: their loads in
        // flight together, then added in position order.
        u32 t = TWIN_OF(idx);
        const u8* vbase = t != NO_TWIN ? (const u8*)kv.tv : kv.v;
        int kind = t != NO_TWIN ? KV_F16 : vf;
        u64 v0 = t != NO_TWIN ? VEC(t, a) : VEC(pages[idx], a);
        // Each dimension's index, within the vector (loads of a thread
        // without a dimension read its neighbour's and are not added).
        int e0 = min(tid, hd - 1), e1 = min(d1, hd - 1);
        const float* wp = sc + (a - start);
        if (kind == KV_F16)
            value_pages<KV_F16>(vbase, v0, b - a, hd, e0, e1, wp, lv, &o0, &o1);
        else if (kind == KV_Q8)
            value_pages<KV_Q8>(vbase, v0, b - a, hd, e0, e1, wp, lv, &a0, &a1);
        else
            value_pages<KV_TQ4>(vbase, v0, b - a, hd, e0, e1, wp, lv, &a0, &a1);
    }
#undef TWIN_OF
#undef VEC
    if (vf != KV_F16) {
        if (on0) rot[tid] = a0;
        if (on1) rot[d1] = a1;
        __syncthreads();
        hadamard_shared(rot, hd);
        if (on0) o0 = o0 + (sign_of(sg, tid) ? -(rot[tid] * kv.rs) : rot[tid] * kv.rs);
        if (on1) o1 = o1 + (sign_of(sg, d1) ? -(rot[d1] * kv.rs) : rot[d1] * kv.rs);
    }
    __syncthreads();
    float* o = out + ((u64)r * heads + h) * hd;
    if (on0) o[tid] = o0 * inv_s;
    if (on1) o[d1] = o1 * inv_s;
}

__device__ __forceinline__ float silu1(float x) { return x / (1.0f + exp_fixed(-x)); }

__device__ __forceinline__ float gelu1(float x) {
    float y = 0.7978846f * x * (1.0f + 0.044715f * x * x);
    return x / (1.0f + exp_fixed(-2.0f * y));
}

extern "C" __global__ void gated(float* gate, const float* up, u64 len, int gelu) {
    after_previous();
    SKIPS(16);
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) gate[i] = (gelu ? gelu1(gate[i]) : silu1(gate[i])) * up[i];
}

// gated, then the values quantized in format `fmt` into `q8`: q8_0 and
// q8_1 a warp per block of 32 (`blocks` in all, 8 warps a block), q8_K a
// block of 256 threads per 256 values.
extern "C" __global__ void gated_q8(float* gate, const float* up, u64 blocks, int gelu, int fmt, Q8* q8) {
    after_previous();
    SKIPS(16);
    if (fmt == FMT_Q8_K) {
        __shared__ float v[256];
        u64 i = (u64)blockIdx.x * 256 + threadIdx.x;
        float g = (gelu ? gelu1(gate[i]) : silu1(gate[i])) * up[i];
        gate[i] = g;
        v[threadIdx.x] = g;
        q8k_super(v, q8 + (u64)blockIdx.x * 8);
        return;
    }
    u64 blk = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= blocks) return;
    u64 i = blk * 32 + (threadIdx.x & 31);
    float g = (gelu ? gelu1(gate[i]) : silu1(gate[i])) * up[i];
    gate[i] = g;
    q8_block(g, fmt, q8 + blk);
}

// to[m] = from[which[m]], rows of `width`.
extern "C" __global__ void gather(const float* from, float* to, const u32* which, int width) {
    after_previous();
    int m = blockIdx.x;
    const float* s = from + (u64)which[m] * width;
    float* d = to + (u64)m * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
}
