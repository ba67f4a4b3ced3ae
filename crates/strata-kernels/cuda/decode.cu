// Strata's own CUDA kernels for the GPU decode step (issue 24), compiled to PTX by build.rs with
// nvcc when the `cuda` feature is on, loaded through candle's CUDA device (src/cuda.rs).
// Each kernel has a CPU reference it is tested against on the device (crates/strata-models/tests/
// cuda_kernels.rs): Router::select, candle's rope / rope_i, the KV cache's attention.
//
//  moe_route_topk   router logits -> softmax|sigmoid -> top-k (ties to the lower id) -> weights
//                   renormalised -> optional --moe-top-k cut; ids and weights stay on the device.
//  silu_mul         SwiGLU's silu(gate) * up in one pass.
//  moe_combine      sum_j w[t,j] * y[t,j,:] over the top-k expert outputs.
//  rope_kv_append   [per-head q/k RMSNorm +] RoPE (NeoX or interleaved pairs, rotary dims <= head dim) on q and k, k and v
//                   written into the KV cache at their positions, q returned rotated.
//  attn_decode      attention of a few query rows over the KV cache (split-K online softmax,
//                   FlashDecoding: Dao et al. 2023), row i over positions [0, pos + i].
//                   Both also for an f16 KV cache (`_f16` names): values rounded to nearest on
//                   the write, arithmetic in f32.
//  attn_combine     merges the split-K partial results.
//  causal_softmax   softmax(scale · scores) under the causal mask, in place (prompt passes).
//  add_rms_norm     residual add + RMSNorm in one pass.
//  mv_f32           f32 mat-vec (router logits of a decode step).
//  moe_gate_up_q4k, moe_down_q4k (moe_q4k.cuh): the MoE block over Q4_K experts for a few tokens;
//                   moe_rows_q4k_grouped_nb*: batches grouped by expert (a row dequantized once).
//  moe_tc_sort, q4k_mm_tc (moe_tc.cuh): prompt passes' Q4_K products on tensor cores, MoE pairs
//                   grouped by expert on the device.
//  q4k_mm3_q8, moe_mmq_q8 (moe_mma.cuh): batched / verify passes' dense and MoE products on int8
//                   tensor cores over q8 inputs, MoE pairs grouped by expert (each selected
//                   expert read once per pass).
//  attn_prefill_f16_hd*, attn_decode_tc_f16_hd* (attn_tc.cuh): attention over an f16 KV cache
//                   on tensor cores (FlashAttention-2) — prompt passes, and decode / verify /
//                   batched passes split over positions (merged by attn_combine).
//  gdn_conv, gdn_delta, gdn_gated_norm (gdn.cuh): Gated DeltaNet layers of hybrid models — the
//                   causal conv with its window, the delta rule over the recurrent state, the
//                   gated RMSNorm (CPU reference: strata-models' gated_delta_net.rs).

#include <stdint.h>
#include <math_constants.h>
#include <cuda_fp16.h>

#define WARP 32

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The 8-bit rounding of 32 consecutive values held one per lane of a full warp (lane l holds
// element i = 32·b + l): q[i] = round_half_even(v / s), d[b] = s = max|v| / 127 (IEEE
// division; q = 0 where s = 0) — llama.cpp's `quantize_q8_1` without the sums. Every kernel
// that rounds activations (quantize_q8 and the norms / attention outputs that write their q8
// form as they go) calls this one function, so all give the same bytes. All 32 lanes must call
// it together; `valid` false only pads (writes nothing).
__device__ __forceinline__ void q8_round_warp(float v, size_t i, bool valid, int8_t* __restrict__ q,
                                              float* __restrict__ d) {
    const float amax = warp_max(valid ? fabsf(v) : 0.f);
    const float s = __fdiv_rn(amax, 127.f);
    if (valid) {
        q[i] = (int8_t)(s == 0.f ? 0 : (int)rintf(__fdiv_rn(v, s)));
        if ((i & 31) == 0) d[i >> 5] = s;
    }
}

// Programmatic dependent launch (Hopper; CUDA programming guide, "Programmatic Dependent Launch
// and Synchronization"): every kernel here starts with PDL_ENTER. `launch_dependents` lets the
// next kernel on the stream be scheduled once every block of this one has started (its blocks
// then wait in PDL_ENTER instead of behind this grid's drain and launch latency); `wait` blocks
// until the previous grid has completed and its writes are visible. Nothing is read from or
// written to global memory before the wait but L2 prefetches of constant weights (the mat-vecs
// split PDL_ENTER into PDL_LAUNCH, l2_prefetch, PDL_WAIT), and every thread executes it (so a
// grid's completion implies its predecessors'). Without the launch attribute (src/cuda.rs,
// `STRATA_GPU_PDL=0`) all are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTER()                                                 \
    do {                                                            \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
        asm volatile("griddepcontrol.wait;" ::: "memory");          \
    } while (0)
#define PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define PDL_ENTER() \
    do {            \
    } while (0)
#define PDL_LAUNCH() \
    do {             \
    } while (0)
#define PDL_WAIT() \
    do {           \
    } while (0)
#endif

// Weights fetched into L2 ahead of their loads (`prefetch.global.L2` of each 128-byte line, PTX ISA
// "prefetch"): a mat-vec's constant weights before its PDL wait — fetched while the previous
// kernel still runs — and a MoE gate/up warp's expert rows once the routing is known. A prefetch
// changes no value. Build with -DSTRATA_L2_PREFETCH=0 for kernels without them (measurements:
// docs/performance.md, "Weights into L2 ahead of their loads").
#ifndef STRATA_L2_PREFETCH
#define STRATA_L2_PREFETCH 1
#endif

// [p, p + bytes) into L2 (bytes > 0), its lines spread over `lanes` threads (this one `lane`).
__device__ __forceinline__ void l2_prefetch(const uint8_t* p, uint32_t bytes, int lane, int lanes) {
    if (!STRATA_L2_PREFETCH) return;
    // One more than the lines `bytes` spans from a 128-byte boundary: p need not be on one.
    const uint32_t lines = (bytes + 127) / 128 + 1;
    for (uint32_t l = lane; l < lines; l += lanes)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + min(l * 128, bytes - 1)));
}

