//! Experts built on their slot's bytes: our kernels run Q4_1, Q8_0 and Q4_K in place; other
//! formats are decoded into candle tensors beside the slot. [`ExpertBytes`] hands the stored bytes
//! to a tier above (the GPU tier).

use std::sync::Arc;

use candle_core::Device;
use strata_formats::{ExpertDims, ExpertEncoding, ExpertExtent};
use strata_kernels::{QuantMatrix, WeightBytes};
use strata_models::layers::{kernel_format, Linear};
use strata_models::mlp::Mlp;
use strata_models::{Expert, ModelError};

use super::read_plan::ReadPlan;
use super::StreamingExperts;
use crate::slab::Slot;

/// One cached expert's stored bytes, for a tier above the host cache (the GPU tier copies them to
/// device memory): gate, up and down lie at `ranges` of `slot`, in `encodings` with `shapes`
/// (`[rows, cols]`: gate and up `[I, H]`, down `[H, I]`). Holding it keeps the slot from reuse.
pub struct ExpertBytes {
    pub slot: Arc<Slot>,
    pub ranges: [std::ops::Range<usize>; 3],
    pub encodings: [ExpertEncoding; 3],
    pub shapes: [[usize; 2]; 3],
    /// Stored bytes of the three parts.
    pub bytes: usize,
}

impl ExpertBytes {
    /// Part `k` (0 gate, 1 up, 2 down) decoded into a candle tensor on `device` (formats our CPU
    /// kernels do not run from the slot, float weights widened to f32); `name` names it in errors.
    pub fn decoded(&self, k: usize, name: &str, device: &Device) -> Result<Linear, ModelError> {
        let bytes = &AsRef::<[u8]>::as_ref(self.slot.as_ref())[self.ranges[k].clone()];
        let w = strata_formats::weight_from_bytes(
            self.encodings[k],
            self.shapes[k],
            bytes,
            name,
            device,
        )?;
        Linear::for_expert(w).map_err(|e| ModelError::Tensor { name: name.to_string(), source: e })
    }
}

impl StreamingExperts {
    /// Puts the bytes of a slot whose reads completed in place (gate, up, down back to back).
    pub(super) fn place(
        &self,
        layer: usize,
        expert: usize,
        mut slot: Slot,
    ) -> Result<Arc<Slot>, ModelError> {
        ReadPlan::new(self.extent(layer, expert)?, self.io.direct()).place(&mut slot);
        Ok(Arc::new(slot))
    }

    /// Where gate, up and down lie in a placed slot, with their encodings and shapes.
    pub(super) fn layout_of(
        &self,
        layer: usize,
        expert: usize,
        slot: &Arc<Slot>,
    ) -> Result<ExpertBytes, ModelError> {
        let extent = self.extent(layer, expert)?;
        let (h, i) = (self.dims.hidden, self.dims.intermediate);
        let lens = extent.parts.map(|p| p.len as usize);
        let offs = [0, lens[0], lens[0] + lens[1]];
        Ok(ExpertBytes {
            slot: slot.clone(),
            ranges: [0, 1, 2].map(|k| offs[k]..offs[k] + lens[k]),
            encodings: extent.encodings,
            shapes: [[i, h], [i, h], [h, i]],
            bytes: extent.bytes() as usize,
        })
    }

    /// Builds a ready expert over a placed slot.
    pub(super) fn build(
        &self,
        layer: usize,
        expert: usize,
        slot: &Arc<Slot>,
    ) -> Result<Expert, ModelError> {
        let b = self.layout_of(layer, expert, slot)?;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = slot.clone();
        let name = format!("blk.{layer}.ffn_exps[{expert}]");
        let kernel = |enc: ExpertEncoding| match enc {
            ExpertEncoding::Ggml(dt) if self.device.is_cpu() => kernel_format(dt),
            _ => None,
        };
        let bad = |e: String| ModelError::ExpertRead { layer, expert, message: e };
        let on_kernel =
            |format, range: std::ops::Range<usize>, rows, cols| -> Result<Linear, ModelError> {
                let bytes = WeightBytes::new(owner.clone(), range).map_err(bad)?;
                Ok(Linear::from_kernel(QuantMatrix::new(format, bytes, rows, cols).map_err(bad)?))
            };
        let part = |k: usize| -> Result<Linear, ModelError> {
            match kernel(b.encodings[k]) {
                Some(f) => on_kernel(f, b.ranges[k].clone(), b.shapes[k][0], b.shapes[k][1]),
                None => b.decoded(k, &name, &self.device),
            }
        };
        let mlp = match kernel(b.encodings[0]) {
            // gate and up are adjacent in the slot: one [2I, H] matrix, as the resident path fuses them.
            Some(f) if b.encodings[1] == b.encodings[0] => Mlp::from_fused(
                on_kernel(
                    f,
                    b.ranges[0].start..b.ranges[1].end,
                    2 * b.shapes[0][0],
                    b.shapes[0][1],
                )?,
                part(2)?,
            ),
            _ => Mlp::new(part(0)?, part(1)?, part(2)?)?,
        };
        Ok(Expert::new(mlp, b.bytes))
    }
}

/// Bytes of the tensors decoded beside the slot for parts our kernels do not run.
pub(super) fn decoded_bytes(x: &ExpertExtent, dims: ExpertDims) -> u64 {
    let elems = (dims.hidden * dims.intermediate) as u64;
    x.encodings
        .iter()
        .zip(&x.parts)
        .map(|(enc, p)| match enc {
            ExpertEncoding::Ggml(dt) if kernel_format(*dt).is_some() => 0,
            ExpertEncoding::Ggml(_) => p.len,
            ExpertEncoding::Float(_) => elems * 4,
        })
        .sum()
}
