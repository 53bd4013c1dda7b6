//! The CPU reference of the in-place updates.

use super::{AdamWConsts, UpdateOps};
use crate::backend::cpu::pool;
use crate::backend::cpu::simd::LANES;
use crate::backend::cpu::{cpu_threads, simd, CpuStorage};
use crate::backend::math;
use crate::backend::reduce::cpu::{chunk_sums_of_squares, SQUARES_PIECE};
use crate::backend::reduce::NORM_CHUNK;
use crate::Result;

impl UpdateOps for CpuStorage {
    fn finite_check_unscale(
        bufs: &[&CpuStorage],
        inv_scale: f32,
        also: &[&CpuStorage],
    ) -> Result<(bool, Vec<f32>, Vec<f64>)> {
        let also: Vec<f64> = also.iter().flat_map(|a| a.to_vec_f64()).collect();
        if bufs.iter().all(|b| matches!(b, CpuStorage::F32(_))) {
            // whole chunks per part: the partials are every buffer's chunks, in order
            let mut held: Vec<_> = bufs.iter().map(|b| b.f32s_mut()).collect();
            let pieces = held.iter_mut().flat_map(|x| x.chunks_mut(SQUARES_PIECE));
            let parts = pool::map(pieces, |x| (unscale(x, inv_scale), chunk_sums_of_squares(x)));
            let finite = parts.iter().all(|p| p.0);
            return Ok((finite, parts.into_iter().flat_map(|p| p.1).collect(), also));
        }
        let mut finite = true;
        let mut partials = Vec::new();
        for b in bufs {
            finite &= b.unscale_in_place(inv_scale, &mut partials);
        }
        Ok((finite, partials, also))
    }

    fn scale_in_place(&self, c: f32) -> Result<()> {

        match self {
            CpuStorage::F32(b) => b.get_mut().iter_mut().for_each(|x| *x *= c),
            CpuStorage::F64(b) => b.get_mut().iter_mut().for_each(|x| *x *= c as f64),
        }
        Ok(())
    }

    fn adamw_step(&self, g: &CpuStorage, m: &CpuStorage, v: &CpuStorage, c: &AdamWConsts) -> Result<()> {
        // The reference scales in its own pass: the same bits as the fused kernel.
        if let Some(s) = c.grad_scale {
            g.scale_in_place(s)?;
        }

        let (mut p, g, mut m, mut v) = (self.f32s_mut(), g.f32s(), m.f32s_mut(), v.f32s_mut());
        let (n, c) = (p.len(), *c);
        // An element-wise update has no order to keep: large buffers are split
        // over the threads in whole groups of lanes.
        let threads = if n >= pool::SPLIT_VALUES {
            cpu_threads()
        } else {
            1
        };
        if threads == 1 {
            adamw_slices(&mut p, &g, &mut m, &mut v, &c);
            return Ok(());
        }
        let per = n.div_ceil(threads).next_multiple_of(LANES);
        let parts = p.chunks_mut(per).zip(g.chunks(per)).zip(m.chunks_mut(per)).zip(v.chunks_mut(per));
        pool::each(parts, |(((p, g), m), v)| adamw_slices(p, g, m, v, &c));
        Ok(())
    }

    fn sgd_step(
        &self,
        g: &CpuStorage,
        buf: Option<&CpuStorage>,
        lr: f32,
        momentum: f32,
        wd: f32,
        first: bool,
    ) -> Result<()> {
        let (mut p, g) = (self.f32s_mut(), g.f32s());
        let mut b = buf.map(|b| b.f32s_mut());
        sgd_slices(&mut p, &g, b.as_deref_mut().map(|b| b.as_mut_slice()), [lr, momentum, wd], first);
        Ok(())
    }
}

impl CpuStorage {
    /// `x *= inv_scale` in place, pushing each chunk's sum of squares of the
    /// new values; true when every value was finite before.
    fn unscale_in_place(&self, inv_scale: f32, partials: &mut Vec<f32>) -> bool {
        match self {
            CpuStorage::F32(b) => {
                let mut x = b.get_mut();
                let finite = unscale(&mut x, inv_scale);
                partials.extend(chunk_sums_of_squares(&x));
                finite
            }
            CpuStorage::F64(b) => {
                let mut finite = true;
                for x in b.get_mut().iter_mut() {
                    finite &= x.is_finite();
                    *x *= inv_scale as f64;
                }
                // `sum_squares` reads an f64 buffer as its f32 values too.
                let narrowed: Vec<f32> = b.get().iter().map(|&x| x as f32).collect();
                partials.extend(narrowed.chunks(NORM_CHUNK).map(|c| c.iter().fold(-0.0f32, |a, &v| v.mul_add(v, a))));
                finite
            }
        }
    }
}

simd::multiversion! {
    /// `x *= inv_scale`; true when every value was finite before.
    fn unscale(x: &mut [f32], inv_scale: f32) -> bool {
        let mut finite = true;
        for v in x.iter_mut() {
            finite &= v.is_finite();
            *v *= inv_scale;
        }
        finite
    }
}

