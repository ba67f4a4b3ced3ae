// Gated DeltaNet layers (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks", arXiv 2412.06464)
// on the device: the causal depthwise conv with its rolling window, the delta rule over the
// recurrent state, and the gated RMSNorm. CPU reference: crates/strata-models/src/gated_delta_net.rs
// (`GatedDeltaNet::forward`, `delta_update`, `delta_readout`; transformers
// `torch_recurrent_gated_delta_rule`).
//
// A pass of T tokens reads `row [T, rw]`: per token the in-projections' outputs in
// [qkv (cd) | z (vw) | b (nv) | a (nv)] order (rw ≥ cd + vw + 2·nv), cd = 2·kw + vw conv channels,
// kw = k_heads·dk, vw = v_heads·dv. `gdn_conv` and `gdn_delta` run a pass token by token (the
// recurrent form: a verify pass's rows equal decode steps, bit for bit); prompt passes take
// `gdn_conv_rows` (every output at once, the same arithmetic per output) and
// `gdn_delta_chunked` (the chunked form, equal to the recurrent one up to f32 rounding).

#define GDN_KMAX 8      // conv taps
#define GDN_RMAX 8      // dk / 32 rounded up: dk ≤ 256
#define GDN_WARPS 4     // value columns (warps) per delta block

// A batched decode step's state table (rows_tab, nullable): per row 5 u32 — a position word (unused
// here: a row table's layout, so one buffer holds every layer's table), then the addresses of its
// sequence's conv window and delta-rule state for this layer (low word first). Row i of the pass
// is one token of that sequence.
__device__ __forceinline__ float* gdn_state(const uint32_t* __restrict__ tab, int i, int word) {
    const uint32_t* t = tab + 5 * (size_t)i + word;
    return (float*)(((uint64_t)t[1] << 32) | t[0]);
}

// One thread per conv channel c, the tokens in order: out[t, c] = silu(w[c, K-1]·x_t +
// Σ_{j<K-1} w[c, j]·win_j) with win the K-1 previous inputs (from conv_state [K-1, cd], oldest
// first), then the window written back. out == nullptr: only the window moves (a rollback's
// replay, or after gdn_conv_rows; w unused), straight to its last K-1 inputs. With rows_tab
// (grid (ceil(cd / 128), rows), T = 1, conv_state unused): block row y is one token of its own
// sequence, whose window is rows_tab's row y — the same arithmetic as that sequence's own pass.
extern "C" __global__ void gdn_conv(const float* __restrict__ row, int rw, float* __restrict__ conv_state,
                                    const float* __restrict__ w, float* __restrict__ out, int T, int cd,
                                    int K, const uint32_t* __restrict__ rows_tab) {
    PDL_ENTER();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    if (rows_tab) {
        const int i = blockIdx.y;
        conv_state = gdn_state(rows_tab, i, 1);
        row += (size_t)i * rw;
        if (out != nullptr) out += (size_t)i * cd;
    }
    float win[GDN_KMAX];
    if (out == nullptr) {
        // Only the window moves: its new rows are the last K-1 of (window ++ the pass's inputs).
        for (int j = 0; j < K - 1; ++j) {
            const int p = T + j;
            win[j] = p < K - 1 ? conv_state[(size_t)p * cd + c] : row[(size_t)(p - (K - 1)) * rw + c];
        }
        for (int j = 0; j < K - 1; ++j) conv_state[(size_t)j * cd + c] = win[j];
        return;
    }
    for (int j = 0; j < K - 1; ++j) win[j] = conv_state[(size_t)j * cd + c];
    for (int t = 0; t < T; ++t) {
        const float x = row[(size_t)t * rw + c];
        float acc = w[(size_t)c * K + K - 1] * x;
        for (int j = 0; j < K - 1; ++j) acc += w[(size_t)c * K + j] * win[j];
        out[(size_t)t * cd + c] = acc / (1.f + expf(-acc));
        for (int j = 0; j + 1 < K - 1; ++j) win[j] = win[j + 1];
        if (K > 1) win[K - 2] = x;
    }
    for (int j = 0; j < K - 1; ++j) conv_state[(size_t)j * cd + c] = win[j];
}

