// Prompt-pass attention on tensor cores over an f16 KV cache: FlashAttention-2 (Dao 2023,
// "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", Algorithm 1:
// query tiles per block, an online softmax over key/value tiles, the score tile never leaves the
// registers). Included by decode.cu. The code is ours; the fragment layouts are those of PTX's
// mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
//
//  attn_prefill_f16_hd{64,128,256}
//      q [seq, nh, hd] f32 (rotated), cache k, v [nkv, cap, hd] f16 (this pass's rows already
//      written) -> out [seq, nh * hd] f32; row i attends positions [0, pos + i].
//  attn_prefill_rows_f16_hd{64,128,256}
//      the same for a batched prompt pass over several sequences in one launch: q and out hold
//      every sequence's rows; per sequence (grid z) its rows, first position and, through the
//      row table (decode.cu's RowKv) entry of its first row, its cache.
//  attn_decode_tc_f16_hd{64,128,256}
//      the same for decode steps and verify passes (a few rows), split over chunks of positions
//      (FlashDecoding: grid z = splits of `chunk` positions, a multiple of the key tile) into
//      partials part [seq, nh, splits, hd + 2] (unnormalised output, natural-log maximum, sum)
//      that attn_combine merges; pos_dev (nullable): the position read from the device (a
//      captured CUDA graph; splits past a row's length give empty partials); rows_tab
//      (nullable): a batched pass's row table (decode.cu's RowKv), one block column per row, each
//      over its own sequence's cache. The block's warps that hold no query row only copy tiles.
//
// A block takes one kv head and FA_BM "query rows" of its n_rep query heads, numbered t = i·n_rep
// + r (token i, head kvh·n_rep + r): the heads that share the kv head share its key/value tiles,
// and a tile's tokens are few and adjacent, so the causal bound is tight. Each of the 4 warps owns
// 16 rows: their queries as f16 A fragments in registers, the scores S = Q·Kᵀ of a tile of FA_BN
// positions and the output O in f32 accumulators. The softmax runs in f32 on S (base 2, scale ·
// log2 e folded in); P = exp2(S − m) is rounded to f16 and reused as the A fragments of O += P·V
// without a trip through shared memory. Key and value tiles are copied with cp.async into one
// buffer each: V's copy overlaps Q·Kᵀ, the next K's copy overlaps P·V.
// Rounding: q and P to f16 (the cache already is); products and sums in f32.

#define FA_BM 64
#define FA_WARPS 4
#define FA_THREADS (FA_WARPS * WARP)

__device__ __forceinline__ void fa_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8×8 f16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void fa_ldsm(uint32_t (&r)[4], const __half* p) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// The same, transposed (each lane receives a column pair instead of a row pair).
__device__ __forceinline__ void fa_ldsm_t(uint32_t (&r)[4], const __half* p) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// 16 bytes global -> shared, asynchronously; zeros when !ok (src is then not read).
__device__ __forceinline__ void fa_cp16(__half* dst, const __half* src, bool ok) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
                 "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void fa_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void fa_cp_wait() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ uint32_t fa_pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *(const uint32_t*)&h;
}

// Rows [j0, j0 + BN) of one kv head's cache [cap, HD] into s [BN][HD + 8]; rows >= n are zeros.
template <int HD, int BN>
__device__ __forceinline__ void fa_load_tile(__half* s, const __half* __restrict__ g, int j0,
                                             int n) {
    constexpr int CH = HD / 8;  // 16-byte chunks per row
#pragma unroll
    for (int c = threadIdx.x; c < BN * CH; c += FA_THREADS) {
        const int r = c / CH, x = c % CH;
        const bool ok = j0 + r < n;
        fa_cp16(s + r * (HD + 8) + x * 8, ok ? g + (size_t)(j0 + r) * HD + x * 8 : g, ok);
    }
    fa_cp_commit();
}

