//! The GPU backend as a user sees it: which adapter it runs on, and explicit
//! synchronisation for timing. Tensors go to the GPU with
//! [`Device::Gpu`](crate::Device); the device is created on first use.

pub use crate::backend::gpu::{
    adapter, adapter_name, device_peak_bytes, flush, gpu_pool_bytes as pool_bytes,
    restart_device_peak, sync, use_backend, AdapterInfo, Backend,
};
pub use crate::profile::GpuCounters;
