// Q4_K products of many rows on tensor cores (WMMA, f16 inputs, f32 accumulation), for prompt
// passes: a MoE layer's (token, slot) pairs grouped by expert, or a dense matrix. Included by
// decode.cu after moe_q4k.cuh (Q4K_BYTES).
//
// Each block (8 warps) takes a tile of up to TC_TM pairs of one expert and TC_TN weight rows; per
// k-step of TC_KS values it stores the pairs' f16 inputs and the weight rows dequantized to f16
// (ggml's dequantize_row_q4_K values d·scale·q − dmin·min, unfused as ggml computes them, then
// rounded to f16) in shared memory, and the warps multiply them with wmma 16×16×16 fragments
// (warp w: pair rows 16(w % 4).., weight rows 64(w / 4)..). The next k-step's global reads are
// issued into registers before the current step's products (software pipelining). A pair's
// result depends only on its own row and the weights (the k-steps and their order are the same
// for every row and tile), so it does not depend on which pairs share its tile or pass. The
// approach is that of grouped-GEMM MoE kernels (vLLM fused_moe: tokens sorted by expert, one
// tile of one expert per block); the code is ours.
//
//  moe_tc_sort   ids [P] -> pairs grouped by expert (ascending expert id) and
//                the tile table (expert, first sorted position, count) of tiles of up to `tm`
//                pairs (TC_TM here, MMA_TN for moe_mma.cuh's kernel).
//  to_f16        f32 -> f16 (round to nearest even).
//  q4k_mm_tc     out[p, r] = W_e[r, :] · src[s(p), :] for every pair p of a tile (s(p) = p / k
//                when per_token, else p); or, order null, a dense product out = src · Wᵀ. With a
//                second matrix (w2: SwiGLU's up next to gate) a block takes 64 rows of each and
//                writes silu(gate · x) · (up · x) in f16 instead.

#include <mma.h>

#define TC_TM 64
#define TC_TN 128
#define TC_KS 64
#define TC_LD (TC_KS + 8)   // f16 row pitch in shared memory (a multiple of 8, off the banks)
#define TC_CLD (TC_TN + 4)  // f32 pitch of the output staging
#define TC_THREADS 256

// Inclusive prefix sums of two values across a full warp's lanes (lane l gets the sums over
// lanes 0..l; Hillis-Steele with shuffles).
__device__ __forceinline__ void warp_scan2(uint32_t& a, uint32_t& b, int lane) {
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const uint32_t ua = __shfl_up_sync(0xffffffffu, a, o), ub = __shfl_up_sync(0xffffffffu, b, o);
        if (lane >= o) {
            a += ua;
            b += ub;
        }
    }
}

// One block of 1024 threads. ids [P] (< E: others are dropped, their pairs never computed);
// order [P]; tiles [3 · max_tiles] (expert, start, count); ntiles [1]. E <= GROUPED_MAX_E (the
// block's threads: thread e counts expert e). The experts' pair and tile offsets are a block-wide
// exclusive scan (warp shuffles, then the warps' totals). The order of pairs within an expert
// depends on the atomics' order; results do not (a pair's product does not depend on its place in
// a tile), and the tile table does not.
extern "C" __global__ void moe_tc_sort(const uint32_t* __restrict__ ids, int P, int E, int tm,
                                       uint32_t* __restrict__ order, uint32_t* __restrict__ tiles,
                                       uint32_t* __restrict__ ntiles) {
    PDL_ENTER();
    __shared__ uint32_t cnt[GROUPED_MAX_E], off[GROUPED_MAX_E];
    __shared__ uint32_t warp_pairs[32], warp_tiles[32];
    const int e = threadIdx.x, lane = e % WARP, warp = e / WARP;
    if (e < E) cnt[e] = 0u;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const uint32_t x = ids[p];
        if (x < (uint32_t)E) atomicAdd(&cnt[x], 1u);
    }
    __syncthreads();
    const uint32_t c = e < E ? cnt[e] : 0u, nt = (c + tm - 1) / tm;
    uint32_t sc = c, st = nt;  // inclusive scans within the warp
    warp_scan2(sc, st, lane);
    if (lane == WARP - 1) {
        warp_pairs[warp] = sc;
        warp_tiles[warp] = st;
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the warps' totals (blockDim / 32 <= 32 of them)
        const int nw = blockDim.x / WARP;
        uint32_t wc = lane < nw ? warp_pairs[lane] : 0u, wt = lane < nw ? warp_tiles[lane] : 0u;
        uint32_t ic = wc, it = wt;
        warp_scan2(ic, it, lane);
        if (lane < nw) {
            warp_pairs[lane] = ic - wc;
            warp_tiles[lane] = it - wt;
        }
        if (lane == nw - 1) *ntiles = it;
    }
    __syncthreads();
    if (e < E) {
        const uint32_t first = warp_pairs[warp] + sc - c, tfirst = warp_tiles[warp] + st - nt;
        off[e] = first;
        for (uint32_t j = 0; j < nt; j++) {
            uint32_t* t = tiles + 3 * (size_t)(tfirst + j);
            t[0] = (uint32_t)e;
            t[1] = first + j * tm;
            t[2] = min((uint32_t)tm, c - j * tm);
        }
    }
    __syncthreads();  // off[] becomes each expert's cursor
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const uint32_t x = ids[p];
        if (x < (uint32_t)E) order[atomicAdd(&off[x], 1u)] = (uint32_t)p;
    }
}

