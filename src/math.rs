//! The crate's own f32 math library — the functions every device computes
//! the same way (built from `+ − × fma` and bit operations, never a platform
//! `exp` or a driver's division), so they are reproducible everywhere.

pub use crate::backend::math::{div, exp, log, rsqrt, sigmoid, silu, sqrt};
