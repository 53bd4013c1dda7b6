//! "Is my GPU bit-exact with the reference?" — the cross-check. So far:
//!
//! * [`trace`] — every backend primitive call in order, with the model path
//!   that issued it and a hash of its output; off by default (one
//!   thread-local read per primitive then).

pub mod trace;