extern "C" __global__ void to_f16(const float* __restrict__ x, __half* __restrict__ y, int n) {
    PDL_ENTER();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half_rn(x[i]);
}

// Byte b (runtime) of a 32-bit word.
__device__ __forceinline__ uint32_t byte_of(uint32_t w, int b) { return (w >> (8 * b)) & 0xFFu; }

// ggml get_scale_min_k4 of sub-block j from a super-block header held in registers (h.x: d, dmin;
// h.y, h.z, h.w: the 12 scale bytes).
__device__ __forceinline__ void q4k_head_scale_min(const uint4& h, int j, float& s, float& m) {
    if (j < 4) {
        s = (float)(byte_of(h.y, j) & 63u);
        m = (float)(byte_of(h.z, j) & 63u);
    } else {
        s = (float)((byte_of(h.w, j - 4) & 0xFu) | ((byte_of(h.y, j - 4) >> 6) << 4));
        m = (float)((byte_of(h.w, j - 4) >> 4) | ((byte_of(h.z, j - 4) >> 6) << 4));
    }
}

// The low / high f16 of a 32-bit word, as f32 (a Q4_K header's d / dmin).
__device__ __forceinline__ float half_lo(uint32_t w) {
    return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu)));
}
__device__ __forceinline__ float half_hi(uint32_t w) {
    return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}

// One k-step's global reads, held in registers until they are stored to shared memory.
struct TcStage {
    uint4 a[2];   // two 16-byte pieces of the pairs' f16 inputs
    uint4 head;   // the weight row's super-block header (d, dmin, 12 scale bytes)
    uint4 qs[2];  // the 32 quant bytes of this k-step's chunk
    bool row_ok;
};

// src [*, K] f16; w (and w2) [E, R, K] Q4_K (K a multiple of 256); order [P], tiles, ntiles from
// moe_tc_sort, or all three null for a dense product (E = 1, tile x = pairs 64x..); out [P, R]
// f32, or with w2, out_glu [P, R] f16 = silu(w · x) · (w2 · x); indirect: w and w2 are tables of
// E expert addresses (expert_weights, moe_q4k.cuh). grid (max_tiles, ceil(R / 128))
// (ceil(R / 64) with w2), TC_THREADS threads.
extern "C" __global__ void __launch_bounds__(TC_THREADS)
    q4k_mm_tc(const __half* __restrict__ src, const uint8_t* __restrict__ w,
              const uint8_t* __restrict__ w2, const uint32_t* __restrict__ order,
              const uint32_t* __restrict__ tiles, const uint32_t* __restrict__ ntiles,
              float* __restrict__ out, __half* __restrict__ out_glu, int P, int R, int K, int k,
              int per_token, int indirect) {
    PDL_ENTER();
    using namespace nvcuda;
    constexpr int AB_BYTES = (TC_TM + TC_TN) * TC_LD * 2, C_BYTES = TC_TM * TC_CLD * 4;
    __shared__ __align__(32) unsigned char smem[AB_BYTES > C_BYTES ? AB_BYTES : C_BYTES];
    __half* As = (__half*)smem;        // [TC_TM][TC_LD] pairs' inputs
    __half* Bs = As + TC_TM * TC_LD;   // [TC_TN][TC_LD] weight rows
    float* Cs = (float*)smem;          // [TC_TM][TC_CLD] after the k loop
    __shared__ int rows_src[TC_TM], rows_dst[TC_TM];

    int e = 0, start, count;
    if (order) {
        if (blockIdx.x >= *ntiles) return;
        const uint32_t* t = tiles + 3 * (size_t)blockIdx.x;
        e = (int)t[0];
        start = (int)t[1];
        count = (int)t[2];
    } else {
        start = blockIdx.x * TC_TM;
        if (start >= P) return;
        count = min(TC_TM, P - start);
    }
    const bool glu = w2 != nullptr;
    const int n0 = blockIdx.y * (glu ? TC_TN / 2 : TC_TN);
    const int tid = threadIdx.x, warp = tid / WARP, wm = warp % 4, wn = warp / 4;
    if (tid < TC_TM) {
        const int p = tid < count ? (order ? (int)order[start + tid] : start + tid) : -1;
        rows_dst[tid] = p;
        rows_src[tid] = p < 0 ? -1 : (per_token ? p / k : p);
    }
    __syncthreads();

    // Thread t < TC_TN loads and dequantizes weight row lr = t of the tile.
    const size_t row_bytes = (size_t)(K / 256) * Q4K_BYTES;
    const uint8_t* wrow = nullptr;
    if (tid < TC_TN) {
        const int half_rows = TC_TN / 2;
        const uint8_t* m = glu && tid >= half_rows ? w2 : w;
        const int row = n0 + (glu ? tid % half_rows : tid);
        if (row < R) wrow = expert_weights(m, indirect, e, (size_t)R * row_bytes) + row * row_bytes;
    }
    auto load = [&](int k0, TcStage& s) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int idx = tid + TC_THREADS * j, r = idx / (TC_KS / 8), c = idx % (TC_KS / 8);
            s.a[j] = rows_src[r] >= 0 ? *(const uint4*)(src + (size_t)rows_src[r] * K + k0 + 8 * c)
                                      : make_uint4(0u, 0u, 0u, 0u);
        }
        s.row_ok = wrow != nullptr;
        if (s.row_ok) {
            const uint8_t* blk = wrow + (size_t)(k0 / 256) * Q4K_BYTES;
            const int chunk = (k0 % 256) / 64;
            s.head = *(const uint4*)blk;
            s.qs[0] = *(const uint4*)(blk + 16 + 32 * chunk);
            s.qs[1] = *(const uint4*)(blk + 16 + 32 * chunk + 16);
        }
    };
    auto store = [&](int k0, const TcStage& s) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int idx = tid + TC_THREADS * j, r = idx / (TC_KS / 8), c = idx % (TC_KS / 8);
            *(uint4*)(As + r * TC_LD + 8 * c) = s.a[j];
        }
        if (tid >= TC_TN) return;
        __half* d = Bs + tid * TC_LD;
        if (!s.row_ok) {
            for (int l = 0; l < TC_KS; l += 2) *(__half2*)(d + l) = __floats2half2_rn(0.f, 0.f);
            return;
        }
        // ggml get_scale_min_k4 for sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles).
        const int c = (k0 % 256) / 64;
        float sc[2], mn[2];
