// Q4_K products of a few rows over q8 activations on int8 tensor cores (mma.m16n8k32), for
// decode steps, batched steps and verify passes: a MoE layer's (token, slot) pairs grouped by
// expert (moe_tc_sort with tiles of MMA_TN pairs), so that each selected expert's weights are
// read once for all of the pass's tokens routed to it instead of once per pair. Included by
// decode.cu after moe_tc.cuh and mv_q8.cuh.
//
// The arithmetic is llama.cpp's MMQ for Q4_K × Q8_1 (ggml-cuda mmq.cuh, `vec_dot_q4_K_q8_1_mma`):
// a sub-block of 32 weights is one k-step of the instruction — its 4-bit quants (0..15) times the
// token's 8-bit inputs, summed exactly in int32 — then scaled: ggml's weight d·scale·q − dmin·min
// applied as d·Σⱼ scaleⱼ·dxⱼ·Σq·x − dmin·Σⱼ minⱼ·dxⱼ·Σx over the super-block's 8 sub-blocks j (dxⱼ
// the input's q8 scale). Each (pair, row) sum is kept by one thread and runs over the super-blocks
// and sub-blocks in the same order whatever the tile's other pairs, so a pair's result does not
// depend on which pairs share its pass (tested: a token alone = the same token in a batch).
//
//  q4k_mm_q8   out[p, r] = W_e[r, :] · x[s(p), :] for the pairs p of a tile (s(p) = p / k when
//              per_token, else p); or, order null, a dense product out = x · Wᵀ over tiles of
//              MMA_TN consecutive rows. With w2 (SwiGLU's up beside gate) out = silu(gate · x) ·
//              (up · x).
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k32", .s8): lane = 4·g + t; A (16×32,
// weight rows × k): a0 row g, k 4t..4t+3; a1 row g + 8, same k; a2 row g, k 16 + 4t..; a3 row
// g + 8, k 16 + 4t..; B (32×8, k × pairs): b0 k 4t.., pair g; b1 k 16 + 4t.., pair g; C (16×8):
// c0, c1 row g, pairs 2t, 2t + 1; c2, c3 row g + 8.

#define MMA_TN 8                 // pairs per tile (the instruction's n)
#define MMA_WARPS 4              // warps per block: the same 16 weight rows, super-blocks split
#define MMA_ROWS 16              // weight rows per block

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

// One matrix's share of a warp's super-block from shared memory: rows g and g + 8 of the block's
// 16 (ra, rb: their super-block's 144 bytes), over the 8 sub-blocks' B fragments bq and input
// scales dx / sx (pairs 2t, 2t + 1: dx[h][j] the q8 scale, sx[h][j] = dx·Σq of sub-block j).
// acc: c0..c3 as C.
__device__ __forceinline__ void q4k_mma_superblock(const uint8_t* ra, const uint8_t* rb,
                                                   const uint2 (&bq)[8], const float (&dx)[2][8],
                                                   const float (&sx)[2][8], int t,
                                                   float (&acc)[4]) {
    const uint4 ha = *(const uint4*)ra, hb = *(const uint4*)rb;
    float sq[4] = {0.f, 0.f, 0.f, 0.f}, sm[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < 4; c++) {
        const uint2 qa = *(const uint2*)(ra + 16 + 32 * c + 8 * t);
        const uint2 qb = *(const uint2*)(rb + 16 + 32 * c + 8 * t);
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            const int j = 2 * c + hi, sh = 4 * hi;
            int ci[4] = {0, 0, 0, 0};
            mma_s8_16832(ci, (qa.x >> sh) & 0x0F0F0F0Fu, (qb.x >> sh) & 0x0F0F0F0Fu,
                         (qa.y >> sh) & 0x0F0F0F0Fu, (qb.y >> sh) & 0x0F0F0F0Fu, bq[j].x, bq[j].y);
            float s_a, m_a, s_b, m_b;
            q4k_head_scale_min(ha, j, s_a, m_a);
            q4k_head_scale_min(hb, j, s_b, m_b);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int h = i & 1;
                const float s = i < 2 ? s_a : s_b, m = i < 2 ? m_a : m_b;
                sq[i] = __fadd_rn(sq[i], __fmul_rn(s, __fmul_rn(dx[h][j], (float)ci[i])));
                sm[i] = __fadd_rn(sm[i], __fmul_rn(m, sx[h][j]));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t hx = i < 2 ? ha.x : hb.x;
        acc[i] = __fadd_rn(acc[i], __fsub_rn(__fmul_rn(half_lo(hx), sq[i]),
                                             __fmul_rn(half_hi(hx), sm[i])));
    }
}