// ---------------------------------------------------------------------------------------------
// Routing. One block (ROUTE_THREADS threads, of which one warp works: no block barriers) per
// token; scores in dynamic shared memory [E].
// logits [n, E] f32; ids [n, keep] u32; weights [n, keep] f32; ids_all / w_all (nullable): the
// same values also written at [n, keep] offset `all_off` (the pass's routing record).
// scoring: 0 softmax, 1 sigmoid. norm: renormalise the top-k weights to sum 1. keep <= k: keep the
// keep best, rescaled to the top-k's total weight (Router::weigh). chosen (nullable) [n, k]: each
// row's k experts (distinct) already chosen — a synthetic model's routing process, run on the host
// — so only they compete: the result is Router::weigh of them (scores still over all E experts).
#define ROUTE_THREADS 128
#define ROUTE_MAX_K 32

extern "C" __global__ void moe_route_topk(const float* __restrict__ logits, uint32_t* __restrict__ ids,
                                          float* __restrict__ weights, uint32_t* __restrict__ ids_all,
                                          float* __restrict__ w_all, int all_off,
                                          const uint32_t* __restrict__ chosen, int E, int k,
                                          int keep, int scoring, int norm) {
    PDL_ENTER();
    extern __shared__ float sc[];  // [E] scores, then removed ones as -1
    __shared__ float top_w[ROUTE_MAX_K];
    __shared__ int top_i[ROUTE_MAX_K];
    // One warp does everything (no block barriers): lane l owns experts l, l + 32, ...
    if (threadIdx.x >= WARP) return;
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* l = logits + (size_t)t * E;
    if (scoring == 0) {
        float m = -CUDART_INF_F;
        for (int e = lane; e < E; e += WARP) m = fmaxf(m, l[e]);
        m = warp_max(m);
        float s = 0.f;
        for (int e = lane; e < E; e += WARP) {
            float x = expf(l[e] - m);
            sc[e] = x;
            s += x;
        }
        s = warp_sum(s);
        for (int e = lane; e < E; e += WARP) sc[e] = sc[e] / s;
    } else {
        for (int e = lane; e < E; e += WARP) sc[e] = 1.f / (1.f + expf(-l[e]));
    }
    if (chosen) {
        // Experts the row did not choose leave the selection (each lane its own, as below).
        const uint32_t* c = chosen + (size_t)t * k;
        for (int e = lane; e < E; e += WARP) {
            bool in = false;
            for (int j = 0; j < k; j++) in |= c[j] == (uint32_t)e;
            if (!in) sc[e] = -1.f;
        }
    }
    for (int j = 0; j < k; j++) {
        // arg max over the scores left: highest score, then the lower id.
        float bv = -2.f;
        int bi = 0x7fffffff;
        for (int e = lane; e < E; e += WARP) {
            float v = sc[e];
            if (v > bv || (v == bv && e < bi)) { bv = v; bi = e; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        // Every lane holds the winner; its owner removes it (only the owner reads that score).
        if (lane == 0) { top_w[j] = bv; top_i[j] = bi; }
        if (bi % WARP == lane) sc[bi] = -1.f;
    }
    __syncwarp();
    if (lane == 0) {
        // Router::weigh, in its order of operations.
        if (norm) {
            float s = 0.f;
            for (int j = 0; j < k; j++) s += top_w[j];
            for (int j = 0; j < k; j++) top_w[j] /= s;
        }
        if (keep < k) {
            float mass = 0.f, kept = 0.f;
            for (int j = 0; j < k; j++) mass += top_w[j];
            for (int j = 0; j < keep; j++) kept += top_w[j];
            for (int j = 0; j < keep; j++) top_w[j] *= mass / kept;
        }
        for (int j = 0; j < keep; j++) {
            ids[(size_t)t * keep + j] = (uint32_t)top_i[j];
            weights[(size_t)t * keep + j] = top_w[j];
            if (ids_all) {
                ids_all[(size_t)all_off + (size_t)t * keep + j] = (uint32_t)top_i[j];
                w_all[(size_t)all_off + (size_t)t * keep + j] = top_w[j];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// silu(g) * u, elementwise over n values (transformers' SiLU: x * sigmoid(x)). oq [n] int8,
// od [n / 32] (nullable; n and the rows' width multiples of 32 when given): out's q8 rounding
// (q8_round_warp) for the down projection's mat-vec, written in the same pass. blockDim.x a
// multiple of 32, so each warp holds 32 consecutive values of one row, or none.
extern "C" __global__ void silu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                    float* __restrict__ out, int8_t* __restrict__ oq,
                                    float* __restrict__ od, int n) {
    PDL_ENTER();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = 0.f;
    if (i < n) {
        const float x = g[i];
        v = x / (1.f + expf(-x)) * u[i];
        out[i] = v;
    }
    // n % 32 == 0 here: a warp is wholly inside or wholly past the end.
    if (oq && i - i % WARP < n) q8_round_warp(v, i, true, oq, od);
}

// out[t, h] = sum_j w[t, j] * y[t, j, h]; y [n, k, H], w [n, k], out [n, H]. grid (ceil(H/256), n).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                                       float* __restrict__ out, int k, int H) {
    PDL_ENTER();
    int h = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (h >= H) return;
    float acc = 0.f;
    for (int j = 0; j < k; j++) acc += w[t * k + j] * y[((size_t)t * k + j) * H + h];
    out[(size_t)t * H + h] = acc;
}

// ids[t] = the index of the largest value of x[t, :] (x [n, V] f32, ids [n] u32): the first on ties,
// values that are NaN never chosen unless x[t, 0] is NaN (then 0) — exactly the host's greedy
// pick (strata_engine::sampling::argmax, a scan keeping the first strictly greater value), so a
// token picked here equals the one the host would pick from the same logits. grid n, 1024 threads
// (ARGMAX_THREADS); a thread scans a strided share in increasing index, then a tree reduction in
// which an equal value keeps the smaller index.
#define ARGMAX_THREADS 1024
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_rows(const float* __restrict__ x, uint32_t* __restrict__ ids, int V) {
    PDL_ENTER();
    __shared__ float best[ARGMAX_THREADS];
    __shared__ uint32_t at[ARGMAX_THREADS];
    const float* row = x + (size_t)blockIdx.x * V;
    float b = -INFINITY;
    uint32_t i_best = 0xFFFFFFFFu;
    for (int i = threadIdx.x; i < V; i += ARGMAX_THREADS) {
        const float v = row[i];
        if (v > b || (v == b && i_best == 0xFFFFFFFFu)) {
            b = v;
            i_best = (uint32_t)i;
        }
    }
    best[threadIdx.x] = b;
    at[threadIdx.x] = i_best;
    for (int s = ARGMAX_THREADS / 2; s > 0; s >>= 1) {
        __syncthreads();
        if (threadIdx.x < s) {
            const float o = best[threadIdx.x + s];
            const uint32_t oi = at[threadIdx.x + s];
            if (o > best[threadIdx.x] || (o == best[threadIdx.x] && oi < at[threadIdx.x])) {
                best[threadIdx.x] = o;
                at[threadIdx.x] = oi;
            }
        }
    }
    // A row whose first value is not NaN has a pick (thread 0 took index 0 at least).
    if (threadIdx.x == 0) ids[blockIdx.x] = (V == 0 || isnan(row[0])) ? 0u : at[0];
}

// ---------------------------------------------------------------------------------------------
// A run of positions of every attention layer's KV cache, copied to or from one contiguous block
// in one launch (the prefix cache's entries, strata-engine batch/prefix_cache.rs; before, one
// candle copy per layer and k / v: 96 launches and allocations for a 48-layer model's block).
// caches [2L] device addresses (layer 0's k, its v, layer 1's k, ...), each [kvh, cap, row16]
// in 16-byte units; block [2L, kvh, len, row16]. grid (kvh, 2L), 256 threads; to_block 1 copies
// positions start .. start + len of each cache into the block, 0 copies the block back there.
extern "C" __global__ void kv_span_copy(const unsigned long long* __restrict__ caches,
                                        uint4* __restrict__ block, int kvh, int cap, int start,
                                        int len, int row16, int to_block) {
    PDL_ENTER();
    const int h = blockIdx.x, t = blockIdx.y;
    uint4* c = (uint4*)caches[t] + ((size_t)h * cap + start) * row16;
    uint4* b = block + ((size_t)t * kvh + h) * len * row16;
    const size_t n = (size_t)len * row16;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
        if (to_block) {
            b[i] = c[i];
        } else {
            c[i] = b[i];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Residual add + RMSNorm in one pass (Zhang & Sennrich 2019; candle's `rms_norm` after an add):
// sum = a + b; out = sum / sqrt(mean(sum²) + eps) · w. a, b, sum, out [n, H]; w [H].
// oq [n, H] int8, od [n, H / 32] (nullable; H a multiple of 32 when given): out's q8 rounding
// (q8_round_warp), written in the same pass for the mat-vec kernels that take it.
// grid n, blockDim.x a multiple of 32, at most 1024 (src/cuda.rs: `add_norm_threads`).
extern "C" __global__ void add_rms_norm(const float* __restrict__ a, const float* __restrict__ b,
                                        const float* __restrict__ w, float* __restrict__ sum,
                                        float* __restrict__ out, int8_t* __restrict__ oq,
                                        float* __restrict__ od, int H, float eps) {
    PDL_ENTER();
    __shared__ float red[1024 / WARP];
    const int threads = blockDim.x;
    const size_t base = (size_t)blockIdx.x * H;
    float ss = 0.f;
    for (int j = threadIdx.x; j < H; j += threads) {
        const float v = a[base + j] + b[base + j];
        sum[base + j] = v;
        ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    if (threadIdx.x % WARP == 0) red[threadIdx.x / WARP] = ss;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < threads / WARP; i++) t += red[i];
    const float inv = rsqrtf(t / (float)H + eps);
    if (oq) {
        // H % 32 == 0: each warp's 32 lanes hold 32 consecutive values of one row.
        for (int j0 = threadIdx.x - threadIdx.x % WARP; j0 < H; j0 += threads) {
            const int j = j0 + threadIdx.x % WARP;
            const float v = sum[base + j] * inv * w[j];
            out[base + j] = v;
            q8_round_warp(v, base + j, true, oq, od);
        }
        return;
    }
    for (int j = threadIdx.x; j < H; j += threads) out[base + j] = sum[base + j] * inv * w[j];
}

// Σ w[i]·x[i] over the float4s i = first, first + stride, … < n4, each float4's four products
// folded into the sum by fmaf in w/x order: one thread's share of an f32 dot product.
__device__ __forceinline__ float dot_f32x4(const float4* __restrict__ w, const float4* __restrict__ x,
                                           int first, int n4, int stride) {
    float acc = 0.f;
#pragma unroll 4
    for (int i = first; i < n4; i += stride) {
        const float4 a = __ldg(w + i), b = x[i];
        acc = fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, acc))));
    }
    return acc;
}

// An f32 dot product of n4 float4s by a block of MVF_THREADS threads: each thread's dot_f32x4,
// its warp's sum, then the four warps' sums in a fixed order. The result is valid in thread 0.
#define MVF_THREADS 128
__device__ __forceinline__ float block_dot_f32(const float4* __restrict__ w, const float4* __restrict__ x,
                                               int n4) {
    __shared__ float part[MVF_THREADS / WARP];
    const float acc = warp_sum(dot_f32x4(w, x, threadIdx.x, n4, MVF_THREADS));
    if (threadIdx.x % WARP == 0) part[threadIdx.x / WARP] = acc;
    __syncthreads();
    return (part[0] + part[1]) + (part[2] + part[3]);
}

// f32 mat-vec (a MoE router's logits, a shared expert's gate in a decode step): x [n, cols];
// w [rows, cols]; y [n, rows] = x · wᵀ. cols a multiple of 4, x and w 16-byte aligned. grid (rows,
// n), MVF_THREADS threads: a block per (row, token), its threads striding over the row's float4s
// (a few loads each, all in flight), then a warp sum and the block's four partial sums.
extern "C" __global__ void mv_f32(const float* __restrict__ x, const float* __restrict__ w,
                                  float* __restrict__ y, int rows, int cols) {
    PDL_LAUNCH();
    const int r = blockIdx.x, t = blockIdx.y;
    if (t == 0 && threadIdx.x < WARP)  // the row, before the wait (constant)
        l2_prefetch((const uint8_t*)(w + (size_t)r * cols), (uint32_t)cols * 4, threadIdx.x, WARP);
    PDL_WAIT();
    const float d = block_dot_f32((const float4*)(w + (size_t)r * cols),
                                  (const float4*)(x + (size_t)t * cols), cols / 4);
    if (threadIdx.x == 0) y[(size_t)t * rows + r] = d;
}

// A shared expert's gate and sum in one launch (qwen2_moe, Qwen3.5): y[t] = routed[t] + shared[t] ·
// σ(x[t] · wg) for x, shared, routed, y [n, cols], wg [cols]; the gate's dot product as mv_f32
// computes it, σ as candle's sigmoid (1 / (1 + e^−l), the division in f64), the product and the
// sum rounded apart as candle's mul and add: the same bits as those four launches. grid n,
// MVF_THREADS threads; cols a multiple of 4, x and wg 16-byte aligned.
extern "C" __global__ void shared_gate_add(const float* __restrict__ x, const float* __restrict__ wg,
                                           const float* __restrict__ shared,
                                           const float* __restrict__ routed, float* __restrict__ y,
                                           int cols) {
    PDL_ENTER();
    __shared__ float gate;
    const int t = blockIdx.x;
    const float l = block_dot_f32((const float4*)wg, (const float4*)(x + (size_t)t * cols), cols / 4);
    if (threadIdx.x == 0) gate = (float)(1.0 / (double)(1.f + expf(-l)));
    __syncthreads();
    for (int j = threadIdx.x; j < cols; j += MVF_THREADS) {
        const size_t o = (size_t)t * cols + j;
        y[o] = __fadd_rn(routed[o], __fmul_rn(shared[o], gate));
    }
}

// The kernel mv_f32 replaced (STRATA_GPU_MV_F32=warp, a measurement switch): grid (ceil(rows / 4),
// n), 128 threads, a warp per row walking all of its float4s.
extern "C" __global__ void mv_f32_warp(const float* __restrict__ x, const float* __restrict__ w,
                                       float* __restrict__ y, int rows, int cols) {
    PDL_ENTER();
    const int lane = threadIdx.x % WARP, r = blockIdx.x * 4 + threadIdx.x / WARP, t = blockIdx.y;
    if (r >= rows) return;
    const float acc = warp_sum(dot_f32x4((const float4*)(w + (size_t)r * cols),
                                         (const float4*)(x + (size_t)t * cols), lane, cols / 4, WARP));
    if (lane == 0) y[(size_t)t * rows + r] = acc;
}

// f32 product of many rows (a MoE router's logits in a prompt pass): x [n, cols]; w [rows, cols];
// y [n, rows] = x · wᵀ, in two launches: gemm_f32_rows_part sums each output over chunk z of
// `chunk` consecutive k (one fmaf per k, in order) into part [splits, n, rows], and
// gemm_f32_rows_sum adds the chunks' partials in chunk order. The chunks depend on cols alone, so
// a row's outputs do not depend on n or on the rows beside it (cuBLAS picks its kernel, split-K
// included, by the shape: a prompt's router logits then changed with the other prompts of its
// pass). Tiles of GR_T rows × GR_T outputs staged GR_K values at a time in shared memory.
// part: grid (ceil(rows / GR_T), ceil(n / GR_T), splits), 256 threads (16 × 16, each 2 × 2).
#define GR_T 32
#define GR_K 32
extern "C" __global__ void __launch_bounds__(256) gemm_f32_rows_part(const float* __restrict__ x,
                                                                     const float* __restrict__ w,
                                                                     float* __restrict__ part,
                                                                     int n, int rows, int cols,
                                                                     int chunk) {
    PDL_ENTER();
    __shared__ float xs[GR_T][GR_K + 1], ws[GR_T][GR_K + 1];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int t0 = blockIdx.y * GR_T, r0 = blockIdx.x * GR_T;
    const int kb = blockIdx.z * chunk, ke = min(cols, kb + chunk);
    float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    for (int k0 = kb; k0 < ke; k0 += GR_K) {
        for (int i = threadIdx.x; i < GR_T * GR_K; i += 256) {
            const int a = i / GR_K, k = k0 + i % GR_K;
            xs[a][i % GR_K] = t0 + a < n && k < ke ? x[(size_t)(t0 + a) * cols + k] : 0.f;
            ws[a][i % GR_K] = r0 + a < rows && k < ke ? w[(size_t)(r0 + a) * cols + k] : 0.f;
        }
        __syncthreads();
        const int kn = min(GR_K, ke - k0);
        for (int k = 0; k < kn; k++) {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++)
                    acc[i][j] = fmaf(xs[ty + 16 * i][k], ws[tx + 16 * j][k], acc[i][j]);
        }
        __syncthreads();
    }
    float* p = part + (size_t)blockIdx.z * n * rows;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int t = t0 + ty + 16 * i, r = r0 + tx + 16 * j;
            if (t < n && r < rows) p[(size_t)t * rows + r] = acc[i][j];
        }
}

// y[i] = part[0][i] + part[1][i] + … (in order) over `splits` partials of `total` values each.
extern "C" __global__ void gemm_f32_rows_sum(const float* __restrict__ part, float* __restrict__ y,
                                             int total, int splits) {
    PDL_ENTER();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    float s = part[i];
    for (int z = 1; z < splits; z++) s += part[(size_t)z * total + i];
    y[i] = s;
}

// ---------------------------------------------------------------------------------------------
// Causal softmax of attention scores, in place: x [R, total] with row r the query i = r % seq of
// a pass of seq rows after `past` cached positions; y = softmax(scale · x) over keys j <= past + i
// (the others 0). Replaces candle's scale, additive-mask broadcast and softmax (three launches and
// a mask upload per layer) in prompt passes. grid R, CSM_THREADS threads.
#define CSM_THREADS 256
extern "C" __global__ void causal_softmax(float* __restrict__ x, int total, int seq, int past,
                                          float scale) {
    PDL_ENTER();
    __shared__ float red[CSM_THREADS / WARP];
    const int r = blockIdx.x, i = r % seq, n = min(total, past + i + 1);
    float* row = x + (size_t)r * total;
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    float m = -CUDART_INF_F;
    for (int j = threadIdx.x; j < n; j += CSM_THREADS) m = fmaxf(m, row[j] * scale);
    m = warp_max(m);
    if (lane == 0) red[wid] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < CSM_THREADS / WARP; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    float s = 0.f;
    for (int j = threadIdx.x; j < n; j += CSM_THREADS) {
        const float e = expf(row[j] * scale - m);
        row[j] = e;
        s += e;
    }
    s = warp_sum(s);
    if (lane == 0) red[wid] = s;
    __syncthreads();
    s = 0.f;
    for (int w = 0; w < CSM_THREADS / WARP; w++) s += red[w];
    const float inv = 1.f / s;
    for (int j = threadIdx.x; j < total; j += CSM_THREADS) row[j] = j < n ? row[j] * inv : 0.f;
}

// ---------------------------------------------------------------------------------------------
// A KV cache holds f32 or f16 values (`--kv-cache-dtype`); kernels read and write them through
// these and compute in f32. The f16 write rounds to nearest even (as candle's casts do).
__device__ __forceinline__ float kv_load(const float* p) { return *p; }
__device__ __forceinline__ float kv_load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void kv_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void kv_store(__half* p, float v) { *p = __float2half_rn(v); }

// ---------------------------------------------------------------------------------------------
// RoPE + KV append. q [seq, nh, hd], k, v [seq, nkv, hd] (contiguous); cos, sin [max_pos, rd/2];
// cache_k, cache_v [nkv, cap, hd] (one layer's cache, batch 1); q_out [seq, nh, hd]. pos_dev
// (nullable): the position read from the device instead of `pos` (a captured CUDA graph).
// style 0: NeoX (pairs i, i + rd/2), 1: interleaved (pairs 2i, 2i + 1). Dimensions >= rd pass
// unrotated. q_norm, k_norm (nullable, both or neither): per-head RMSNorm weights [hd] applied to
// q and k before the rotation (Qwen3's q_norm / k_norm), epsilon eps.
// grid (seq, nh + nkv), block hd/2 threads rounded up to a multiple of 32 (one per rotated pair /
// two tail dims).
// The RMSNorm scale 1 / sqrt(mean(x²) + eps) of one head's hd values, over the block (every
// thread of the block calls it; blockDim a multiple of 32, at most 1024).
__device__ __forceinline__ float head_rms_inv(const float* x, int hd, float eps) {
    __shared__ float red[32];
    float ss = 0.f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) ss = fmaf(x[d], x[d], ss);
    ss = warp_sum(ss);
    if (threadIdx.x % WARP == 0) red[threadIdx.x / WARP] = ss;
    __syncthreads();
    float t = 0.f;
    for (int w = 0; w < (int)blockDim.x / WARP; w++) t += red[w];
    return rsqrtf(t / (float)hd + eps);
}

