// Fused MoE kernels over Q4_K experts for decode and verify passes (a few tokens), f32 activations
// (no activation quantization: the same function as dequantizing to f32, up to summation order).
// Included by decode.cu.
//
// Q4_K (ggml `block_q4_K`, 144 bytes per 256 weights): f16 d, f16 dmin, 12 bytes of 6-bit
// sub-block scales and mins, 128 bytes of 4-bit quants. Sub-block s (32 weights) of a super-block
// holds weights 64(s/2) + 32(s%2) + l, l < 32: the low (s even) or high (s odd) nibble of
// qs[32(s/2) + l], weighted d·scale_s, offset by dmin·min_s (ggml-quants.c
// `dequantize_row_q4_K`, `get_scale_min_k4`).
//
//  moe_gate_up_q4k  a[t, j, :] = silu(gate_e · x_t) * (up_e · x_t), e = ids[t, j]
//  moe_down_q4k     out[t, :] = residual[t, :] + sum_j w[t, j] * (down_{ids[t, j]} · a[t, j, :])
//  mv_q4k_r{R}      y_m[t, :] = W_m · x_t, m < 3 (dense decode products: R rows per warp)
//
// The MoE kernels take an expert's weights either as row e of an [E, rows, cols] tensor
// (`indirect` 0) or, with `indirect` 1, from a table of E device addresses passed in the
// tensor's place (the GPU expert tier's mapped experts: each address a VRAM cache slot or the
// expert's bytes in page-locked host memory, which the kernel then reads over the bus).

#include <cuda_fp16.h>

#define Q4K_BYTES 144

// Expert e's weights: row e of a tensor `stride` bytes per expert, or table entry e (indirect).
__device__ __forceinline__ const uint8_t* expert_weights(const uint8_t* w, int indirect, uint32_t e,
                                                         size_t stride) {
    return indirect ? (const uint8_t*)((const unsigned long long*)w)[e] : w + (size_t)e * stride;
}

