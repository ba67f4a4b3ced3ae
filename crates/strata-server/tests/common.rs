//! Starts an in-process server on 127.0.0.1 (port 0) with the SmolLM2 default model.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use strata_engine::{Engine, LoadOptions, SamplingParams};
use strata_server::{AppState, ServerConfig};

pub fn smollm2_path() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = std::env::var_os("STRATA_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run `strata fetch-default` (scripts/test.sh does)",
        p.display()
    );
    p
}

pub fn engine() -> Arc<Engine> {
    static E: OnceLock<Arc<Engine>> = OnceLock::new();
    E.get_or_init(|| {
        let opts = LoadOptions::new(2048, candle_core::Device::Cpu);
        Arc::new(Engine::load(&smollm2_path(), &opts, &mut |_, _| {}).expect("load SmolLM2"))
    })
    .clone()
}

pub fn config() -> ServerConfig {
    ServerConfig {
        ctx_size: 2048,
        max_tokens: 64,
        sampling: SamplingParams::greedy(),
        ..ServerConfig::default()
    }
}

pub struct Server {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A server with `config`, running on its own runtime thread until dropped.
pub fn start(config: ServerConfig) -> Server {
    start_with(engine(), config)
}

/// A server for `engine` with `config`.
pub fn start_with(engine: Arc<Engine>, config: ServerConfig) -> Server {
    let st = AppState::new(engine, config).expect("state");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            let shutdown = async move {
                let _ = stop_rx.await;
            };
            strata_server::serve_on(listener, st, shutdown, std::time::Duration::from_secs(2))
                .await
                .unwrap();
        });
    });
    let addr = addr_rx.recv().unwrap();
    Server { addr, stop: Some(stop_tx), thread: Some(thread) }
}

/// One shared default server per test binary.
pub fn shared() -> SocketAddr {
    static S: OnceLock<SocketAddr> = OnceLock::new();
    *S.get_or_init(|| {
        let s = start(config());
        let addr = s.addr;
        std::mem::forget(s); // lives for the whole test process
        addr
    })
}
