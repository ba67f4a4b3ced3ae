//! `strata info`: the memory plan, printed or as JSON, before loading anything.

use anyhow::Result;
use clap::Args;
use strata_plan::{Plan, Strategy};

use crate::model_args::ModelArgs;

#[derive(Args, Debug)]
pub struct InfoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Measure drive, RAM and kernel rates now (< 20 s) and cache them for this drive.
    #[arg(long)]
    pub calibrate: bool,
    /// Print the plan as one JSON object (fields documented in docs/memory-plan.md).
    #[arg(long)]
    pub json: bool,
    /// Plan for `serve --parallel N`: N sequence slots, one KV cache each.
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Plan for `serve --prefix-cache SIZE|auto` (default: none, as `generate` runs).
    #[arg(long, default_value = "0")]
    pub prefix_cache: strata_plan::PrefixCacheBudget,
}

pub fn run(mut a: InfoArgs) -> Result<()> {
    a.model.serving =
        crate::model_args::Serving { parallel: a.parallel.max(1), prefix_cache: a.prefix_cache };
    a.model.set_threads();
    let path = a.model.model_path()?;
    if a.calibrate {
        eprintln!("calibrating (drive: random 4 MiB reads of {}; RAM; kernels)…", path.display());
        let b = strata_bench::calibrate::calibrate(&path, a.model.threads())
            .map_err(anyhow::Error::msg)?;
        eprintln!(
            "drive {:.2} GB/s, RAM {:.1} GB/s, Q4_K expert matvec {:.1} GB/s, dense matvec {:.1} GB/s, Q4_K GEMM {:.0} GFLOP/s → {}",
            b.drive_gbps,
            b.ram_gbps,
            b.matvec_gbps,
            b.dense_matvec_gbps.unwrap_or(b.matvec_gbps),
            b.gemm_gflops,
            strata_plan::calibrate::cache_file().display()
        );
    }
    let plan = a.model.plan(&path)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print_plan(&plan);
    }
    if plan.strategy == Strategy::TooLarge {
        std::process::exit(2);
    }
    Ok(())
}

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / 1e9)
}

fn print_plan(p: &Plan) {
    let m = &p.model;
    println!(
        "model        {} ({}, {} layers, {})",
        m.path, m.architecture, m.layers, m.quantization
    );
    println!(
        "parameters   {:.2} B total, {:.2} B active per token",
        m.total_params as f64 / 1e9,
        m.active_params as f64 / 1e9
    );
    if m.experts > 0 {
        println!(
            "experts      {} per layer × {} MoE layers, {} active per token; {:.2} MB per expert, {} touched per token",
            m.experts,
            m.moe_layers,
            m.experts_per_token,
            m.bytes_per_expert as f64 / 1e6,
            gb(m.expert_bytes_per_token)
        );
    }
    println!("stored       dense {}, experts {}", gb(m.dense_bytes), gb(m.expert_bytes));
    let mem = &p.memory;
    println!(
        "memory       dense weights {} | experts {} | KV cache {} (ctx {} × {} slot{}) | prefix cache {} | compute {} | draft {} | reserve {}",
        gb(mem.dense_weights),
        gb(mem.expert_weights),
        gb(mem.kv_cache),
        p.ctx_size,
        p.parallel,
        if p.parallel == 1 { "" } else { "s" },
        gb(mem.prefix_cache),
        gb(mem.compute_buffers),
        gb(mem.draft),
        gb(mem.reserve)
    );
    let s = &p.system;
    println!(
        "machine      RAM {} total, {} available{}{}",
        gb(s.ram_total),
        gb(s.available),
        s.cgroup_limit.map(|l| format!(", cgroup limit {}", gb(l))).unwrap_or_default(),
        if s.simulated { " (simulated)" } else { "" }
    );
    if let Some(g) = &p.gpu {
        println!(
            "GPU          VRAM {} total, {} free{}; everything resident needs {} ({} for dense weights, KV, compute and a 2 GiB reserve)",
            gb(g.memory.vram_total),
            gb(g.memory.vram_free),
            if g.memory.simulated { " (simulated)" } else { "" },
            gb(g.vram_resident_total),
            gb(g.vram_fixed)
        );
        println!("overcommit   {:.2}× (everything resident ÷ free VRAM)", p.overcommit);
    } else {
        println!("overcommit   {:.2}× (everything resident ÷ available)", p.overcommit);
    }
    println!("strategy     {}: {}", p.strategy.name(), p.reason);
    match &p.gpu {
        Some(g) => {
            if let (Some(vb), Some(vn), Some(vh), Some(hb), Some(hn), Some(hh)) = (
                g.vram_expert_cache_bytes,
                g.vram_expert_cache_experts,
                g.expected_vram_hit_rate,
                g.host_expert_cache_bytes,
                g.host_expert_cache_experts,
                g.expected_host_hit_rate,
            ) {
                println!(
                    "VRAM experts {} = {vn} experts; expected hit rate ≥ {:.0}% (uniform routing)",
                    gb(vb),
                    vh * 100.0
                );
                println!("host experts {} = {hn} experts, page-locked; expected hit rate ≥ {:.0}%; misses read from the drive", gb(hb), hh * 100.0);
            }
            println!(
                "estimate     decode {:.1} tok/s ({:.1} ms compute + {:.1} ms VRAM-miss copies + {:.1} ms drive reads per token), prefill {:.0} tok/s — GPU rates measured on an H100 (not this GPU): pinned copy {:.1} GB/s, {:.0} GB/s touched resident, {:.0} GB/s through the VRAM expert pool ({:.0} per expert); drive {:.2} GB/s",
                p.estimate.decode_tok_s,
                g.decode_compute_ms,
                g.decode_copy_ms,
                g.decode_read_ms,
                p.estimate.prefill_tok_s,
                g.rates.h2d_gbps,
                g.rates.resident_gbps,
                g.rates.tiered_gbps,
                g.rates.tiered_per_expert_gbps,
                p.estimate.rates.drive_gbps
            );
        }
        None => {
            if let (Some(c), Some(n), Some(h)) =
                (p.expert_cache_bytes, p.expert_cache_experts, p.expected_hit_rate)
            {
                println!("expert cache {} = {n} experts; expected hit rate ≥ {:.0}% (uniform routing; real routing is usually more local)", gb(c), h * 100.0);
            }
        }
    }
    let e = &p.estimate;
    if p.gpu.is_some() {
        print_tail(p);
        return;
    }
    let src = match &e.rates_source {
        strata_plan::RatesSource::Defaults => {
            "DEFAULT bandwidths (not measured: run `strata info --calibrate`)".to_string()
        }
        strata_plan::RatesSource::Calibrated { device, .. } => {
            format!("bandwidths measured for drive {device}")
        }
    };
    println!(
        "estimate     decode {:.2} tok/s ({:.0} ms reads + {:.0} ms compute per token), prefill {:.0} tok/s — {src}: drive {:.2} GB/s, matvec {:.1} GB/s, GEMM {:.0} GFLOP/s",
        e.decode_tok_s, e.decode_read_ms, e.decode_compute_ms, e.prefill_tok_s, e.rates.drive_gbps, e.rates.matvec_gbps, e.rates.gemm_gflops
    );
    print_tail(p);
}

fn print_tail(p: &Plan) {
    for w in &p.warnings {
        println!("warning      {w}");
    }
    match &p.recommended_command {
        Some(c) => println!("run          {c}"),
        None => println!("run          (nothing fits; see the strategy line)"),
    }
}