#pragma unroll
        for (int h = 0; h < 2; h++) q4k_head_scale_min(s.head, 2 * c + h, sc[h], mn[h]);
        const float dd = half_lo(s.head.x), dmin = half_hi(s.head.x);
        const float a0 = __fmul_rn(dd, sc[0]), b0 = __fmul_rn(dmin, mn[0]);
        const float a1 = __fmul_rn(dd, sc[1]), b1 = __fmul_rn(dmin, mn[1]);
        const uint32_t qw[8] = {s.qs[0].x, s.qs[0].y, s.qs[0].z, s.qs[0].w,
                                s.qs[1].x, s.qs[1].y, s.qs[1].z, s.qs[1].w};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float lo[4], hi[4];
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const uint32_t q = byte_of(qw[i], b);
                // Unfused multiply and subtract: ggml's (and candle's) values.
                lo[b] = __fsub_rn(__fmul_rn(a0, (float)(q & 0xFu)), b0);
                hi[b] = __fsub_rn(__fmul_rn(a1, (float)(q >> 4)), b1);
            }
            __half2* dl = (__half2*)(d + 4 * i);
            __half2* dh = (__half2*)(d + 32 + 4 * i);
            dl[0] = __floats2half2_rn(lo[0], lo[1]);
            dl[1] = __floats2half2_rn(lo[2], lo[3]);
            dh[0] = __floats2half2_rn(hi[0], hi[1]);
            dh[1] = __floats2half2_rn(hi[2], hi[3]);
        }
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4];
#pragma unroll
    for (int c = 0; c < 4; c++) wmma::fill_fragment(acc[c], 0.f);
    const bool active = 16 * wm < count;
    TcStage stage;
    load(0, stage);
    for (int k0 = 0; k0 < K; k0 += TC_KS) {
        store(k0, stage);
        __syncthreads();
        if (k0 + TC_KS < K) load(k0 + TC_KS, stage);
        if (active) {
#pragma unroll
            for (int kk = 0; kk < TC_KS / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
                wmma::load_matrix_sync(a, As + 16 * wm * TC_LD + 16 * kk, TC_LD);
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
                    wmma::load_matrix_sync(b, Bs + (64 * wn + 16 * c) * TC_LD + 16 * kk, TC_LD);
                    wmma::mma_sync(acc[c], a, b, acc[c]);
                }
            }
        }
        __syncthreads();
    }
    if (active) {
#pragma unroll
        for (int c = 0; c < 4; c++)
            wmma::store_matrix_sync(Cs + 16 * wm * TC_CLD + 64 * wn + 16 * c, acc[c], TC_CLD,
                                    wmma::mem_row_major);
    }
    __syncthreads();
    if (glu) {
        for (int idx = tid; idx < count * (TC_TN / 2); idx += TC_THREADS) {
            const int r = idx / (TC_TN / 2), c = idx % (TC_TN / 2);
            if (n0 + c >= R) continue;
            const float g = Cs[r * TC_CLD + c], u = Cs[r * TC_CLD + TC_TN / 2 + c];
            out_glu[(size_t)rows_dst[r] * R + n0 + c] = __float2half_rn(g / (1.f + expf(-g)) * u);
        }
    } else {
        for (int idx = tid; idx < count * TC_TN; idx += TC_THREADS) {
            const int r = idx / TC_TN, c = idx % TC_TN;
            if (n0 + c < R) out[(size_t)rows_dst[r] * R + n0 + c] = Cs[r * TC_CLD + c];
        }
    }
}
