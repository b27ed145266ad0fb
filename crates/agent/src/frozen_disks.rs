//! Reading a snapshot's frozen disks, for images whose pages are partly
//! stored as references to them (the detection layer, format 2): every
//! place that opens an image to restore it or read its pages opens it with
//! [`open_image`], which gives the reader a [`FrozenDisks`].
//!
//! The frozen disk of a snapshot is the qcow2 chain hard-linked into
//! `snapshots/.disks/<name>/` (manifest `disks[i].path`); it never changes,
//! so each path is opened once (header, L1 table) and kept.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use vmcsnap_image::{DiskPages, DiskRef, Image, ReadError};
use vmcsnap_qcow2::{Disk, Format};

/// A [`DiskPages`] over the qcow2 or raw files the manifest names, each
/// opened once (see the module documentation).
#[derive(Debug, Default)]
pub struct FrozenDisks {
    open: Mutex<HashMap<PathBuf, Arc<Disk>>>,
}

impl FrozenDisks {
    /// A reader with nothing open yet.
    pub fn new() -> Arc<FrozenDisks> {
        Arc::new(FrozenDisks::default())
    }

    /// The disk at `path` (opened now if it was not).
    pub fn disk(&self, path: &Path, format: &str) -> io::Result<Arc<Disk>> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = open.get(path) {
            return Ok(d.clone());
        }
        let format = match format {
            "qcow2" => Some(Format::Qcow2),
            "raw" => Some(Format::Raw),
            _ => None,
        };
        let d = Arc::new(Disk::open_as(path, format).map_err(io::Error::other)?);
        open.insert(path.into(), d.clone());
        Ok(d)
    }
}

impl DiskPages for FrozenDisks {
    fn read(&self, disk: &DiskRef, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.disk(Path::new(&disk.path), &disk.format)?
            .read_at(offset, out)
            .map_err(io::Error::other)
    }
}

/// Opens the image in `dir` (and its parents) with a reader of its frozen
/// disks.
pub fn open_image(dir: &Path) -> Result<Image, ReadError> {
    let disks: Arc<dyn DiskPages> = FrozenDisks::new();
    Image::open_with(dir, Some(disks))
}
