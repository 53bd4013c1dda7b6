pub mod backend;
pub mod error;
pub mod memory;
pub mod rng;
pub use error::{Error, Result};