// grid (ceil(n_rep · seq / FA_BM), nkv, splits), FA_THREADS threads. scale: the softmax scale
// (1/√hd). part null: out is written (one split); else split z's partials (chunk positions each).
template <int HD, int BN>
__device__ void attn_tc_impl(const float* __restrict__ q, const __half* __restrict__ ck,
                             const __half* __restrict__ cv, float* __restrict__ out,
                             float* __restrict__ part, int nh, int nkv, int cap, int pos, int seq,
                             float scale, int chunk, const uint32_t* __restrict__ pos_dev,
                             const uint32_t* __restrict__ rows_tab,
                             const uint32_t* __restrict__ segs) {
    if (pos_dev) pos = (int)*pos_dev;
    // With a row table (a batched pass over several sequences), block x takes batch row x alone:
    // its query heads over its own sequence's cache up to its position. With segments as well
    // (a batched prompt pass, one split), block column z takes sequence z: its rows segs[3z] ..
    // + segs[3z + 1] from position segs[3z + 2] over the cache of its first row's table entry,
    // in the tiles a launch over that sequence alone would have (the same tiles, the same
    // arithmetic: the same bits).
    int row0 = 0, tiles = gridDim.x;
    if (segs) {
        const uint32_t* sg = segs + 3 * (size_t)blockIdx.z;
        row0 = (int)sg[0];
        seq = (int)sg[1];
        pos = (int)sg[2];
        tiles = (nh / nkv * seq + FA_BM - 1) / FA_BM;
        if ((int)blockIdx.x >= tiles) return;  // the whole block
        const RowKv<__half> r = row_kv<__half>(rows_tab, row0);
        ck = r.k;
        cv = r.v;
    } else if (rows_tab) {
        const RowKv<__half> r = row_kv<__half>(rows_tab, blockIdx.x);
        row0 = blockIdx.x;
        pos = r.pos;
        ck = r.k;
        cv = r.v;
        seq = 1;
    }
    constexpr int LD = HD + 8;  // f16 pitch: rows 16-byte aligned, ldmatrix off the banks
    constexpr int QS = HD / 16, NT = BN / 8, DT = HD / 8;
    static_assert(2 * BN >= FA_BM, "the query tile is staged in the key and value buffers");
    __shared__ __align__(16) __half Ks[BN * LD];
    __shared__ __align__(16) __half Vs[BN * LD];
    const int n_rep = nh / nkv, rows = n_rep * seq;
    const int kvh = blockIdx.y;
    // The longest-running tiles (the last tokens) first.
    const int t0 = rows_tab && !segs ? 0 : (tiles - 1 - blockIdx.x) * FA_BM;
    const int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    const __half* kb = ck + (size_t)kvh * cap * HD;
    const __half* vb = cv + (size_t)kvh * cap * HD;

    // Stage the tile's queries (f16) across Ks and Vs, take the warp's A fragments.
    // FA_BM rows of pitch LD: the first BN in Ks, the rest in Vs.
    for (int c = threadIdx.x; c < FA_BM * HD / 4; c += FA_THREADS) {
        const int r = c / (HD / 4), x = (c % (HD / 4)) * 4, t = t0 + r;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (t < rows) {
            const int i = row0 + t / n_rep, h = kvh * n_rep + t % n_rep;
            v = *(const float4*)(q + ((size_t)i * nh + h) * HD + x);
        }
        __half* d = (r < BN ? Ks + r * LD : Vs + (r - BN) * LD) + x;
        *(__half2*)d = __floats2half2_rn(v.x, v.y);
        *(__half2*)(d + 2) = __floats2half2_rn(v.z, v.w);
    }
    __syncthreads();
    uint32_t qf[QS][4];
    {
        const int r = w * 16 + (lane & 15);
        const __half* row = r < BN ? Ks + r * LD : Vs + (r - BN) * LD;
#pragma unroll
        for (int kk = 0; kk < QS; kk++) fa_ldsm(qf[kk], row + kk * 16 + (lane >> 4) * 8);
    }
    __syncthreads();

    // This thread's two rows (g and g + 8 of the warp's 16) and the positions they may see.
    const int last = min(t0 + FA_BM, rows) - 1;
    const int lim_min = pos + t0 / n_rep;  // positions every row of the tile sees
    // This split's positions [j_first, n_end): those any row of the tile sees.
    const int split = blockIdx.z, j_first = split * chunk;
    const int n_end = min(pos + last / n_rep + 1, part ? j_first + chunk : 0x7fffffff);
    const bool active = t0 + w * 16 < rows;  // the warp holds query rows
    int lim[2];
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int t = min(t0 + w * 16 + lane / 4 + 8 * e, rows - 1);
        lim[e] = pos + t / n_rep;
    }
    const float sl = scale * 1.4426950408889634f;  // log2(e)
    float o[DT][4], m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;

    if (j_first < n_end) fa_load_tile<HD, BN>(Ks, kb, j_first, n_end);
    for (int j0 = j_first; j0 < n_end; j0 += BN) {
        fa_cp_wait();
        __syncthreads();  // K[j0] in; every warp is done with V of the last tile
        fa_load_tile<HD, BN>(Vs, vb, j0, n_end);
        uint32_t pa[BN / 16][4];
        float corr[2];
        if (active) {
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < QS; kk++) {
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                uint32_t b[4];
                fa_ldsm(b, Ks + (nt * 8 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 +
                               ((lane >> 3) & 1) * 8);
                fa_mma(s[nt], qf[kk], b[0], b[1]);
                fa_mma(s[nt + 1], qf[kk], b[2], b[3]);
            }
        }
        // Online softmax of the thread's two rows (each row's values sit in a quad of lanes).
        const bool masked = j0 + BN - 1 > lim_min;
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int e = c / 2, col = j0 + nt * 8 + 2 * (lane % 4) + c % 2;
                float x = s[nt][c] * sl;
                if (masked && col > lim[e]) x = -CUDART_INF_F;
                s[nt][c] = x;
                mx[e] = fmaxf(mx[e], x);
            }
        }