__device__ __forceinline__ void q4k_scale_min(const uint8_t* sc, int j, float& s, float& m) {
    if (j < 4) {
        s = (float)(sc[j] & 63);
        m = (float)(sc[j + 4] & 63);
    } else {
        s = (float)((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4));
        m = (float)((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
    }
}

// A lane's 32 inputs of a super-block and their sums: lane slot j (0..7) takes chunk c = j / 2
// of 64 weights at positions 16·(j % 2) .. + 15 of its low half (sub-block 2c: lo, sum sl) and
// of its high half (sub-block 2c + 1: hi, sum sh). Loaded once and used for every weight row
// that multiplies the same x (rows per warp, gate and up): x is read from L1 once per row group.
struct Q4kX {
    float4 lo[4], hi[4];
    float sl, sh;
};

__device__ __forceinline__ Q4kX q4k_x_lane(const float* __restrict__ xb, int j) {
    const int c = j >> 1, l0 = (j & 1) * 16;
    const float4* xl = (const float4*)(xb + 64 * c + l0);
    const float4* xh = (const float4*)(xb + 64 * c + 32 + l0);
    Q4kX x;
    x.sl = 0.f;
    x.sh = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x.lo[i] = xl[i];
        x.hi[i] = xh[i];
        x.sl += (x.lo[i].x + x.lo[i].y) + (x.lo[i].z + x.lo[i].w);
        x.sh += (x.hi[i].x + x.hi[i].y) + (x.hi[i].z + x.hi[i].w);
    }
    return x;
}

// One lane's part of a Q4_K super-block's weights (lane slot j, as q4k_x_lane): one 16-byte
// load of quants — bytes 16j .. 16j + 15 hold the slot's low nibbles (sub-block 2c) and high
// nibbles (2c + 1) — and one 16-byte load of the header: d, dmin and the 12 bytes of 6-bit scales
// and mins, from which the slot's two sub-blocks' are taken in registers (the bit layout of
// `get_scale_min_k4`, q4k_scale_min above: sub-block b < 4 takes the low 6 bits of scales[b] and
// scales[b + 4]; b >= 4 takes 4 bits of scales[b + 4] and the top 2 of scales[b - 4] / scales[b]).
// Loaded once and used for every input that multiplies the same row (tokens per warp). Before,
// the scales were up to six one-byte loads (and branches) per lane and super-block.
struct Q4kW {
    uint32_t q[4];
    float d, dmin, s0, m0, s1, m1;
};

__device__ __forceinline__ Q4kW q4k_w_lane(const uint8_t* __restrict__ blk, int j) {
    const int c = j >> 1, l0 = (j & 1) * 16;
    const uint4 q = __ldg((const uint4*)(blk + 16 + 32 * c + l0));
    const uint4 h = __ldg((const uint4*)blk);  // d | dmin << 16, scales[0..3], [4..7], [8..11]
    __half_raw dr, mr;
    dr.x = (unsigned short)(h.x & 0xFFFF);
    mr.x = (unsigned short)(h.x >> 16);
    Q4kW w;
    w.q[0] = q.x;
    w.q[1] = q.y;
    w.q[2] = q.z;
    w.q[3] = q.w;
    w.d = __half2float(__half(dr));
    w.dmin = __half2float(__half(mr));
    // Sub-blocks 2c and 2c + 1: bytes 2(c % 2) and 2(c % 2) + 1 of each scale word. (The same
    // layout per sub-block is moe_tc.cuh's q4k_head_scale_min; two calls of it here compile to
    // ~10% more PTX in these kernels, its shifts and branch per sub-block, not measured on a
    // device — so the pair is taken inline.)
    const int sh = 16 * (c & 1);
    const uint32_t a = h.y >> sh, b = h.z >> sh, e = h.w >> sh;
    uint32_t s0, m0, s1, m1;
    if (c < 2) {
        s0 = a & 63;
        s1 = (a >> 8) & 63;
        m0 = b & 63;
        m1 = (b >> 8) & 63;
    } else {
        s0 = (e & 0xF) | (((a >> 6) & 3) << 4);
        s1 = ((e >> 8) & 0xF) | (((a >> 14) & 3) << 4);
        m0 = ((e >> 4) & 0xF) | (((b >> 6) & 3) << 4);
        m1 = ((e >> 12) & 0xF) | (((b >> 14) & 3) << 4);
    }
    w.s0 = (float)s0;
    w.m0 = (float)m0;
    w.s1 = (float)s1;
    w.m1 = (float)m1;
    return w;
}

// A lane's share of a super-block's dot product: weights w (q4k_w_lane) times inputs x
// (q4k_x_lane, same slot). ggml's weight d·scale·q − dmin·min is applied as
// d·scale·Σ q·x − dmin·min·Σ x over the slot's 16 positions (the same sum, regrouped). The same
// operations in the same order wherever it is called, so a row's result does not depend on how
// many rows or tokens a warp takes.
__device__ __forceinline__ float q4k_dot(const Q4kW& w, const Q4kX& x) {
    float dl = 0.f, dh = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float4 a = x.lo[i], b = x.hi[i];
        const uint32_t v = w.q[i];
        dl = fmaf((float)(v & 0xF), a.x, dl);
        dl = fmaf((float)((v >> 8) & 0xF), a.y, dl);
        dl = fmaf((float)((v >> 16) & 0xF), a.z, dl);
        dl = fmaf((float)((v >> 24) & 0xF), a.w, dl);
        dh = fmaf((float)((v >> 4) & 0xF), b.x, dh);
        dh = fmaf((float)((v >> 12) & 0xF), b.y, dh);
        dh = fmaf((float)((v >> 20) & 0xF), b.z, dh);
        dh = fmaf((float)(v >> 28), b.w, dh);
    }
    return __fsub_rn(__fmul_rn(w.d, __fadd_rn(__fmul_rn(w.s0, dl), __fmul_rn(w.s1, dh))),
                     __fmul_rn(w.dmin, __fadd_rn(__fmul_rn(w.m0, x.sl), __fmul_rn(w.m1, x.sh))));
}