// A prompt pass's conv outputs, all at once: grid (ceil(cd / 128), T), 128 threads; out[t, c] as
// in gdn_conv (the same products in the same order), the inputs before the pass read from
// conv_state, which stays as it was (gdn_conv with out == nullptr moves it afterwards).
extern "C" __global__ void gdn_conv_rows(const float* __restrict__ row, int rw,
                                         const float* __restrict__ conv_state, const float* __restrict__ w,
                                         float* __restrict__ out, int T, int cd, int K) {
    PDL_ENTER();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    if (c >= cd || t >= T) return;
    float acc = w[(size_t)c * K + K - 1] * row[(size_t)t * rw + c];
    for (int j = 0; j < K - 1; ++j) {
        const int p = t - (K - 1) + j;  // the input's position; < 0: the window's row p + K - 1
        const float x = p >= 0 ? row[(size_t)p * rw + c] : conv_state[(size_t)(p + K - 1) * cd + c];
        acc += w[(size_t)c * K + j] * x;
    }
    out[(size_t)t * cd + c] = acc / (1.f + expf(-acc));
}

// The delta rule. Grid (v_heads, ceil(dv / GDN_WARPS)), GDN_WARPS warps per block: warp w owns
// column j of value head h's state S [dk, dv], stored transposed (ssm [nv, dv, dk]: column j's dk
// values contiguous, so a warp's loads and stores coalesce), lane l its rows l + 32·r. Per
// token t: k, q of key head kh (grouped: h / (nv / k_heads), else h % k_heads) from qkv [T, cd]
// (q at 0, k at kw, v at 2·kw), L2-normalised (x · 1/√(Σx² + 1e-6)), q also times q_scale;
// g = A[h]·softplus(a + dt_bias[h]) (A = −exp(A_log)), decay = exp(g), β = σ(b) from row;
// S_:j ← decay·S_:j; S_:j += k̂·β(v_j − S_:jᵀk̂); out[t, h·dv + j] = S_:jᵀq̂. out == nullptr: no
// readout (a rollback's replay). With rows_tab (grid z = rows, T = 1, ssm unused): block z is one
// token of its own sequence, whose state is rows_tab's row z (gdn_state) — the same arithmetic as
// that sequence's own pass.
extern "C" __global__ void gdn_delta(const float* __restrict__ qkv, const float* __restrict__ row, int rw,
                                     const float* __restrict__ A, const float* __restrict__ dt_bias,
                                     float* __restrict__ ssm, float* __restrict__ out, int T, int k_heads,
                                     int v_heads, int dk, int dv, int grouped, float q_scale,
                                     const uint32_t* __restrict__ rows_tab) {
    PDL_ENTER();
    const int h = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.y * GDN_WARPS + (threadIdx.x >> 5);
    if (j >= dv) return;  // a whole warp leaves: no barriers below
    const int kw = k_heads * dk, vw = v_heads * dv, cd = 2 * kw + vw;
    if (rows_tab) {
        const int i = blockIdx.z;
        ssm = gdn_state(rows_tab, i, 3);
        qkv += (size_t)i * cd;
        row += (size_t)i * rw;
        if (out != nullptr) out += (size_t)i * vw;
    }
    const int kh = grouped ? h / (v_heads / k_heads) : h % k_heads;
    const int R = (dk + 31) / 32;
    float* S = ssm + ((size_t)h * dv + j) * dk;
    float s[GDN_RMAX];
#pragma unroll
    for (int r = 0; r < GDN_RMAX; ++r) {
        const int i = lane + 32 * r;
        s[r] = (r < R && i < dk) ? S[i] : 0.f;
    }
    const float a_h = A[h], dt_h = dt_bias[h];
    for (int t = 0; t < T; ++t) {
        const float* x = qkv + (size_t)t * cd;
        const float* rt = row + (size_t)t * rw + cd + vw;
        const float b = rt[h], a = rt[v_heads + h] + dt_h;
        const float sp = a > 20.f ? a : log1pf(expf(a));
        const float decay = expf(a_h * sp);
        const float beta = 1.f / (1.f + expf(-b));
        float kr[GDN_RMAX], qr[GDN_RMAX];
        float kk = 0.f, qq = 0.f, sk = 0.f;
#pragma unroll
        for (int r = 0; r < GDN_RMAX; ++r) {
            const int i = lane + 32 * r;
            const bool in = r < R && i < dk;
            kr[r] = in ? x[kw + kh * dk + i] : 0.f;
            qr[r] = (in && out != nullptr) ? x[kh * dk + i] : 0.f;
            s[r] *= decay;
            kk += kr[r] * kr[r];
            qq += qr[r] * qr[r];
            sk += s[r] * kr[r];
        }
        kk = warp_sum(kk);
        sk = warp_sum(sk);
        const float ik = 1.f / sqrtf(kk + 1e-6f);
        const float d = (x[2 * kw + h * dv + j] - sk * ik) * beta;
        float so = 0.f;
#pragma unroll
        for (int r = 0; r < GDN_RMAX; ++r) {
            s[r] += kr[r] * ik * d;
            so += s[r] * qr[r];
        }
        if (out != nullptr) {
            qq = warp_sum(qq);
            so = warp_sum(so);
            if (lane == 0) out[(size_t)t * vw + h * dv + j] = so * (q_scale / sqrtf(qq + 1e-6f));
        }
    }
#pragma unroll
    for (int r = 0; r < GDN_RMAX; ++r) {
        const int i = lane + 32 * r;
        if (r < R && i < dk) S[i] = s[r];
    }
}

