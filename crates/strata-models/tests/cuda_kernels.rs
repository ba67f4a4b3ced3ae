//! Our CUDA decode kernels (`strata_kernels::cuda`) against their CPU references, on the device.
//! Built only with the `cuda` feature; run on the lent GPU by `scripts/cuda_device_check.sh`
//! (`PART=decode`), which carries the test binary there. Every input is drawn at random, every
//! output checked element by element (finite, within the bound stated per test).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use strata_formats::{RopeScaling, RopeStyle, RouterScoring, Weight};
use strata_kernels::cuda as gpu;
use strata_models::layers::Linear;
use strata_models::rope::RotaryEmbedding;
use strata_models::Router;

fn cuda() -> Device {
    Device::new_cuda(0).expect("a CUDA device (this test runs on the GPU machine)")
}

/// xorshift64*: reproducible uniform values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        v as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert!(x.is_finite(), "non-finite output {x}");
            (x - y).abs() / scale
        })
        .fold(0f32, f32::max)
}

/// Random weights of shape `dims` (values in [-1, 1)) quantized to Q4_K on `dev`, and their
/// dequantized values (candle's CPU dequantizer: the reference's weights).
fn random_q4k(
    dims: &[usize],
    rng: &mut Rng,
    dev: &Device,
) -> (candle_core::quantized::QTensor, Vec<f32>) {
    use candle_core::quantized::{GgmlDType, QTensor};
    let w = Tensor::from_vec(rng.vec(dims.iter().product(), 1.0), dims, &Device::Cpu).unwrap();
    let deq = QTensor::quantize(&w, GgmlDType::Q4K).unwrap().dequantize(&Device::Cpu).unwrap();
    let deq = deq.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (QTensor::quantize_onto(&w, GgmlDType::Q4K, dev).unwrap(), deq)
}