// The inputs of the kernels below, f32 (this file) or rounded to 8 bits (Q8In, mv_q8.cuh): row
// `t` of an [rows, cols] input; load(t, sb, j) gives lane slot j's part of super-block sb and
// dot() its product with a lane's weights (q4k_w_lane).
struct F32In {
    const float* __restrict__ x;
    int cols;
    __device__ __forceinline__ Q4kX load(size_t t, int sb, int j) const {
        return q4k_x_lane(x + t * cols + sb * 256, j);
    }
    static __device__ __forceinline__ float dot(const Q4kW& w, const Q4kX& x) { return q4k_dot(w, x); }
};

// Which grid dimension walks the pairs (tokens, for down): pairs_first puts them on x, so the
// blocks of every pair (token) for the same weight rows are launched next to each other and the
// pairs routed to one expert read its rows from L2 (a batched step's 128 pairs fall on ~73
// experts); otherwise the rows are on x (one pair's whole expert streamed at a time: decode
// steps). The arithmetic is the same either way.
__device__ __forceinline__ void moe_block(int pairs_first, int& rows_block, int& pair) {
    rows_block = pairs_first ? blockIdx.y : blockIdx.x;
    pair = pairs_first ? blockIdx.x : blockIdx.y;
}

// x [n, H] (In, cols H); gate, up [E, I, H] Q4_K; ids [n, k]; a [n, k, I]. grid (ceil(I / 4R),
// n * k), or (n * k, ceil(I / 4R)) with pairs_first, 128 threads: warp w computes rows
// R·(4·b + w) .. + R − 1 of the expert's gate and up (one load of x for all of them) for the
// block's row group b and pair. A row's sums are the same operations in the same order whatever
// R (more rows per warp: more independent weight loads in flight per warp, fewer blocks).
template <int R, class In>
__device__ void moe_gate_up(const In in, const uint8_t* __restrict__ gate,
                            const uint8_t* __restrict__ up, const uint32_t* __restrict__ ids,
                            float* __restrict__ a, int H, int I, int k, int indirect,
                            int pairs_first) {
    int b, tj;
    moe_block(pairs_first, b, tj);
    const int lane = threadIdx.x % WARP, r0 = (b * 4 + threadIdx.x / WARP) * R, t = tj / k;
    if (r0 >= I) return;
    const int nb = H / 256;
    const size_t stride = (size_t)I * nb * Q4K_BYTES, row = (size_t)nb * Q4K_BYTES;
    const uint8_t* ge = expert_weights(gate, indirect, ids[tj], stride) + r0 * row;
    const uint8_t* ue = expert_weights(up, indirect, ids[tj], stride) + r0 * row;
    if (!indirect) {  // the warp's rows (VRAM experts; mapped ones would cross the bus twice)
        const uint32_t bytes = (uint32_t)(min(R, I - r0) * row);
        l2_prefetch(ge, bytes, lane, WARP);
        l2_prefetch(ue, bytes, lane, WARP);
    }
    float g[R], u[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        g[i] = 0.f;
        u[i] = 0.f;
    }
#pragma unroll 2
    for (int sb = lane >> 3; sb < nb; sb += 4) {
        const size_t o = (size_t)sb * Q4K_BYTES;
        const auto xs = in.load(t, sb, lane & 7);
#pragma unroll
        for (int i = 0; i < R; i++) {
            if (r0 + i < I) {  // warp-uniform
                g[i] += In::dot(q4k_w_lane(ge + i * row + o, lane & 7), xs);
                u[i] += In::dot(q4k_w_lane(ue + i * row + o, lane & 7), xs);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < R; i++) {
        if (r0 + i < I) {
            const float gs = warp_sum(g[i]), us = warp_sum(u[i]);
            if (lane == 0) a[(size_t)tj * I + r0 + i] = gs / (1.f + expf(-gs)) * us;
        }
    }
}

// a [n, k, I] (In: rows n·k, cols I); down [E, H, I] Q4_K; ids, w [n, k]; residual (nullable)
// and out [n, H]. grid (ceil(H / 4), n), or (n, ceil(H / 4)) with pairs_first, 128 threads: warp
// w computes output h = 4·b + w of the block's token, its lanes spread over the k experts'
// super-blocks (k · I / 256 of them, 4 per step).
template <class In>
__device__ void moe_down(const In in, const uint8_t* __restrict__ down,
                         const uint32_t* __restrict__ ids, const float* __restrict__ w,
                         const float* __restrict__ residual, float* __restrict__ out, int H, int I,
                         int k, int indirect, int pairs_first) {
    int b, t;
    moe_block(pairs_first, b, t);
    const int lane = threadIdx.x % WARP, h = b * 4 + threadIdx.x / WARP;
    if (h >= H) return;
    const int nb = I / 256;
    const size_t stride = (size_t)H * nb * Q4K_BYTES;
    float acc = 0.f;
    // Not unrolled: with the 16-byte header loads, two items in flight per lane took 64-80
    // registers and 55-60 µs against 49.4 µs at 53 (ncu, 16-token step of the synthetic 30B).
    // Item j·nb + sb (expert slot j, super-block sb) steps by 4: q slots and r super-blocks, then
    // a carry — no integer division per step (ncu on the 16-token step: SM throughput 73%, 0.77
    // warps issued per scheduler and cycle — bound by instructions more than by memory; 49.5 →
    // 47.5 µs, 53 → 48 registers).
    const int q = 4 / nb, r = 4 - q * nb;
    int j = (lane >> 3) / nb, sb = (lane >> 3) - j * nb;
    const uint32_t* idt = ids + (size_t)t * k;
    const float* wt = w + (size_t)t * k;
    const size_t row_off = (size_t)h * nb * Q4K_BYTES;
#pragma unroll 1
    while (j < k) {
        const uint8_t* de = expert_weights(down, indirect, idt[j], stride);
        const auto as = in.load((size_t)t * k + j, sb, lane & 7);
        acc += wt[j] * In::dot(q4k_w_lane(de + row_off + (size_t)sb * Q4K_BYTES, lane & 7), as);
        sb += r;
        j += q;
        if (sb >= nb) {
            sb -= nb;
            j++;
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) out[(size_t)t * H + h] = (residual ? residual[(size_t)t * H + h] : 0.f) + acc;
}

extern "C" __global__ void moe_gate_up_q4k(const float* x, const uint8_t* gate, const uint8_t* up,
                                           const uint32_t* ids, float* a, int H, int I, int k,
                                           int indirect, int pairs_first) {
    PDL_ENTER();
    moe_gate_up<1>(F32In{x, H}, gate, up, ids, a, H, I, k, indirect, pairs_first);
}

extern "C" __global__ void moe_down_q4k(const float* a, const uint8_t* down, const uint32_t* ids,
                                        const float* w, const float* residual, float* out, int H,
                                        int I, int k, int indirect, int pairs_first) {
    PDL_ENTER();
    moe_down(F32In{a, I}, down, ids, w, residual, out, H, I, k, indirect, pairs_first);
}

// Dense Q4_K mat-vecs, up to three matrices in one launch (a layer's q, k and v projections):
// x [n, cols] (In); w0, w1, w2 [r0|r1|r2, cols] Q4_K (r1 = r2 = 0 for fewer); y_m [n, r_m] =
// x · w_mᵀ. The three matrices' rows are taken end to end; warp w of block b takes R consecutive
// rows from R·(4b + w) and T consecutive tokens from T·blockIdx.y, loading each super-block's
// weights once for its T tokens and each token's inputs once for its R rows. A row's sum for a
// token is the same operations in the same order whatever R, T and the warp's other rows and
// tokens (tested bit for bit), so a short pass's rows equal one-token decode steps.
// grid (ceil((r0 + r1 + r2) / (4R)), ceil(n / T)), 128 threads.
// A warp's R weight rows among up to three matrices taken end to end (mat-vec kernels): row i's
// weights (row_bytes apart in its matrix), its output column and the output's row stride, and
// whether it exists (the same for every lane of the warp).
template <int R>
struct WarpRows {
    const uint8_t* row[R];
    float* out[R];
    int stride[R];
    bool live[R];

    __device__ __forceinline__ WarpRows(int first, size_t row_bytes, const uint8_t* w0,
                                        const uint8_t* w1, const uint8_t* w2, float* y0, float* y1,
                                        float* y2, int r0, int r1, int r2) {
#pragma unroll
        for (int i = 0; i < R; i++) {
            int r = first + i, rows = r0;
            const uint8_t* w = w0;
            float* y = y0;
            if (r >= r0) {
                r -= r0;
                w = w1;
                y = y1;
                rows = r1;
                if (r >= r1) {
                    r -= r1;
                    w = w2;
                    y = y2;
                    rows = r2;
                }
            }
            live[i] = r < rows;
            row[i] = live[i] ? w + (size_t)r * row_bytes : w0;
            out[i] = live[i] ? y + r : y0;
            stride[i] = rows;
        }
    }

    // The warp's sums acc[i][u] (one partial per lane) for tokens t0.. (the first `tokens`)
    // reduced and written by lane 0.
    template <int T>
    __device__ __forceinline__ void store(float (&acc)[R][T], int t0, int tokens, int lane) const {
#pragma unroll
        for (int u = 0; u < T; u++) {
            if (u < tokens) {
#pragma unroll
                for (int i = 0; i < R; i++) {
                    const float v = warp_sum(acc[i][u]);
                    if (lane == 0 && live[i]) out[i][(size_t)(t0 + u) * stride[i]] = v;
                }
            }
        }
    }
};

// The frame of the mat-vec kernels: the warp's rows (row_bytes apart), its tokens t0.. (the
// first `tokens` of T), sums zeroed, `sweep(row, live, t0, tokens, lane, acc)` adding each lane's
// share, then the reduction and store.
template <int R, int T, class Sweep>
__device__ __forceinline__ void mv_frame(size_t row_bytes, const uint8_t* w0, const uint8_t* w1,
                                         const uint8_t* w2, float* y0, float* y1, float* y2,
                                         int r0, int r1, int r2, int n, Sweep sweep) {
    const int lane = threadIdx.x % WARP, t0 = blockIdx.y * T;
    const int first = (blockIdx.x * 4 + threadIdx.x / WARP) * R;
    const WarpRows<R> wr(first, row_bytes, w0, w1, w2, y0, y1, y2, r0, r1, r2);
#pragma unroll
    for (int i = 0; i < R; i++)  // the rows, before the wait (constant weights)
        if (wr.live[i]) l2_prefetch(wr.row[i], (uint32_t)row_bytes, lane, WARP);
    PDL_WAIT();
    if (!wr.live[0]) return;
    const int tokens = min(T, n - t0);
    float acc[R][T];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int u = 0; u < T; u++) acc[i][u] = 0.f;
    sweep(wr.row, wr.live, t0, tokens, lane, acc);
    wr.store(acc, t0, tokens, lane);
}

template <int R, int T, class In>
__device__ void mv_q4k_rows(const In in, const uint8_t* __restrict__ w0,
                            const uint8_t* __restrict__ w1, const uint8_t* __restrict__ w2,
                            float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2,
                            int r0, int r1, int r2, int cols, int n) {
    const int nb = cols / 256;
    auto sweep = [&](const uint8_t* const* row, const bool* live, int t0, int tokens, int lane,
                     float (&acc)[R][T]) {
#pragma unroll 2
        for (int sb = lane >> 3; sb < nb; sb += 4) {
            Q4kW ws[R];
#pragma unroll
            for (int i = 0; i < R; i++)
                if (live[i]) ws[i] = q4k_w_lane(row[i] + (size_t)sb * Q4K_BYTES, lane & 7);
            // Guards, not `break`: fully unrolled, acc stays in registers (warp-uniform branches).
#pragma unroll
            for (int u = 0; u < T; u++) {
                if (u < tokens) {
                    const auto xs = in.load(t0 + u, sb, lane & 7);
#pragma unroll
                    for (int i = 0; i < R; i++)
                        if (live[i]) acc[i][u] += In::dot(ws[i], xs);
                }
            }
        }
    };
    mv_frame<R, T>((size_t)nb * Q4K_BYTES, w0, w1, w2, y0, y1, y2, r0, r1, r2, n, sweep);
}

#define MV_Q4K_KERNEL(R, T, NAME)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                         \
        const float* x, const uint8_t* w0, const uint8_t* w1, const uint8_t* w2, float* y0,       \
        float* y1, float* y2, int r0, int r1, int r2, int cols, int n) {                           \
        PDL_LAUNCH();                                                                             \
        mv_q4k_rows<R, T>(F32In{x, cols}, w0, w1, w2, y0, y1, y2, r0, r1, r2, cols, n);             \
    }
// Rows per warp (mv_rows in src/cuda.rs picks one by the launch's row count); one token per warp
// for decode steps, four for short passes (verify, a few prompt tokens).
MV_Q4K_KERNEL(1, 1, mv_q4k_r1)
MV_Q4K_KERNEL(2, 1, mv_q4k_r2)
MV_Q4K_KERNEL(4, 1, mv_q4k_r4)
MV_Q4K_KERNEL(1, 4, mv_q4k_r1t4)
MV_Q4K_KERNEL(2, 4, mv_q4k_r2t4)
MV_Q4K_KERNEL(4, 4, mv_q4k_r4t4)

// ---------------------------------------------------------------------------------------------
// Grouped by expert, for batched passes (many tokens, experts shared between them): block
// (x, y) takes rows 4x..4x+3 (a warp each) of the y-th distinct expert of `ids` (ascending expert
// id; blocks past the last distinct expert return at once). Each warp dequantizes its row once
// into registers (lane l: weight l of every 32-weight sub-block, ggml's dequantize_row_q4_K
// values d·scale·q − dmin·min) and then takes every (token, slot) pair routed to that expert:
// the row is read and dequantized once per pass, not once per pair.
//
//  moe_rows_q4k_grouped_nb{NB}  out[p, r] = W_e[r, :] · src[s(p), :] over rows of NB super-blocks
//                               (256·NB values), s(p) = p / k (per_token: x rows) or p (a rows).
// Used as gate, up (then silu_mul), down (then moe_combine) by strata_kernels::cuda::moe_q4k_grouped,
// and with ids null for dense Q4_K products of a few rows (strata_kernels::cuda::matmul_q4k).
#define GROUPED_MAX_E 1024

// The y-th distinct expert id of ids[0..pairs) (ids >= E ignored), or -1; every thread of the
// block gets the answer. bits: shared, GROUPED_MAX_E / 32 words. ids null: every pair is
// expert 0's (a dense matrix).
__device__ int nth_expert(const uint32_t* __restrict__ ids, int pairs, int E, int y, uint32_t* bits,
                          int* sel) {
    if (!ids) return y == 0 ? 0 : -1;
    const int words = (E + 31) / 32;
    for (int i = threadIdx.x; i < words; i += blockDim.x) bits[i] = 0u;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const uint32_t e = ids[p];
        if (e < (uint32_t)E) atomicOr(&bits[e / 32], 1u << (e % 32));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int left = y, found = -1;
        for (int w = 0; w < words && found < 0; w++) {
            uint32_t b = bits[w];
            const int c = __popc(b);
            if (left >= c) {
                left -= c;
                continue;
            }
            for (; left > 0; left--) b &= b - 1;  // drop the lowest set bits
            found = w * 32 + __ffs(b) - 1;
        }
        *sel = found;
    }
    __syncthreads();
    return *sel;
}