// nw (nullable): the head's RMSNorm weight [hd], applied (x · inv · nw) before the rotation.
template <typename O>
__device__ __forceinline__ void rope_row(const float* x, O* o, const float* c, const float* s,
                                         int hd, int rd, int style, const float* nw, float inv) {
    int half = rd / 2;
    for (int p = threadIdx.x; p < hd / 2; p += blockDim.x) {
        if (p < half) {
            int a = style == 0 ? p : 2 * p, b = style == 0 ? p + half : 2 * p + 1;
            float x0 = x[a], x1 = x[b], cs = c[p], sn = s[p];
            if (nw) {
                x0 = x0 * inv * nw[a];
                x1 = x1 * inv * nw[b];
            }
            kv_store(o + a, x0 * cs - x1 * sn);
            kv_store(o + b, x0 * sn + x1 * cs);
        } else {
            // tail: dims rd + 2(p - half) and the next one
            int d = rd + 2 * (p - half);
            kv_store(o + d, nw ? x[d] * inv * nw[d] : x[d]);
            kv_store(o + d + 1, nw ? x[d + 1] * inv * nw[d + 1] : x[d + 1]);
        }
    }
}

// A batched pass's rows of several sequences (rows_tab, nullable): per row 5 u32 — its position,
// then the addresses of its sequence's cache k and v for this layer (low word first). Every cache
// has the shape [nkv, cap, hd] of the launch.
// Every cache of a table holds the launch's element type T.
template <typename T>
struct RowKv {
    int pos;
    T* k;
    T* v;
};

