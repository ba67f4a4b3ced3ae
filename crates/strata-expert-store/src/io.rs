//! The I/O engine: a pool of threads issuing positioned reads (`pread`) concurrently, so that the
//! reads of all experts a layer needs are in flight together (queue depth = threads). SwiftLM's
//! expert streaming reached queue depth 24 the same way. Optional `O_DIRECT` bypasses the page
//! cache; its reads must be aligned ([`DIRECT_ALIGN`]) in offset, length and buffer address.
//!
//! Two queues: demand reads (a layer's routing is known) always go before prefetch reads
//! (predictions), so a wrong prediction never delays a read the forward pass waits for; a
//! prefetch that turns out to be needed is promoted ([`IoEngine::promote`]).

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// Alignment of offsets, lengths and buffers for `O_DIRECT` reads (bytes).
pub const DIRECT_ALIGN: usize = 4096;

/// One positioned read into memory the caller keeps valid until its [`Ticket`] completes.
#[derive(Debug, Clone, Copy)]
pub struct ReadJob {
    /// Index into the engine's files.
    pub file: usize,
    pub offset: u64,
    /// Bytes requested.
    pub len: usize,
    /// Bytes that must arrive (less than `len` only for aligned supersets reaching past the end).
    pub need: usize,
    pub dst: *mut u8,
}

// SAFETY: `dst` points into an expert-cache slot owned by the waiting ticket's holder; each job
// writes a disjoint range and nobody reads it before the ticket completes.
unsafe impl Send for ReadJob {}

/// Completion of a batch of reads.
#[derive(Debug)]
pub struct Ticket {
    state: Mutex<(usize, Option<String>)>,
    done: Condvar,
}

impl Ticket {
    fn new(jobs: usize) -> Arc<Self> {
        Arc::new(Self { state: Mutex::new((jobs, None)), done: Condvar::new() })
    }

    fn finish(&self, error: Option<String>) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0 -= 1;
        if s.1.is_none() {
            s.1 = error;
        }
        if s.0 == 0 {
            self.done.notify_all();
        }
    }

    /// Whether every read finished.
    pub fn is_done(&self) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0 == 0
    }

    /// Blocks until every read finished. Errors: the first failed read (I/O error, short read).
    pub fn wait(&self) -> Result<(), String> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while s.0 > 0 {
            s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.1.clone().map_or(Ok(()), Err)
    }
}

/// Cumulative I/O counters.
#[derive(Debug, Default)]
pub struct IoCounters {
    pub bytes: AtomicU64,
    pub reads: AtomicU64,
    /// Nanoseconds during which at least one read was queued or running.
    pub busy_ns: AtomicU64,
}

struct Busy {
    in_flight: usize,
    since: Option<Instant>,
}

/// Which queue a batch of reads joins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// A forward pass waits (or will wait) for these.
    Demand,
    /// A prediction: run when no demand read is queued.
    Prefetch,
}

type Queued = (ReadJob, Arc<Ticket>);

#[derive(Default)]
struct Queues {
    demand: VecDeque<Queued>,
    prefetch: VecDeque<Queued>,
    closed: bool,
    /// Workers start no read while set (tests hold reads in flight with [`IoEngine::pause`]).
    paused: bool,
}

struct Shared {
    files: Vec<(PathBuf, File, u64)>,
    counters: IoCounters,
    busy: Mutex<Busy>,
    queues: Mutex<Queues>,
    ready: Condvar,
}

impl Shared {
    fn begin(&self, n: usize) {
        let mut b = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        if b.in_flight == 0 {
            b.since = Some(Instant::now());
        }
        b.in_flight += n;
    }

    fn end(&self) {
        let mut b = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        b.in_flight -= 1;
        if b.in_flight == 0 {
            if let Some(t) = b.since.take() {
                self.counters.busy_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        }
    }

    fn run(&self, job: ReadJob) -> Result<(), String> {
        let (path, file, _) = &self.files[job.file];
        // SAFETY: see `ReadJob`: the destination is valid, exclusive and `len` bytes long.
        let buf = unsafe { std::slice::from_raw_parts_mut(job.dst, job.len) };
        let mut done = 0;
        while done < job.len {
            match file.read_at(&mut buf[done..], job.offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(format!(
                        "{}: read of {} bytes at offset {} failed: {e}",
                        path.display(),
                        job.len,
                        job.offset
                    ))
                }
            }
        }
        self.counters.bytes.fetch_add(done as u64, Ordering::Relaxed);
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        if done < job.need {
            return Err(format!(
                "{}: short read: {} of {} bytes at offset {} (the file is truncated or changed)",
                path.display(),
                done,
                job.need,
                job.offset
            ));
        }
        Ok(())
    }
}

/// A fixed pool of reader threads over a set of files opened once.
pub struct IoEngine {
    shared: Arc<Shared>,
    workers: Vec<std::thread::JoinHandle<()>>,
    direct: bool,
}

impl std::fmt::Debug for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IoEngine({} files, {} threads, direct: {})",
            self.shared.files.len(),
            self.workers.len(),
            self.direct
        )
    }
}

/// `--direct-io`: whether expert reads bypass the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// `O_DIRECT` where every model file's filesystem supports it, buffered reads otherwise: on
    /// realistic routing O_DIRECT read at the drive's peak while buffered reads reached 63–87% and
    /// cost a CPU copy per expert (docs/performance.md, "Realistic routing").
    #[default]
    Auto,
    On,
    Off,
}

