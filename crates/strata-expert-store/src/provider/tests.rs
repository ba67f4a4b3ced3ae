//! The host cache under a slow drive: reads still in flight when a pass needs a slot.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use candle_core::Device;
use strata_formats::ModelFiles;
use strata_models::{ExpertProvider, PrefetchMode};

use super::{StreamOptions, StreamingExperts};
use crate::io::DirectIo;
use strata_plan::budget::CacheBudget;

/// Every slab slot taken by a read in flight (the whole model's experts queued at 10% cached,
/// reads held), then a pass asks for an expert nobody started: once the reads finish, it evicts a
/// finished entry for its slot and gets its expert, instead of waiting a minute for a slot that
/// only eviction can free (the `expert cache exhausted` failure CI hit on a slow drive).
#[test]
fn a_read_waiting_for_a_slot_evicts_finished_reads() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/moe-tiny/qwen3_moe.gguf");
    let files = ModelFiles::open(&path).unwrap();
    let cfg = files.config().unwrap();
    let opts = StreamOptions {
        budget: CacheBudget::Percent(10.0),
        direct_io: DirectIo::Off,
        io_threads: 2,
        prefetch: PrefetchMode::Off,
        ..StreamOptions::default()
    };
    let x = StreamingExperts::open(&files, &cfg, &Device::Cpu, &opts).unwrap();
    let experts = cfg.moe.as_ref().unwrap().num_experts;
    let layers: Vec<usize> = (0..cfg.num_layers).filter(|&l| cfg.is_moe_layer(l)).collect();
    let keys: Vec<(usize, usize)> =
        layers.iter().flat_map(|&l| (0..experts).map(move |e| (l, e))).collect();
    x.io.pause(true);
    let all: Vec<u32> = (0..experts as u32).collect();
    for &layer in &layers {
        x.fetch_routed(layer, &all);
    }
    assert!(x.slab.try_acquire().is_none(), "the slab is not full: {:?}", x.slab);
    let missing = {
        let st = x.state.lock().unwrap();
        *keys.iter().find(|k| !st.map.contains(k)).expect("an expert nobody started")
    };
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        let x = &x;
        s.spawn(move || tx.send(x.expert(missing.0, missing.1).map(|_| ())).unwrap());
        std::thread::sleep(Duration::from_millis(50));
        x.io.pause(false);
        let got = rx.recv_timeout(Duration::from_secs(10));
        let got = got.expect("expert() still waiting for a slot 10 s after the reads finished");
        got.unwrap_or_else(|e| panic!("{missing:?}: {e}"));
    });
    // And every expert can still be had.
    for &(l, e) in &keys {
        x.expert(l, e).unwrap_or_else(|err| panic!("({l}, {e}): {err}"));
    }
    let stats = x.stats().unwrap();
    assert_eq!(stats.hits + stats.misses, keys.len() as u64 + 1, "{stats:?}");
}
