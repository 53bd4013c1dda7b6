//! The spec of the product: one ascending fma chain per output.

#![forbid(unsafe_code)]

use super::{Halves, MatmulDims, MatmulOps};
use crate::backend::pack::spec::unpacked;
use crate::backend::round::{round_f32, Format};
use crate::backend::spec::{fma, SpecStorage};
use crate::Result;

/// Element `e` of an operand as the product reads it: unpacked from 16-bit
/// words when `half`, then rounded under autocast.
fn read(x: &[f32], half: Option<Format>, e: usize, round: Option<Format>) -> f32 {
    let v = match half {
        Some(fmt) => unpacked(x, fmt, e),
        None => x[e],
    };
    match round {
        Some(fmt) => round_f32(v, fmt),
        None => v,
    }
}

impl MatmulOps for SpecStorage {
    fn matmul(&self, rhs: &SpecStorage, d: MatmulDims, halves: Halves, round: Option<Format>) -> Result<SpecStorage> {
        let (a, b) = (self.get(), rhs.get());
        let (m, k, n) = (d.m, d.k, d.n);
        let ([pa, pb, pc], h) = (d.placements(), d.heads());
        let mut c = vec![0.0f32; d.batch * m * n];
        for batch in 0..d.batch {
            let (a0, b0, c0) = (pa.start(batch, h), pb.start(batch, h), pc.start(batch, h));
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0.0f32;
                    for p in 0..k {
                        if !d.causal.includes(i, j, p) {
                            continue;
                        }
                        let ea = a0 + if d.trans_a { p * pa.row + i } else { i * pa.row + p };
                        let eb = b0 + if d.trans_b { j * pb.row + p } else { p * pb.row + j };
                        acc = fma(read(&a, halves.a, ea, round), read(&b, halves.b, eb, round), acc);
                    }
                    c[c0 + i * pc.row + j] = match round {
                        Some(fmt) => round_f32(acc, fmt),
                        None => acc,
                    };
                }
            }
        }
        Ok(SpecStorage::new(c))
    }

    fn matmul_add(
        &self,
        rhs: &SpecStorage,
        d: MatmulDims,
        halves: Halves,
        round: Option<Format>,
        addend: &SpecStorage,
    ) -> Result<SpecStorage> {
        let c = self.matmul(rhs, d, halves, round)?;
        let sums = addend.get().iter().zip(c.get().iter()).map(|(&e, &c)| e + c).collect();
        Ok(SpecStorage::new(sums))
    }
}