template <typename T>
__device__ __forceinline__ RowKv<T> row_kv(const uint32_t* __restrict__ tab, int i) {
    const uint32_t* t = tab + 5 * (size_t)i;
    RowKv<T> r;
    r.pos = (int)t[0];
    r.k = (T*)(((uint64_t)t[2] << 32) | t[1]);
    r.v = (T*)(((uint64_t)t[4] << 32) | t[3]);
    return r;
}

template <typename T>
__device__ void rope_kv_append_impl(const float* __restrict__ q, const float* __restrict__ k,
                                    const float* __restrict__ v, const float* __restrict__ cos_t,
                                    const float* __restrict__ sin_t, float* __restrict__ q_out,
                                    T* __restrict__ cache_k, T* __restrict__ cache_v, int nh,
                                    int nkv, int hd, int rd, int style, int pos, int cap,
                                    const uint32_t* __restrict__ pos_dev,
                                    const uint32_t* __restrict__ rows_tab,
                                    const float* __restrict__ q_norm,
                                    const float* __restrict__ k_norm, float eps) {
    if (pos_dev) pos = (int)*pos_dev;
    const int i = blockIdx.x, h = blockIdx.y;
    int p = pos + i;
    if (rows_tab) {
        const RowKv<T> r = row_kv<T>(rows_tab, i);
        p = r.pos;
        cache_k = r.k;
        cache_v = r.v;
    }
    const float* c = cos_t + (size_t)p * (rd / 2);
    const float* s = sin_t + (size_t)p * (rd / 2);
    if (h < nh) {
        size_t off = ((size_t)i * nh + h) * hd;
        const float inv = q_norm ? head_rms_inv(q + off, hd, eps) : 1.f;
        rope_row(q + off, q_out + off, c, s, hd, rd, style, q_norm, inv);
    } else {
        int g = h - nh;
        size_t src = ((size_t)i * nkv + g) * hd, dst = ((size_t)g * cap + p) * hd;
        const float inv = k_norm ? head_rms_inv(k + src, hd, eps) : 1.f;
        rope_row(k + src, cache_k + dst, c, s, hd, rd, style, k_norm, inv);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) kv_store(cache_v + dst + d, v[src + d]);
    }
}

