// Dense Q4_K mat-vecs over activations rounded to 8 bits (decode steps and short verify passes),
// the arithmetic of llama.cpp's MMVQ (ggml-cuda vecdotq.cuh, `vec_dot_q4_K_q8_1`): x is quantized
// per 32 values (q = round(x / d), d = max|x| / 127) and each lane's 16 weights × 16 inputs are
// integer dot products (`__dp4a`), scaled once. An input element costs one byte of L1 traffic
// instead of four (the f32 kernels of moe_q4k.cuh are bound by those reads, ncu). Included by
// decode.cu after moe_q4k.cuh.
//
//  quantize_q8   q[t, :] (int8), d[t, :/32] (f32) from x[t, :]
//  mv_q4k_q8_r{R}[t4]  y_m[t, :] = W_m · x_t over q8 x (as mv_q4k_r{R}[t4])
//  moe_gate_up_q4k_q8, moe_down_q4k_q8  moe_gate_up_q4k / moe_down_q4k over q8 x and q8 a
//  mv_q4_1_q8_r{R}[t4], mv_q8_0_q8_r{R}[t4]  the same mat-vecs over Q4_1 / Q8_0 weights (llama.cpp's
//                   vec_dot_q4_1_q8_1 / vec_dot_q8_0_q8_1 arithmetic: dense layers of llama-family
//                   models such as SmolLM2)

// x [rows, K] f32 → q [rows, K] int8, d [rows, K / 32] f32; one warp per 32 values (a block of
// 32 consecutive values of one row). grid ceil(rows·K / 128), 128 threads. The division is IEEE
// (__fdiv_rn) and the rounding to nearest even (rintf), so a host emulation gives the same q.
extern "C" __global__ void quantize_q8(const float* __restrict__ x, int8_t* __restrict__ q,
                                       float* __restrict__ d, int total) {
    PDL_ENTER();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    q8_round_warp(i < total ? x[i] : 0.f, i, i < total, q, d);
}

// A lane's 32 quantized inputs of a super-block (slot j as q4k_x_lane): 16 of sub-block 2c
// (positions 16·(j % 2) ..) and the same 16 of sub-block 2c + 1, their scales and integer sums.
struct Q8X {
    int lo[4], hi[4];
    float dlo, dhi;
    int sl, sh;
};

__device__ __forceinline__ Q8X q8_x_lane(const int8_t* __restrict__ qb, const float* __restrict__ db,
                                         int j) {
    const int c = j >> 1, l0 = (j & 1) * 16;
    const int4 lo = *(const int4*)(qb + 64 * c + l0);
    const int4 hi = *(const int4*)(qb + 64 * c + 32 + l0);
    Q8X x;
    x.lo[0] = lo.x; x.lo[1] = lo.y; x.lo[2] = lo.z; x.lo[3] = lo.w;
    x.hi[0] = hi.x; x.hi[1] = hi.y; x.hi[2] = hi.z; x.hi[3] = hi.w;
    x.dlo = db[2 * c];
    x.dhi = db[2 * c + 1];
    x.sl = 0;
    x.sh = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x.sl = __dp4a(x.lo[i], 0x01010101, x.sl);
        x.sh = __dp4a(x.hi[i], 0x01010101, x.sh);
    }
    return x;
}

// A lane's share of a super-block's dot product over q8 inputs: d·(s0·dlo·Σq·x + s1·dhi·Σq·x)
// − dmin·(m0·dlo·Σx + m1·dhi·Σx), the integer sums exact. Fixed operation order (the _rn
// intrinsics are never contracted), so a row's result does not depend on the launch's shape.
__device__ __forceinline__ float q4k_dot_q8(const Q4kW& w, const Q8X& x) {
    int dl = 0, dh = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        dl = __dp4a((int)(w.q[i] & 0x0F0F0F0Fu), x.lo[i], dl);
        dh = __dp4a((int)((w.q[i] >> 4) & 0x0F0F0F0Fu), x.hi[i], dh);
    }
    const float lo = __fmul_rn(x.dlo, (float)dl), hi = __fmul_rn(x.dhi, (float)dh);
    const float slo = __fmul_rn(x.dlo, (float)x.sl), shi = __fmul_rn(x.dhi, (float)x.sh);
    return __fsub_rn(__fmul_rn(w.d, __fadd_rn(__fmul_rn(w.s0, lo), __fmul_rn(w.s1, hi))),
                     __fmul_rn(w.dmin, __fadd_rn(__fmul_rn(w.m0, slo), __fmul_rn(w.m1, shi))));
}