// src [*, 256·NB]; w [E, rows, 256·NB] Q4_K; ids [pairs] (= [n, k]), or null for a dense
// matrix (E = 1, every pair expert 0's: out = src · wᵀ); out [pairs, rows].
// grid (ceil(rows / 4), min(pairs, E)), 128 threads.
template <int NB>
__device__ void moe_rows_q4k_grouped(const float* __restrict__ src, const uint8_t* __restrict__ w,
                                     const uint32_t* __restrict__ ids, float* __restrict__ out,
                                     int rows, int k, int per_token, int pairs, int E) {
    __shared__ uint32_t bits[GROUPED_MAX_E / 32];
    __shared__ int sel;
    const int e = nth_expert(ids, pairs, E, blockIdx.y, bits, &sel);
    const int lane = threadIdx.x % WARP, r = blockIdx.x * 4 + threadIdx.x / WARP;
    if (e < 0 || r >= rows) return;
    const uint8_t* row = w + ((size_t)e * rows + r) * NB * Q4K_BYTES;
    float wv[NB][8];
#pragma unroll
    for (int b = 0; b < NB; b++) {
        const uint8_t* blk = row + (size_t)b * Q4K_BYTES;
        const float d = __half2float(*(const __half*)blk);
        const float dmin = __half2float(*(const __half*)(blk + 2));
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const uint8_t q = blk[16 + 32 * c + lane];
            float s0, m0, s1, m1;
            q4k_scale_min(blk + 4, 2 * c, s0, m0);
            q4k_scale_min(blk + 4, 2 * c + 1, s1, m1);
            wv[b][2 * c] = d * s0 * (float)(q & 0xF) - dmin * m0;
            wv[b][2 * c + 1] = d * s1 * (float)(q >> 4) - dmin * m1;
        }
    }
    for (int c0 = 0; c0 < pairs; c0 += WARP) {
        const int p = c0 + lane;
        unsigned m = __ballot_sync(0xffffffffu, p < pairs && (!ids || ids[p] == (uint32_t)e));
        while (m) {
            const int q = c0 + __ffs(m) - 1;
            m &= m - 1;
            const float* xs = src + (size_t)(per_token ? q / k : q) * (NB * 256);
            float acc = 0.f;
#pragma unroll
            for (int b = 0; b < NB; b++) {
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    acc = fmaf(wv[b][2 * c], xs[b * 256 + 64 * c + lane], acc);
                    acc = fmaf(wv[b][2 * c + 1], xs[b * 256 + 64 * c + 32 + lane], acc);
                }
            }
            acc = warp_sum(acc);
            if (lane == 0) out[(size_t)q * rows + r] = acc;
        }
    }
}

#define MOE_ROWS_KERNEL(NB)                                                                          \
    extern "C" __global__ void __launch_bounds__(128) moe_rows_q4k_grouped_nb##NB(                 \
        const float* src, const uint8_t* w, const uint32_t* ids, float* out, int rows, int k,       \
        int per_token, int pairs, int E) {                                                          \
        PDL_ENTER();                                                                              \
        moe_rows_q4k_grouped<NB>(src, w, ids, out, rows, k, per_token, pairs, E);                   \
    }
// Row lengths 256 · NB: 256 … 4096 (NB_SUPPORTED in src/cuda.rs).
MOE_ROWS_KERNEL(1)
MOE_ROWS_KERNEL(2)
MOE_ROWS_KERNEL(3)
MOE_ROWS_KERNEL(4)
MOE_ROWS_KERNEL(6)
MOE_ROWS_KERNEL(8)
MOE_ROWS_KERNEL(12)
MOE_ROWS_KERNEL(16)
