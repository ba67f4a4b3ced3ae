//! Returning freed heap memory to the system after large requests. glibc keeps freed chunks in
//! its per-thread arenas, so a burst of megabyte-sized bodies would leave the server's RSS high
//! for good; `malloc_trim(0)` hands the free pages back.

/// Releases free heap memory to the system (glibc; a no-op elsewhere).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}