// q8 inputs for the kernels of moe_q4k.cuh: q [rows, cols] int8, d [rows, cols / 32].
struct Q8In {
    const int8_t* __restrict__ q;
    const float* __restrict__ d;
    int cols;
    __device__ __forceinline__ Q8X load(size_t t, int sb, int j) const {
        return q8_x_lane(q + t * cols + sb * 256, d + t * (cols / 32) + sb * 8, j);
    }
    static __device__ __forceinline__ float dot(const Q4kW& w, const Q8X& x) { return q4k_dot_q8(w, x); }
};

#define MV_Q4K_Q8_KERNEL(R, T, NAME)                                                                \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                         \
        const int8_t* q, const float* d, const uint8_t* w0, const uint8_t* w1, const uint8_t* w2,  \
        float* y0, float* y1, float* y2, int r0, int r1, int r2, int cols, int n) {                \
        PDL_LAUNCH();                                                                             \
        mv_q4k_rows<R, T>(Q8In{q, d, cols}, w0, w1, w2, y0, y1, y2, r0, r1, r2, cols, n);           \
    }
MV_Q4K_Q8_KERNEL(1, 1, mv_q4k_q8_r1)
MV_Q4K_Q8_KERNEL(2, 1, mv_q4k_q8_r2)
MV_Q4K_Q8_KERNEL(4, 1, mv_q4k_q8_r4)
MV_Q4K_Q8_KERNEL(1, 4, mv_q4k_q8_r1t4)
MV_Q4K_Q8_KERNEL(2, 4, mv_q4k_q8_r2t4)
MV_Q4K_Q8_KERNEL(4, 4, mv_q4k_q8_r4t4)

// moe_gate_up_q4k over q8 inputs xq [n, H], xd [n, H / 32]; same output, R rows per warp
// (grid over ceil(I / 4R) row groups), built for at least MINB resident blocks per SM. `_r4`:
// batched steps of 12+ tokens (src/cuda.rs moe_gate_up_rows_per_warp; ncu on a 16-token step of
// the synthetic 30B, H200: 72.9 µs against 78.4 with one row per warp, 89.9 with two; with the
// header's 16-byte loads (q4k_w_lane) 120.5 µs at the 118 registers ptxas then took, 87.1 at 6
// blocks per SM, 70.5 at 8 — 64 registers, no spills).
#define MOE_GATE_UP_Q8(R, MINB, NAME)                                                            \
    extern "C" __global__ void __launch_bounds__(128, MINB)                                      \
        NAME(const int8_t* xq, const float* xd, const uint8_t* gate, const uint8_t* up,         \
             const uint32_t* ids, float* a, int H, int I, int k, int indirect, int pairs_first) { \
        PDL_ENTER();                                                                            \
        moe_gate_up<R>(Q8In{xq, xd, H}, gate, up, ids, a, H, I, k, indirect, pairs_first);       \
    }
MOE_GATE_UP_Q8(1, 1, moe_gate_up_q4k_q8)
MOE_GATE_UP_Q8(4, 8, moe_gate_up_q4k_q8_r4)

// moe_down_q4k over q8 activations aq [n, k, I], ad [n, k, I / 32]; same grid and output (one
// output per warp: two or four measured slower on the same 16-token step, 51.2 and 56.9 µs
// against 49.5).
extern "C" __global__ void __launch_bounds__(128, 1)
    moe_down_q4k_q8(const int8_t* aq, const float* ad, const uint8_t* down, const uint32_t* ids,
                    const float* w, const float* residual, float* out, int H, int I, int k,
                    int indirect, int pairs_first) {
    PDL_ENTER();
    moe_down(Q8In{aq, ad, I}, down, ids, w, residual, out, H, I, k, indirect, pairs_first);
}

// ---------------------------------------------------------------------------------------------
// Weights in 32-value blocks (Q4_1: f16 d, f16 m, 16 bytes of nibbles — value i low nibble of
// byte i, value 16 + i its high nibble; Q8_0: f16 d, 32 int8) over q8 inputs (one scale per 32
// values, the same blocks). Four lanes share a block, lane j (0..3) taking 8 of its values; a
// warp walks 8 blocks per step. A lane's part of a block is ggml's integer dot product scaled
// once, in a fixed order of IEEE operations (no contraction), so a row's result for a token is
// the same bits whatever R, T and the launch's other rows and tokens (tested).
struct Q41 {
    static constexpr int BYTES = 20;
    // Byte j·4.. of the nibbles: values 4j..4j+3 (low) and 16+4j.. (high).
    static __device__ __forceinline__ void x_lane(const int8_t* __restrict__ xb, int j, int& lo,
                                                  int& hi) {
        lo = *(const int*)(xb + 4 * j);
        hi = *(const int*)(xb + 16 + 4 * j);
    }
    static __device__ __forceinline__ float dot(const uint8_t* __restrict__ blk, int j, int lo,
                                                int hi, float xd) {
        const __half2 dm = *(const __half2*)blk;
        const int v = *(const int*)(blk + 4 + 4 * j);
        int s = __dp4a(v & 0x0F0F0F0F, lo, 0);
        s = __dp4a((v >> 4) & 0x0F0F0F0F, hi, s);
        const int sx = __dp4a(hi, 0x01010101, __dp4a(lo, 0x01010101, 0));
        const float d = __low2float(dm), m = __high2float(dm);
        return __fadd_rn(__fmul_rn(__fmul_rn(d, xd), (float)s), __fmul_rn(__fmul_rn(m, xd), (float)sx));
    }
};