#define ROPE_KV_KERNEL(NAME, T)                                                                   \
    extern "C" __global__ void NAME(                                                              \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,    \
        const float* __restrict__ cos_t, const float* __restrict__ sin_t,                         \
        float* __restrict__ q_out, T* __restrict__ cache_k, T* __restrict__ cache_v, int nh,      \
        int nkv, int hd, int rd, int style, int pos, int cap, const uint32_t* __restrict__ pos_dev, \
        const uint32_t* __restrict__ rows_tab, const float* __restrict__ q_norm,                  \
        const float* __restrict__ k_norm, float eps) {                                            \
        PDL_ENTER();                                                                              \
        rope_kv_append_impl<T>(q, k, v, cos_t, sin_t, q_out, cache_k, cache_v, nh, nkv, hd, rd,   \
                               style, pos, cap, pos_dev, rows_tab, q_norm, k_norm, eps);          \
    }
ROPE_KV_KERNEL(rope_kv_append, float)
ROPE_KV_KERNEL(rope_kv_append_f16, __half)

// ---------------------------------------------------------------------------------------------
// Decode attention. q [seq, nh, hd]; cache [nkv, cap, hd]; row i attends positions [0, pos + i]
// (with rows_tab: positions [0, its position] of its own sequence's cache).
// grid (nkv * groups, splits, seq), ATT_THREADS threads. A block takes REP query heads of one kv
// head (groups = ceil(n_rep / REP)) over positions [split * chunk, (split + 1) * chunk); each warp
// takes every ATT_WARPS-th position with an online softmax, lanes hold HPL = hd / 32 dimensions.
// splits == 1: out [seq, nh * hd] is written; else partials part [seq, nh, splits, hd + 2]
// (unnormalised acc, then max and sum), merged by attn_combine. pos_dev (nullable): the position
// read from the device (a captured CUDA graph: `splits` then covers the longest context the graph
// serves, and chunks past a row's length give empty partials).
#define ATT_WARPS 4
#define ATT_THREADS (ATT_WARPS * WARP)
#define REP 4
// Positions whose keys and values a warp loads before updating with the first of them (2 for
// head dims of 256, whose rows take twice the registers).
#define ATT_UNROLL 4
// Most splits of a context (ATTN_SPLITS_LIMIT in src/cuda.rs): attn_combine's shared weights.
#define ATT_SPLITS_MAX 512

