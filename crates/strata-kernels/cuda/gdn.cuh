// Gated DeltaNet layers (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks", arXiv 2412.06464)
// on the device: the causal depthwise conv with its rolling window, the delta rule over the
// recurrent state, and the gated RMSNorm. CPU reference: crates/strata-models/src/gated_delta_net.rs
// (`GatedDeltaNet::forward`, `delta_update`, `delta_readout`; transformers
// `torch_recurrent_gated_delta_rule`).
//
// A pass of T tokens reads `row [T, rw]`: per token the in-projections' outputs in
// [qkv (cd) | z (vw) | b (nv) | a (nv)] order (rw ≥ cd + vw + 2·nv), cd = 2·kw + vw conv channels,
// kw = k_heads·dk, vw = v_heads·dv. Every pass, whatever T, runs the recurrent form token by token
// (the same arithmetic per token: a verify pass's rows equal decode steps, bit for bit).

#define GDN_KMAX 8      // conv taps
#define GDN_RMAX 8      // dk / 32 rounded up: dk ≤ 256
#define GDN_WARPS 4     // value columns (warps) per delta block

// One thread per conv channel c, the tokens in order: out[t, c] = silu(w[c, K-1]·x_t +
// Σ_{j<K-1} w[c, j]·win_j) with win the K-1 previous inputs (from conv_state [K-1, cd], oldest
// first), then the window written back. out == nullptr: only the window moves (a rollback's
// replay; w unused).
extern "C" __global__ void gdn_conv(const float* __restrict__ row, int rw, float* __restrict__ conv_state,
                                    const float* __restrict__ w, float* __restrict__ out, int T, int cd,
                                    int K) {
    PDL_ENTER();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    float win[GDN_KMAX];
    for (int j = 0; j < K - 1; ++j) win[j] = conv_state[(size_t)j * cd + c];
    for (int t = 0; t < T; ++t) {
        const float x = row[(size_t)t * rw + c];
        if (out != nullptr) {
            float acc = w[(size_t)c * K + K - 1] * x;
            for (int j = 0; j < K - 1; ++j) acc += w[(size_t)c * K + j] * win[j];
            out[(size_t)t * cd + c] = acc / (1.f + expf(-acc));
        }
        for (int j = 0; j + 1 < K - 1; ++j) win[j] = win[j + 1];
        if (K > 1) win[K - 2] = x;
    }
    for (int j = 0; j < K - 1; ++j) conv_state[(size_t)j * cd + c] = win[j];
}

// The delta rule. Grid (v_heads, ceil(dv / GDN_WARPS)), GDN_WARPS warps per block: warp w owns
// column j of value head h's state S [dk, dv], stored transposed (ssm [nv, dv, dk]: column j's dk
// values contiguous, so a warp's loads and stores coalesce), lane l its rows l + 32·r. Per
// token t: k, q of key head kh (grouped: h / (nv / k_heads), else h % k_heads) from qkv [T, cd]
// (q at 0, k at kw, v at 2·kw), L2-normalised (x · 1/√(Σx² + 1e-6)), q also times q_scale;
// g = A[h]·softplus(a + dt_bias[h]) (A = −exp(A_log)), decay = exp(g), β = σ(b) from row;
// S_:j ← decay·S_:j; S_:j += k̂·β(v_j − S_:jᵀk̂); out[t, h·dv + j] = S_:jᵀq̂. out == nullptr: no
// readout (a rollback's replay).
extern "C" __global__ void gdn_delta(const float* __restrict__ qkv, const float* __restrict__ row, int rw,
                                     const float* __restrict__ A, const float* __restrict__ dt_bias,
                                     float* __restrict__ ssm, float* __restrict__ out, int T, int k_heads,
                                     int v_heads, int dk, int dv, int grouped, float q_scale) {
    PDL_ENTER();
    const int h = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.y * GDN_WARPS + (threadIdx.x >> 5);
    if (j >= dv) return;  // a whole warp leaves: no barriers below
    const int kw = k_heads * dk, vw = v_heads * dv, cd = 2 * kw + vw;
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
