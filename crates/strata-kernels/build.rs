//! With the `cuda` feature: compiles `cuda/decode.cu` with nvcc (`$NVCC`, else `nvcc` on the
//! PATH; `CUDA_COMPUTE_CAP`, default 90) into a fat binary, `$OUT_DIR/strata_decode.fatbin`
//! (machine code for `sm_{cap}` and PTX for `compute_{cap}`), which `src/cuda.rs` embeds. Without
//! the feature nothing is built and no CUDA toolkit is needed.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cuda/decode.cu");
    println!("cargo:rerun-if-changed=cuda/moe_q4k.cuh");
    println!("cargo:rerun-if-changed=cuda/moe_tc.cuh");
    println!("cargo:rerun-if-changed=cuda/mv_q8.cuh");
    println!("cargo:rerun-if-changed=cuda/gdn.cuh");
    println!("cargo:rerun-if-changed=cuda/attn_tc.cuh");
    println!("cargo:rerun-if-changed=cuda/moe_mma.cuh");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    // Machine code for sm_{cap} (the driver loads it as it is) and PTX for compute_{cap} (compiled
    // by the driver on any later GPU), in one fat binary.
    let fatbin = out.join("strata_decode.fatbin");
    let status = std::process::Command::new(&nvcc)
        .args(["--fatbin", "-O3", "-std=c++17"])
        .arg(format!("-gencode=arch=compute_{cap},code=sm_{cap}"))
        .arg(format!("-gencode=arch=compute_{cap},code=compute_{cap}"))
        .arg("-o")
        .arg(&fatbin)
        .arg("cuda/decode.cu")
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "strata-kernels: cannot run {nvcc} (the `cuda` feature needs the CUDA toolkit: \
                 scripts/build_cuda.sh): {e}"
            )
        });
    assert!(status.success(), "strata-kernels: nvcc failed on cuda/decode.cu");
}