// The delta rule over a prompt pass in the chunked form (Yang et al. 2024 §3.3, the WY/UT
// transform; CPU reference `chunked_delta_rule` in crates/strata-models/src/gated_delta_net.rs,
// transformers `torch_chunk_gated_delta_rule`): the same result as gdn_delta up to f32 rounding,
// with T/GDN_CC dependent steps instead of T. Grid (v_heads, ceil(dv / GDN_CT)), 256 threads: the
// block owns GDN_CT columns of value head h's state (a lane each), warp w its rows 16·w .. 16·w+15
// in registers (dk ≤ GDN_CDK). Per chunk of n ≤ GDN_CC tokens, with k̂, q̂ as in gdn_delta, g_i the
// log-decays, G their running sum inside the chunk, β_i = σ(b_i), S the state before the chunk:
//   A_ij = −β_i (k̂_i·k̂_j) e^{G_i−G_j} (j < i), P_ij = (q̂_i·k̂_j) e^{G_i−G_j} (j ≤ i);
//   Y_i = β_i (v_i − e^{G_i} k̂_iᵀS);  V_i = Y_i + Σ_{j<i} A_ij V_j  (forward substitution);
//   out_i = e^{G_i} q̂_iᵀS + Σ_{j≤i} P_ij V_j;  S ← e^{G_n} S + Σ_j e^{G_n−G_j} k̂_j V_jᵀ.
#define GDN_CC 16
#define GDN_CT 32
#define GDN_CDK 128
#define GDN_CKP (GDN_CDK + 4)  // shared row stride: float4 rows, lanes' rows on different banks

// One warp's share of x_iᵀS for the chunk's rows x_i (sK or sQ): the state rows r0 .. r0 + 15 it
// holds (s, a lane's column) against x_i's same 16 entries, into part[i][lane].
__device__ __forceinline__ void gdn_row_shares(const float (*x)[GDN_CKP], const float (&s)[16], int r0,
                                               float (*part)[GDN_CT], int lane) {
#pragma unroll 4
    for (int i = 0; i < GDN_CC; ++i) {
        const float4* xi = reinterpret_cast<const float4*>(&x[i][r0]);
        float p = 0.f;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const float4 a = xi[m];
            p += a.x * s[4 * m] + a.y * s[4 * m + 1] + a.z * s[4 * m + 2] + a.w * s[4 * m + 3];
        }
        part[i][lane] = p;
    }
}