#[test]
fn route_topk_matches_the_host_router() {
    let dev = cuda();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut cases = 0;
    for &(experts, hidden) in &[(8usize, 64usize), (64, 128), (128, 256), (512, 96)] {
        for &k in &[1usize, 2, 8] {
            for scoring in [RouterScoring::Softmax, RouterScoring::Sigmoid] {
                for norm in [false, true] {
                    for keep in [None, Some(1)] {
                        let w = Tensor::from_vec(
                            rng.vec(experts * hidden, 0.5),
                            (experts, hidden),
                            &dev,
                        )
                        .unwrap();
                        let gate = Linear::new(Weight::Dense(w), None).unwrap();
                        let mut router = Router::new(gate, k, norm, scoring);
                        router.set_top_k_override(keep);
                        let n = 37;
                        let x =
                            Tensor::from_vec(rng.vec(n * hidden, 1.0), (n, hidden), &dev).unwrap();
                        let host = router.route(&x, 0).unwrap();
                        let (ids, weights) = router.route_on_device(&x, None, None).unwrap();
                        let ids = ids.flatten_all().unwrap().to_vec1::<u32>().unwrap();
                        let weights = weights.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                        let ctx =
                            format!("E {experts} k {k} {scoring:?} norm {norm} keep {keep:?}");
                        assert_eq!(ids, host.expert_ids, "{ctx}");
                        let err = max_rel(&weights, &host.weights);
                        assert!(err < 1e-5, "{ctx}: weights off by {err}");
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 4 * 3 * 2 * 2 * 2);
}

/// A synthetic model's routing: the host's process chooses, the device weighs the choice
/// (`Router::synthetic_choice` → `route_on_device` with `chosen`) — the same ids, in the same
/// order, and weights as the host path (`route_seq`), for realistic and uniform processes, with
/// and without renormalisation and `--moe-top-k`, over two passes (the second continuing the
/// first's history), the choice read at an offset in a larger buffer.
#[test]
fn route_topk_weighs_a_synthetic_choice_as_the_host_does() {
    use strata_formats::SyntheticRouting;
    use strata_models::{RoutingHistory, SeqRoute, SyntheticRouter};
    let dev = cuda();
    let mut rng = Rng(0x51_7e);
    let (experts, hidden, k, layer) = (128usize, 64usize, 8usize, 3usize);
    let mut cases = 0;
    for cfg in [SyntheticRouting::realistic(11), SyntheticRouting::uniform(12)] {
        for scoring in [RouterScoring::Softmax, RouterScoring::Sigmoid] {
            for norm in [false, true] {
                for keep in [None, Some(2)] {
                    let w =
                        Tensor::from_vec(rng.vec(experts * hidden, 0.5), (experts, hidden), &dev)
                            .unwrap();
                    let gate = Linear::new(Weight::Dense(w), None).unwrap();
                    let mut router = Router::new(gate, k, norm, scoring)
                        .with_synthetic(Some(SyntheticRouter::new(cfg, layer, experts, k)));
                    router.set_top_k_override(keep);
                    let (mut h_host, mut h_dev) =
                        (RoutingHistory::new(8, k), RoutingHistory::new(8, k));
                    let mut start = 0;
                    for n in [5usize, 1] {
                        let tokens: Vec<u32> = (0..n as u32).map(|i| 100 + 37 * i).collect();
                        let x =
                            Tensor::from_vec(rng.vec(n * hidden, 1.0), (n, hidden), &dev).unwrap();
                        let seq = SeqRoute { start, tokens: &tokens, history: &mut h_host };
                        let host = router.route_seq(&x, layer, Some(seq), false).unwrap();
                        let seq = SeqRoute { start, tokens: &tokens, history: &mut h_dev };
                        let mut ids = vec![0u32; 3 * k]; // an offset inside a larger buffer
                        ids.extend(router.synthetic_choice(layer, seq).unwrap());
                        let buf = Tensor::new(ids, &dev).unwrap();
                        let chosen = gpu::ChosenExperts { ids: &buf, offset: 3 * k };
                        let (d_ids, d_w) = router.route_on_device(&x, None, Some(chosen)).unwrap();
                        let d_ids = d_ids.flatten_all().unwrap().to_vec1::<u32>().unwrap();
                        let d_w = d_w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                        let ctx =
                            format!("{:?} {scoring:?} norm {norm} keep {keep:?} n {n}", cfg.mode);
                        assert_eq!(d_ids, host.expert_ids, "{ctx}");
                        let err = max_rel(&d_w, &host.weights);
                        assert!(err < 1e-5, "{ctx}: weights off by {err}");
                        for p in start..start + n {
                            assert_eq!(h_dev.get(layer, p), h_host.get(layer, p), "{ctx}: history");
                        }
                        start += n;
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 2 * 2 * 2 * 2 * 2);
}

#[test]
fn route_topk_writes_the_record_and_refuses_bad_k() {
    let dev = cuda();
    let mut rng = Rng(7);
    let (n, e, k) = (5, 16, 4);
    let logits = Tensor::from_vec(rng.vec(n * e, 3.0), (n, e), &dev).unwrap();
    let rec_ids = Tensor::zeros(3 * n * k, DType::U32, &dev).unwrap();
    let rec_w = Tensor::zeros(3 * n * k, DType::F32, &dev).unwrap();
    let record = gpu::RoutingRecord { ids: &rec_ids, weights: &rec_w, offset: n * k };
    let (ids, w) =
        gpu::route_topk(&logits, k, k, gpu::Scoring::Softmax, true, Some(record), None).unwrap();
    let all = rec_ids.to_vec1::<u32>().unwrap();
    assert_eq!(&all[n * k..2 * n * k], ids.flatten_all().unwrap().to_vec1::<u32>().unwrap());
    assert!(all[..n * k].iter().chain(&all[2 * n * k..]).all(|&v| v == 0), "outside the slot");
    let all_w = rec_w.to_vec1::<f32>().unwrap();
    assert_eq!(&all_w[n * k..2 * n * k], w.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    for bad in [0, e + 1, 33] {
        assert!(gpu::route_topk(&logits, bad, bad.max(1), gpu::Scoring::Softmax, true, None, None)
            .is_err());
    }
    assert!(gpu::route_topk(&logits, 2, 3, gpu::Scoring::Softmax, true, None, None).is_err());
    let small = gpu::RoutingRecord { ids: &rec_ids, weights: &rec_w, offset: 3 * n * k - 1 };
    assert!(gpu::route_topk(&logits, k, k, gpu::Scoring::Softmax, true, Some(small), None).is_err());
    let few = Tensor::zeros(n * k - 1, DType::U32, &dev).unwrap();
    let chosen = gpu::ChosenExperts { ids: &few, offset: 0 };
    assert!(
        gpu::route_topk(&logits, k, k, gpu::Scoring::Softmax, true, None, Some(chosen)).is_err(),
        "chosen experts shorter than the rows"
    );
}

#[test]
fn silu_mul_and_combine_match_candle() {
    let dev = cuda();
    let mut rng = Rng(11);
    let (n, k, h) = (3, 8, 1000);
    let g = Tensor::from_vec(rng.vec(n * k * h, 6.0), (n, k, h), &dev).unwrap();
    let u = Tensor::from_vec(rng.vec(n * k * h, 2.0), (n, k, h), &dev).unwrap();
    let ours = gpu::silu_mul(&g, &u).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let want = (candle_nn::ops::silu(&g).unwrap() * &u).unwrap();
    let err = max_rel(&ours, &want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    assert!(err < 1e-6, "silu_mul off by {err}");
    let w = Tensor::from_vec(rng.vec(n * k, 1.0), (n, k), &dev).unwrap();
    let ours = gpu::moe_combine(&g, &w).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // f64 on the host.
    let (gv, wv) =
        (g.flatten_all().unwrap().to_vec1::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
    let mut want = vec![0f32; n * h];
    for t in 0..n {
        for d in 0..h {
            let s: f64 = (0..k).map(|j| wv[t][j] as f64 * gv[(t * k + j) * h + d] as f64).sum();
            want[t * h + d] = s as f32;
        }
    }
    let err = max_rel(&ours, &want);
    assert!(err < 1e-6, "moe_combine off by {err}");
    assert!(gpu::silu_mul(&g, &w).is_err());
    assert!(gpu::moe_combine(&g, &u).is_err());
}

/// The GPU's greedy pick equals the host's (`strata_kernels::pick::argmax`, itself tested against
/// the first-strictly-greater scan) on rows with ties, NaNs, ±0 and −∞.
#[test]
fn argmax_rows_equals_the_first_strictly_greater_scan() {
    let dev = cuda();
    let mut rng = Rng(23);
    for vocab in [1usize, 7, 1023, 1025, 4097, 49_152, 151_936] {
        let mut rows: Vec<Vec<f32>> = (0..9).map(|_| rng.vec(vocab, 30.0)).collect();
        if vocab > 2000 {
            let m = 100.0;
            // Ties between threads (1500 is thread 476's second value, 700 thread 700's first;
            // the smaller index must win) and inside one thread's share (3 and 3 + 1024).
            (rows[1][1500], rows[1][700]) = (m, m);
            (rows[2][3], rows[2][1027]) = (m, m);
            rows[3][vocab - 1] = m; // the last value
            rows[4][10] = f32::NAN; // a NaN inside is never picked
            rows[4][vocab / 2] = m;
            rows[5][0] = f32::NAN; // a first NaN: 0
            rows[6].iter_mut().for_each(|x| *x = f32::NEG_INFINITY); // all -inf: 0
            (rows[7][900], rows[7][2000]) = (0.0, -0.0); // ±0 as the largest: the first
            rows[7].iter_mut().filter(|x| **x != 0.0).for_each(|x| *x = -x.abs() - 1.0);
            rows[8].iter_mut().for_each(|x| *x = 5.0); // all equal: 0
        }
        let flat: Vec<f32> = rows.concat();
        let x = Tensor::from_vec(flat, (rows.len(), vocab), &dev).unwrap();
        let got = gpu::argmax_rows(&x).unwrap().to_vec1::<u32>().unwrap();
        let want: Vec<u32> = rows.iter().map(|r| strata_kernels::pick::argmax(r)).collect();
        assert_eq!(got, want, "vocab {vocab}");
    }
    let empty = Tensor::zeros((0, 10), DType::F32, &dev).unwrap();
    assert_eq!(gpu::argmax_rows(&empty).unwrap().dims(), [0]);
    let u = Tensor::zeros((2, 10), DType::U32, &dev).unwrap();
    assert!(gpu::argmax_rows(&u).is_err());
}

/// A prefix-cache block copied out of every layer's KV cache in one launch equals candle's
/// per-layer copies (layer 0's k, its v, layer 1's k, ...), bit for bit; copied back at another
/// position it writes those positions and nothing else; bad blocks and ranges are refused.
#[test]
fn kv_span_copies_equal_the_per_layer_copies() {
    let dev = cuda();
    let mut rng = Rng(31);
    for (dtype, kvh, hd, cap) in [(DType::F16, 4, 128, 96), (DType::F32, 3, 64, 80)] {
        let layers = 5;
        let mk = |rng: &mut Rng| {
            Tensor::from_vec(rng.vec(kvh * cap * hd, 4.0), (1, kvh, cap, hd), &dev)
                .and_then(|t| t.to_dtype(dtype))
                .unwrap()
        };
        let k: Vec<Tensor> = (0..layers).map(|_| mk(&mut rng)).collect();
        let v: Vec<Tensor> = (0..layers).map(|_| mk(&mut rng)).collect();
        let kv: Vec<gpu::LayerKv<'_>> =
            k.iter().zip(&v).map(|(k, v)| gpu::LayerKv { k, v }).collect();
        assert!(gpu::kv_span_supports(&kv));
        let span = gpu::KvSpanTable::new(&kv).unwrap();
        let (start, len) = (17, 29);
        let block = span.export(start, len).unwrap();
        assert_eq!(block.dims(), [2 * layers, kvh, len, hd]);
        assert_eq!(block.dtype(), dtype);
        let as_f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        for l in 0..layers {
            for (j, t) in [&k[l], &v[l]].into_iter().enumerate() {
                let want = as_f32(&t.narrow(2, start, len).unwrap().contiguous().unwrap());
                let got = as_f32(&block.narrow(0, 2 * l + j, 1).unwrap().contiguous().unwrap());
                let (w, g) = (want.to_vec1::<f32>().unwrap(), got.to_vec1::<f32>().unwrap());
                assert!(w.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits()), "layer {l}");
            }
        }
        // Back into zeroed caches at position 40: those positions equal the block, the rest 0.
        let zk: Vec<Tensor> =
            (0..layers).map(|_| Tensor::zeros((1, kvh, cap, hd), dtype, &dev).unwrap()).collect();
        let zv: Vec<Tensor> =
            (0..layers).map(|_| Tensor::zeros((1, kvh, cap, hd), dtype, &dev).unwrap()).collect();
        let zkv: Vec<gpu::LayerKv<'_>> =
            zk.iter().zip(&zv).map(|(k, v)| gpu::LayerKv { k, v }).collect();
        let at = 40;
        let zspan = gpu::KvSpanTable::new(&zkv).unwrap();
        zspan.import(&block, at).unwrap();
        for l in 0..layers {
            for (j, t) in [&zk[l], &zv[l]].into_iter().enumerate() {
                let src = if j == 0 { &k[l] } else { &v[l] };
                let want = as_f32(&src.narrow(2, start, len).unwrap().contiguous().unwrap());
                let got = as_f32(&t.narrow(2, at, len).unwrap().contiguous().unwrap());
                assert_eq!(want.to_vec1::<f32>().unwrap(), got.to_vec1::<f32>().unwrap());
                let all = as_f32(t).to_vec1::<f32>().unwrap();
                let nonzero = all.iter().filter(|x| **x != 0.0).count();
                let inside = got.to_vec1::<f32>().unwrap().iter().filter(|x| **x != 0.0).count();
                assert_eq!(nonzero, inside, "a write outside positions {at}..{}", at + len);
            }
        }
        // Refusals: past the capacity, a block for another layer count, an empty layer list,
        // caches of different shapes.
        assert!(span.export(cap - 3, 4).is_err());
        assert!(zspan.import(&block, cap - len + 1).is_err());
        let fewer = gpu::KvSpanTable::new(&zkv[..layers - 1]).unwrap();
        assert!(fewer.import(&block, 0).is_err());
        assert!(gpu::KvSpanTable::new(&[]).is_err());
        let other = Tensor::zeros((1, kvh, cap + 1, hd), dtype, &dev).unwrap();
        let mixed = [kv[0], gpu::LayerKv { k: &other, v: &other }];
        assert!(!gpu::kv_span_supports(&mixed) && gpu::KvSpanTable::new(&mixed).is_err());
    }
    // A row of 2 f16 (4 bytes) is not a whole number of 16-byte units: not taken.
    let small = Tensor::zeros((1, 2, 8, 2), DType::F16, &dev).unwrap();
    assert!(!gpu::kv_span_supports(&[gpu::LayerKv { k: &small, v: &small }]));
}

/// One attention case: `seq` query rows after `pos` cached positions, a cache of `dtype`.
struct Case {
    nh: usize,
    nkv: usize,
    hd: usize,
    rope_dim: usize,
    style: RopeStyle,
    pos: usize,
    seq: usize,
    dtype: DType,
}

/// f32 → the cache's element type → f32 (the half crate rounds to nearest even, as the kernels'
/// `__float2half_rn` and candle's casts do).
fn kv_round(x: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F16 => x.iter().map(|&v| f16r(v) as f32).collect(),
        _ => x.to_vec(),
    }
}

/// Shape of an attention reference call: `seq` query rows after `pos` cached positions, caches
/// `[nkv, cap, hd]`, softmax scale `scale`.
struct AttnShape {
    nh: usize,
    nkv: usize,
    hd: usize,
    cap: usize,
    pos: usize,
    seq: usize,
    scale: f32,
}

/// Causal GQA attention in f64: `q: [seq, nh, hd]`, row `i` over positions `0..=pos + i` of
/// `k, v: [nkv, cap, hd]` → `[seq, nh, hd]`.
fn attention_f64(a: &AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
    let (nh, nkv, hd, cap) = (a.nh, a.nkv, a.hd, a.cap);
    let mut want = vec![0f32; a.seq * nh * hd];
    for i in 0..a.seq {
        let total = a.pos + i + 1;
        for h in 0..nh {
            let g = h / (nh / nkv);
            let qh = &q[(i * nh + h) * hd..(i * nh + h + 1) * hd];
            let s: Vec<f64> = (0..total)
                .map(|j| {
                    let kj = &k[(g * cap + j) * hd..(g * cap + j + 1) * hd];
                    qh.iter().zip(kj).map(|(x, y)| *x as f64 * *y as f64).sum::<f64>()
                        * a.scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let acc: f64 = (0..total).map(|j| e[j] * v[(g * cap + j) * hd + d] as f64).sum();
                want[(i * nh + h) * hd + d] = (acc / z) as f32;
            }
        }
    }
    want
}

impl AttnShape {
    /// `seq` rows after `pos` positions in a cache with `spare` positions past the pass, the
    /// softmax scale 1/√hd.
    fn of(nh: usize, nkv: usize, hd: usize, pos: usize, seq: usize, spare: usize) -> Self {
        let scale = 1.0 / (hd as f32).sqrt();
        Self { nh, nkv, hd, cap: pos + seq + spare, pos, seq, scale }
    }
}

/// A case for the tensor-core attention kernels: random keys and values as an f16 cache holds
/// them, NaN past the pass (the kernels must never read them), random queries in [-2, 2), and
/// their device tensors (`ck`, `cv: [1, nkv, cap, hd]` f16, `qt: [seq, nh, hd]` f32).
struct F16Case {
    shape: AttnShape,
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    ck: Tensor,
    cv: Tensor,
    qt: Tensor,
}

impl F16Case {
    fn new(rng: &mut Rng, dev: &Device, shape: AttnShape) -> Self {
        let AttnShape { nh, nkv, hd, cap, pos, seq, .. } = shape;
        let mut k = kv_round(&rng.vec(nkv * cap * hd, 1.0), DType::F16);
        let mut v = kv_round(&rng.vec(nkv * cap * hd, 1.0), DType::F16);
        for g in 0..nkv {
            for j in pos + seq..cap {
                k[(g * cap + j) * hd..(g * cap + j + 1) * hd].fill(f32::NAN);
                v[(g * cap + j) * hd..(g * cap + j + 1) * hd].fill(f32::NAN);
            }
        }
        let q = rng.vec(seq * nh * hd, 2.0);
        let up = |x: &Vec<f32>| {
            Tensor::from_vec(x.clone(), (1, nkv, cap, hd), dev)
                .unwrap()
                .to_dtype(DType::F16)
                .unwrap()
        };
        let (ck, cv) = (up(&k), up(&v));
        let qt = Tensor::from_vec(q.clone(), (seq, nh, hd), dev).unwrap();
        Self { shape, k, v, q, ck, cv, qt }
    }

    /// The f64 attention over the case's queries and (rounded) cache.
    fn reference(&self) -> Vec<f32> {
        attention_f64(&self.shape, &self.q, &self.k, &self.v)
    }
}

/// Checks `rope_kv_append` and `attend_decode` on one case; returns the attention output's
/// largest difference from the same attention over the unrounded (f32) keys and values,
/// relative to its largest magnitude: an f16 cache's accuracy cost.
fn check_attention(c: &Case, rng: &mut Rng) -> f32 {
    let (dev, cpu) = (cuda(), Device::Cpu);
    let cap = c.pos + c.seq + 3;
    let (nh, nkv, hd, seq) = (c.nh, c.nkv, c.hd, c.seq);
    let rope_cpu =
        RotaryEmbedding::new(10000.0, c.rope_dim, &RopeScaling::None, c.style, cap, &cpu).unwrap();
    let rope_gpu =
        RotaryEmbedding::new(10000.0, c.rope_dim, &RopeScaling::None, c.style, cap, &dev).unwrap();
    // Earlier positions already in the cache (rotated keys, as the model writes them).
    let cache_k0 = rng.vec(nkv * cap * hd, 1.0);
    let cache_v0 = rng.vec(nkv * cap * hd, 1.0);
    let up_cache =
        |x: &Vec<f32>| Tensor::from_vec(x.clone(), (1, nkv, cap, hd), &dev)?.to_dtype(c.dtype);
    let (ck, cv) = (up_cache(&cache_k0).unwrap(), up_cache(&cache_v0).unwrap());
    let (q, k, v) =
        (rng.vec(seq * nh * hd, 1.0), rng.vec(seq * nkv * hd, 1.0), rng.vec(seq * nkv * hd, 1.0));
    let up = |x: &Vec<f32>, n: usize| Tensor::from_vec(x.clone(), (seq, n, hd), &dev).unwrap();
    let (cos, sin, _) = rope_gpu.tables();
    let style = match c.style {
        RopeStyle::Neox => gpu::RopeStyle::Neox,
        RopeStyle::Interleaved => gpu::RopeStyle::Interleaved,
    };
    let scale = 1.0 / (hd as f32).sqrt();
    let q_rot = gpu::rope_kv_append(
        &up(&q, nh),
        &up(&k, nkv),
        &up(&v, nkv),
        cos,
        sin,
        style,
        gpu::Position::Host(c.pos),
        gpu::LayerKv { k: &ck, v: &cv },
        None,
    )
    .unwrap();
    let out = gpu::attend_decode(
        &q_rot,
        gpu::Position::Host(c.pos),
        scale,
        gpu::LayerKv { k: &ck, v: &cv },
    )
    .unwrap()
    .flatten_all()
    .unwrap()
    .to_vec1::<f32>()
    .unwrap();
    // Reference: candle's CPU RoPE on [1, heads, seq, hd], attention in f64.
    let rot = |x: &Vec<f32>, n: usize| -> Vec<f32> {
        let t = Tensor::from_vec(x.clone(), (seq, n, hd), &cpu).unwrap();
        let t = t.transpose(0, 1).unwrap().unsqueeze(0).unwrap().contiguous().unwrap();
        let r = rope_cpu.apply(&t, c.pos).unwrap(); // [1, n, seq, hd]
        r.squeeze(0).unwrap().transpose(0, 1).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    };
    let (q_ref, k_ref) = (rot(&q, nh), rot(&k, nkv)); // [seq, n, hd]
    let q_got = q_rot.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let err = max_rel(&q_got, &q_ref);
    assert!(err < 1e-5, "rotated q off by {err}");
    // The cache: the new rows at pos.., everything else untouched (f32 values, and as the cache
    // holds them).
    let (mut k_exact, mut v_exact) = (cache_k0, cache_v0);
    for i in 0..seq {
        for g in 0..nkv {
            let dst = (g * cap + c.pos + i) * hd;
            let src = (i * nkv + g) * hd;
            k_exact[dst..dst + hd].copy_from_slice(&k_ref[src..src + hd]);
            v_exact[dst..dst + hd].copy_from_slice(&v[src..src + hd]);
        }
    }
    let (k_want, v_want) = (kv_round(&k_exact, c.dtype), kv_round(&v_exact, c.dtype));
    let read = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>();
    let (k_got, v_got) = (read(&ck).unwrap(), read(&cv).unwrap());
    // f16: the kernel's rotation and candle's differ in the last f32 bits, which may move a key's
    // rounding by one f16 step (2⁻¹⁰ relative).
    let k_bound = if c.dtype == DType::F16 { 1e-3 } else { 1e-5 };
    assert!(max_rel(&k_got, &k_want) < k_bound, "cache keys ({:?})", c.dtype);
    assert_eq!(v_got, v_want, "cache values ({:?})", c.dtype);
    // The reference attends over the cache as the kernel reads it.
    let shape = AttnShape { nh, nkv, hd, cap, pos: c.pos, seq, scale };
    let attend_ref = |k_all: &[f32], v_all: &[f32]| attention_f64(&shape, &q_ref, k_all, v_all);
    let err = max_rel(&out, &attend_ref(&k_got, &v_got));
    assert!(
        err < 2e-5,
        "attention off by {err} (nh {nh} nkv {nkv} hd {hd} pos {} seq {seq}, {:?} cache)",
        c.pos,
        c.dtype
    );
    max_rel(&out, &attend_ref(&k_exact, &v_exact))
}

/// RoPE with the cache write and the split-K decode attention against candle's CPU RoPE and an
/// f64 attention, for an f32 cache and an f16 one (`--kv-cache-dtype f16`): the f16 cache holds
/// exactly the rounded keys and values, and the attention over them is as exact as over f32;
/// the rounding's own cost (the output against f32 keys and values) is printed and bounded.
#[test]
fn rope_append_and_decode_attention_match_the_reference() {
    let mut rng = Rng(0xdead_beef);
    let (mut n, mut f16_cost) = (0, 0f32);
    for dtype in [DType::F32, DType::F16] {
        for &(nh, nkv, hd) in
            &[(9usize, 3usize, 64usize), (32, 4, 128), (16, 16, 32), (8, 1, 256), (6, 2, 96)]
        {
            for &(pos, seq) in
                &[(0usize, 1usize), (5, 1), (300, 1), (1000, 4), (17, 16), (255, 1), (256, 3)]
            {
                for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
                    for rope_dim in [hd, hd / 2] {
                        let c = Case { nh, nkv, hd, rope_dim, style, pos, seq, dtype };
                        let cost = check_attention(&c, &mut rng);
                        if dtype == DType::F16 {
                            f16_cost = f16_cost.max(cost);
                        } else {
                            assert!(cost < 2e-5, "f32 cache: {cost}");
                        }
                        n += 1;
                    }
                }
            }
        }
    }
    assert_eq!(n, 2 * 5 * 7 * 2 * 2);
    println!("f16 KV cache: attention outputs within {f16_cost:.2e} of the f32 cache's");
    // Keys and values in [-1, 1) rounded to f16 (relative 2⁻¹¹): the outputs move by about that.
    assert!(f16_cost > 0.0 && f16_cost < 4e-3, "f16 KV cache cost {f16_cost}");
}

/// The dense Q4_K product of a few rows equals the f64 product over the dequantized weights
/// (within f32 rounding), and each row's result is bit for bit the same whatever the other rows.
#[test]
fn matmul_and_matvec_q4k_match_the_f32_reference_and_rows_are_independent() {
    use candle_core::quantized::{GgmlDType, QTensor};
    let (dev, cpu) = (cuda(), Device::Cpu);
    let mut rng = Rng(0xd3);
    // Row counts of 2200 and 4400: the mat-vec's 2- and 4-rows-per-warp launches (mv_rows),
    // compared bit for bit below with other row groupings of the same matrices.
    for &(r, k, n) in &[
        (7usize, 256usize, 1usize),
        (64, 2048, 16),
        (130, 768, 3),
        (2200, 256, 5),
        (4400, 512, 2),
        (97, 512, 11),
        // The tiles' kernel: 16 super-blocks over the block's warps, a partial second tile of
        // rows; six super-blocks (an uneven split), 9 rows.
        (40, 4096, 13),
        (33, 1536, 9),
    ] {
        let (wq, deq) = random_q4k(&[r, k], &mut rng, &dev);
        let x = rng.vec(n * k, 1.0);
        let xt = Tensor::from_vec(x.clone(), (n, k), &dev).unwrap();
        let got =
            gpu::matmul_q4k(&xt, &wq).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let want = matmul_ref(&deq, &x, r, k);
        let err = max_rel(&got, &want);
        assert!(err < 1e-5, "matmul_q4k off by {err} (R {r} K {k} n {n})");
        // The decode mat-vec on f32 inputs, from an aligned tensor and from one starting 4 bytes
        // in (copied).
        let f32mv = |x: &Tensor, ws: &[&QTensor]| {
            gpu::matvec_quant_many_as(x, ws, gpu::Activations::F32).unwrap()
        };
        let err = max_rel(&flat(&f32mv(&xt, &[&wq])[0]), &want);
        assert!(err < 1e-5, "matvec_q4k off by {err} (R {r} K {k} n {n})");
        let padded: Vec<f32> = std::iter::once(0.0).chain(x.iter().copied()).collect();
        let shifted = Tensor::from_vec(padded, n * k + 1, &dev).unwrap().narrow(0, 1, n * k);
        let shifted = shifted.unwrap().reshape((n, k)).unwrap();
        assert!(max_rel(&flat(&f32mv(&shifted, &[&wq])[0]), &want) < 1e-5, "unaligned x");
        // On q8 inputs: the f64 product over the dequantized weights and the host's own q8
        // rounding of x (the kernel's integer sums are exact; only the scaling rounds).
        let q8 = |x: &Tensor, ws: &[&QTensor]| {
            gpu::matvec_quant_many_as(x, ws, gpu::Activations::Q8).unwrap()
        };
        let want_q8 = matmul_ref(&deq, &q8_round(&x), r, k);
        let err = max_rel(&flat(&q8(&xt, &[&wq])[0]), &want_q8);
        assert!(err < 1e-5, "matvec_q4k (q8) off by {err} (R {r} K {k} n {n})");
        assert!(max_rel(&flat(&q8(&shifted, &[&wq])[0]), &want_q8) < 1e-5, "q8 of unaligned x");
        // The int8 tensor-core product over the same q8 inputs (tiles of 8 rows; R 7, 97, 130:
        // a block's rows past R), and each row alone gives its bits in the pass.
        let mma = flat(&gpu::matmul_q4k_mma(&xt, &wq).unwrap());
        let err = max_rel(&mma, &want_q8);
        assert!(err < 1e-5, "matmul_q4k_mma off by {err} (R {r} K {k} n {n})");
        for t in 0..n {
            let row = xt.narrow(0, t, 1).unwrap().contiguous().unwrap();
            let one = flat(&gpu::matmul_q4k_mma(&row, &wq).unwrap());
            assert_eq!(one, mma[t * r..(t + 1) * r], "matmul_q4k_mma row {t} of {n} (R {r} K {k})");
        }
        // Up to three matrices in one launch (q, k, v): each its own launch's bits; R + 5 and 3
        // rows: a partial 16-row group in every matrix after the first.
        let (wb, _) = random_q4k(&[r + 5, k], &mut rng, &dev);
        let (wc, _) = random_q4k(&[3, k], &mut rng, &dev);
        for ws in [vec![&wq], vec![&wq, &wb], vec![&wq, &wb, &wc], vec![&wc, &wq]] {
            let many = gpu::matmul_q4k_mma_many(&xt, &ws).unwrap();
            assert_eq!(many.len(), ws.len());
            for (y, w) in many.iter().zip(&ws) {
                let alone = flat(&gpu::matmul_q4k_mma(&xt, w).unwrap());
                assert_eq!(flat(y), alone, "matmul_q4k_mma_many vs alone (R {r} K {k} n {n})");
            }
        }
        for (act, mv) in
            [("f32", &f32mv as &dyn Fn(&Tensor, &[&QTensor]) -> Vec<Tensor>), ("q8", &q8)]
        {
            // Three matrices in one launch: each result bit for bit its own launch's.
            let (w2, _) = random_q4k(&[r + 5, k], &mut rng, &dev);
            let (w3, _) = random_q4k(&[3, k], &mut rng, &dev);
            let many = mv(&xt, &[&wq, &w2, &w3]);
            for (y, w) in many.iter().zip([&wq, &w2, &w3]) {
                let alone = &mv(&xt, &[w])[0];
                assert_eq!(flat(y), flat(alone), "{act} matvec many vs alone (R {r} K {k} n {n})");
            }
            // A short pass's rows (four tokens per warp) equal one-row decode products bit for
            // bit: a verify pass reproduces decode steps.
            let all = flat(&mv(&xt, &[&wq])[0]);
            for t in 0..n {
                let row = xt.narrow(0, t, 1).unwrap().contiguous().unwrap();
                let one = flat(&mv(&row, &[&wq])[0]);
                assert_eq!(
                    one,
                    all[t * r..(t + 1) * r],
                    "{act} mat-vec row {t} of {n} (R {r} K {k})"
                );
            }
        }
        let last = xt.narrow(0, n - 1, 1).unwrap().contiguous().unwrap();
        let alone =
            gpu::matmul_q4k(&last, &wq).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(alone, got[(n - 1) * r..], "row {} alone differs (R {r} K {k} n {n})", n - 1);
    }
    let x = Tensor::zeros((gpu::MATMUL_ROWS_MAX + 1, 256), DType::F32, &dev).unwrap();
    let w = Tensor::zeros((4, 256), DType::F32, &cpu).unwrap();
    let wq = QTensor::quantize_onto(&w, GgmlDType::Q4K, &dev).unwrap();
    assert!(gpu::matmul_q4k(&x, &wq).is_err());
    let x = Tensor::zeros((1, 512), DType::F32, &dev).unwrap();
    assert!(gpu::matvec_quant(&x, &wq).is_err(), "K 512 against a matrix of 256 columns");
    assert!(gpu::matvec_quant_many(&x, &[]).is_err());
    assert!(gpu::matmul_q4k_mma(&x, &wq).is_err(), "K 512 against a matrix of 256 columns");
    assert!(gpu::matmul_q4k_mma_many(&x, &[&wq]).is_err(), "K 512 against 256 columns");
    assert!(gpu::matmul_q4k_mma_many(&x, &[]).is_err(), "no matrix");
    assert!(gpu::matmul_q4k_mma_many(&x, &[&wq, &wq, &wq, &wq]).is_err(), "four matrices");
}

/// The Q4_1 and Q8_0 mat-vecs (llama-family dense layers; q8 inputs) equal the f64 product over
/// the dequantized weights (candle's CPU dequantizer) and the host's q8 rounding of x within f32
/// rounding; several matrices in one launch and each row of a short pass are bit for bit their
/// own launch's / a one-row launch's; f32 inputs and mixed formats are refused.
#[test]
fn matvec_q4_1_and_q8_0_match_the_reference_and_rows_are_independent() {
    use candle_core::quantized::{GgmlDType, QTensor};
    let (dev, cpu) = (cuda(), Device::Cpu);
    let mut rng = Rng(0x41_80);
    let random = |dims: &[usize], dt: GgmlDType, rng: &mut Rng| {
        let w = Tensor::from_vec(rng.vec(dims.iter().product(), 1.0), dims, &cpu).unwrap();
        let deq = QTensor::quantize(&w, dt).unwrap().dequantize(&cpu).unwrap();
        (QTensor::quantize_onto(&w, dt, &dev).unwrap(), flat(&deq.flatten_all().unwrap()))
    };
    let mut cases = 0;
    for dt in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
        // SmolLM2's shapes (576 = 18 blocks: a warp's last step half idle), row counts of the 2-
        // and 4-rows-per-warp decode launches (an lm_head's), a single block per row.
        for &(r, k, n) in &[
            (576usize, 576usize, 1usize),
            (192, 1536, 5),
            (4400, 64, 2),
            (4400, 64, 1),
            (2200, 96, 1),
            (9, 32, 8),
            (300, 64, 13),
        ] {
            let (w, deq) = random(&[r, k], dt, &mut rng);
            let x = rng.vec(n * k, 2.0);
            let xt = Tensor::from_vec(x.clone(), (n, k), &dev).unwrap();
            let mv = |x: &Tensor, ws: &[&QTensor]| {
                gpu::matvec_quant_many_as(x, ws, gpu::Activations::Q8).unwrap()
            };
            let want = matmul_ref(&deq, &q8_round(&x), r, k);
            let got = flat(&mv(&xt, &[&w])[0]);
            let err = max_rel(&got, &want);
            assert!(err < 1e-5, "{dt:?} mat-vec off by {err} (R {r} K {k} n {n})");
            let (w2, _) = random(&[r + 3, k], dt, &mut rng);
            let (w3, _) = random(&[5, k], dt, &mut rng);
            let many = mv(&xt, &[&w, &w2, &w3]);
            for (y, m) in many.iter().zip([&w, &w2, &w3]) {
                assert_eq!(flat(y), flat(&mv(&xt, &[m])[0]), "{dt:?} many vs alone (R {r} K {k})");
            }
            for t in 0..n {
                let row = xt.narrow(0, t, 1).unwrap().contiguous().unwrap();
                let one = flat(&mv(&row, &[&w])[0]);
                assert_eq!(one, got[t * r..(t + 1) * r], "{dt:?} row {t} of {n} (R {r} K {k})");
            }
            assert!(
                gpu::matvec_quant_many_as(&xt, &[&w], gpu::Activations::F32).is_err(),
                "{dt:?} takes q8 inputs only"
            );
            cases += 1;
        }
    }
    assert_eq!(cases, 14);
    let x = Tensor::zeros((1, 64), DType::F32, &dev).unwrap();
    let (a, _) = random(&[4, 64], GgmlDType::Q4_1, &mut rng);
    let (b, _) = random(&[4, 64], GgmlDType::Q8_0, &mut rng);
    assert!(gpu::matvec_quant_many_as(&x, &[&a, &b], gpu::Activations::Q8).is_err(), "mixed");
    let x48 = Tensor::zeros((1, 48), DType::F32, &dev).unwrap();
    assert!(!gpu::matvec_supports(GgmlDType::Q4_1, 48, gpu::Activations::Q8));
    assert!(gpu::matvec_quant(&x48, &a).is_err(), "K 48");
}

/// `x: [n, k] · wᵀ` for `w: [r, k]`, summed in f64 and rounded to f32: the mat-vec kernels'
/// reference.
fn matmul_ref(w: &[f32], x: &[f32], r: usize, k: usize) -> Vec<f32> {
    (0..x.len() / k * r)
        .map(|i| {
            let (t, o) = (i / r, i % r);
            (0..k).map(|j| w[o * k + j] as f64 * x[t * k + j] as f64).sum::<f64>() as f32
        })
        .collect()
}

/// `x` rounded as `strata_kernels::cuda::quantize_q8` rounds it (per 32 values: `d = max|x| /
/// 127`, `q = round_half_even(x / d)`), back to `d · q` (rounded to f32: within half an ulp).
fn q8_round(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for b in x.chunks(32) {
        let d = b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        out.extend(b.iter().map(|&v| if d == 0.0 { 0.0 } else { (v / d).round_ties_even() * d }));
    }
    out
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// The 8-bit rounding of the mat-vec's inputs equals the host's: the same scales and integers.
#[test]
fn quantize_q8_matches_the_host_rounding() {
    let dev = cuda();
    let mut rng = Rng(0x08);
    let (n, k) = (3usize, 512usize);
    let mut x = rng.vec(n * k, 3.0);
    x[32..64].iter_mut().for_each(|v| *v = 0.0); // an all-zero block: d = 0, q = 0
    x[70] = 0.5 * x[64..96].iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0 * 3.0; // a tie
    let xt = Tensor::from_vec(x.clone(), (n, k), &dev).unwrap();
    let (q, d) = gpu::quantize_q8(&xt).unwrap();
    let q = q.flatten_all().unwrap().to_vec1::<u8>().unwrap();
    let d = flat(&d);
    for (b, chunk) in x.chunks(32).enumerate() {
        let want_d = chunk.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        assert_eq!(d[b], want_d, "scale of block {b}");
        for (i, &v) in chunk.iter().enumerate() {
            let want = if want_d == 0.0 { 0 } else { (v / want_d).round_ties_even() as i32 };
            assert_eq!(q[b * 32 + i] as i8 as i32, want, "q of value {i} of block {b}");
        }
    }
    let odd = Tensor::zeros((1, 48), DType::F32, &dev).unwrap();
    assert!(gpu::quantize_q8(&odd).is_err(), "K not a multiple of 32");
}

/// A shared expert's gated sum in one launch equals the four launches it replaces — the gate's
/// `matvec_f32`, candle's sigmoid, mul and add — bit for bit, for one row (a decode step), a few
/// and a prompt's worth; a gate of the wrong shape is an error.
#[test]
fn shared_gate_add_equals_matvec_sigmoid_mul_add() {
    let dev = cuda();
    let mut rng = Rng(0x5ca1_ab1e);
    for &(n, h) in &[(1usize, 2048usize), (3, 12), (40, 3072)] {
        let t = |v: Vec<f32>, shape: (usize, usize)| Tensor::from_vec(v, shape, &dev).unwrap();
        let x = t(rng.vec(n * h, 1.0), (n, h));
        let shared = t(rng.vec(n * h, 1.0), (n, h));
        let routed = t(rng.vec(n * h, 1.0), (n, h));
        let gate = t(rng.vec(h, 0.1), (1, h));
        let g = candle_nn::ops::sigmoid(&gpu::matvec_f32(&x, &gate).unwrap()).unwrap();
        let want = flat(&(&routed + shared.broadcast_mul(&g).unwrap()).unwrap());
        let got = flat(&gpu::shared_gate_add(&routed, &shared, &x, &gate).unwrap());
        assert_eq!(got, want, "n {n}, H {h}");
    }
    let z = |r: usize, c: usize| Tensor::zeros((r, c), DType::F32, &dev).unwrap();
    assert!(gpu::shared_gate_add(&z(2, 8), &z(2, 8), &z(2, 8), &z(2, 8)).is_err());
}

/// The f32 mat-vec (router logits, a shared expert's one-row gate) and the fused residual add + RMSNorm against f64 references.
#[test]
fn matvec_f32_and_add_rms_norm_match_the_reference() {
    let dev = cuda();
    let mut rng = Rng(0xf32);
    for &(r, k, n) in &[(128usize, 2048usize, 1usize), (7, 12, 3), (64, 4, 1), (1, 3072, 2)] {
        let (w, x) = (rng.vec(r * k, 1.0), rng.vec(n * k, 1.0));
        let wt = Tensor::from_vec(w.clone(), (r, k), &dev).unwrap();
        let xt = Tensor::from_vec(x.clone(), (n, k), &dev).unwrap();
        let got = flat(&gpu::matvec_f32(&xt, &wt).unwrap());
        let want = matmul_ref(&w, &x, r, k);
        let err = max_rel(&got, &want);
        assert!(err < 1e-5, "matvec_f32 off by {err} (R {r} K {k} n {n})");
    }
    let odd = Tensor::zeros((1, 6), DType::F32, &dev).unwrap();
    assert!(gpu::matvec_f32(&odd, &Tensor::zeros((2, 6), DType::F32, &dev).unwrap()).is_err());
    // The many-row product (prompt passes' router logits): the reference, and each row the same
    // bits whatever the pass's other rows (a 3-row pass against rows of a 900-row one).
    for &(r, k, n) in &[(128usize, 2048usize, 900usize), (33, 70, 5), (1, 31, 40)] {
        let (w, x) = (rng.vec(r * k, 1.0), rng.vec(n * k, 1.0));
        let wt = Tensor::from_vec(w.clone(), (r, k), &dev).unwrap();
        let xt = Tensor::from_vec(x.clone(), (n, k), &dev).unwrap();
        let got = flat(&gpu::matmul_f32_rows(&xt, &wt).unwrap());
        let err = max_rel(&got, &matmul_ref(&w, &x, r, k));
        assert!(err < 1e-5, "matmul_f32_rows off by {err} (R {r} K {k} n {n})");
        let start = n / 2;
        let few = xt.narrow(0, start, 3.min(n - start)).unwrap().contiguous().unwrap();
        let part = flat(&gpu::matmul_f32_rows(&few, &wt).unwrap());
        assert_eq!(part, got[start * r..start * r + part.len()], "rows alone (R {r} K {k})");
    }
    assert!(gpu::matmul_f32_rows(&odd, &Tensor::zeros((2, 5), DType::F32, &dev).unwrap()).is_err());
    for &(n, h) in &[(1usize, 2048usize), (3, 100), (2, 4096)] {
        let (a, b, w) = (rng.vec(n * h, 2.0), rng.vec(n * h, 2.0), rng.vec(h, 1.0));
        let up = |v: &Vec<f32>, s: (usize, usize)| Tensor::from_vec(v.clone(), s, &dev).unwrap();
        let wt = Tensor::from_vec(w.clone(), h, &dev).unwrap();
        let (sum, out) = gpu::add_rms_norm(&up(&a, (n, h)), &up(&b, (n, h)), &wt, 1e-6).unwrap();
        let (sum, out) = (flat(&sum), flat(&out));
        let mut want = vec![0f32; n * h];
        for t in 0..n {
            let s: Vec<f64> = (0..h).map(|j| a[t * h + j] as f64 + b[t * h + j] as f64).collect();
            let inv = 1.0 / (s.iter().map(|v| v * v).sum::<f64>() / h as f64 + 1e-6).sqrt();
            for j in 0..h {
                assert_eq!(sum[t * h + j], a[t * h + j] + b[t * h + j], "the sum is f32's");
                want[t * h + j] = (s[j] * inv * w[j] as f64) as f32;
            }
        }
        let err = max_rel(&out, &want);
        assert!(err < 1e-5, "add_rms_norm off by {err} (n {n} H {h})");
    }
    let (a, w) = (Tensor::zeros((2, 8), DType::F32, &dev).unwrap(), rng.vec(4, 1.0));
    let w = Tensor::from_vec(w, 4, &dev).unwrap();
    assert!(gpu::add_rms_norm(&a, &a, &w, 1e-6).is_err(), "weight of another width");
}

/// The q8 roundings that `add_rms_norm`, `silu_mul` and `attend_decode` write beside their
/// outputs (the twins the mat-vec kernels take instead of a `quantize_q8` launch) are
/// `quantize_q8`'s bytes; they are kept for the row counts `q8_beside` names, at most `TWINS_KEPT`, and released on demand.
#[test]
fn fused_q8_twins_equal_quantize_q8_of_the_output() {
    let dev = cuda();
    let mut rng = Rng(0x7e1);
    assert!(gpu::q8_beside(3, 2048), "run with the default activations (STRATA_GPU_Q8 unset)");
    let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
    let same_as_quantize = |out: &Tensor, what: &str| {
        let (tq, td) = gpu::q8_twin(out).unwrap_or_else(|| panic!("{what}: no twin kept"));
        let (q, d) = gpu::quantize_q8(out).unwrap();
        assert_eq!(bytes(&tq), bytes(&q), "{what}: integers");
        assert_eq!(flat(&td), flat(&d), "{what}: scales");
    };
    gpu::release_q8_twins();
    let mut outs = Vec::new();
    for &(n, h) in &[(1usize, 2048usize), (3, 2048), (16, 512), (17, 512), (3, 100)] {
        let up = |v: Vec<f32>| Tensor::from_vec(v, (n, h), &dev).unwrap();
        let (a, b) = (up(rng.vec(n * h, 2.0)), up(rng.vec(n * h, 2.0)));
        let w = Tensor::from_vec(rng.vec(h, 1.0), h, &dev).unwrap();
        let (_, out) = gpu::add_rms_norm(&a, &b, &w, 1e-6).unwrap();
        if n <= gpu::MOE_ROWS_MAX && h % 32 == 0 {
            same_as_quantize(&out, &format!("add_rms_norm n {n} H {h}"));
        } else {
            assert!(gpu::q8_twin(&out).is_none(), "n {n} H {h}: no twin expected");
        }
        outs.push(out);
    }
    // The SwiGLU product of a dense MLP (its down projection's input) for the same row counts.
    for &(n, k) in &[(2usize, 1536usize), (17, 64), (1, 100)] {
        let up = |v: Vec<f32>| Tensor::from_vec(v, (n, k), &dev).unwrap();
        let (g, u) = (up(rng.vec(n * k, 4.0)), up(rng.vec(n * k, 2.0)));
        let out = gpu::silu_mul(&g, &u).unwrap();
        if n <= gpu::MOE_ROWS_MAX && k % 32 == 0 {
            same_as_quantize(&out, &format!("silu_mul n {n} K {k}"));
        } else {
            assert!(gpu::q8_twin(&out).is_none(), "silu_mul n {n} K {k}: no twin expected");
        }
        outs.push(out);
    }
    // Four twins were kept, none evicted yet; two more push the oldest out.
    assert!(gpu::q8_twin(&outs[0]).is_some());
    let (nh, nkv, hd, cap) = (8usize, 2usize, 64usize, 700usize);
    let scale = 1.0 / (hd as f32).sqrt();
    for &(pos, seq) in &[(5usize, 1usize), (600, 4)] {
        // Position 600: three chunks, merged by attn_combine (which writes the twin then).
        let ck = Tensor::from_vec(rng.vec(nkv * cap * hd, 1.0), (1, nkv, cap, hd), &dev).unwrap();
        let cv = Tensor::from_vec(rng.vec(nkv * cap * hd, 1.0), (1, nkv, cap, hd), &dev).unwrap();
        let q = Tensor::from_vec(rng.vec(seq * nh * hd, 1.0), (seq, nh, hd), &dev).unwrap();
        let kv = gpu::LayerKv { k: &ck, v: &cv };
        let out = gpu::attend_decode(&q, gpu::Position::Host(pos), scale, kv).unwrap();
        same_as_quantize(&out, &format!("attend_decode pos {pos} rows {seq}"));
        outs.push(out);
    }
    assert!(gpu::q8_twin(&outs[0]).is_none(), "past TWINS_KEPT the oldest twin is dropped");
    assert_eq!(gpu::TWINS_KEPT, 5);
    // A mat-vec given an output with a twin computes what it computes from a fresh rounding.
    let (w, _) = random_q4k(&[256, 2048], &mut rng, &dev);
    let ones = Tensor::ones(2048, DType::F32, &dev).unwrap();
    let (_, xn) = gpu::add_rms_norm(&outs[1], &outs[1], &ones, 1e-6).unwrap();
    assert!(gpu::q8_twin(&xn).is_some());
    let with_twin = flat(&gpu::matvec_quant(&xn, &w).unwrap());
    gpu::release_q8_twins();
    assert!(gpu::q8_twin(&xn).is_none(), "released");
    let fresh = flat(&gpu::matvec_quant(&xn, &w).unwrap());
    assert_eq!(with_twin, fresh, "a twin's product equals a fresh rounding's");
}

/// RoPE with the per-head q/k RMSNorm inside the kernel equals candle's `rms_norm` on each head
/// followed by the plain kernel: the same rotated q and cache keys (values untouched by the norm).
#[test]
fn rope_with_head_norms_equals_norm_then_rope() {
    let dev = cuda();
    let mut rng = Rng(0x9e);
    for &(nh, nkv, hd, rd, seq) in
        &[(8usize, 2usize, 128usize, 128usize, 1usize), (4, 4, 64, 32, 3)]
    {
        let cap = seq + 4;
        let rope = RotaryEmbedding::new(1e6, rd, &RopeScaling::None, RopeStyle::Neox, cap, &dev);
        let rope = rope.unwrap();
        let (cos, sin, _) = rope.tables();
        let up = |n: usize, rng: &mut Rng| {
            Tensor::from_vec(rng.vec(seq * n * hd, 3.0), (seq, n, hd), &dev).unwrap()
        };
        let (q, k, v) = (up(nh, &mut rng), up(nkv, &mut rng), up(nkv, &mut rng));
        let qw = Tensor::from_vec(rng.vec(hd, 1.0), hd, &dev).unwrap();
        let kw = Tensor::from_vec(rng.vec(hd, 1.0), hd, &dev).unwrap();
        let cache = || Tensor::zeros((1, nkv, cap, hd), DType::F32, &dev).unwrap();
        let (ck1, cv1, ck2, cv2) = (cache(), cache(), cache(), cache());
        let norms = gpu::HeadNorms { q: &qw, k: &kw, eps: 1e-6 };
        let at = gpu::Position::Host(1);
        let kv1 = gpu::LayerKv { k: &ck1, v: &cv1 };
        let fused =
            gpu::rope_kv_append(&q, &k, &v, cos, sin, gpu::RopeStyle::Neox, at, kv1, Some(norms));
        let qn = candle_nn::ops::rms_norm(&q, &qw, 1e-6).unwrap();
        let kn = candle_nn::ops::rms_norm(&k, &kw, 1e-6).unwrap();
        let kv2 = gpu::LayerKv { k: &ck2, v: &cv2 };
        let plain =
            gpu::rope_kv_append(&qn, &kn, &v, cos, sin, gpu::RopeStyle::Neox, at, kv2, None);
        let err = max_rel(&flat(&fused.unwrap()), &flat(&plain.unwrap()));
        assert!(err < 1e-5, "rotated q off by {err} (hd {hd})");
        let err = max_rel(&flat(&ck1), &flat(&ck2));
        assert!(err < 1e-5, "cache keys off by {err} (hd {hd})");
        assert_eq!(flat(&cv1), flat(&cv2), "cache values");
    }
}

/// A batched pass over several sequences' caches through a row table (one launch each for RoPE
/// with the cache writes and for attention) equals running each sequence alone: the same rotated
/// queries, cache contents and attention outputs. Contexts of different lengths, one past a
/// split boundary, and a sequence with two rows.
#[test]
fn row_table_batch_equals_each_sequence_alone() {
    check_row_table(DType::F32);
    check_row_table(DType::F16);
}

/// [`row_table_batch_equals_each_sequence_alone`] with caches of `dtype`.
fn check_row_table(dtype: DType) {
    let dev = cuda();
    let mut rng = Rng(0xba7c);
    let (nh, nkv, hd, cap) = (8usize, 2usize, 64usize, 700usize);
    let rope =
        RotaryEmbedding::new(10000.0, hd, &RopeScaling::None, RopeStyle::Neox, cap, &dev).unwrap();
    let (cos, sin, _) = rope.tables();
    let scale = 1.0 / (hd as f32).sqrt();
    let seqs = [(5usize, 1usize), (300, 2), (611, 1)]; // (position, rows)
    let rows: usize = seqs.iter().map(|s| s.1).sum();
    let caches: Vec<(Vec<f32>, Vec<f32>)> =
        seqs.iter().map(|_| (rng.vec(nkv * cap * hd, 1.0), rng.vec(nkv * cap * hd, 1.0))).collect();
    let cache = |c: &Vec<f32>| {
        Tensor::from_vec(c.clone(), (1, nkv, cap, hd), &dev).unwrap().to_dtype(dtype).unwrap()
    };
    let (q, k, v) = (
        rng.vec(rows * nh * hd, 1.0),
        rng.vec(rows * nkv * hd, 1.0),
        rng.vec(rows * nkv * hd, 1.0),
    );
    let t = |x: &Vec<f32>, n: usize| Tensor::from_vec(x.clone(), (rows, n, hd), &dev).unwrap();
    let (qt, kt, vt) = (t(&q, nh), t(&k, nkv), t(&v, nkv));
    let flat = |t: &Tensor| {
        t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    // Alone: each sequence's rows with a host position.
    let alone: Vec<(Tensor, Tensor)> = caches.iter().map(|(a, b)| (cache(a), cache(b))).collect();
    let (mut q_alone, mut out_alone, mut start) = (Vec::new(), Vec::new(), 0);
    for (&(pos, n), (ck, cv)) in seqs.iter().zip(&alone) {
        let pick = |x: &Tensor| x.narrow(0, start, n).unwrap();
        let kv = gpu::LayerKv { k: ck, v: cv };
        let qr = gpu::rope_kv_append(
            &pick(&qt),
            &pick(&kt),
            &pick(&vt),
            cos,
            sin,
            gpu::RopeStyle::Neox,
            gpu::Position::Host(pos),
            kv,
            None,
        )
        .unwrap();
        let kv = gpu::LayerKv { k: ck, v: cv };
        out_alone
            .extend(flat(&gpu::attend_decode(&qr, gpu::Position::Host(pos), scale, kv).unwrap()));
        q_alone.extend(flat(&qr));
        start += n;
    }
    // Batched: all rows, one row table.
    let batched: Vec<(Tensor, Tensor)> = caches.iter().map(|(a, b)| (cache(a), cache(b))).collect();
    let mut table = gpu::RowTable::default();
    for (&(pos, n), (ck, cv)) in seqs.iter().zip(&batched) {
        table.push(pos, n, gpu::LayerKv { k: ck, v: cv }).unwrap();
    }
    let rows_table = table.upload(&dev).unwrap();
    let at = gpu::Position::Rows(&rows_table);
    let kv = gpu::LayerKv { k: &batched[0].0, v: &batched[0].1 };
    let qr =
        gpu::rope_kv_append(&qt, &kt, &vt, cos, sin, gpu::RopeStyle::Neox, at, kv, None).unwrap();
    let kv = gpu::LayerKv { k: &batched[0].0, v: &batched[0].1 };
    let out = flat(&gpu::attend_decode(&qr, at, scale, kv).unwrap());
    assert!(max_rel(&flat(&qr), &q_alone) < 1e-6, "rotated q");
    for ((ak, av), (bk, bv)) in alone.iter().zip(&batched) {
        assert_eq!(flat(ak), flat(bk), "cache keys");
        assert_eq!(flat(av), flat(bv), "cache values");
    }
    let err = max_rel(&out, &out_alone);
    assert!(err < 1e-6, "batched attention off by {err}");
    if dtype == DType::F16 {
        // The tensor-core kernel over the row table: each row the same bits as its sequence's
        // rows alone, and within its rounding of the CUDA-core kernel.
        let (mut tc_alone, mut start) = (Vec::new(), 0);
        for (&(pos, n), (ck, cv)) in seqs.iter().zip(&batched) {
            let qa = qr.narrow(0, start, n).unwrap().contiguous().unwrap();
            let kv = gpu::LayerKv { k: ck, v: cv };
            let o = gpu::attend_decode_tc(&qa, gpu::Position::Host(pos), scale, kv).unwrap();
            tc_alone.extend(flat(&o));
            start += n;
        }
        let kv = gpu::LayerKv { k: &batched[0].0, v: &batched[0].1 };
        let tc = flat(&gpu::attend_decode_tc(&qr, at, scale, kv).unwrap());
        assert_eq!(tc, tc_alone, "tensor-core batched attention");
        assert!(max_rel(&tc, &out) < 3e-3, "tensor-core against CUDA-core");
    }
    // Refused: a table with fewer rows than the pass, a cache of another shape in a table, and
    // a table whose caches differ from the launch's.
    let mut short = gpu::RowTable::default();
    short.push(5, 1, gpu::LayerKv { k: &batched[0].0, v: &batched[0].1 }).unwrap();
    let short = short.upload(&dev).unwrap();
    let kv = gpu::LayerKv { k: &batched[0].0, v: &batched[0].1 };
    assert!(gpu::attend_decode(&qr, gpu::Position::Rows(&short), scale, kv).is_err());
    let other = Tensor::zeros((1, nkv, cap + 1, hd), dtype, &dev).unwrap();
    let mut mixed = gpu::RowTable::default();
    mixed.push(5, 1, gpu::LayerKv { k: &batched[0].0, v: &batched[0].1 }).unwrap();
    assert!(mixed.push(5, 1, gpu::LayerKv { k: &other, v: &other }).is_err());
    // ... and a cache of the other element type, in a table or beside its own values.
    let other_type = if dtype == DType::F16 { DType::F32 } else { DType::F16 };
    let retyped = batched[1].0.to_dtype(other_type).unwrap();
    assert!(mixed.push(5, 1, gpu::LayerKv { k: &retyped, v: &retyped }).is_err());
    assert!(mixed.push(5, 1, gpu::LayerKv { k: &batched[1].0, v: &retyped }).is_err());
    let mut lone = gpu::RowTable::default();
    for _ in 0..rows {
        lone.push(5, 1, gpu::LayerKv { k: &other, v: &other }).unwrap();
    }
    let lone = lone.upload(&dev).unwrap();
    let kv = gpu::LayerKv { k: &batched[0].0, v: &batched[0].1 };
    assert!(gpu::attend_decode(&qr, gpu::Position::Rows(&lone), scale, kv).is_err());
}

/// A batched prompt pass's attention in one launch over a row table (`attend_prefill_rows`)
/// equals `attend_prefill` over each sequence alone, bit for bit: sequences of different lengths
/// (one tile, several, a partial last tile) at different positions, head dimensions 64 and 128.
#[test]
fn prefill_attention_over_a_row_table_equals_each_sequence_alone() {
    let dev = cuda();
    let mut rng = Rng(0x9f11);
    for &(nh, nkv, hd) in &[(8usize, 2usize, 128usize), (4, 4, 64)] {
        let cap = 700usize;
        let scale = 1.0 / (hd as f32).sqrt();
        let seqs = [(5usize, 40usize), (300, 17), (611, 70), (0, 64)]; // (position, rows)
        let rows: usize = seqs.iter().map(|s| s.1).sum();
        let caches: Vec<(Tensor, Tensor)> = seqs
            .iter()
            .map(|_| {
                let c = |rng: &mut Rng| {
                    Tensor::from_vec(rng.vec(nkv * cap * hd, 1.0), (1, nkv, cap, hd), &dev)
                        .unwrap()
                        .to_dtype(DType::F16)
                        .unwrap()
                };
                (c(&mut rng), c(&mut rng))
            })
            .collect();
        let q = Tensor::from_vec(rng.vec(rows * nh * hd, 1.0), (rows, nh, hd), &dev).unwrap();
        let (mut alone, mut start) = (Vec::new(), 0);
        let mut table = gpu::RowTable::default();
        for (&(pos, n), (ck, cv)) in seqs.iter().zip(&caches) {
            let qa = q.narrow(0, start, n).unwrap().contiguous().unwrap();
            let o = gpu::attend_prefill(&qa, pos, scale, gpu::LayerKv { k: ck, v: cv }).unwrap();
            alone.extend(flat(&o));
            table.push(pos, n, gpu::LayerKv { k: ck, v: cv }).unwrap();
            start += n;
        }
        let table = table.upload_segments(&dev).unwrap();
        let kv = gpu::LayerKv { k: &caches[0].0, v: &caches[0].1 };
        let batched = flat(&gpu::attend_prefill_rows(&q, &table, scale, kv).unwrap());
        assert_eq!(batched, alone, "batched prompt attention (nh {nh}, nkv {nkv}, hd {hd})");
        // Refused: a pass of another row count than the table's.
        let fewer = q.narrow(0, 0, rows - 1).unwrap().contiguous().unwrap();
        assert!(gpu::attend_prefill_rows(&fewer, &table, scale, kv).is_err());
    }
}

#[test]
fn attention_refuses_what_it_cannot_run() {
    let dev = cuda();
    let ck = Tensor::zeros((1, 2, 8, 64), DType::F32, &dev).unwrap();
    let cv = ck.clone();
    let q = Tensor::zeros((2, 4, 64), DType::F32, &dev).unwrap();
    // past the cache
    assert!(gpu::attend_decode(&q, gpu::Position::Host(7), 1.0, gpu::LayerKv { k: &ck, v: &cv })
        .is_err());
    // heads not a multiple of kv heads
    let q3 = Tensor::zeros((1, 3, 64), DType::F32, &dev).unwrap();
    assert!(gpu::attend_decode(&q3, gpu::Position::Host(0), 1.0, gpu::LayerKv { k: &ck, v: &cv })
        .is_err());
    assert!(!gpu::attend_supports(80));
    assert!(gpu::attend_supports(128));
}

/// The prompt-pass attention on tensor cores (`attend_prefill`, FlashAttention-2 over an f16 KV
/// cache) against an f64 attention over the same f16 keys and values and the f32 queries: its
/// own rounding (q and the softmax weights to f16) is all that separates them. Positions past the
/// pass hold NaN: the kernel must never read them. Row counts that leave the last 64-row tile
/// part empty, GQA groups of 1, 3, 8 and 16 heads, passes after a long context. It also matches
/// the split-K decode kernel (f32 arithmetic) over the same cache within that rounding.
#[test]
fn prefill_attention_on_tensor_cores_matches_the_reference() {
    let dev = cuda();
    let mut rng = Rng(0x5eed_f1a5);
    let mut worst = 0f32;
    let mut n = 0;
    for &(nh, nkv, hd) in &[(9usize, 3usize, 64usize), (32, 4, 128), (8, 1, 256), (16, 16, 128)] {
        for &(pos, seq) in &[(0usize, 17usize), (0, 100), (333, 64), (1000, 37), (70, 203)] {
            let c = F16Case::new(&mut rng, &dev, AttnShape::of(nh, nkv, hd, pos, seq, 40));
            let (qt, scale) = (&c.qt, c.shape.scale);
            let kv = || gpu::LayerKv { k: &c.ck, v: &c.cv };
            let got = flat(&gpu::attend_prefill(qt, pos, scale, kv()).unwrap());
            let err = max_rel(&got, &c.reference());
            assert!(
                err < 3e-3,
                "attend_prefill off by {err} (nh {nh} nkv {nkv} hd {hd} pos {pos} seq {seq})"
            );
            let split_k =
                flat(&gpu::attend_decode(qt, gpu::Position::Host(pos), scale, kv()).unwrap());
            assert!(max_rel(&got, &split_k) < 3e-3, "against attend_decode");
            worst = worst.max(err);
            n += 1;
        }
    }
    assert_eq!(n, 4 * 5);
    println!(
        "attend_prefill: within {worst:.2e} of the f64 attention (relative to the largest output)"
    );
    // Refusals: an f32 cache, a head dimension without a kernel, positions past the cache.
    let q = Tensor::zeros((20, 4, 64), DType::F32, &dev).unwrap();
    let c32 = Tensor::zeros((1, 2, 64, 64), DType::F32, &dev).unwrap();
    assert!(gpu::attend_prefill(&q, 0, 1.0, gpu::LayerKv { k: &c32, v: &c32 }).is_err());
    let c16 = c32.to_dtype(DType::F16).unwrap();
    assert!(gpu::attend_prefill(&q, 0, 1.0, gpu::LayerKv { k: &c16, v: &c16 }).is_ok());
    assert!(gpu::attend_prefill(&q, 45, 1.0, gpu::LayerKv { k: &c16, v: &c16 }).is_err());
    let q96 = Tensor::zeros((20, 4, 96), DType::F32, &dev).unwrap();
    let c96 = Tensor::zeros((1, 2, 64, 96), DType::F16, &dev).unwrap();
    assert!(gpu::attend_prefill(&q96, 0, 1.0, gpu::LayerKv { k: &c96, v: &c96 }).is_err());
    assert!(!gpu::attend_prefill_supports(96) && gpu::attend_prefill_supports(128));
}

/// Decode and verify passes on tensor cores (`attend_decode_tc`, split-K over chunks of 64·n
/// positions, merged by `attn_combine`) against the f64 attention over the same f16 cache (its
/// rounding: q and the softmax weights to f16), and against the CUDA-core `attend_decode`. A row
/// of a 4-row pass equals that row decoded alone bit for bit (speculative verification), and a
/// position read from the device (a CUDA graph's launch, more splits) equals the host's.
#[test]
fn decode_attention_on_tensor_cores_matches_the_reference() {
    let dev = cuda();
    let mut rng = Rng(0xdec0_de7c);
    let (mut worst, mut n) = (0f32, 0);
    for &(nh, nkv, hd) in &[(9usize, 3usize, 64usize), (32, 4, 128), (8, 1, 256), (16, 16, 128)] {
        for &(pos, seq) in
            &[(0usize, 1usize), (5, 1), (63, 1), (64, 4), (1000, 4), (9000, 1), (300, 16)]
        {
            let c = F16Case::new(&mut rng, &dev, AttnShape::of(nh, nkv, hd, pos, seq, 70));
            let (qt, q, scale, cap) = (&c.qt, &c.q, c.shape.scale, c.shape.cap);
            let kv = || gpu::LayerKv { k: &c.ck, v: &c.cv };
            let got =
                flat(&gpu::attend_decode_tc(qt, gpu::Position::Host(pos), scale, kv()).unwrap());
            let err = max_rel(&got, &c.reference());
            assert!(
                err < 3e-3,
                "attend_decode_tc off by {err} (nh {nh} hd {hd} pos {pos} seq {seq})"
            );
            let cuda_cores =
                flat(&gpu::attend_decode(qt, gpu::Position::Host(pos), scale, kv()).unwrap());
            assert!(max_rel(&got, &cuda_cores) < 3e-3, "against attend_decode");
            worst = worst.max(err);
            // Each row alone, at its own position: the same bits.
            for i in 0..seq {
                let row = &q[i * nh * hd..(i + 1) * nh * hd];
                let qi = Tensor::from_vec(row.to_vec(), (1, nh, hd), &dev).unwrap();
                let alone = flat(
                    &gpu::attend_decode_tc(&qi, gpu::Position::Host(pos + i), scale, kv()).unwrap(),
                );
                assert_eq!(alone, got[i * nh * hd..(i + 1) * nh * hd], "row {i} of {seq} at {pos}");
            }
            // The position from the device, a graph bucket's maximum above it.
            if pos + seq < 2048 {
                let p = Tensor::from_vec(vec![pos as u32], 1, &dev).unwrap();
                let max = (pos + 64).min(cap - seq);
                let on_dev = gpu::Position::Device { pos: &p, max };
                let d = flat(&gpu::attend_decode_tc(qt, on_dev, scale, kv()).unwrap());
                assert_eq!(d, got, "device position (nh {nh} hd {hd} pos {pos} seq {seq})");
            }
            n += 1;
        }
    }
    assert_eq!(n, 4 * 7);
    println!("attend_decode_tc: within {worst:.2e} of the f64 attention (relative to the largest output)");
    let q = Tensor::zeros((1, 4, 64), DType::F32, &dev).unwrap();
    let c32 = Tensor::zeros((1, 2, 64, 64), DType::F32, &dev).unwrap();
    assert!(gpu::attend_decode_tc(
        &q,
        gpu::Position::Host(0),
        1.0,
        gpu::LayerKv { k: &c32, v: &c32 }
    )
    .is_err());
    let c16 = c32.to_dtype(DType::F16).unwrap();
    assert!(gpu::attend_decode_tc(
        &q,
        gpu::Position::Host(64),
        1.0,
        gpu::LayerKv { k: &c16, v: &c16 }
    )
    .is_err());
}

#[test]
fn moe_q4k_matches_the_f32_reference() {
    use candle_core::quantized::{GgmlDType, QTensor};
    let (dev, cpu) = (cuda(), Device::Cpu);
    let mut rng = Rng(0x5eed);
    // (16, 256, 512, 9, 4) and (4, 256, 256, 5, 2): tokens share experts (n·k > E), for the
    // grouped kernels; (8, 256, 256, 16, 8): every token takes every expert; (4, 5632, 256, 3, 2):
    // gate/up rows too long for the tensor-core kernel's inputs in shared memory (read from global
    // memory instead).
    for &(e, h, i, n, k) in &[
        (8usize, 256usize, 512usize, 1usize, 2usize),
        (4, 5632, 256, 3, 2),
        (16, 512, 256, 4, 4),
        (64, 2048, 768, 1, 8),
        (16, 256, 512, 9, 4),
        (128, 512, 256, 16, 8),
        (4, 256, 256, 5, 2),
        (8, 256, 256, 16, 8),
    ] {
        let q = |rows: usize, cols: usize, rng: &mut Rng| random_q4k(&[e, rows, cols], rng, &dev);
        let ((gq, g), (uq, u), (dq, d)) = (q(i, h, &mut rng), q(i, h, &mut rng), q(h, i, &mut rng));
        let x = rng.vec(n * h, 1.0);
        let ids: Vec<u32> = (0..n * k).map(|j| ((j * 7 + 3) % e) as u32).collect();
        let w = rng.vec(n * k, 1.0);
        let res = rng.vec(n * h, 1.0);
        let xt = Tensor::from_vec(x.clone(), (n, h), &dev).unwrap();
        let it = Tensor::from_vec(ids.clone(), (n, k), &dev).unwrap();
        let wt = Tensor::from_vec(w.clone(), (n, k), &dev).unwrap();
        let rt = Tensor::from_vec(res.clone(), (n, h), &dev).unwrap();
        // (residual, kernel): the grouped kernels take no residual. q8: inputs of gate/up and
        // of down rounded to 8 bits; the reference rounds x as the kernel does, and a (computed
        // here in f64) likewise — where the kernel's f32 a sits on the other side of a rounding
        // boundary one q8 step of one activation differs, hence the looser bound.
        // "mma": the int8 tensor-core kernel over the same q8 inputs (pairs grouped by expert;
        // (8, 256, 256, 16, 8) puts 16 pairs on every expert: two tiles each). "q8" with 16
        // tokens takes gate/up four rows per warp (`moe_gate_up_q4k_q8_r4`), each token alone
        // one row per warp: the bit-for-bit check below covers both.
        for (residual, kernel) in [
            (false, "f32"),
            (true, "f32"),
            (false, "q8"),
            (true, "q8"),
            (false, "grouped"),
            (false, "mma"),
        ] {
            // (the grouped kernels take rows of up to 16 super-blocks: not 5632 values)
            if kernel == "grouped" && !gpu::moe_grouped_supports(h, i) {
                continue;
            }
            let q8 = kernel == "q8" || kernel == "mma";
            let act = if q8 { gpu::Activations::Q8 } else { gpu::Activations::F32 };
            let run = |xt: &Tensor, it: &Tensor, wt: &Tensor, rt: Option<&Tensor>| {
                let out = if kernel == "grouped" {
                    gpu::moe_q4k_grouped(xt, &gq, &uq, &dq, it, wt)
                } else if kernel == "mma" {
                    gpu::moe_q4k_mma(xt, &gq, &uq, &dq, it, wt, None)
                } else {
                    gpu::moe_q4k_as(xt, &gq, &uq, &dq, it, wt, rt, act, None)
                };
                flat(&out.unwrap())
            };
            let out = run(&xt, &it, &wt, residual.then_some(&rt));
            // f64 over the dequantized weights.
            let xin = if q8 { q8_round(&x) } else { x.clone() };
            let mut want = vec![0f32; n * h];
            for t in 0..n {
                let xr = &xin[t * h..(t + 1) * h];
                let mut o = vec![0f64; h];
                for j in 0..k {
                    let ex = ids[t * k + j] as usize;
                    let a: Vec<f64> = (0..i)
                        .map(|r| {
                            let row = |m: &[f32]| -> f64 {
                                let base = (ex * i + r) * h;
                                m[base..base + h]
                                    .iter()
                                    .zip(xr)
                                    .map(|(p, q)| *p as f64 * *q as f64)
                                    .sum()
                            };
                            let (gv, uv) = (row(&g), row(&u));
                            gv / (1.0 + (-gv).exp()) * uv
                        })
                        .collect();
                    let a: Vec<f64> = if q8 {
                        let a32: Vec<f32> = a.iter().map(|&v| v as f32).collect();
                        q8_round(&a32).into_iter().map(f64::from).collect()
                    } else {
                        a
                    };
                    for (hh, o) in o.iter_mut().enumerate() {
                        let base = (ex * h + hh) * i;
                        let y: f64 =
                            d[base..base + i].iter().zip(&a).map(|(p, q)| *p as f64 * q).sum();
                        *o += w[t * k + j] as f64 * y;
                    }
                }
                for hh in 0..h {
                    want[t * h + hh] =
                        (o[hh] + if residual { res[t * h + hh] as f64 } else { 0.0 }) as f32;
                }
            }
            let err = max_rel(&out, &want);
            let bound = if q8 { 2e-3 } else { 1e-5 };
            assert!(err < bound, "moe_q4k ({kernel}) off by {err} (E {e} H {h} I {i} n {n} k {k})");
            // A verify pass's tokens equal decode steps bit for bit.
            if kernel != "grouped" && n > 1 {
                for t in 0..n {
                    let row = |m: &Tensor| m.narrow(0, t, 1).unwrap().contiguous().unwrap();
                    let rr = residual.then(|| row(&rt));
                    let one = run(&row(&xt), &row(&it), &row(&wt), rr.as_ref());
                    assert_eq!(
                        one,
                        out[t * h..(t + 1) * h],
                        "moe_q4k ({kernel}) token {t} of {n} alone (E {e} H {h} I {i} k {k})"
                    );
                }
            }
        }
    }
    // Refusals: another format, too many tokens.
    let w8 = Tensor::zeros((4, 256, 256), DType::F32, &cpu).unwrap();
    let q8 = QTensor::quantize_onto(&w8, GgmlDType::Q8_0, &dev).unwrap();
    let x = Tensor::zeros((1, 256), DType::F32, &dev).unwrap();
    let ids = Tensor::zeros((1, 2), DType::U32, &dev).unwrap();
    let w = Tensor::zeros((1, 2), DType::F32, &dev).unwrap();
    assert!(gpu::moe_q4k(&x, &q8, &q8, &q8, &ids, &w, None).is_err());
    assert!(gpu::moe_q4k_grouped(&x, &q8, &q8, &q8, &ids, &w).is_err());
    assert!(gpu::moe_q4k_mma(&x, &q8, &q8, &q8, &ids, &w, None).is_err());
    let many = gpu::MOE_GROUPED_ROWS_MAX + 1;
    let w4 = Tensor::zeros((4, 256, 256), DType::F32, &cpu).unwrap();
    let q4 = QTensor::quantize_onto(&w4, GgmlDType::Q4K, &dev).unwrap();
    let x = Tensor::zeros((many, 256), DType::F32, &dev).unwrap();
    let ids = Tensor::zeros((many, 2), DType::U32, &dev).unwrap();
    let w = Tensor::zeros((many, 2), DType::F32, &dev).unwrap();
    assert!(gpu::moe_q4k_grouped(&x, &q4, &q4, &q4, &ids, &w).is_err());
    let x = Tensor::zeros((gpu::MOE_MMA_ROWS_MAX + 1, 256), DType::F32, &dev).unwrap();
    let ids = Tensor::zeros((gpu::MOE_MMA_ROWS_MAX + 1, 2), DType::U32, &dev).unwrap();
    let w = Tensor::zeros((gpu::MOE_MMA_ROWS_MAX + 1, 2), DType::F32, &dev).unwrap();
    assert!(gpu::moe_q4k_mma(&x, &q4, &q4, &q4, &ids, &w, None).is_err());
}

/// Page-locked host memory mapped into the device's address space (what the GPU expert tier's
/// mapped experts read over the bus), page-aligned; unregistered and freed on drop.
struct MappedHost {
    ptr: *mut u8,
    layout: std::alloc::Layout,
    device: u64,
}

impl MappedHost {
    fn new(bytes: &[u8]) -> Self {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let layout = std::alloc::Layout::from_size_align(bytes.len(), 4096).unwrap();
        // SAFETY: non-zero size; filled at once; registered, then its device address taken.
        unsafe {
            let ptr = std::alloc::alloc(layout);
            assert!(!ptr.is_null());
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len());
            let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP;
            let rc = sys::cuMemHostRegister_v2(ptr as *mut _, bytes.len(), flags);
            assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemHostRegister");
            let mut device = 0;
            let rc = sys::cuMemHostGetDevicePointer_v2(&mut device, ptr as *mut _, 0);
            assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemHostGetDevicePointer");
            Self { ptr, layout, device }
        }
    }
}

impl Drop for MappedHost {
    fn drop(&mut self) {
        use candle_core::cuda_backend::cudarc::driver::sys;
        // SAFETY: registered and allocated in `new`; the tests synchronised (they read results).
        unsafe {
            sys::cuMemHostUnregister(self.ptr as *mut _);
            std::alloc::dealloc(self.ptr, self.layout);
        }
    }
}

/// The fused MoE kernels reading experts through a table (`ExpertTable`, the GPU expert tier's
/// mapped experts) — even experts at their rows of the tensors in VRAM, odd ones in page-locked
/// host memory mapped into the device and read over the bus — give the bits of the same kernels
/// reading the tensors' rows: decode (`moe_q4k_as`, f32 and q8 activations, and `moe_q4k_mma`, 1,
/// 4 and 16 tokens — 16 take the q8 gate/up four rows per warp) and prompt passes on tensor cores
/// (`moe_q4k_tc`, 40 tokens).
#[test]
fn moe_kernels_through_an_expert_table_equal_the_tensors() {
    use candle_core::cuda_backend::cudarc::driver::result;
    let dev = cuda();
    let mut rng = Rng(0x7ab1e);
    let (e, h, i, k) = (8usize, 512usize, 256usize, 4usize);
    let (gq, _) = random_q4k(&[e, i, h], &mut rng, &dev);
    let (uq, _) = random_q4k(&[e, i, h], &mut rng, &dev);
    let (dq, _) = random_q4k(&[e, h, i], &mut rng, &dev);
    let parts = [&gq, &uq, &dq];
    let host: Vec<MappedHost> = parts.iter().map(|q| MappedHost::new(&q.data().unwrap())).collect();
    let mut entries = Vec::with_capacity(3 * e);
    for (q, m) in parts.iter().zip(&host) {
        let stride = q.storage_size_in_bytes() / e;
        for x in 0..e {
            let base = if x % 2 == 0 { q.device_ptr().unwrap() as u64 } else { m.device };
            entries.push(base + (x * stride) as u64);
        }
    }
    // SAFETY: a plain allocation of the table, written once, freed at the end.
    let table = unsafe { result::malloc_sync(entries.len() * 8) }.unwrap();
    unsafe { result::memcpy_htod_sync(table, &entries) }.unwrap();
    let t = gpu::ExpertTable { addr: table, experts: e };
    for n in [1usize, 4, 16, 40] {
        let xt = Tensor::from_vec(rng.vec(n * h, 1.0), (n, h), &dev).unwrap();
        let ids: Vec<u32> = (0..n * k).map(|j| ((j * 3 + 1) % e) as u32).collect();
        let it = Tensor::from_vec(ids, (n, k), &dev).unwrap();
        let wt = Tensor::from_vec(rng.vec(n * k, 1.0), (n, k), &dev).unwrap();
        let (g, u, d) = (&gq, &uq, &dq);
        let outputs = |tb: Option<gpu::ExpertTable>| -> Vec<(&str, Vec<f32>)> {
            if n <= gpu::MOE_ROWS_MAX {
                let mut outs: Vec<(&str, Vec<f32>)> =
                    [("f32", gpu::Activations::F32), ("q8", gpu::Activations::Q8)]
                        .into_iter()
                        .map(|(name, act)| {
                            let out = gpu::moe_q4k_as(&xt, g, u, d, &it, &wt, None, act, tb);
                            (name, flat(&out.unwrap()))
                        })
                        .collect();
                let mma = gpu::moe_q4k_mma(&xt, g, u, d, &it, &wt, tb).unwrap();
                outs.push(("mma", flat(&mma)));
                outs
            } else {
                vec![("tensor cores", flat(&gpu::moe_q4k_tc(&xt, g, u, d, &it, &wt, tb).unwrap()))]
            }
        };
        assert_eq!(outputs(Some(t)), outputs(None), "{n} tokens: the table's reads differ");
    }
    // SAFETY: every kernel reading the table has finished (their outputs were read above).
    unsafe { result::free_sync(table) }.unwrap();
}

/// f32 → f16 → f32 (the tensor-core kernels' rounding of inputs and weights).
fn f16r(v: f32) -> f64 {
    half::f16::from_f32(v).to_f64()
}

/// The prompt-pass kernels on tensor cores (`matmul_q4k_tc`, `moe_q4k_tc`) equal an f64
/// reference over f16-rounded inputs and dequantized weights (the kernels' own rounding; the rest
/// is f32 accumulation order), and a row's result does not depend on the rows beside it: a token
/// run alone gives bit-identical outputs. The MoE cases include an expert with more than one
/// 64-pair tile and experts no token picks.
#[test]
fn tensor_core_products_match_the_f16_reference_and_rows_are_independent() {
    use candle_core::quantized::{GgmlDType, QTensor};
    let (dev, cpu) = (cuda(), Device::Cpu);
    let mut rng = Rng(0x7c);
    let quant = |dims: &[usize], rng: &mut Rng| random_q4k(dims, rng, &dev);
    let dot = |w: &[f32], x: &[f64]| -> f64 { w.iter().zip(x).map(|(a, b)| f16r(*a) * b).sum() };
    for &(r, k, n) in &[(130usize, 768usize, 70usize), (64, 2048, 33), (192, 256, 1)] {
        let (wq, w) = quant(&[r, k], &mut rng);
        let x = rng.vec(n * k, 1.0);
        let xt = Tensor::from_vec(x.clone(), (n, k), &dev).unwrap();
        let got = gpu::matmul_q4k_tc(&xt, &wq).unwrap().flatten_all().unwrap().to_vec1::<f32>();
        let got = got.unwrap();
        let want: Vec<f32> = (0..n * r)
            .map(|idx| {
                let (t, o) = (idx / r, idx % r);
                let xr: Vec<f64> = x[t * k..(t + 1) * k].iter().map(|&v| f16r(v)).collect();
                dot(&w[o * k..(o + 1) * k], &xr) as f32
            })
            .collect();
        let err = max_rel(&got, &want);
        assert!(err < 1e-5, "matmul_q4k_tc off by {err} (R {r} K {k} n {n})");
        let last = xt.narrow(0, n - 1, 1).unwrap().contiguous().unwrap();
        let alone = gpu::matmul_q4k_tc(&last, &wq).unwrap().flatten_all().unwrap();
        assert_eq!(alone.to_vec1::<f32>().unwrap(), got[(n - 1) * r..], "row alone differs");
    }
    // (E, H, I, n, k, skew): skew sends every third pair to expert 0 (> 64 pairs: two tiles).
    for &(e, h, i, n, k, skew) in
        &[(16usize, 512usize, 256usize, 70usize, 4usize, false), (8, 256, 512, 100, 2, true)]
    {
        let (gq, g) = quant(&[e, i, h], &mut rng);
        let (uq, u) = quant(&[e, i, h], &mut rng);
        let (dq, d) = quant(&[e, h, i], &mut rng);
        let x = rng.vec(n * h, 1.0);
        let ids: Vec<u32> = (0..n * k)
            .map(|j| if skew && j % 3 == 0 { 0 } else { ((j * 5 + 1) % (e - 1) + 1) as u32 })
            .collect();
        let w = rng.vec(n * k, 1.0);
        let xt = Tensor::from_vec(x.clone(), (n, h), &dev).unwrap();
        let it = Tensor::from_vec(ids.clone(), (n, k), &dev).unwrap();
        let wt = Tensor::from_vec(w.clone(), (n, k), &dev).unwrap();
        let out = gpu::moe_q4k_tc(&xt, &gq, &uq, &dq, &it, &wt, None).unwrap();
        let out = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut want = vec![0f32; n * h];
        for t in 0..n {
            let xr: Vec<f64> = x[t * h..(t + 1) * h].iter().map(|&v| f16r(v)).collect();
            let mut o = vec![0f64; h];
            for j in 0..k {
                let ex = ids[t * k + j] as usize;
                let a: Vec<f64> = (0..i)
                    .map(|r| {
                        let base = (ex * i + r) * h;
                        let (gv, uv) = (dot(&g[base..base + h], &xr), dot(&u[base..base + h], &xr));
                        f16r((gv / (1.0 + (-gv).exp()) * uv) as f32)
                    })
                    .collect();
                for (hh, o) in o.iter_mut().enumerate() {
                    let base = (ex * h + hh) * i;
                    *o += w[t * k + j] as f64 * dot(&d[base..base + i], &a);
                }
            }
            for hh in 0..h {
                want[t * h + hh] = o[hh] as f32;
            }
        }
        // The down inputs are rounded to f16 from f32 sums here and from f64 sums there: an
        // input near a rounding boundary may round the other way (one f16 step, 2^-11 relative).
        let err = max_rel(&out, &want);
        assert!(err < 2e-3, "moe_q4k_tc off by {err} (E {e} H {h} I {i} n {n} k {k})");
        let t = n / 2;
        let alone = gpu::moe_q4k_tc(
            &xt.narrow(0, t, 1).unwrap().contiguous().unwrap(),
            &gq,
            &uq,
            &dq,
            &it.narrow(0, t, 1).unwrap().contiguous().unwrap(),
            &wt.narrow(0, t, 1).unwrap().contiguous().unwrap(),
            None,
        );
        let alone = alone.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(alone, out[t * h..(t + 1) * h], "token {t} alone differs (E {e})");
    }
    let w8 = Tensor::zeros((4, 256, 256), DType::F32, &cpu).unwrap();
    let q8 = QTensor::quantize_onto(&w8, GgmlDType::Q8_0, &dev).unwrap();
    let x = Tensor::zeros((40, 256), DType::F32, &dev).unwrap();
    let ids = Tensor::zeros((40, 2), DType::U32, &dev).unwrap();
    let w = Tensor::zeros((40, 2), DType::F32, &dev).unwrap();
    assert!(gpu::moe_q4k_tc(&x, &q8, &q8, &q8, &ids, &w, None).is_err());
    let w2 = Tensor::zeros((4, 256), DType::F32, &cpu).unwrap();
    assert!(gpu::matmul_q4k_tc(&x, &QTensor::quantize_onto(&w2, GgmlDType::Q8_0, &dev).unwrap())
        .is_err());
}

/// `causal_softmax` equals the scaled, masked softmax in f64: rows of several heads, a pass after
/// cached positions and one from the start; masked keys are exactly 0.
#[test]
fn causal_softmax_matches_the_masked_softmax() {
    let dev = cuda();
    let mut rng = Rng(0x51);
    for &(heads, seq, past) in &[(3usize, 5usize, 0usize), (2, 40, 300), (4, 1, 7)] {
        let total = past + seq;
        let x = rng.vec(heads * seq * total, 4.0);
        let t = Tensor::from_vec(x.clone(), (heads * seq, total), &dev).unwrap();
        let got = gpu::causal_softmax(t, seq, past, 0.3).unwrap();
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for r in 0..heads * seq {
            let n = past + r % seq + 1;
            let row = &x[r * total..(r + 1) * total];
            let m = row[..n].iter().map(|&v| v as f64 * 0.3).fold(f64::MIN, f64::max);
            let s: f64 = row[..n].iter().map(|&v| (v as f64 * 0.3 - m).exp()).sum();
            for j in 0..total {
                let want = if j < n { (row[j] as f64 * 0.3 - m).exp() / s } else { 0.0 };
                let g = got[r * total + j] as f64;
                assert!((g - want).abs() <= 1e-6, "row {r} key {j}: {g} vs {want}");
                if j >= n {
                    assert_eq!(g, 0.0);
                }
            }
        }
    }
    let t = Tensor::zeros((6, 4), DType::F32, &dev).unwrap();
    assert!(gpu::causal_softmax(t, 4, 1, 1.0).is_err()); // total 4 < past + seq
}

/// One Gated DeltaNet pass on the host, written out from the definitions (gated_delta_net.rs's
/// per-token steps with `delta_update` / `delta_readout`): returns `y [T, vw]` and advances
/// `conv [K-1, cd]` and `ssm [nv, dk, dv]`.
#[allow(clippy::too_many_arguments)]
fn gdn_host(
    s: &gpu::GdnShape,
    row: &[f32],
    conv: &mut [f32],
    conv_w: &[f32],
    a_neg: &[f32],
    dt_bias: &[f32],
    ssm: &mut [f32],
    norm_w: &[f32],
    eps: f32,
) -> Vec<f32> {
    use strata_models::recurrent::{delta_readout, delta_update};
    let (rw, cd, vw, nv) = (s.row_width(), s.conv_dim(), s.value_width(), s.v_heads);
    let (dk, dv, kk) = (s.k_dim, s.v_dim, s.kernel);
    let kw = s.k_heads * dk;
    let t_len = row.len() / rw;
    let silu = |x: f32| x / (1.0 + (-x).exp());
    let mut y = vec![0f32; t_len * vw];
    let mut mem = vec![0f32; dv];
    for t in 0..t_len {
        let r = &row[t * rw..(t + 1) * rw];
        let mut c = vec![0f32; cd];
        for ch in 0..cd {
            let w = &conv_w[ch * kk..(ch + 1) * kk];
            let mut acc = w[kk - 1] * r[ch];
            for j in 0..kk - 1 {
                acc += w[j] * conv[j * cd + ch];
            }
            c[ch] = silu(acc);
        }
        conv.copy_within(cd.., 0);
        let n = conv.len();
        conv[n - cd..].copy_from_slice(&r[..cd]);
        let norm = |v: &mut [f32]| {
            let inv = 1.0 / (v.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
            v.iter_mut().for_each(|a| *a *= inv);
        };
        let (q, rest) = c.split_at_mut(kw);
        let (k, v) = rest.split_at_mut(kw);
        q.chunks_exact_mut(dk).for_each(|h| {
            norm(h);
            h.iter_mut().for_each(|a| *a /= (dk as f32).sqrt());
        });
        k.chunks_exact_mut(dk).for_each(norm);
        for h in 0..nv {
            let kh = if s.grouped { h / (nv / s.k_heads) } else { h % s.k_heads };
            let (b, a) = (r[cd + vw + h], r[cd + vw + nv + h] + dt_bias[h]);
            let sp = if a > 20.0 { a } else { a.exp().ln_1p() };
            let st = &mut ssm[h * dk * dv..(h + 1) * dk * dv];
            let beta = 1.0 / (1.0 + (-b).exp());
            delta_update(
                st,
                &k[kh * dk..(kh + 1) * dk],
                &v[h * dv..(h + 1) * dv],
                (a_neg[h] * sp).exp(),
                beta,
                &mut mem,
            );
            let o = &mut y[t * vw + h * dv..t * vw + (h + 1) * dv];
            delta_readout(st, &q[kh * dk..(kh + 1) * dk], o);
            let inv = 1.0 / (o.iter().map(|x| x * x).sum::<f32>() / dv as f32 + eps).sqrt();
            let z = &r[cd + h * dv..cd + (h + 1) * dv];
            for ((x, &g), &zz) in o.iter_mut().zip(norm_w).zip(z) {
                *x = *x * inv * g * silu(zz);
            }
        }
    }
    y
}

/// The Gated DeltaNet kernel tests' shapes: the tiny fixtures' (k_dim 16, grouped), a k_dim that
/// is no multiple of 32 (tiled), Qwen3.5-122B-A10B's (16 key / 64 value heads of 128).
fn gdn_shapes() -> [gpu::GdnShape; 3] {
    [
        gpu::GdnShape { k_heads: 2, v_heads: 4, k_dim: 16, v_dim: 16, kernel: 4, grouped: true },
        gpu::GdnShape { k_heads: 2, v_heads: 6, k_dim: 48, v_dim: 24, kernel: 3, grouped: false },
        gpu::GdnShape {
            k_heads: 16,
            v_heads: 64,
            k_dim: 128,
            v_dim: 128,
            kernel: 4,
            grouped: true,
        },
    ]
}

/// Random inputs of a Gated DeltaNet pass of `t_len` tokens: rows, conv window and weight, `A`
/// (−exp), `dt_bias`, delta-rule state (host layout `[nv, dk, dv]`), norm weight.
struct GdnInputs {
    row: Vec<f32>,
    conv0: Vec<f32>,
    conv_w: Vec<f32>,
    a_neg: Vec<f32>,
    dt_bias: Vec<f32>,
    ssm0: Vec<f32>,
    norm_w: Vec<f32>,
}

impl GdnInputs {
    fn new(rng: &mut Rng, s: &gpu::GdnShape, t_len: usize) -> Self {
        let (cd, nv) = (s.conv_dim(), s.v_heads);
        Self {
            row: rng.vec(t_len * s.row_width(), 2.0),
            conv0: rng.vec((s.kernel - 1) * cd, 1.0),
            conv_w: rng.vec(cd * s.kernel, 0.7),
            a_neg: rng.vec(nv, 1.0).iter().map(|x| -(x + 1.2).exp()).collect(),
            dt_bias: rng.vec(nv, 1.0),
            ssm0: rng.vec(nv * s.k_dim * s.v_dim, 0.5),
            norm_w: rng.vec(s.v_dim, 1.0),
        }
    }

    /// The host's definition over these inputs (norm epsilon 1e-6): the outputs, the conv window
    /// and the delta-rule state after the pass.
    fn host(&self, s: &gpu::GdnShape) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (mut conv, mut ssm) = (self.conv0.clone(), self.ssm0.clone());
        let (a, dt) = (&self.a_neg, &self.dt_bias);
        let y =
            gdn_host(s, &self.row, &mut conv, &self.conv_w, a, dt, &mut ssm, &self.norm_w, 1e-6);
        (y, conv, ssm)
    }
}

/// Each head's `[rows, cols]` matrix of `m` (heads one after another) transposed: the device keeps
/// the delta-rule state as `[nv, dv, dk]`, the host as `[nv, dk, dv]`.
fn transpose_heads(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..m.len())
        .map(|x| {
            let (h, rest) = (x / (rows * cols), x % (rows * cols));
            m[h * rows * cols + (rest % rows) * cols + rest / rows]
        })
        .collect()
}

/// The Gated DeltaNet kernels (gdn_conv → gdn_delta → gdn_gated_norm) against the host's
/// definition over a pass of several tokens (outputs and final states within 2e-5 of the largest
/// value); one token per pass gives the same outputs and states bit for bit; a replay (no weight,
/// no readout) reaches the same state bit for bit. Shapes: the tiny fixtures' (k_dim 16, grouped),
/// a k_dim that is no multiple of 32 (tiled), Qwen3.5-122B-A10B's (16 key / 64 value heads of 128).
#[test]
fn gated_delta_net_kernels_match_the_host_and_rows_equal_steps() {
    let dev = cuda();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for s in gdn_shapes() {
        let t_len = 7;
        let (rw, cd, nv) = (s.row_width(), s.conv_dim(), s.v_heads);
        let inputs = GdnInputs::new(&mut rng, &s, t_len);
        let (want, conv_h, ssm_h) = inputs.host(&s);
        let GdnInputs { row, conv0, conv_w, a_neg, dt_bias, ssm0, norm_w } = inputs;
        let eps = 1e-6;

        let t = |v: &[f32], shape: &[usize]| Tensor::from_slice(v, shape, &dev).unwrap();
        let (cw, an, dt, nw) = (
            t(&conv_w, &[cd, s.kernel]),
            t(&a_neg, &[nv]),
            t(&dt_bias, &[nv]),
            t(&norm_w, &[s.v_dim]),
        );
        // The device keeps each head's state transposed: `[nv, dv, dk]`.
        let (dk, dv) = (s.k_dim, s.v_dim);
        let ssm0_t = transpose_heads(&ssm0, dk, dv);
        let fresh = || (t(&conv0, &[s.kernel - 1, cd]), t(&ssm0_t, &[nv, dv, dk]));
        let q_scale = 1.0 / (s.k_dim as f32).sqrt();
        let pass = |rows: &Tensor, conv: &Tensor, ssm: &Tensor| {
            let qkv = gpu::gdn_conv(&s, rows, conv, Some(&cw)).unwrap().unwrap();
            let o = gpu::gdn_delta(&s, &qkv, rows, &an, &dt, ssm, q_scale, true).unwrap().unwrap();
            flat(&gpu::gdn_gated_norm(&s, o, rows, &nw, eps).unwrap())
        };
        let rows = t(&row, &[t_len, rw]);
        let (conv, ssm) = fresh();
        let have = pass(&rows, &conv, &ssm);
        let (conv_d, ssm_d) = (flat(&conv), transpose_heads(&flat(&ssm), dv, dk));
        for (what, a, b) in
            [("outputs", &have, &want), ("ssm", &ssm_d, &ssm_h), ("conv", &conv_d, &conv_h)]
        {
            let e = max_rel(a, b);
            assert!(e < 2e-5, "{s:?}: {what} differ from the host by {e:.3e}");
        }
        // One token per pass: the same bits.
        let (conv1, ssm1) = fresh();
        let mut steps = Vec::new();
        for i in 0..t_len {
            steps.extend(pass(&rows.narrow(0, i, 1).unwrap(), &conv1, &ssm1));
        }
        assert_eq!(steps, have, "{s:?}: one-token passes differ from the {t_len}-token pass");
        assert_eq!(transpose_heads(&flat(&ssm1), dv, dk), ssm_d, "{s:?}: states differ");
        // A replay without readout: the same state.
        let (conv2, ssm2) = fresh();
        let qkv = gpu::gdn_conv(&s, &rows, &conv2, Some(&cw)).unwrap().unwrap();
        let (conv3, ssm3) = fresh();
        assert!(gpu::gdn_conv(&s, &rows, &conv3, None).unwrap().is_none());
        assert!(gpu::gdn_delta(&s, &qkv, &rows, &an, &dt, &ssm3, q_scale, false)
            .unwrap()
            .is_none());
        gpu::gdn_delta(&s, &qkv, &rows, &an, &dt, &ssm2, q_scale, true).unwrap();
        assert_eq!(flat(&ssm3), flat(&ssm2), "{s:?}: replayed state differs");
        assert_eq!(flat(&conv3), flat(&conv2), "{s:?}: replayed conv window differs");
    }
    // Shapes the kernels refuse: an error, not a launch.
    let bad =
        gpu::GdnShape { k_heads: 1, v_heads: 1, k_dim: 512, v_dim: 8, kernel: 4, grouped: true };
    let row = Tensor::zeros((1, bad.row_width()), DType::F32, &dev).unwrap();
    let conv = Tensor::zeros((3, bad.conv_dim()), DType::F32, &dev).unwrap();
    assert!(gpu::gdn_conv(&bad, &row, &conv, None).is_err());
}

/// A batched decode step over a state table (`gdn_conv_seqs` → `gdn_delta_seqs` →
/// `gdn_gated_norm`, one launch each for five sequences) equals each sequence's own one-token pass
/// (`gdn_conv` → `gdn_delta`) bit for bit — outputs, conv windows and delta-rule states — over two
/// steps, the second with the sequences in another order in the table; each sequence's first step
/// is also within 2e-5 of the host's definition. A table whose rows disagree with the pass's, or
/// a state of another shape, is an error.
#[test]
fn gated_delta_net_state_tables_equal_each_sequence_alone() {
    let dev = cuda();
    let mut rng = Rng(0x3c6e_f372_fe94_f82b);
    let n = 5;
    for s in gdn_shapes() {
        let (rw, cd, nv, dk, dv) = (s.row_width(), s.conv_dim(), s.v_heads, s.k_dim, s.v_dim);
        let t = |v: &[f32], shape: &[usize]| Tensor::from_slice(v, shape, &dev).unwrap();
        let seqs: Vec<GdnInputs> = (0..n).map(|_| GdnInputs::new(&mut rng, &s, 2)).collect();
        // One layer's weights for every sequence (the first's), each its own state and rows.
        let w = &seqs[0];
        let (cw, an, dt, nw) = (
            t(&w.conv_w, &[cd, s.kernel]),
            t(&w.a_neg, &[nv]),
            t(&w.dt_bias, &[nv]),
            t(&w.norm_w, &[dv]),
        );
        let q_scale = 1.0 / (dk as f32).sqrt();
        let fresh = |x: &GdnInputs| {
            (t(&x.conv0, &[s.kernel - 1, cd]), t(&transpose_heads(&x.ssm0, dk, dv), &[nv, dv, dk]))
        };
        let alone: Vec<(Tensor, Tensor)> = seqs.iter().map(fresh).collect();
        let batched: Vec<(Tensor, Tensor)> = seqs.iter().map(fresh).collect();
        for (step, order) in [[0, 1, 2, 3, 4], [3, 0, 4, 2, 1]].into_iter().enumerate() {
            let mut want = Vec::new();
            let mut rows = Vec::new();
            for &k in &order {
                let row = t(&seqs[k].row[step * rw..(step + 1) * rw], &[1, rw]);
                let (conv, ssm) = &alone[k];
                let qkv = gpu::gdn_conv(&s, &row, conv, Some(&cw)).unwrap().unwrap();
                let o =
                    gpu::gdn_delta(&s, &qkv, &row, &an, &dt, ssm, q_scale, true).unwrap().unwrap();
                want.extend(flat(&gpu::gdn_gated_norm(&s, o, &row, &nw, 1e-6).unwrap()));
                rows.extend_from_slice(&seqs[k].row[step * rw..(step + 1) * rw]);
            }
            let mut words = Vec::new();
            for &k in &order {
                let (conv, ssm) = &batched[k];
                let w = gpu::GdnState { conv, ssm }.address_words(&s).unwrap();
                words.extend([7u32, w[0], w[1], w[2], w[3]]);
            }
            let table = Tensor::from_slice(&words, (n, 5), &dev).unwrap();
            // SAFETY: every row holds the address words of a distinct live state of shape `s`
            // (`batched`, alive to the end of the test).
            let states = unsafe { gpu::GdnStates::in_buffer(table, s) }.unwrap();
            let rows = t(&rows, &[n, rw]);
            let qkv = gpu::gdn_conv_seqs(&s, &rows, &states, &cw).unwrap();
            let o = gpu::gdn_delta_seqs(&s, &qkv, &rows, &an, &dt, &states, q_scale).unwrap();
            let have = flat(&gpu::gdn_gated_norm(&s, o, &rows, &nw, 1e-6).unwrap());
            assert_eq!(have, want, "{s:?}: step {step}'s batched outputs differ from alone");
            for k in 0..n {
                assert_eq!(flat(&batched[k].0), flat(&alone[k].0), "{s:?}: conv window {k}");
                assert_eq!(flat(&batched[k].1), flat(&alone[k].1), "{s:?}: state {k}");
            }
            if step == 0 {
                // Against the host's definition, sequence by sequence (its first token).
                for (i, &k) in order.iter().enumerate() {
                    let x = &seqs[k];
                    let (mut conv, mut ssm) = (x.conv0.clone(), x.ssm0.clone());
                    let y = gdn_host(
                        &s,
                        &x.row[..rw],
                        &mut conv,
                        &w.conv_w,
                        &w.a_neg,
                        &w.dt_bias,
                        &mut ssm,
                        &w.norm_w,
                        1e-6,
                    );
                    let e = max_rel(&have[i * s.value_width()..(i + 1) * s.value_width()], &y);
                    assert!(e < 2e-5, "{s:?}: sequence {k} differs from the host by {e:.3e}");
                }
            }
            // Rows that disagree with the table: an error, not a launch.
            assert!(
                gpu::gdn_conv_seqs(&s, &rows.narrow(0, 0, n - 1).unwrap(), &states, &cw).is_err()
            );
        }
        let other = gpu::GdnShape { v_dim: s.v_dim + 1, ..s };
        let (conv, ssm) = &batched[0];
        assert!(gpu::GdnState { conv, ssm }.address_words(&other).is_err());
    }
}

/// Prompt passes (more than 32 tokens): the conv's outputs all at once (`gdn_conv_rows`, then the
/// window alone) and the chunked delta rule (`gdn_delta_chunked`) against the host's
/// token-by-token definition — 150 tokens (nine chunks of 16 and a partial one) from non-zero
/// states, outputs and final states within 1e-4 of the largest value, the conv window exact — and
/// against the recurrent kernel over the same pass. Shapes as in the test above; a key head
/// dimension over 128 is refused.
#[test]
fn gated_delta_net_prompt_kernels_match_the_host() {
    let dev = cuda();
    let mut rng = Rng(0x6a09_e667_f3bc_c908);
    assert!(gpu::gdn_chunked_enabled(), "STRATA_GPU_GDN_CHUNKED=0 would skip the prompt kernels");
    for s in gdn_shapes() {
        let t_len = 150;
        let (rw, cd, nv, dk, dv) = (s.row_width(), s.conv_dim(), s.v_heads, s.k_dim, s.v_dim);
        let inputs = GdnInputs::new(&mut rng, &s, t_len);
        let (want, conv_h, ssm_h) = inputs.host(&s);
        let GdnInputs { row, conv0, conv_w, a_neg, dt_bias, ssm0, norm_w } = inputs;
        let eps = 1e-6;
        let t = |v: &[f32], shape: &[usize]| Tensor::from_slice(v, shape, &dev).unwrap();
        let (cw, an, dt, nw) =
            (t(&conv_w, &[cd, s.kernel]), t(&a_neg, &[nv]), t(&dt_bias, &[nv]), t(&norm_w, &[dv]));
        let q_scale = 1.0 / (dk as f32).sqrt();
        let rows = t(&row, &[t_len, rw]);
        let (conv, ssm) =
            (t(&conv0, &[s.kernel - 1, cd]), t(&transpose_heads(&ssm0, dk, dv), &[nv, dv, dk]));
        let qkv = gpu::gdn_conv(&s, &rows, &conv, Some(&cw)).unwrap().unwrap();
        let o = gpu::gdn_delta_chunked(&s, &qkv, &rows, &an, &dt, &ssm, q_scale).unwrap();
        let have = flat(&gpu::gdn_gated_norm(&s, o.copy().unwrap(), &rows, &nw, eps).unwrap());
        let ssm_d = transpose_heads(&flat(&ssm), dv, dk);
        for (what, a, b) in [("outputs", &have, &want), ("ssm", &ssm_d, &ssm_h)] {
            let e = max_rel(a, b);
            assert!(e < 1e-4, "{s:?}: chunked {what} differ from the host by {e:.3e}");
        }
        assert_eq!(flat(&conv), conv_h, "{s:?}: conv window after a prompt pass");
        // The recurrent kernel over the same pass (same conv outputs): within the same bound.
        let ssm_r = t(&transpose_heads(&ssm0, dk, dv), &[nv, dv, dk]);
        let o_r =
            gpu::gdn_delta(&s, &qkv, &rows, &an, &dt, &ssm_r, q_scale, true).unwrap().unwrap();
        let e = max_rel(&flat(&o), &flat(&o_r));
        assert!(e < 1e-4, "{s:?}: chunked and recurrent readouts differ by {e:.3e}");
        let e = max_rel(&flat(&ssm), &flat(&ssm_r));
        assert!(e < 1e-4, "{s:?}: chunked and recurrent states differ by {e:.3e}");
    }
    let wide =
        gpu::GdnShape { k_heads: 1, v_heads: 1, k_dim: 192, v_dim: 8, kernel: 4, grouped: true };
    let z = |r: usize, c: usize| Tensor::zeros((r, c), DType::F32, &dev).unwrap();
    let (row, qkv) = (z(40, wide.row_width()), z(40, wide.conv_dim()));
    let (a, ssm) =
        (z(1, 1).flatten_all().unwrap(), Tensor::zeros((1, 8, 192), DType::F32, &dev).unwrap());
    assert!(gpu::gdn_delta_chunked(&wide, &qkv, &row, &a, &a, &ssm, 1.0).is_err());
}
