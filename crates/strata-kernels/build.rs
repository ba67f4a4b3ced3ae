//! With the `cuda` feature: compiles `cuda/decode.cu` to PTX with nvcc (`$NVCC`, else `nvcc` on the
//! PATH; `CUDA_COMPUTE_CAP`, default 90) into `$OUT_DIR/strata_decode.ptx`, which `src/cuda.rs`
//! embeds. Without the feature nothing is built and no CUDA toolkit is needed.

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
    let ptx = out.join("strata_decode.ptx");
    let status = std::process::Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=compute_{cap}"), "-o"])
        .arg(&ptx)
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