template <int HPL, typename T>
__device__ void attn_decode_impl(const float* __restrict__ q, const T* __restrict__ ck,
                                 const T* __restrict__ cv, float* __restrict__ out,
                                 float* __restrict__ part, int nh, int nkv, int cap, int pos,
                                 int chunk, float scale, const uint32_t* __restrict__ pos_dev,
                                 const uint32_t* __restrict__ rows_tab, int8_t* __restrict__ oq,
                                 float* __restrict__ od) {
    if (pos_dev) pos = (int)*pos_dev;
    constexpr int HD = HPL * WARP;
    __shared__ float sm_acc[ATT_WARPS][REP][HD];
    __shared__ float sm_m[ATT_WARPS][REP], sm_l[ATT_WARPS][REP];
    const int n_rep = nh / nkv, groups = (n_rep + REP - 1) / REP;
    const int kvh = blockIdx.x / groups, grp = blockIdx.x % groups;
    const int split = blockIdx.y, splits = gridDim.y, row = blockIdx.z;
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    int total = pos + row + 1;
    if (rows_tab) {
        const RowKv<T> r = row_kv<T>(rows_tab, row);
        total = r.pos + 1;
        ck = r.k;
        cv = r.v;
    }
    const int j0 = split * chunk, j1 = min(total, j0 + chunk);
    const int h0 = kvh * n_rep + grp * REP;
    const int nr = min(REP, n_rep - grp * REP);
    float qr[REP][HPL], acc[REP][HPL], m[REP], l[REP];
#pragma unroll
    for (int r = 0; r < REP; r++) {
        m[r] = -CUDART_INF_F;
        l[r] = 0.f;
#pragma unroll
        for (int d = 0; d < HPL; d++) {
            acc[r][d] = 0.f;
            qr[r][d] = r < nr ? q[((size_t)row * nh + h0 + r) * HD + d * WARP + lane] * scale : 0.f;
        }
    }
    const T* kb = ck + (size_t)kvh * cap * HD;
    const T* vb = cv + (size_t)kvh * cap * HD;
    // One position's update of the REP rows' online softmax (the order of positions per warp is
    // j0 + wid, + ATT_WARPS, ...; unrolling below only issues the loads of ATT_UNROLL of them
    // before the first update, so several rows of keys and values are in flight per warp).
    auto update = [&](const float (&kr)[HPL], const float (&vr)[HPL]) {
#pragma unroll
        for (int r = 0; r < REP; r++) {
            if (r >= nr) break;
            float s = 0.f;
#pragma unroll
            for (int d = 0; d < HPL; d++) s += qr[r][d] * kr[d];
            s = warp_sum(s);
            float mn = fmaxf(m[r], s), corr = expf(m[r] - mn), pj = expf(s - mn);
            l[r] = l[r] * corr + pj;
#pragma unroll
            for (int d = 0; d < HPL; d++) acc[r][d] = acc[r][d] * corr + pj * vr[d];
            m[r] = mn;
        }
    };
    constexpr int U = HPL >= 8 ? 2 : ATT_UNROLL;
    int j = j0 + wid;
    for (; j + (U - 1) * ATT_WARPS < j1; j += U * ATT_WARPS) {
        float kr[U][HPL], vr[U][HPL];
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int d = 0; d < HPL; d++) {
                kr[u][d] = kv_load(kb + (size_t)(j + u * ATT_WARPS) * HD + d * WARP + lane);
                vr[u][d] = kv_load(vb + (size_t)(j + u * ATT_WARPS) * HD + d * WARP + lane);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) update(kr[u], vr[u]);
    }
    for (; j < j1; j += ATT_WARPS) {
        float kr[HPL], vr[HPL];
#pragma unroll
        for (int d = 0; d < HPL; d++) {
            kr[d] = kv_load(kb + (size_t)j * HD + d * WARP + lane);
            vr[d] = kv_load(vb + (size_t)j * HD + d * WARP + lane);
        }
        update(kr, vr);
    }
