//! User-facing ops. Each file holds a family; each op's backward sits right
//! beside its forward, in the closure each op records with its result.

pub mod attention;
pub mod elementwise;
pub mod fused;
pub mod index;
pub mod matmul;
pub mod nn;
pub mod reduce;
pub mod view;

pub use fused::cross_entropy;
pub use nn::{dropout, mse};
