// Q4_K products of a few rows over q8 activations on int8 tensor cores (mma.m16n8k32), for
// batched steps and verify passes: dense matrices over tiles of MMA_TN consecutive rows, and a MoE
// layer's (token, slot) pairs grouped by expert (moe_tc_sort with tiles of MMA_TN pairs), so that
// each selected expert's weights are read once for all of the pass's tokens routed to it instead
// of once per pair. Included by decode.cu after moe_tc.cuh and mv_q8.cuh.
//
// The arithmetic is llama.cpp's MMQ for Q4_K × Q8_1 (ggml-cuda mmq.cuh, `vec_dot_q4_K_q8_1_mma`):
// a sub-block of 32 weights is one k-step of the instruction — its 4-bit quants (0..15) times the
// token's 8-bit inputs, summed exactly in int32 — then scaled: ggml's weight d·scale·q − dmin·min
// applied as d·Σⱼ scaleⱼ·dxⱼ·Σq·x − dmin·Σⱼ minⱼ·dxⱼ·Σx over the super-block's 8 sub-blocks j (dxⱼ
// the input's q8 scale). Each (pair, row) sum is kept by one thread and runs over the super-blocks
// and sub-blocks in the same order whatever the tile's other pairs, so a pair's result does not
// depend on which pairs share its pass (tested: a token alone = the same token in a batch).
//
//  q4k_mm3_q8  out_m = x · W_mᵀ for up to three dense matrices sharing x (a layer's q, k, v).
//  moe_mmq_q8  out[p, r] = W_e[r, :] · x[s(p), :] for the pairs p of a tile (s(p) = p / k when
//              per_token, else p); with w2 (SwiGLU's up beside gate) out = silu(gate · x) ·
//              (up · x).
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k32", .s8): lane = 4·g + t; A (16×32,
// weight rows × k): a0 row g, k 4t..4t+3; a1 row g + 8, same k; a2 row g, k 16 + 4t..; a3 row
// g + 8, k 16 + 4t..; B (32×8, k × pairs): b0 k 4t.., pair g; b1 k 16 + 4t.., pair g; C (16×8):
// c0, c1 row g, pairs 2t, 2t + 1; c2, c3 row g + 8.

#define MMA_TN 8                 // pairs per tile (the instruction's n)
#define MMA_ROWS 16              // weight rows per dense block and per warp of moe_mmq_q8

__device__ __forceinline__ void mma_s8_16832(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The k-order inside an instruction is a free choice as long as A and B share it: fragment k
// 4t + i (i < 4) holds position 8t + i of the sub-block and k 16 + 4t + i position 8t + 4 + i, so
// a thread's A words for a row are one 8-byte piece of the quants (qs bytes 32c + 8t ..: sub-block
// 2c in the low nibbles, 2c + 1 in the high ones) and its B words one 8-byte piece of the inputs.

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}