extern "C" __global__ void __launch_bounds__(256)
    gdn_delta_chunked(const float* __restrict__ qkv, const float* __restrict__ row, int rw,
                      const float* __restrict__ A, const float* __restrict__ dt_bias, float* __restrict__ ssm,
                      float* __restrict__ out, int T, int k_heads, int v_heads, int dk, int dv, int grouped,
                      float q_scale) {
    PDL_ENTER();
    __shared__ __align__(16) float sK[GDN_CC][GDN_CKP];
    __shared__ __align__(16) float sQ[GDN_CC][GDN_CKP];
    __shared__ float sPart[8][GDN_CC][GDN_CT];  // per warp: its rows' share of k̂ᵀS, then q̂ᵀS
    __shared__ float sV[GDN_CC][GDN_CT];        // Y, then V (in place)
    __shared__ float sA[GDN_CC][GDN_CC + 1];
    __shared__ float sP[GDN_CC][GDN_CC + 1];
    __shared__ float sG[GDN_CC], sB[GDN_CC], sE[GDN_CC], sF[GDN_CC];  // G, β, e^{G_i}, e^{G_n−G_i}
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int j = blockIdx.y * GDN_CT + lane;  // this lane's state column
    const bool col = j < dv;
    const int kw = k_heads * dk, vw = v_heads * dv, cd = 2 * kw + vw;
    const int kh = grouped ? h / (v_heads / k_heads) : h % k_heads;
    const int r0 = 16 * w;
    float* S = ssm + ((size_t)h * dv + (col ? j : 0)) * dk;
    float s[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) s[m] = (col && r0 + m < dk) ? S[r0 + m] : 0.f;
    const float a_h = A[h], dt_h = dt_bias[h];
    for (int c0 = 0; c0 < T; c0 += GDN_CC) {
        const int n = min(GDN_CC, T - c0);
        // The chunk's q and k rows (zero past n and past dk); padded tokens get g = 0, β = 0.
        for (int e = tid; e < GDN_CC * GDN_CDK; e += 256) {
            const int i = e / GDN_CDK, r = e % GDN_CDK;
            float qv = 0.f, kv = 0.f;
            if (i < n && r < dk) {
                const float* x = qkv + (size_t)(c0 + i) * cd + kh * dk + r;
                qv = x[0];
                kv = x[kw];
            }
            sQ[i][r] = qv;
            sK[i][r] = kv;
        }
        if (w == 0) {
            float g = 0.f, b = 0.f;
            if (lane < n) {
                const float* rt = row + (size_t)(c0 + lane) * rw + cd + vw;
                const float a = rt[v_heads + h] + dt_h;
                const float sp = a > 20.f ? a : log1pf(expf(a));
                g = a_h * sp;
                b = 1.f / (1.f + expf(-rt[h]));
            }
            if (lane < GDN_CC) {
                sG[lane] = g;
                sB[lane] = b;
            }
            __syncwarp();
            if (lane == 0) {
                float acc = 0.f;
                for (int i = 0; i < GDN_CC; ++i) {
                    acc += sG[i];
                    sG[i] = acc;
                }
            }
            __syncwarp();
            if (lane < GDN_CC) {
                sE[lane] = expf(sG[lane]);
                sF[lane] = expf(sG[GDN_CC - 1] - sG[lane]);
            }
        }
        __syncthreads();
        // L2 norms: warp w the rows 2w and 2w + 1.
        for (int i = 2 * w; i < 2 * w + 2; ++i) {
            float kk = 0.f, qq = 0.f;
            for (int r = lane; r < GDN_CDK; r += 32) {
                kk += sK[i][r] * sK[i][r];
                qq += sQ[i][r] * sQ[i][r];
            }
            kk = warp_sum(kk);
            qq = warp_sum(qq);
            const float ik = 1.f / sqrtf(kk + 1e-6f), iq = q_scale / sqrtf(qq + 1e-6f);
            for (int r = lane; r < GDN_CDK; r += 32) {
                sK[i][r] *= ik;
                sQ[i][r] *= iq;
            }
        }
        __syncthreads();
        {
            // A and P, one entry per thread.
            const int i = tid / GDN_CC, jj = tid % GDN_CC;
            const float4* ki = reinterpret_cast<const float4*>(sK[i]);
            const float4* qi = reinterpret_cast<const float4*>(sQ[i]);
            const float4* kj = reinterpret_cast<const float4*>(sK[jj]);
            float kk = 0.f, qk = 0.f;
            for (int r = 0; r < GDN_CDK / 4; ++r) {
                const float4 a = ki[r], q = qi[r], b = kj[r];
                kk += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                qk += q.x * b.x + q.y * b.y + q.z * b.z + q.w * b.w;
            }
            const float e = jj <= i ? expf(sG[i] - sG[jj]) : 0.f;
            sA[i][jj] = jj < i ? -sB[i] * kk * e : 0.f;
            sP[i][jj] = qk * e;
        }
        // This warp's rows' share of k̂_iᵀS.
        gdn_row_shares(sK, s, r0, sPart[w], lane);
        __syncthreads();
        // Y_i = β_i (v_i − e^{G_i} k̂_iᵀS).
        for (int i = w; i < GDN_CC; i += 8) {
            float x = 0.f;
#pragma unroll
            for (int u = 0; u < 8; ++u) x += sPart[u][i][lane];
            const float v = (i < n && col) ? qkv[(size_t)(c0 + i) * cd + 2 * kw + (size_t)h * dv + j] : 0.f;
            sV[i][lane] = sB[i] * (v - sE[i] * x);
        }
        __syncthreads();
        // q̂_iᵀS shares; warp 0 then solves for V (each lane its column, rows in order).
        gdn_row_shares(sQ, s, r0, sPart[w], lane);
        if (w == 0) {
            for (int i = 1; i < n; ++i) {
                float y = sV[i][lane];
                for (int jj = 0; jj < i; ++jj) y += sA[i][jj] * sV[jj][lane];
                sV[i][lane] = y;
            }
        }
        __syncthreads();
        // out_i = e^{G_i} q̂_iᵀS + Σ_{j≤i} P_ij V_j.
        for (int i = w; i < n; i += 8) {
            float qs = 0.f;
#pragma unroll
            for (int u = 0; u < 8; ++u) qs += sPart[u][i][lane];
            float o = sE[i] * qs;
            for (int jj = 0; jj <= i; ++jj) o += sP[i][jj] * sV[jj][lane];
            if (col) out[(size_t)(c0 + i) * vw + (size_t)h * dv + j] = o;
        }
        // S ← e^{G_n} S + Σ_j e^{G_n − G_j} k̂_j V_jᵀ (padded tokens add nothing: V_j = 0).
        const float el = sE[GDN_CC - 1];
#pragma unroll
        for (int m = 0; m < 16; ++m) s[m] *= el;
        for (int jj = 0; jj < n; ++jj) {
            const float f = sF[jj] * sV[jj][lane];
            const float4* kj = reinterpret_cast<const float4*>(&sK[jj][r0]);
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const float4 a = kj[m];
                s[4 * m] += a.x * f;
                s[4 * m + 1] += a.y * f;
                s[4 * m + 2] += a.z * f;
                s[4 * m + 3] += a.w * f;
            }
        }
        __syncthreads();  // the next chunk overwrites sK, sQ, sPart, sV
    }
