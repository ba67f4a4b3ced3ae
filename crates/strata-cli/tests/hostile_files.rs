//! The committed hostile-file corpus (`tests/fixtures/hostile/corpus.tar.xz`, written by
//! `scripts/make_fuzz_corpus.py`, plus any crash the fuzz targets ever found): 240 mutated GGUF and
//! safetensors copies of the tiny Qwen3-MoE fixture. Each is opened by `strata info` and loaded
//! and run by `strata generate`, as processes: every run ends with status 0, 1 or 2 (a clean
//! error naming the problem, or a clean run), never 101 (a panic) or a signal, within 60 s, with
//! a peak RSS of at most twice the file plus 64 MiB.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `strata ARGS`, returning (exit code or None for a signal, peak RSS in bytes, stderr).
// The child is reaped by `wait4` (for its rusage), which clippy does not see.
#[allow(clippy::zombie_processes)]
fn run(args: &[&std::ffi::OsStr]) -> (Option<i32>, u64, String) {
    let err_path = std::env::temp_dir().join(format!("strata-hostile-{}.err", std::process::id()));
    let child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let t = Instant::now();
    let (mut status, mut usage): (libc::c_int, libc::rusage) = (0, unsafe { std::mem::zeroed() });
    loop {
        // SAFETY: waits for our own child; `status` and `usage` are valid out-pointers.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break;
        }
        assert!(r == 0, "wait4 failed");
        if t.elapsed() > Duration::from_secs(60) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("strata {args:?} hung for 60 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    (code, usage.ru_maxrss as u64 * 1024, std::fs::read_to_string(&err_path).unwrap_or_default())
}

fn check(model: &Path, file_bytes: u64, name: &str) -> bool {
    let m = model.as_os_str();
    let mut ok = true;
    for args in [
        vec!["info".as_ref(), "--json".as_ref(), "-m".as_ref(), m],
        vec![
            "generate".as_ref(),
            "--prompt".as_ref(),
            "Hi".as_ref(),
            "-n".as_ref(),
            "2".as_ref(),
            "--ctx-size".as_ref(),
            "64".as_ref(),
            "-t".as_ref(),
            "1".as_ref(),
            "-m".as_ref(),
            m,
        ],
    ] {
        let (code, rss, err) = run(&args);
        let limit = 2 * file_bytes + (64 << 20);
        let clean = matches!(code, Some(0..=2));
        if !clean || rss > limit {
            eprintln!(
                "{name}: `strata {}` → exit {code:?}, peak RSS {rss} (limit {limit})\n{err}",
                args[0].to_string_lossy()
            );
            ok = false;
        }
        if code == Some(1) && !err.contains("strata: error:") {
            eprintln!("{name}: failed without an error message: {err}");
            ok = false;
        }
    }
    ok
}

#[test]
fn every_hostile_file_is_a_clean_error_or_a_clean_run() {
    let dir = std::env::temp_dir().join(format!("strata-hostile-corpus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let tar = repo().join("tests/fixtures/hostile/corpus.tar.xz");
    let st = Command::new("tar").arg("-xJf").arg(&tar).arg("-C").arg(&dir).status().expect("tar");
    assert!(st.success(), "extracting {}", tar.display());
    let hf = repo().join("tests/fixtures/moe-tiny/qwen3_moe");
    // The unmutated models run: the corpus's failures are the mutations' doing.
    assert!(check(&repo().join("tests/fixtures/moe-tiny/qwen3_moe.gguf"), 1 << 21, "base GGUF"));
    assert!(check(&hf, 1 << 20, "base safetensors"));
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert!(files.len() >= 200, "{} files in the corpus", files.len());
    let (mut bad, mut gguf, mut st) = (Vec::new(), 0, 0);
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::metadata(f).unwrap().len();
        let model = if name.ends_with(".safetensors") {
            st += 1;
            // An HF directory: the fixture's config and tokenizer beside the mutated weights.
            let d = dir.join(format!("{name}.d"));
            std::fs::create_dir_all(&d).unwrap();
            for other in [
                "config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "generation_config.json",
                "chat_template.jinja",
            ] {
                std::fs::copy(hf.join(other), d.join(other)).unwrap();
            }
            std::fs::rename(f, d.join("model.safetensors")).unwrap();
            d
        } else {
            gguf += 1;
            f.clone()
        };
        if !check(&model, bytes, &name) {
            bad.push(name);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("{gguf} GGUF and {st} safetensors files replayed");
    assert!(gguf >= 100 && st >= 100);
    assert!(bad.is_empty(), "{} files misbehaved: {bad:?}", bad.len());
}