// ---------------------------------------------------------------------------------------------
// moe_mmq_q8: the MoE products of a grouped pass (pairs sorted by expert by moe_tc_sort, tiles of
// MMA_TN pairs of one expert), each selected expert's rows read once for all of its pairs, with
// every weight fragment loaded straight into registers — no shared-memory staging of weights, no
// split of K between warps — and the next super-block's loads in flight while the current one is
// multiplied. The tile's inputs (its pairs' q8 values and scales) are copied to shared memory once
// per block when `staged` (the host gives the dynamic shared memory), else read from global memory.
// Warp w of block (x, y) takes 16 weight rows of tile x over all of K: without w2, rows
// 16·(MMQ_WARPS·y + w) ..; with w2, warps 0 and 1 take gate's rows 32·y + 16·w .. and warps 2 and 3
// the same rows of up, whose warps then apply SwiGLU to gate's sums (through shared memory).
//
// Per 32-weight sub-block j: one mma over the quants (the exact Σq·x of 16 rows × 8 pairs) and one
// over the sub-block's 6-bit min broadcast to all 32 k (A = min_j(row) in every byte), which gives
// min_j · Σx exactly in int32 — the min term without the pairs' sums. Then sq += dx_j · (scale_j ·
// Σq·x) and sm += dx_j · (min_j · Σx) (the integer products are exact and below 2^24 — |scale ·
// Σq·x| ≤ 63 · 32 · 15 · 127 — so their conversion to f32 is exact), and per super-block acc +=
// d · sq − dmin · sm: ggml's d·scale·q − dmin·min regrouped (mmq_superblock, which the dense block
// shares). A (pair, row)'s sum runs over the super-blocks and sub-blocks in one order whatever the
// tile's other pairs, so a pair's result does not depend on which pairs share its pass (tested).
//
// Measured on the H200 (docs/performance.md, thirty-third session), 16-token step of the synthetic
// 30B: gate/up 53.4 µs and down 28.6 µs against the per-pair kernels' 67.1 and 47.3. Tried there
// and slower: loads two super-blocks ahead (100 registers: 77 µs), weights loaded without L1
// allocation (63 µs), the warp's rows or the super-block after next prefetched into L2 (62, 57 µs),
// inputs from global memory instead of shared (60 µs), the first super-block's loads issued before
// the inputs' staging (53.1 against 52.4 µs), each warp's weights copied into shared memory with
// cp.async one or two super-blocks ahead (85 / 96 registers: 56.9 / 55.5 against 53.3 µs).
#define MMQ_WARPS 4

// Dynamic shared memory of a staged block for K-value rows (its size: the host's
// `mmq_smem_bytes`, src/cuda/moe_mma.rs): MMA_TN q8 rows at a pitch of K + 32 bytes (pair g's
// 8-byte pieces at g·(K + 32) + 8t fall on distinct banks), then their MMA_TN · K / 32 f32 scales.
#define MMQ_PITCH(K) ((K) + 32)

// One super-block of rows g and g + 8 of a warp's 16 (headers and quants; thread t's 8-byte pieces
// 32c + 8t of each 32-byte chunk c, the fragment order above).
struct MmqSb {
    uint4 ha, hb;
    uint2 qa[4], qb[4];
};

__device__ __forceinline__ MmqSb mmq_load(const uint8_t* __restrict__ ra,
                                          const uint8_t* __restrict__ rb, int t) {
    MmqSb s;
    s.ha = __ldg((const uint4*)ra);
    s.hb = __ldg((const uint4*)rb);
#pragma unroll
    for (int c = 0; c < 4; c++) {
        s.qa[c] = __ldg((const uint2*)(ra + 16 + 32 * c + 8 * t));
        s.qb[c] = __ldg((const uint2*)(rb + 16 + 32 * c + 8 * t));
    }
    return s;
}