#pragma unroll
    for (int m = 0; m < 16; ++m)
        if (col && r0 + m < dk) S[r0 + m] = s[m];
}

// Qwen3NextRMSNormGated per (token, value head), in place: o ← o · 1/√(mean(o²) + eps) · w ·
// silu(z), o = y[t, h·dv .. +dv], z = row[t, z_off + h·dv ..], w [dv]. Grid (T, v_heads),
// 128 threads.
extern "C" __global__ void gdn_gated_norm(float* __restrict__ y, const float* __restrict__ row, int rw,
                                          int z_off, const float* __restrict__ w, int v_heads, int dv,
                                          float eps) {
    PDL_ENTER();
    __shared__ float part[4];
    const int t = blockIdx.x, h = blockIdx.y;
    float* o = y + (size_t)t * v_heads * dv + (size_t)h * dv;
    const float* z = row + (size_t)t * rw + z_off + (size_t)h * dv;
    float ss = 0.f;
    for (int i = threadIdx.x; i < dv; i += blockDim.x) ss += o[i] * o[i];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    const float tot = part[0] + part[1] + part[2] + part[3];
    const float inv = 1.f / sqrtf(tot / (float)dv + eps);
    for (int i = threadIdx.x; i < dv; i += blockDim.x) {
        const float zz = z[i];
        o[i] = o[i] * inv * w[i] * (zz / (1.f + expf(-zz)));
    }
}