#pragma unroll
    for (int r = 0; r < REP; r++) {
        if (lane == 0) { sm_m[wid][r] = m[r]; sm_l[wid][r] = l[r]; }
#pragma unroll
        for (int d = 0; d < HPL; d++) sm_acc[wid][r][d * WARP + lane] = acc[r][d];
    }
    __syncthreads();
    // nr · HD is a multiple of 32: each warp's lanes take 32 consecutive d of one head.
    for (int idx = threadIdx.x; idx < nr * HD; idx += ATT_THREADS) {
        int r = idx / HD, d = idx % HD;
        float M = -CUDART_INF_F;
        for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm_m[w][r]);
        float L = 0.f, A = 0.f;
        if (M != -CUDART_INF_F) {
            for (int w = 0; w < ATT_WARPS; w++) {
                float f = expf(sm_m[w][r] - M);
                L += sm_l[w][r] * f;
                A += sm_acc[w][r][d] * f;
            }
        }
        int h = h0 + r;
        if (splits == 1) {
            const size_t o = ((size_t)row * nh + h) * HD + d;
            out[o] = A / L;
            if (oq) q8_round_warp(A / L, o, true, oq, od);
        } else {
            float* pp = part + (((size_t)row * nh + h) * splits + split) * (HD + 2);
            pp[d] = A;
            if (d == 0) { pp[HD] = M; pp[HD + 1] = L; }
        }
    }
}

