//! Copies of experts into VRAM on the tier's own CUDA stream, ordered against candle's stream
//! with events (see the module docs of `gpu_tier`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaEvent};
use candle_core::quantized::{cuda::QCudaStorage, GgmlDType, QStorage, QTensor};
use strata_formats::{ExpertEncoding, Weight};
use strata_models::layers::Linear;
use strata_models::mlp::Mlp;
use strata_models::{Expert, ModelError};

use super::{cuda_err, GpuExperts, TierState};
use crate::provider::ExpertBytes;

impl GpuExperts {
    /// Makes the compute stream (the calling thread's candle stream) wait for a copy.
    pub(super) fn wait_copied(&self, ev: &Option<Arc<CudaEvent>>) -> Result<(), ModelError> {
        match ev {
            Some(e) if !e.is_complete() => {
                self.dev.cuda_stream().wait(e).map_err(|e| cuda_err(0, 0)(e.to_string()))
            }
            _ => Ok(()),
        }
    }

    /// Orders the copy stream after the compute stream's work queued so far: allocations (and
    /// their zeroing) and kernels still reading a pool row about to be overwritten.
    pub(super) fn copy_after_compute(&self, layer: usize, expert: usize) -> Result<(), ModelError> {
        let e = cuda_err(layer, expert);
        let queued = self.dev.cuda_stream().record_event(None).map_err(|x| e(x.to_string()))?;
        self.copy.wait(&queued).map_err(|x| e(x.to_string()))
    }

    /// Queues the copies of `b`'s parts to `dst[k]` on the copy stream; returns the event that
    /// completes with them. The host slot is held until then.
    pub(super) fn copy_parts(
        &self,
        st: &mut TierState,
        layer: usize,
        expert: usize,
        b: &ExpertBytes,
        dst: [sys::CUdeviceptr; 3],
    ) -> Result<Arc<CudaEvent>, ModelError> {
        let e = cuda_err(layer, expert);
        self.copy_after_compute(layer, expert)?;
        self.queue_copies(layer, expert, b, dst)?;
        let copied = Arc::new(self.copy.record_event(None).map_err(|x| e(x.to_string()))?);
        st.inflight.retain(|(ev, _)| !ev.is_complete());
        st.inflight.push((copied.clone(), b.slot.clone()));
        Ok(copied)
    }

    /// Queues the copies of `b`'s three parts to `dst[k]` on the copy stream (no ordering, no
    /// event: the callers' part) and counts them as an upload. The caller keeps `b`'s slot alive
    /// until the copies complete, and `dst[k]` holds at least `ranges[k].len()` bytes.
    pub(super) fn queue_copies(
        &self,
        layer: usize,
        expert: usize,
        b: &ExpertBytes,
        dst: [sys::CUdeviceptr; 3],
    ) -> Result<(), ModelError> {
        let bytes: &[u8] = AsRef::<[u8]>::as_ref(b.slot.as_ref());
        for k in 0..3 {
            // SAFETY: the caller's contract above (sizes checked by the callers, the source slot
            // alive until the copies complete).
            unsafe {
                result::memcpy_htod_async(
                    dst[k],
                    &bytes[b.ranges[k].clone()],
                    self.copy.cu_stream(),
                )
            }
            .map_err(|x| cuda_err(layer, expert)(x.to_string()))?;
        }
        self.counters.uploads.fetch_add(1, Ordering::Relaxed);
        self.counters.upload_bytes.fetch_add(b.bytes as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Copies an expert's bytes into freshly allocated device tensors and builds it there.
    pub(super) fn upload_tensors(
        &self,
        st: &mut TierState,
        layer: usize,
        expert: usize,
        b: &ExpertBytes,
    ) -> Result<(Arc<Expert>, Option<Arc<CudaEvent>>), ModelError> {
        let name = format!("blk.{layer}.ffn_exps[{expert}]");
        let tensor = |e: candle_core::Error| ModelError::Tensor { name: name.clone(), source: e };
        let quantized: Option<Vec<GgmlDType>> = b
            .encodings
            .iter()
            .map(|e| match e {
                ExpertEncoding::Ggml(dt) => Some(*dt),
                ExpertEncoding::Float(_) => None,
            })
            .collect();
        let Some(dtypes) = quantized else {
            // Float experts: candle copies them (synchronously) and converts to f32 on the way.
            let lin = |k: usize| b.decoded(k, &name, &self.device);
            let mlp = Mlp::new(lin(0)?, lin(1)?, lin(2)?)?;
            self.counters.uploads.fetch_add(1, Ordering::Relaxed);
            self.counters.upload_bytes.fetch_add(b.bytes as u64, Ordering::Relaxed);
            return Ok((Arc::new(Expert::new(mlp, b.bytes)), None));
        };
        // Device tensors, allocated (and zeroed) on the compute stream.
        let mut parts = Vec::with_capacity(3);
        let mut dst = [0; 3];
        for k in 0..3 {
            let [rows, cols] = b.shapes[k];
            let storage = QCudaStorage::zeros(&self.dev, rows * cols, dtypes[k]).map_err(tensor)?;
            let q = QTensor::new(QStorage::Cuda(storage), (rows, cols)).map_err(tensor)?;
            assert!(
                q.storage_size_in_bytes() >= b.ranges[k].len(),
                "{name}: device tensor smaller than the stored part"
            );
            dst[k] = q.device_ptr().map_err(tensor)? as sys::CUdeviceptr;
            parts.push(q);
        }
        let copied = self.copy_parts(st, layer, expert, b, dst)?;
        let mut lin =
            parts.into_iter().map(|q| Linear::for_expert(Weight::Quantized(q)).map_err(tensor));
        let (g, u, d) = (lin.next().unwrap()?, lin.next().unwrap()?, lin.next().unwrap()?);
        let mlp = Mlp::new(g, u, d)?;
        Ok((Arc::new(Expert::new(mlp, b.bytes)), Some(copied)))
    }
}