#define MMA_SB 8                              // super-blocks staged per round
#define MMA_PITCH (MMA_SB * Q4K_BYTES + 32)   // a staged row's bytes (padded off the banks)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}

// xq [*, K] int8, xd [*, K / 32] f32 (quantize_q8); w (and w2) [E, R, K] Q4_K (K a multiple of
// 256); order [P], tiles, ntiles from moe_tc_sort (tiles of MMA_TN), or all three null for a dense
// product over [R, K] (tile x = rows MMA_TN·x ..); out [P, R] f32; indirect: w and w2 are tables of
// E expert addresses (expert_weights). grid (max_tiles, ceil(R / MMA_ROWS)), 32·MMA_WARPS threads.
// The block's 16 weight rows (of each matrix) are copied to shared memory MMA_SB super-blocks at a
// time (cp.async: every byte of a round in flight at once), then warp w takes super-blocks w,
// w + MMA_WARPS, .. of the round, and the warps' sums are added in warp order (a fixed order: the
// same whatever the tile's pairs). `rb`: the block's 16-row group of W (blockIdx.y for q4k_mm_q8).
__device__ __forceinline__ void q4k_mm_q8_block(
    const int8_t* __restrict__ xq, const float* __restrict__ xd, const uint8_t* __restrict__ w,
    const uint8_t* __restrict__ w2, const uint32_t* __restrict__ order,
    const uint32_t* __restrict__ tiles, const uint32_t* __restrict__ ntiles,
    float* __restrict__ out, int P, int R, int K, int k, int per_token, int indirect, int rb) {
    __shared__ __align__(16) uint8_t wsm[2][MMA_ROWS][MMA_PITCH];
    __shared__ float part[MMA_WARPS - 1][8][WARP];
    int e = 0, start, count;
    if (order) {
        const uint32_t* tl = tiles + 3 * (size_t)blockIdx.x;  // inside the table even past ntiles
        const uint32_t nt = *ntiles, te = tl[0], ts = tl[1], tc = tl[2];
        if (blockIdx.x >= nt) return;
        e = (int)te;
        start = (int)ts;
        count = (int)tc;
    } else {
        start = blockIdx.x * MMA_TN;
        if (start >= P) return;
        count = min(MMA_TN, P - start);
    }
    const int r0 = rb * MMA_ROWS;
    if (r0 >= R) return;  // the whole block
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, g = lane >> 2, t = lane & 3;
    const int mats = w2 ? 2 : 1, nb = K / 256;
    const size_t row_bytes = (size_t)nb * Q4K_BYTES, stride = (size_t)R * row_bytes;
    const uint8_t* base[2] = {expert_weights(w, indirect, e, stride),
                              w2 ? expert_weights(w2, indirect, e, stride) : nullptr};
    // Issues round sb0's copies: MMA_SB (or fewer) super-blocks of 16 rows of each matrix.
    auto stage = [&](int sb0) {
        const int nsb = min(MMA_SB, nb - sb0), per_row = nsb * (Q4K_BYTES / 16);
        for (int idx = tid; idx < mats * MMA_ROWS * per_row; idx += 32 * MMA_WARPS) {
            const int m = idx / (MMA_ROWS * per_row), rem = idx % (MMA_ROWS * per_row);
            const int r = rem / per_row, c = rem % per_row;
            const uint8_t* src = base[m] + (size_t)min(r0 + r, R - 1) * row_bytes +
                                 (size_t)sb0 * Q4K_BYTES + 16 * c;
            cp_async16(&wsm[m][r][16 * c], src);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    stage(0);
    auto pair_at = [&](int slot) { return order ? (int)order[start + slot] : start + slot; };
    auto src_of = [&](int p) { return per_token ? p / k : p; };
    // B: pair slot g's inputs; C: pair slots 2t, 2t + 1 (-1: past the tile, never written).
    const int8_t* xg = g < count ? xq + (size_t)src_of(pair_at(g)) * K : nullptr;
    int dst[2];
    const float* dxp[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int slot = 2 * t + h;
        dst[h] = slot < count ? pair_at(slot) : -1;
        dxp[h] = slot < count ? xd + (size_t)src_of(dst[h]) * (K / 32) : nullptr;
    }
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, acc2[4] = {0.f, 0.f, 0.f, 0.f};
    for (int sb0 = 0; sb0 < nb; sb0 += MMA_SB) {
        if (sb0 > 0) {
            __syncthreads();  // every warp is done with the previous round
            stage(sb0);
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        for (int sb = sb0 + warp; sb < min(nb, sb0 + MMA_SB); sb += MMA_WARPS) {
            uint2 bq[8];
            float dx[2][8], sx[2][8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                // Sub-block j holds positions 32j .. 32j + 31 of the super-block.
                bq[j] = xg ? *(const uint2*)(xg + sb * 256 + 32 * j + 8 * t) : make_uint2(0u, 0u);
                // Σq of pair g's sub-block (exact), then those of pairs 2t and 2t + 1.
                int s = __dp4a((int)bq[j].y, 0x01010101, __dp4a((int)bq[j].x, 0x01010101, 0));
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                const int s0 = __shfl_sync(0xffffffffu, s, 8 * t);
                const int s1 = __shfl_sync(0xffffffffu, s, 8 * t + 4);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    dx[h][j] = dxp[h] ? dxp[h][sb * 8 + j] : 0.f;
                    sx[h][j] = __fmul_rn(dx[h][j], (float)(h ? s1 : s0));
                }
            }
            const int o = (sb - sb0) * Q4K_BYTES;
            q4k_mma_superblock(&wsm[0][g][o], &wsm[0][g + 8][o], bq, dx, sx, t, acc);
            if (w2) q4k_mma_superblock(&wsm[1][g][o], &wsm[1][g + 8][o], bq, dx, sx, t, acc2);
        }
    }
    // The warps' sums, added in warp order by warp 0.
    if (warp > 0) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            part[warp - 1][i][lane] = acc[i];
            part[warp - 1][4 + i][lane] = acc2[i];
        }
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int v = 0; v < MMA_WARPS - 1; v++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            acc[i] = __fadd_rn(acc[i], part[v][i][lane]);
            acc2[i] = __fadd_rn(acc2[i], part[v][4 + i][lane]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int h = i & 1, r = r0 + g + (i < 2 ? 0 : 8);
        if (dst[h] < 0 || r >= R) continue;
        const float v = w2 ? acc[i] / (1.f + expf(-acc[i])) * acc2[i] : acc[i];
        out[(size_t)dst[h] * R + r] = v;
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

extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)
    q4k_mm_q8(const int8_t* __restrict__ xq, const float* __restrict__ xd,
              const uint8_t* __restrict__ w, const uint8_t* __restrict__ w2,
              const uint32_t* __restrict__ order, const uint32_t* __restrict__ tiles,
              const uint32_t* __restrict__ ntiles, float* __restrict__ out, int P, int R, int K,
              int k, int per_token, int indirect) {
    PDL_LAUNCH();
    if (!order) mma_dense_prefetch(w, R, K, blockIdx.y);
    PDL_WAIT();
    q4k_mm_q8_block(xq, xd, w, w2, order, tiles, ntiles, out, P, R, K, k, per_token, indirect,
                    blockIdx.y);
}

// Up to three dense products over the same inputs in one launch (a layer's q, k and v):
// out_m = x · W_mᵀ for W_m [R_m, K] Q4_K (w1, w2 null / R = 0 when absent), out_m [P, R_m].
// grid (ceil(P / MMA_TN), Σ ceil(R_m / MMA_ROWS)): blockIdx.y walks W0's row groups, then W1's,
// then W2's; each block runs as q4k_mm_q8's dense block over its matrix, so every output equals
// that matrix's own q4k_mm_q8 launch bit for bit.
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS)
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
    q4k_mm_q8_block(xq, xd, w, nullptr, nullptr, nullptr, nullptr, out, P, R, K, 1, 0, 0, rb);
}