#define ATT_KERNEL(NAME, HPL, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) NAME(                               \
        const float* q, const T* ck, const T* cv, float* out, float* part, int nh, int nkv,       \
        int cap, int pos, int chunk, float scale, const uint32_t* pos_dev, const uint32_t* rows_tab, \
        int8_t* oq, float* od) {                                                                  \
        PDL_ENTER();                                                                              \
        attn_decode_impl<HPL, T>(q, ck, cv, out, part, nh, nkv, cap, pos, chunk, scale, pos_dev,  \
                                 rows_tab, oq, od);                                               \
    }
ATT_KERNEL(attn_decode_hd1, 1, float)
ATT_KERNEL(attn_decode_hd2, 2, float)
ATT_KERNEL(attn_decode_hd3, 3, float)
ATT_KERNEL(attn_decode_hd4, 4, float)
ATT_KERNEL(attn_decode_hd8, 8, float)
ATT_KERNEL(attn_decode_f16_hd1, 1, __half)
ATT_KERNEL(attn_decode_f16_hd2, 2, __half)
ATT_KERNEL(attn_decode_f16_hd3, 3, __half)
ATT_KERNEL(attn_decode_f16_hd4, 4, __half)
ATT_KERNEL(attn_decode_f16_hd8, 8, __half)

// part [seq, nh, splits, hd + 2] -> out [seq, nh, hd]; oq [seq, nh · hd] int8, od [seq, nh · hd /
// 32] (nullable): out's q8 rounding (q8_round_warp; hd is a multiple of 32). grid (nh, seq), block
// hd threads (at most 1024), splits <= ATT_SPLITS_MAX. The splits' maxima and weights are taken
// by the block's threads together (one split each), then every thread sums its dimension over the
// splits from shared memory: no thread walks the splits' partials one dependent load at a time.
extern "C" __global__ void attn_combine(const float* __restrict__ part, float* __restrict__ out,
                                        int8_t* __restrict__ oq, float* __restrict__ od, int nh,
                                        int hd, int splits) {
    PDL_ENTER();
    __shared__ float w[ATT_SPLITS_MAX];
    __shared__ float red[32];
    const int h = blockIdx.x, row = blockIdx.y, d = threadIdx.x;
    const int lane = d % WARP, wid = d / WARP, warps = blockDim.x / WARP;
    const float* pp = part + ((size_t)row * nh + h) * splits * (hd + 2);
    float m = -CUDART_INF_F;
    for (int s = d; s < splits; s += blockDim.x) m = fmaxf(m, pp[s * (hd + 2) + hd]);
    m = warp_max(m);
    if (lane == 0) red[wid] = m;
    __syncthreads();
    float M = -CUDART_INF_F;
    for (int i = 0; i < warps; i++) M = fmaxf(M, red[i]);
    __syncthreads();
    float l = 0.f;
    for (int s = d; s < splits; s += blockDim.x) {
        const float ms = pp[s * (hd + 2) + hd];
        const float f = ms == -CUDART_INF_F ? 0.f : expf(ms - M);
        w[s] = f;
        l += pp[s * (hd + 2) + hd + 1] * f;
    }
    l = warp_sum(l);
    if (lane == 0) red[wid] = l;
    __syncthreads();
    float L = 0.f;
    for (int i = 0; i < warps; i++) L += red[i];
    // Four partial sums, so that 16 loads are in flight per thread.
    float a[4] = {0.f, 0.f, 0.f, 0.f};
    int s = 0;
#pragma unroll 4
    for (; s + 4 <= splits; s += 4) {
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] += pp[(s + i) * (hd + 2) + d] * w[s + i];
    }
    // Split s always adds into a[s % 4], in the same order, whatever the split count: a graph's
    // launch (more splits, the extra ones empty: zero weight, zero partial) sums exactly as the
    // op-by-op step over the same context.
    for (; s < splits; s++) a[s % 4] += pp[s * (hd + 2) + d] * w[s];
    const float A = (a[0] + a[1]) + (a[2] + a[3]);
    const size_t o = ((size_t)row * nh + h) * hd + d;
    out[o] = A / L;
    if (oq) q8_round_warp(A / L, o, true, oq, od);
}

#include "moe_q4k.cuh"
#include "moe_tc.cuh"
#include "mv_q8.cuh"
#include "moe_mma.cuh"
#include "gdn.cuh"
#include "attn_tc.cuh"