// A Q4_K header's 8 scales (sc[0]: sub-blocks 0..3, sc[1]: 4..7, a byte each) and 8 mins (mn),
// ggml's get_scale_min_k4 on whole words (q4k_head_scale_min one sub-block at a time).
__device__ __forceinline__ void mmq_scales(const uint4& h, uint32_t (&sc)[2], uint32_t (&mn)[2]) {
    sc[0] = h.y & 0x3F3F3F3Fu;
    mn[0] = h.z & 0x3F3F3F3Fu;
    sc[1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
    mn[1] = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
}

// One super-block's products for NT tiles of MMA_TN pairs: rows g and g + 8 of the warp's 16 (cur,
// each A fragment shared by the tiles) times tile n's pair slot g's inputs (xg[n], null past the
// tile: zeros) with the scales of its pair slots 2t, 2t + 1 (dxp[n][h], null past the tile);
// acc[n] (c0..c3 as C) += d · sq − dmin · sm. Tile n's sums do not depend on the other tiles.
template <int NT>
__device__ __forceinline__ void mmq_superblock(const MmqSb& cur, const int8_t* const (&xg)[NT],
                                               const float* const (&dxp)[NT][2], int sb, int t,
                                               float (&acc)[NT][4]) {
    uint32_t sca[2], mna[2], scb[2], mnb[2];
    mmq_scales(cur.ha, sca, mna);
    mmq_scales(cur.hb, scb, mnb);
    float sq[NT][4], sm[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) sq[n][i] = sm[n][i] = 0.f;
#pragma unroll
    for (int c = 0; c < 4; c++) {
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            const int j = 2 * c + hi, sh = 4 * hi, wd = j >> 2, by = j & 3;
            const uint32_t a0 = (cur.qa[c].x >> sh) & 0x0F0F0F0Fu;
            const uint32_t a1 = (cur.qb[c].x >> sh) & 0x0F0F0F0Fu;
            const uint32_t a2 = (cur.qa[c].y >> sh) & 0x0F0F0F0Fu;
            const uint32_t a3 = (cur.qb[c].y >> sh) & 0x0F0F0F0Fu;
            // min_j of row g (a) and of row g + 8 (b) in every byte of A.
            const uint32_t ma = __byte_perm(mna[wd], 0u, 0x1111u * by);
            const uint32_t mb = __byte_perm(mnb[wd], 0u, 0x1111u * by);
            const int s_a = (int)((sca[wd] >> (8 * by)) & 0xFFu);
            const int s_b = (int)((scb[wd] >> (8 * by)) & 0xFFu);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const uint2 bq = xg[n] ? *(const uint2*)(xg[n] + sb * 256 + 32 * j + 8 * t)
                                       : make_uint2(0u, 0u);
                float dx[2];
#pragma unroll
                for (int h = 0; h < 2; h++) dx[h] = dxp[n][h] ? dxp[n][h][sb * 8 + j] : 0.f;
                int ci[4] = {0, 0, 0, 0}, cm[4] = {0, 0, 0, 0};
                mma_s8_16832(ci, a0, a1, a2, a3, bq.x, bq.y);
                mma_s8_16832(cm, ma, mb, ma, mb, bq.x, bq.y);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int h = i & 1, s = i < 2 ? s_a : s_b;
                    sq[n][i] = fmaf(dx[h], (float)(s * ci[i]), sq[n][i]);
                    sm[n][i] = fmaf(dx[h], (float)cm[i], sm[n][i]);
                }
            }
        }
    }
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t hx = i < 2 ? cur.ha.x : cur.hb.x;
            acc[n][i] += fmaf(half_lo(hx), sq[n][i], -half_hi(hx) * sm[n][i]);
        }
}