simd::multiversion! {
    /// AdamW over whole slices: groups of LANES elements, so the two divisions per
    /// element are one hardware division of a vector each (`math::div_lanes`, the
    /// soft division's bits); the ragged tail runs as a group padded with zeros.
    /// `gi = fma(wd, p, g)`; with a momentum buffer `b = first ? gi : fma(μ, b, gi)`
    /// and `gi = b`; then `p = fma(-lr, gi, p)`.
    fn sgd_slices(p: &mut [f32], g: &[f32], b: Option<&mut [f32]>, lr_mu_wd: [f32; 3], first: bool) {
        let [lr, momentum, wd] = lr_mu_wd;
        let mut b = b;
        for i in 0..p.len() {
            let mut gi = wd.mul_add(p[i], g[i]);
            if let Some(b) = b.as_mut() {
                b[i] = if first { gi } else { momentum.mul_add(b[i], gi) };
                gi = b[i];
            }
            p[i] = (-lr).mul_add(gi, p[i]);
        }
    }
}

simd::multiversion! {
    fn adamw_slices(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &AdamWConsts) {
        let n = p.len();
        let whole = n - n % LANES;
        for i in (0..whole).step_by(LANES) {
            let r = i..i + LANES;
            adamw_lanes(
                &mut p[r.clone()],
                &g[r.clone()],
                &mut m[r.clone()],
                &mut v[r],
                c,
            );
        }
        if whole < n {
            let t = n - whole;
            let mut lanes = [[0.0f32; LANES]; 4];
            for (l, x) in lanes
                .iter_mut()
                .zip([&p[whole..], &g[whole..], &m[whole..], &v[whole..]])
            {
                l[..t].copy_from_slice(x);
            }
            let [mut pt, gt, mut mt, mut vt] = lanes;
            adamw_lanes(&mut pt, &gt, &mut mt, &mut vt, c);
            p[whole..].copy_from_slice(&pt[..t]);
            m[whole..].copy_from_slice(&mt[..t]);
            v[whole..].copy_from_slice(&vt[..t]);
        }
    }
}

/// One AdamW group (slices of exactly LANES elements), PyTorch's formula:
/// `p1 = p·decay; m = fma(β1, m, (1-β1)·g); v = fma(β2, v, (1-β2)·g²);
/// den = v̂ / sqrt(1-β2^t) + eps` with `v̂ = sqrt(v)`; `p = fma(-step, m / den, p1)`.
#[inline(always)]
fn adamw_lanes(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &AdamWConsts) {
    // Whole groups in registers, stored once at the end: element-wise stores
    // followed by a vector load of the same group stall store forwarding.
    let lanes = |x: &[f32]| -> [f32; LANES] { x.try_into().unwrap() };
    let (p0, g, m0, v0) = (lanes(p), lanes(g), lanes(m), lanes(v));
    let m1: [f32; LANES] = std::array::from_fn(|i| c.beta1.mul_add(m0[i], c.omb1 * g[i]));
    let v1: [f32; LANES] = std::array::from_fn(|i| c.beta2.mul_add(v0[i], c.omb2 * (g[i] * g[i])));
    let vhat = math::div_lanes(v1.map(math::sqrt), [c.bc2_sqrt; LANES]);
    let upd = math::div_lanes(m1, vhat.map(|x| x + c.eps));
    let p1: [f32; LANES] = std::array::from_fn(|i| (-c.step_size).mul_add(upd[i], p0[i] * c.decay));
    p.copy_from_slice(&p1);
    m.copy_from_slice(&m1);
    v.copy_from_slice(&v1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::set_cpu_threads;

    /// AdamW split over threads (large buffers) against one pass over the
    /// whole buffer, bit for bit: a ragged length past the threshold, three
    /// threads (so the parts are not halves), data with zeros and tiny values
    /// (the division's fallback groups).
    #[test]
    fn threaded_adamw_equals_one_pass_bitwise() {
        let n = pool::SPLIT_VALUES + 13;
        let mut s = 0x1234_5678_9abc_def0u64;
        let mut next = move |scale: f32| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if s & 63 == 0 {
                0.0
            } else if s & 63 == 1 {
                u * 1e-36
            } else {
                u * scale
            }
        };
        let p: Vec<f32> = (0..n).map(|_| next(1.0)).collect();
        let g: Vec<f32> = (0..n).map(|_| next(1e-2)).collect();
        let m: Vec<f32> = (0..n).map(|_| next(1e-3)).collect();
        let v: Vec<f32> = (0..n).map(|_| next(1e-5).abs()).collect();
        // step 10 of lr 3e-4, weight decay 0.1, betas (0.9, 0.95)
        let c = AdamWConsts {
            decay: 0.99997,
            beta1: 0.9,
            omb1: 0.1,
            beta2: 0.95,
            omb2: 0.05,
            step_size: 4.5649e-4,
            bc2_sqrt: 0.7766,
            eps: 1e-8,
            grad_scale: None,
        };
        let (mut p1, mut m1, mut v1) = (p.clone(), m.clone(), v.clone());
        adamw_slices(&mut p1, &g, &mut m1, &mut v1, &c);
        let [ps, gs, ms, vs] = [p, g, m, v].map(CpuStorage::from_f32);
        set_cpu_threads(Some(3));
        ps.adamw_step(&gs, &ms, &vs, &c).unwrap();
        set_cpu_threads(None);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&ps.f32s()), bits(&p1));
        assert_eq!(bits(&ms.f32s()), bits(&m1));
        assert_eq!(bits(&vs.f32s()), bits(&v1));
    }
}