struct Q80 {
    static constexpr int BYTES = 34;
    // Values 8j..8j+7.
    static __device__ __forceinline__ void x_lane(const int8_t* __restrict__ xb, int j, int& lo,
                                                  int& hi) {
        const int2 v = *(const int2*)(xb + 8 * j);
        lo = v.x;
        hi = v.y;
    }
    static __device__ __forceinline__ float dot(const uint8_t* __restrict__ blk, int j, int lo,
                                                int hi, float xd) {
        // The quants start 2 bytes into a 34-byte block: 16-bit loads (ggml's get_int_b2).
        const uint16_t* q = (const uint16_t*)(blk + 2 + 8 * j);
        const int w0 = (int)(q[0] | ((uint32_t)q[1] << 16));
        const int w1 = (int)(q[2] | ((uint32_t)q[3] << 16));
        const int s = __dp4a(w1, hi, __dp4a(w0, lo, 0));
        const float d = __half2float(*(const __half*)blk);
        return __fmul_rn(__fmul_rn(d, xd), (float)s);
    }
};

// y_m[t, r] = W_m[r, :] · x_t for up to three matrices (rows r0, r1, r2 of `cols` values, cols a
// multiple of 32) over q8 inputs q [n, cols], d [n, cols / 32]; a warp per R rows and T tokens.
// grid (ceil((r0 + r1 + r2) / (4R)), ceil(n / T)), 128 threads.
template <class W, int R, int T>
__device__ void mv_b32_rows(const int8_t* __restrict__ q, const float* __restrict__ d,
                            const uint8_t* __restrict__ w0, const uint8_t* __restrict__ w1,
                            const uint8_t* __restrict__ w2, float* __restrict__ y0,
                            float* __restrict__ y1, float* __restrict__ y2, int r0, int r1, int r2,
                            int cols, int n) {
    const int nb = cols / 32;
    auto sweep = [&](const uint8_t* const* row, const bool* live, int t0, int tokens, int lane,
                     float (&acc)[R][T]) {
        const int j = lane & 3;
        for (int b = lane >> 2; b < nb; b += WARP / 4) {
#pragma unroll
            for (int u = 0; u < T; u++) {
                if (u < tokens) {
                    int lo, hi;
                    const size_t t = (size_t)(t0 + u);
                    W::x_lane(q + t * cols + (size_t)b * 32, j, lo, hi);
                    const float xd = __ldg(d + t * nb + b);  // read-only path, as before the lambda
#pragma unroll
                    for (int i = 0; i < R; i++)
                        if (live[i])
                            acc[i][u] += W::dot(row[i] + (size_t)b * W::BYTES, j, lo, hi, xd);
                }
            }
        }
    };
    mv_frame<R, T>((size_t)nb * W::BYTES, w0, w1, w2, y0, y1, y2, r0, r1, r2, n, sweep);
}

#define MV_B32_KERNEL(W, R, T, NAME)                                                                \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                         \
        const int8_t* q, const float* d, const uint8_t* w0, const uint8_t* w1, const uint8_t* w2,  \
        float* y0, float* y1, float* y2, int r0, int r1, int r2, int cols, int n) {                \
        PDL_LAUNCH();                                                                             \
        mv_b32_rows<W, R, T>(q, d, w0, w1, w2, y0, y1, y2, r0, r1, r2, cols, n);                  \
    }
// The six launch shapes of one format (rows per warp 1, 2, 4; tokens per warp 1, 4).
#define MV_B32_KERNELS(W, PREFIX)                 \
    MV_B32_KERNEL(W, 1, 1, PREFIX##_r1)           \
    MV_B32_KERNEL(W, 2, 1, PREFIX##_r2)           \
    MV_B32_KERNEL(W, 4, 1, PREFIX##_r4)           \
    MV_B32_KERNEL(W, 1, 4, PREFIX##_r1t4)         \
    MV_B32_KERNEL(W, 2, 4, PREFIX##_r2t4)         \
    MV_B32_KERNEL(W, 4, 4, PREFIX##_r4t4)
MV_B32_KERNELS(Q41, mv_q4_1_q8)
MV_B32_KERNELS(Q80, mv_q8_0_q8)
