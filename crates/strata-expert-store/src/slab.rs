//! The expert cache's memory: one allocation of fixed-size slots made at start and reused for the
//! whole run (never an allocation per token). Slots are 4 KiB-aligned so `O_DIRECT` reads land in
//! them directly. Pages are touched only when a slot is first written, so an unused budget costs
//! address space, not RAM.

use std::alloc::Layout;
use std::sync::{Arc, Condvar, Mutex};

use crate::io::DIRECT_ALIGN;

struct SlabInner {
    base: *mut u8,
    layout: Layout,
    slot_bytes: usize,
    slots: usize,
    free: Mutex<Vec<usize>>,
    released: Condvar,
}

// SAFETY: slot memory is handed out to one `Slot` at a time (free list under a mutex); a `Slot`'s
// bytes are written only by the I/O engine before the slot is shared, then only read.
unsafe impl Send for SlabInner {}
unsafe impl Sync for SlabInner {}

impl Drop for SlabInner {
    fn drop(&mut self) {
        // SAFETY: allocated in `Slab::new` with this layout; every Slot holds an Arc to us.
        unsafe { std::alloc::dealloc(self.base, self.layout) }
    }
}

/// `slots` buffers of `slot_bytes` each (rounded up to [`DIRECT_ALIGN`]).
#[derive(Clone)]
pub struct Slab(Arc<SlabInner>);

impl std::fmt::Debug for Slab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Slab({} slots × {} bytes)", self.0.slots, self.0.slot_bytes)
    }
}

impl Slab {
    /// Errors when the allocation fails (address space) or the size overflows.
    pub fn new(slots: usize, slot_bytes: usize) -> Result<Self, String> {
        let slot_bytes = slot_bytes.max(1).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let total = slots.checked_mul(slot_bytes).ok_or("expert cache size overflows")?;
        let layout = Layout::from_size_align(total.max(DIRECT_ALIGN), DIRECT_ALIGN)
            .map_err(|e| e.to_string())?;
        // SAFETY: non-zero size.
        let base = unsafe { std::alloc::alloc(layout) };
        if base.is_null() {
            return Err(format!("cannot reserve {total} bytes for the expert cache"));
        }
        let free = (0..slots).rev().collect();
        Ok(Self(Arc::new(SlabInner {
            base,
            layout,
            slot_bytes,
            slots,
            free: Mutex::new(free),
            released: Condvar::new(),
        })))
    }

    pub fn slot_bytes(&self) -> usize {
        self.0.slot_bytes
    }

    pub fn slots(&self) -> usize {
        self.0.slots
    }

    /// The whole allocation: `(base address, bytes)`.
    pub fn memory(&self) -> (*mut u8, usize) {
        (self.0.base, self.0.layout.size())
    }

    /// A free slot, if any.
    pub fn try_acquire(&self) -> Option<Slot> {
        let idx = self.0.free.lock().unwrap_or_else(|e| e.into_inner()).pop()?;
        Some(Slot { slab: self.0.clone(), idx })
    }

    /// A free slot, waiting up to `timeout` for one to be released (by a forward pass still
    /// holding an evicted expert).
    pub fn acquire_timeout(&self, timeout: std::time::Duration) -> Option<Slot> {
        let mut free = self.0.free.lock().unwrap_or_else(|e| e.into_inner());
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(idx) = free.pop() {
                return Some(Slot { slab: self.0.clone(), idx });
            }
            let left = deadline.checked_duration_since(std::time::Instant::now())?;
            free = self.0.released.wait_timeout(free, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// One slot; returned to the free list when dropped.
pub struct Slot {
    slab: Arc<SlabInner>,
    idx: usize,
}

impl Slot {
    /// The slot's memory for the I/O engine to fill. Callers must not read it while reads are in
    /// flight.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        // SAFETY: idx < slots, so the offset stays inside the allocation.
        unsafe { self.slab.base.add(self.idx * self.slab.slot_bytes) }
    }

    pub fn len(&self) -> usize {
        self.slab.slot_bytes
    }

    pub fn is_empty(&self) -> bool {
        self.slab.slot_bytes == 0
    }

    /// Moves `len` bytes inside the slot from `src` to `dst` (compaction after aligned reads).
    /// Copies `bytes` to offset `dst` of the slot.
    pub fn write(&mut self, dst: usize, bytes: &[u8]) {
        assert!(dst + bytes.len() <= self.len());
        // SAFETY: the range is inside this slot, which `&mut self` holds exclusively; `bytes` is
        // not inside the slot (it is a shared borrow while the slot is borrowed mutably).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.as_mut_ptr().add(dst), bytes.len())
        }
    }

    pub fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        assert!(src + len <= self.len() && dst + len <= self.len());
        // SAFETY: both ranges are inside this slot, which `&mut self` holds exclusively.
        unsafe { std::ptr::copy(self.as_mut_ptr().add(src), self.as_mut_ptr().add(dst), len) }
    }
}

impl AsRef<[u8]> for Slot {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the slot's range is inside the allocation and not written once shared.
        unsafe { std::slice::from_raw_parts(self.as_mut_ptr(), self.len()) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slab.free.lock().unwrap_or_else(|e| e.into_inner()).push(self.idx);
        self.slab.released.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_reused_and_bounded() {
        let slab = Slab::new(2, 5000).unwrap();
        assert_eq!(slab.slot_bytes(), 8192);
        let a = slab.try_acquire().unwrap();
        let b = slab.try_acquire().unwrap();
        assert_eq!(a.as_mut_ptr() as usize % DIRECT_ALIGN, 0);
        assert_ne!(a.as_mut_ptr(), b.as_mut_ptr());
        assert!(slab.try_acquire().is_none());
        let pa = a.as_mut_ptr();
        drop(a);
        assert_eq!(slab.try_acquire().unwrap().as_mut_ptr(), pa);
        assert!(slab.acquire_timeout(std::time::Duration::from_millis(5)).is_some());
    }
}