// xq [*, K] int8, xd [*, K / 32] f32 (quantize_q8); w (and w2) [E, R, K] Q4_K (K a multiple of
// 256), or with `indirect` tables of E expert addresses; order [P], tiles, ntiles from moe_tc_sort
// (tiles of MMA_TN); out [P, R] f32 (with w2: silu(gate · x) · (up · x)). grid (max_tiles,
// ceil(R / 32) with w2, else ceil(R / 64)), 32·MMQ_WARPS threads, the staged inputs' dynamic
// shared memory when staged (else none).
extern "C" __global__ void __launch_bounds__(32 * MMQ_WARPS)
    moe_mmq_q8(const int8_t* __restrict__ xq, const float* __restrict__ xd,
               const uint8_t* __restrict__ w, const uint8_t* __restrict__ w2,
               const uint32_t* __restrict__ order, const uint32_t* __restrict__ tiles,
               const uint32_t* __restrict__ ntiles, float* __restrict__ out, int P, int R, int K,
               int k, int per_token, int indirect, int staged) {
    PDL_ENTER();
    extern __shared__ __align__(16) uint8_t mmq_smem[];
    __shared__ float gate_part[2][4][WARP];
    if (blockIdx.x >= *ntiles) return;  // the whole block
    const uint32_t* tl = tiles + 3 * (size_t)blockIdx.x;
    const int e = (int)tl[0], start = (int)tl[1], count = (int)tl[2];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const bool glu = w2 != nullptr;
    const int group = glu ? 2 * blockIdx.y + (warp & 1) : MMQ_WARPS * blockIdx.y + warp;
    const int r0 = 16 * group;
    auto src_of = [&](int slot) {
        const int p = (int)order[start + slot];
        return per_token ? p / k : p;
    };
    int8_t* xs = (int8_t*)mmq_smem;                          // [MMA_TN][MMQ_PITCH(K)]
    float* xds = (float*)(mmq_smem + MMA_TN * MMQ_PITCH(K));  // [MMA_TN][K / 32]
    if (staged) {
        const int per = K / 16, dper = K / 128;  // 16-byte pieces of a row and of its scales
        for (int idx = threadIdx.x; idx < count * per; idx += blockDim.x) {
            const int sl = idx / per, c = idx % per;
            cp_async16(xs + sl * MMQ_PITCH(K) + 16 * c, xq + (size_t)src_of(sl) * K + 16 * c);
        }
        for (int idx = threadIdx.x; idx < count * dper; idx += blockDim.x) {
            const int sl = idx / dper, c = idx % dper;
            cp_async16(xds + sl * (K / 32) + 4 * c, xd + (size_t)src_of(sl) * (K / 32) + 4 * c);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
    }
    if (!glu && r0 >= R) return;  // the warp (no block barrier after this without w2)
    const int nb = K / 256;
    const size_t row_bytes = (size_t)nb * Q4K_BYTES;
    const uint8_t* base = expert_weights(glu && warp >= 2 ? w2 : w, indirect, e, (size_t)R * row_bytes);
    const uint8_t* ra = base + (size_t)min(r0 + g, R - 1) * row_bytes;
    const uint8_t* rb = base + (size_t)min(r0 + g + 8, R - 1) * row_bytes;
    // B: pair slot g's inputs; C: pair slots 2t, 2t + 1 (dst -1: past the tile, never written).
    const int8_t* xg = nullptr;
    if (g < count) xg = staged ? xs + g * MMQ_PITCH(K) : xq + (size_t)src_of(g) * K;
    int dst[2];
    const float* dxp[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int slot = 2 * t + h;
        dst[h] = slot < count ? (int)order[start + slot] : -1;
        dxp[h] = slot >= count ? nullptr
                 : staged      ? xds + slot * (K / 32)
                               : xd + (size_t)src_of(slot) * (K / 32);
    }
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    const int8_t* const xg1[1] = {xg};
    const float* const dxp1[1][2] = {{dxp[0], dxp[1]}};
    const bool live = r0 < R;
    MmqSb cur = mmq_load(ra, rb, t);
#pragma unroll 1
    for (int sb = 0; live && sb < nb; sb++) {
        // The next super-block's loads in flight during this one's products (the last one loads
        // itself again: L1 hits, no branch). The dense block's mmqd_warp runs the same loop over a
        // warp's share of K; called here instead (stride 1), it made this kernel 76 or 80
        // registers instead of 72 (ptxas, sm_90), so the loop is kept twice.
        const size_t on = (size_t)min(sb + 1, nb - 1) * Q4K_BYTES;
        const MmqSb nxt = mmq_load(ra + on, rb + on, t);
        mmq_superblock<1>(cur, xg1, dxp1, sb, t, acc);
        cur = nxt;
    }
    if (glu) {
        if (warp < 2) {
#pragma unroll
            for (int i = 0; i < 4; i++) gate_part[warp][i][lane] = acc[0][i];
        }
        __syncthreads();
        if (warp < 2) return;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int h = i & 1, r = r0 + g + (i < 2 ? 0 : 8);
        if (dst[h] < 0 || r >= R) continue;
        float v = acc[0][i];
        if (glu) {
            const float gs = gate_part[warp - 2][i][lane];
            v = gs / (1.f + expf(-gs)) * acc[0][i];
        }
        out[(size_t)dst[h] * R + r] = v;
    }
}

// ---------------------------------------------------------------------------------------------
// Dense products of a few rows (q4k_mm3_q8): the arithmetic of moe_mmq_q8 (mmq_load,
// mmq_superblock) over one matrix. Block (x, rb) takes the 16 weight rows of group rb and the
// pass's rows 16·x .. (two tiles of MMA_TN: each weight fragment loaded once into registers serves
// both); its warps split K — warp w takes super-blocks w, w + nw, .. (nw = blockDim.x / 32, up to
// MMQD_WARPS_MAX; the host gives two super-blocks a warp), loading the next one into registers
// while the current one is multiplied — and their sums are added in warp order through shared
// memory. A row's sum thus runs over the super-blocks and sub-blocks in one order whatever the
// other rows of the pass (tested: a row alone = the same row in a pass).
//
// The block this replaced (twentieth to thirty-third sessions) staged its 16 rows in shared memory
// with cp.async, waited for every byte before its first product, took Σx of each sub-block with
// dp4a and shuffles, and ran each tile of 8 rows in its own block (each weight read twice for 16).
#define MMQD_WARPS_MAX 8

// A dense block's warp: super-blocks warp, warp + nw, .. of rows ra / rb8 (g and g + 8) for NT
// tiles, the next super-block's loads in flight during this one's products (the last one loads
// itself again: L1 hits, no branch).
template <int NT>
__device__ __forceinline__ void mmqd_warp(const uint8_t* ra, const uint8_t* rb8,
                                          const int8_t* const (&xg)[NT],
                                          const float* const (&dxp)[NT][2], int warp, int nw,
                                          int nb, int t, float (&acc)[NT][4]) {
    MmqSb cur = mmq_load(ra + (size_t)warp * Q4K_BYTES, rb8 + (size_t)warp * Q4K_BYTES, t);
#pragma unroll 1
    for (int sb = warp; sb < nb; sb += nw) {
        const size_t on = (size_t)(sb + nw < nb ? sb + nw : sb) * Q4K_BYTES;
        const MmqSb nxt = mmq_load(ra + on, rb8 + on, t);
        mmq_superblock<NT>(cur, xg, dxp, sb, t, acc);
        cur = nxt;
    }
}

// xq [*, K] int8, xd [*, K / 32] f32 (quantize_q8); w [R, K] Q4_K (K a multiple of 256); out [P, R]
// f32 = x · Wᵀ for rows 16·blockIdx.x .. of x, weight rows 16·rb ..
__device__ __forceinline__ void q4k_mm_q8_block(const int8_t* __restrict__ xq,
                                                const float* __restrict__ xd,
                                                const uint8_t* __restrict__ w,
                                                float* __restrict__ out, int P, int R, int K,
                                                int rb) {
    __shared__ float part[MMQD_WARPS_MAX - 1][2][4][WARP];
    const int start = blockIdx.x * 2 * MMA_TN;
    if (start >= P) return;
    const int count = min(2 * MMA_TN, P - start);
    const int r0 = rb * MMA_ROWS;
    if (r0 >= R) return;  // the whole block
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const int nw = min((int)(blockDim.x / WARP), MMQD_WARPS_MAX);
    const int nb = K / 256;
    const size_t row_bytes = (size_t)nb * Q4K_BYTES;
    const uint8_t* ra = w + (size_t)min(r0 + g, R - 1) * row_bytes;
    const uint8_t* rb8 = w + (size_t)min(r0 + g + 8, R - 1) * row_bytes;
    // Tile n: B from row slot 8n + g; C to row slots 8n + 2t, 8n + 2t + 1 (dst -1: past the pass).
    const int8_t* xg[2];
    const float* dxp[2][2];
    int dst[2][2];
#pragma unroll
    for (int n = 0; n < 2; n++) {
        const int sg = MMA_TN * n + g;
        xg[n] = sg < count ? xq + (size_t)(start + sg) * K : nullptr;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int slot = MMA_TN * n + 2 * t + h;
            dst[n][h] = slot < count ? start + slot : -1;
            dxp[n][h] = slot < count ? xd + (size_t)(start + slot) * (K / 32) : nullptr;
        }
    }
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    if (warp < nb && warp < nw) {
        if (count > MMA_TN) {
            mmqd_warp<2>(ra, rb8, xg, dxp, warp, nw, nb, t, acc);
        } else {
            // One tile: the first tile's sums alone (the same operations as with two).
            const int8_t* const xg1[1] = {xg[0]};
            const float* const dxp1[1][2] = {{dxp[0][0], dxp[0][1]}};
            float acc1[1][4] = {{0.f, 0.f, 0.f, 0.f}};
            mmqd_warp<1>(ra, rb8, xg1, dxp1, warp, nw, nb, t, acc1);
#pragma unroll
            for (int i = 0; i < 4; i++) acc[0][i] = acc1[0][i];
        }
    }
    // The warps' sums, added in warp order by warp 0.
    if (warp > 0 && warp < nw) {
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) part[warp - 1][n][i][lane] = acc[n][i];
    }
    __syncthreads();
    if (warp > 0) return;
    for (int v = 0; v < nw - 1; v++) {
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[n][i] = __fadd_rn(acc[n][i], part[v][n][i][lane]);
    }
