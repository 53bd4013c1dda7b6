//! The driver's compiled pipelines kept on disk between processes, where the
//! user asks for it (`TINYLLM_PIPELINE_CACHE=DIR`) and the backend offers it
//! (wgpu's pipeline cache: Vulkan).
//!
//! Without it every process compiles every kernel it uses once (the first
//! training step's warm-up); many drivers keep a disk cache of their own, so
//! the saving depends on the driver. Opt-in, because it writes outside a
//! run's directory: one file per adapter and driver
//! (`wgpu::util::pipeline_cache_key`) in the directory named, replaced
//! atomically, never through a link. Data that does not fit the driver is
//! ignored by it (wgpu's `fallback`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// The variable that names the cache directory.
pub const VAR: &str = "TINYLLM_PIPELINE_CACHE";

/// The feature to ask for: the cache's, when a directory is named and the
/// adapter offers it.
pub fn feature(adapter: &wgpu::Adapter) -> wgpu::Features {
    let offered = adapter.features().contains(wgpu::Features::PIPELINE_CACHE);
    if offered && std::env::var_os(VAR).is_some() {
        wgpu::Features::PIPELINE_CACHE
    } else {
        wgpu::Features::empty()
    }
}

/// A pipeline cache backed by one file.
pub struct DiskCache {
    cache: wgpu::PipelineCache,
    path: PathBuf,
    /// Pipelines were created since the file was last written.
    dirty: AtomicBool,
}

impl DiskCache {
    /// The cache for this device, filled from its file when there is one
    /// (`None`: not asked for, or not offered).
    pub fn open(device: &wgpu::Device, info: &wgpu::AdapterInfo) -> Option<DiskCache> {
        if !device.features().contains(wgpu::Features::PIPELINE_CACHE) {
            return None;
        }
        let dir = PathBuf::from(std::env::var_os(VAR)?);
        let path = dir.join(wgpu::util::pipeline_cache_key(info)?);
        let data = read_no_follow(&path);
        // SAFETY: wgpu requires the data to come from `PipelineCache::get_data`
        // of a compatible device; with `fallback` data that the driver
        // rejects is ignored. The file is ours, named by the adapter's key.
        let cache = unsafe {
            device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
                label: Some("tinyllm"),
                data: data.as_deref(),
                fallback: true,
            })
        };
        Some(DiskCache {
            cache,
            path,
            dirty: AtomicBool::new(false),
        })
    }

    /// The cache, for a pipeline about to be created (which makes it dirty).
    pub fn for_new_pipeline(&self) -> &wgpu::PipelineCache {
        self.dirty.store(true, Ordering::Relaxed);
        &self.cache
    }

    /// Writes the file if pipelines were created since it was last written.
    /// A failure only costs the next process its warm start: it is ignored.
    pub fn save_if_dirty(&self) {
        if self.dirty.swap(false, Ordering::Relaxed) {
            if let Some(data) = self.cache.get_data() {
                let _ = write_atomic(&self.path, &data);
            }
        }
    }
}

/// The file's bytes, unless it is missing, unreadable or a link.
fn read_no_follow(path: &Path) -> Option<Vec<u8>> {
    let m = path.symlink_metadata().ok()?;
    if !m.is_file() {
        return None;
    }
    std::fs::read(path).ok()
}

/// `data` into a new file beside `path`, then renamed over it (a link at
/// `path` is replaced, not followed).
fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)?;
    let written = f.write_all(data).and_then(|_| f.sync_all());
    if let Err(e) = written.and_then(|_| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(())
}
