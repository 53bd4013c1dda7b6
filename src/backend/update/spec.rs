//! The spec of the in-place updates: each element's formula, in order.

#![forbid(unsafe_code)]

use super::{AdamWConsts, UpdateOps};
use crate::backend::math::{div, sqrt};
use crate::backend::reduce::ReduceOps;
use crate::backend::spec::{fma, SpecStorage};
use crate::Result;

impl UpdateOps for SpecStorage {
    fn finite_check_unscale(
        bufs: &[&SpecStorage],
        inv_scale: f32,
        also: &[&SpecStorage],
    ) -> Result<(bool, Vec<f32>, Vec<f64>)> {
        let mut finite = true;
        for b in bufs {
            for x in b.get_mut().iter_mut() {
                finite &= x.is_finite();
                *x *= inv_scale;
            }
        }
        let partials = SpecStorage::chunk_sum_squares(bufs)?;
        let also = also.iter().flat_map(|a| a.get().iter().map(|&x| f64::from(x)).collect::<Vec<_>>()).collect();
        Ok((finite, partials, also))
    }

    fn scale_in_place(&self, c: f32) -> Result<()> {
        for x in self.get_mut().iter_mut() {
            *x *= c;
        }
        Ok(())
    }

    fn adamw_step(&self, g: &SpecStorage, m: &SpecStorage, v: &SpecStorage, c: &AdamWConsts) -> Result<()> {
        if let Some(s) = c.grad_scale {
            g.scale_in_place(s)?;
        }
        let (mut p, g, mut m, mut v) = (self.get_mut(), g.get(), m.get_mut(), v.get_mut());
        for i in 0..p.len() {
            let p1 = p[i] * c.decay;
            m[i] = fma(c.beta1, m[i], c.omb1 * g[i]);
            v[i] = fma(c.beta2, v[i], c.omb2 * (g[i] * g[i]));
            let den = div(sqrt(v[i]), c.bc2_sqrt) + c.eps;
            p[i] = fma(-c.step_size, div(m[i], den), p1);
        }
        Ok(())
    }

    fn sgd_step(
        &self,
        g: &SpecStorage,
        buf: Option<&SpecStorage>,
        lr: f32,
        momentum: f32,
        wd: f32,
        first: bool,
    ) -> Result<()> {
        let (mut p, g) = (self.get_mut(), g.get());
        let mut buf = buf.map(|b| b.get_mut());
        for i in 0..p.len() {
            let mut gi = fma(wd, p[i], g[i]);
            if let Some(b) = buf.as_mut() {
                b[i] = if first { gi } else { fma(momentum, b[i], gi) };
                gi = b[i];
            }
            p[i] = fma(-lr, gi, p[i]);
        }
        Ok(())
    }
}