impl std::str::FromStr for DirectIo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        use strata_plan::switch::{parse_switch, Switch};
        Ok(match parse_switch("--direct-io", s)? {
            Switch::Auto => Self::Auto,
            Switch::On => Self::On,
            Switch::Off => Self::Off,
        })
    }
}

impl DirectIo {
    /// Whether to read `files` with `O_DIRECT`: `Auto` tries to open each with it.
    pub fn resolve(self, files: &[PathBuf]) -> bool {
        match self {
            Self::On => true,
            Self::Off => false,
            Self::Auto => files.iter().all(|p| {
                std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(p).is_ok()
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        }
    }
}

impl IoEngine {
    /// Opens `files` (with `O_DIRECT` when `direct`) and starts `threads` readers.
    ///
    /// Errors: a file that cannot be opened (with `O_DIRECT`: a filesystem without direct I/O, such
    /// as tmpfs, is named in the message).
    pub fn open(files: &[PathBuf], threads: usize, direct: bool) -> Result<Self, String> {
        let mut opened = Vec::with_capacity(files.len());
        for p in files {
            let mut o = std::fs::OpenOptions::new();
            o.read(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            let f = o.open(p).map_err(|e| {
                let hint = if direct { " with O_DIRECT (does this filesystem support direct I/O? use --direct-io auto or off)" } else { "" };
                format!("{}: cannot open{hint}: {e}", p.display())
            })?;
            let len = f.metadata().map_err(|e| format!("{}: {e}", p.display()))?.len();
            opened.push((p.clone(), f, len));
        }
        let shared = Arc::new(Shared {
            files: opened,
            counters: IoCounters::default(),
            busy: Mutex::new(Busy { in_flight: 0, since: None }),
            queues: Mutex::new(Queues::default()),
            ready: Condvar::new(),
        });
        let workers = (0..threads.max(1))
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("strata-io-{i}"))
                    .spawn(move || worker(&shared))
                    .expect("spawn I/O thread")
            })
            .collect();
        Ok(Self { shared, workers, direct })
    }

    pub fn direct(&self) -> bool {
        self.direct
    }

    pub fn counters(&self) -> &IoCounters {
        &self.shared.counters
    }

    /// Errors when a file's size differs from when it was opened (replaced or truncated under a
    /// running server).
    pub fn check_files(&self) -> Result<(), String> {
        for (p, f, len) in &self.shared.files {
            let now = f.metadata().map_err(|e| format!("{}: {e}", p.display()))?.len();
            if now != *len {
                return Err(format!(
                    "{}: model file changed size while in use ({len} bytes at start, {now} now)",
                    p.display()
                ));
            }
        }
        Ok(())
    }

    /// Queues `jobs` at once and returns their shared completion ticket.
    pub fn submit(&self, jobs: Vec<ReadJob>, priority: Priority) -> Arc<Ticket> {
        let ticket = Ticket::new(jobs.len());
        if jobs.is_empty() {
            return ticket;
        }
        self.shared.begin(jobs.len());
        let mut q = self.shared.queues.lock().unwrap_or_else(|e| e.into_inner());
        if q.closed {
            drop(q);
            for _ in &jobs {
                self.shared.end();
                ticket.finish(Some("I/O engine stopped".into()));
            }
            return ticket;
        }
        let queue = match priority {
            Priority::Demand => &mut q.demand,
            Priority::Prefetch => &mut q.prefetch,
        };
        queue.extend(jobs.into_iter().map(|j| (j, ticket.clone())));
        drop(q);
        self.shared.ready.notify_all();
        ticket
    }

    /// Holds (`true`) or releases (`false`) every queued read: a test's way to keep reads in
    /// flight for as long as it needs (a slow drive).
    #[cfg(test)]
    pub(crate) fn pause(&self, paused: bool) {
        self.shared.queues.lock().unwrap_or_else(|e| e.into_inner()).paused = paused;
        self.shared.ready.notify_all();
    }

    /// Moves the still-queued prefetch reads of `ticket` to the demand queue (a prediction turned
    /// out to be needed). Returns how many moved.
    pub fn promote(&self, ticket: &Arc<Ticket>) -> usize {
        let mut q = self.shared.queues.lock().unwrap_or_else(|e| e.into_inner());
        let (mine, rest): (VecDeque<Queued>, VecDeque<Queued>) =
            q.prefetch.drain(..).partition(|(_, t)| Arc::ptr_eq(t, ticket));
        q.prefetch = rest;
        let n = mine.len();
        q.demand.extend(mine);
        n
    }
}

fn worker(shared: &Shared) {
    loop {
        let (job, ticket) = {
            let mut q = shared.queues.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if !q.paused {
                    if let Some(j) = q.demand.pop_front().or_else(|| q.prefetch.pop_front()) {
                        break j;
                    }
                }
                if q.closed {
                    return;
                }
                q = shared.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let r = shared.run(job);
        shared.end();
        ticket.finish(r.err());
    }
}

impl Drop for IoEngine {
    fn drop(&mut self) {
        // Workers finish the queued reads (their slots outlive the engine's users), then stop.
        let mut q = self.shared.queues.lock().unwrap_or_else(|e| e.into_inner());
        (q.closed, q.paused) = (true, false);
        drop(q);
        self.shared.ready.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