#pragma unroll
    for (int n = 0; n < 2; n++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int h = i & 1, r = r0 + g + (i < 2 ? 0 : 8);
            if (dst[n][h] < 0 || r >= R) continue;
            out[(size_t)dst[n][h] * R + r] = acc[n][i];
        }
    }
}

// A dense block's 16 weight rows (group rb of W [R, K] Q4_K) into L2 before the PDL wait (the
// weights are constant, so they may be fetched while the previous kernel still runs); warp 0.
__device__ __forceinline__ void mma_dense_prefetch(const uint8_t* w, int R, int K, int rb) {
    const int r0 = rb * MMA_ROWS;
    if (threadIdx.x >= WARP || r0 >= R) return;
    const size_t row_bytes = (size_t)(K / 256) * Q4K_BYTES;
    l2_prefetch(w + r0 * row_bytes, (uint32_t)(min(MMA_ROWS, R - r0) * row_bytes), threadIdx.x, WARP);
}

// Up to three dense products over the same inputs in one launch (a layer's q, k and v):
// out_m = x · W_mᵀ for W_m [R_m, K] Q4_K (w1, w2 null / R = 0 when absent), out_m [P, R_m].
// grid (ceil(P / (2 · MMA_TN)), Σ ceil(R_m / MMA_ROWS)), 32 · nw threads (nw warps split K):
// blockIdx.y walks W0's row groups, then W1's, then W2's; each block runs q4k_mm_q8_block over its
// matrix, so every output equals that matrix's own launch (R1 = R2 = 0) bit for bit.
extern "C" __global__ void __launch_bounds__(32 * MMQD_WARPS_MAX)
    q4k_mm3_q8(const int8_t* __restrict__ xq, const float* __restrict__ xd,
               const uint8_t* __restrict__ w0, const uint8_t* __restrict__ w1,
               const uint8_t* __restrict__ w2, float* __restrict__ out0, float* __restrict__ out1,
               float* __restrict__ out2, int P, int R0, int R1, int R2, int K) {
    PDL_LAUNCH();
    const int g0 = (R0 + MMA_ROWS - 1) / MMA_ROWS, g1 = (R1 + MMA_ROWS - 1) / MMA_ROWS;
    int rb = blockIdx.y;
    const uint8_t* w = w0;
    float* out = out0;
    int R = R0;
    if (rb >= g0 + g1) {
        rb -= g0 + g1;
        w = w2;
        out = out2;
        R = R2;
    } else if (rb >= g0) {
        rb -= g0;
        w = w1;
        out = out1;
        R = R1;
    }
    mma_dense_prefetch(w, R, K, rb);
    PDL_WAIT();
    q4k_mm_q8_block(xq, xd, w, out, P, R, K, rb);
}