#pragma unroll
        for (int e = 0; e < 2; e++) {
            mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
            mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
            // A row that has seen no position yet (a split past its end) keeps m = −∞: its
            // weights are 0 and its state stays zero (no −∞ − −∞).
            const float mref = mx[e] == -CUDART_INF_F ? 0.f : mx[e];
            corr[e] = exp2f(m[e] - mref);  // 0 on the row's first tile (m = −∞)
            m[e] = mx[e];
            l[e] *= corr[e];
            mx[e] = mref;
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float p0 = exp2f(s[nt][0] - mx[0]), p1 = exp2f(s[nt][1] - mx[0]);
            const float p2 = exp2f(s[nt][2] - mx[1]), p3 = exp2f(s[nt][3] - mx[1]);
            l[0] += p0 + p1;
            l[1] += p2 + p3;
            // The accumulator of n-tiles 2k, 2k + 1 is the A fragment of k-step k.
            pa[nt / 2][(nt % 2) * 2] = fa_pack(p0, p1);
            pa[nt / 2][(nt % 2) * 2 + 1] = fa_pack(p2, p3);
        }
#pragma unroll
        for (int d = 0; d < DT; d++) {
            o[d][0] *= corr[0];
            o[d][1] *= corr[0];
            o[d][2] *= corr[1];
            o[d][3] *= corr[1];
        }
        }  // active
        fa_cp_wait();
        __syncthreads();  // V[j0] in; every warp is done with K[j0]
        if (j0 + BN < n_end) fa_load_tile<HD, BN>(Ks, kb, j0 + BN, n_end);
        if (!active) continue;
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
            for (int d = 0; d < DT; d += 2) {
                uint32_t b[4];
                fa_ldsm_t(b, Vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + d * 8 +
                                 (lane >> 4) * 8);
                fa_mma(o[d], pa[kk], b[0], b[1]);
                fa_mma(o[d + 1], pa[kk], b[2], b[3]);
            }
        }
    }

#pragma unroll
    for (int e = 0; e < 2; e++) {
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
        const int t = t0 + w * 16 + lane / 4 + 8 * e;
        if (t >= rows) continue;
        const int i = row0 + t / n_rep, h = kvh * n_rep + t % n_rep;
        if (part) {
            // Unnormalised, with the maximum in natural-log units (attn_combine's partials).
            float* pp = part + (((size_t)i * nh + h) * gridDim.z + split) * (HD + 2);
#pragma unroll
            for (int d = 0; d < DT; d++)
                *(float2*)(pp + d * 8 + 2 * (lane % 4)) = make_float2(o[d][2 * e], o[d][2 * e + 1]);
            if (lane % 4 == 0) {
                pp[HD] = m[e] == -CUDART_INF_F ? -CUDART_INF_F : m[e] * 0.6931471805599453f;
                pp[HD + 1] = l[e];
            }
            continue;
        }
        float* dst = out + ((size_t)i * nh + h) * HD + 2 * (lane % 4);
        const float inv = 1.f / l[e];
#pragma unroll
        for (int d = 0; d < DT; d++)
            *(float2*)(dst + d * 8) = make_float2(o[d][2 * e] * inv, o[d][2 * e + 1] * inv);
    }
}

#define FA_KERNEL(HD, BN)                                                                         \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) attn_prefill_f16_hd##HD(             \
        const float* __restrict__ q, const __half* __restrict__ ck, const __half* __restrict__ cv, \
        float* __restrict__ out, int nh, int nkv, int cap, int pos, int seq, float scale) {       \
        PDL_ENTER();                                                                              \
        attn_tc_impl<HD, BN>(q, ck, cv, out, nullptr, nh, nkv, cap, pos, seq, scale, 0, nullptr,  \
                             nullptr, nullptr);                                                   \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) attn_prefill_rows_f16_hd##HD(        \
        const float* __restrict__ q, const __half* __restrict__ ck, const __half* __restrict__ cv, \
        float* __restrict__ out, int nh, int nkv, int cap, float scale,                           \
        const uint32_t* __restrict__ rows_tab, const uint32_t* __restrict__ segs) {               \
        PDL_ENTER();                                                                              \
        attn_tc_impl<HD, BN>(q, ck, cv, out, nullptr, nh, nkv, cap, 0, 0, scale, 0, nullptr,      \
                             rows_tab, segs);                                                     \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) attn_decode_tc_f16_hd##HD(           \
        const float* __restrict__ q, const __half* __restrict__ ck, const __half* __restrict__ cv, \
        float* __restrict__ part, int nh, int nkv, int cap, int pos, int seq, float scale,        \
        int chunk, const uint32_t* __restrict__ pos_dev, const uint32_t* __restrict__ rows_tab) { \
        PDL_ENTER();                                                                              \
        attn_tc_impl<HD, BN>(q, ck, cv, nullptr, part, nh, nkv, cap, pos, seq, scale, chunk,      \
                             pos_dev, rows_tab, nullptr);                                         \
    }
FA_KERNEL(64, 64)
FA_KERNEL(128, 64)
FA_KERNEL(256, 32)
