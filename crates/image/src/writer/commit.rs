//! [`ImageWriter::commit`]: finish every file, write the manifest, and
//! rename the temporary directory into place (see `docs/image-format.md`,
//! "Commit protocol").

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{Committed, ImageWriter, WriteError};
use crate::fileio::{sync_dir, write_body_file};
use crate::format::{FileKind, PageKey, FILE_HEADER_LEN};
use crate::hashes::encode_hashes;
use crate::index::{encode_bitmaps, encode_index};
use crate::manifest::{FileRef, Files, Manifest, Storage};
use crate::trace::{encode_trace, TRACE_FAFL};

impl ImageWriter {
    /// Finishes every file, writes the manifest, and atomically renames the
    /// temporary directory to its final name (see the module docs).
    pub fn commit(self) -> Result<Committed, WriteError> {
        self.commit_unless(&AtomicBool::new(false))
    }

    /// [`commit`](Self::commit), unless `cancelled` is set before the
    /// rename: then nothing is committed, the temporary directory is
    /// removed, and the result is [`WriteError::Cancelled`]. For a caller
    /// that stops waiting for a commit stuck on a hung disk: if the disk
    /// ever answers, the snapshot it gave up on does not appear.
    pub fn commit_unless(mut self, cancelled: &AtomicBool) -> Result<Committed, WriteError> {
        if self.poisoned {
            return Err(WriteError::Poisoned);
        }
        let check = || match cancelled.load(Ordering::SeqCst) {
            true => Err(WriteError::Cancelled),
            false => Ok(()),
        };
        check()?;
        let Some(device_len) = self.device_len else {
            return Err(WriteError::MissingDeviceState);
        };
        if self.opts.require_complete {
            self.check_complete()?;
        }
        self.drain_pool()?;
        self.resolve_dups();
        let mut header = self.file_header();
        header.body_len = self.mem_len - FILE_HEADER_LEN as u64;
        header.count = self.blocks.len() as u32;
        header.page_size = self.page_size as u32;
        let mem_len = self.mem_len;
        self.io(FileKind::Memory, |w| {
            let file = w
                .mem
                .take()
                .ok_or_else(|| io::Error::other("memory image closed"))?;
            file.write_all_at(&header.encode(FileKind::Memory), 0)?;
            file.sync_all()
        })?;
        header.body_len = 0;
        let index_len = self.io(FileKind::Index, |w| {
            write_body_file(
                &w.file_path(FileKind::Index),
                FileKind::Index,
                header.clone(),
                |out| encode_index(&w.blocks, &w.index, out),
            )
        })?;
        header.page_size = 0;
        header.count = self.ram_pages.len() as u32;
        let zero_len = self.io(FileKind::Zero, |w| {
            write_body_file(
                &w.file_path(FileKind::Zero),
                FileKind::Zero,
                header.clone(),
                |out| encode_bitmaps(&w.zero, out),
            )
        })?;
        header.count = self.traces.len() as u32;
        let trace_len = self.io(FileKind::Trace, |w| {
            write_body_file(
                &w.file_path(FileKind::Trace),
                FileKind::Trace,
                header.clone(),
                |out| encode_trace(&w.traces, out),
            )
        })?;
        let hashes = if self.opts.format_major >= 2 {
            header.count = self.ram_pages.len() as u32;
            let len = self.io(FileKind::Hashes, |w| {
                write_body_file(
                    &w.file_path(FileKind::Hashes),
                    FileKind::Hashes,
                    header.clone(),
                    |out| encode_hashes(&w.hashes, out),
                )
            })?;
            Some(file_ref(FileKind::Hashes, len))
        } else {
            None
        };
        let manifest = self.manifest(Files {
            memory: file_ref(FileKind::Memory, mem_len),
            index: file_ref(FileKind::Index, index_len),
            zero: file_ref(FileKind::Zero, zero_len),
            device: file_ref(FileKind::Device, device_len),
            trace: file_ref(FileKind::Trace, trace_len),
            hashes,
        });
        let bytes = manifest.encode_as(self.opts.version());
        self.io(FileKind::Manifest, |w| {
            let mut f = File::options()
                .write(true)
                .create_new(true)
                .open(w.file_path(FileKind::Manifest))?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            sync_dir(&w.tmp_dir)
        })?;
        check()?;
        if self.replace {
            return self.commit_exchange(manifest);
        }
        if self.final_dir.exists() {
            return Err(WriteError::Exists(self.final_dir.clone()));
        }
        // rename(2) replaces an empty directory but fails on a non-empty
        // one, so a committed snapshot is never clobbered.
        let final_dir = self.final_dir.clone();
        fs::rename(&self.tmp_dir, &final_dir).map_err(|e| WriteError::Io {
            path: final_dir.clone(),
            source: e,
        })?;
        self.committed = true;
        sync_parent(&final_dir)?;
        Ok(Committed {
            path: final_dir,
            manifest,
        })
    }

    /// The commit of [`ImageWriter::create_replacing`]: swap, sync, remove
    /// the old image (now under the temporary name).
    fn commit_exchange(mut self, manifest: Manifest) -> Result<Committed, WriteError> {
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        let final_dir = self.final_dir.clone();
        renameat_with(CWD, &self.tmp_dir, CWD, &final_dir, RenameFlags::EXCHANGE).map_err(|e| {
            WriteError::Io {
                path: final_dir.clone(),
                source: e.into(),
            }
        })?;
        // The new image is in place; the temporary name holds the old one.
        self.committed = true;
        sync_parent(&final_dir)?;
        // Best effort: a leftover is a temporary directory gc removes.
        let _ = fs::remove_dir_all(&self.tmp_dir);
        Ok(Committed {
            path: final_dir,
            manifest,
        })
    }

    fn check_complete(&self) -> Result<(), WriteError> {
        let mut missing = 0u64;
        let mut first = None;
        for (r, &pages) in self.ram_pages.iter().enumerate() {
            for p in 0..pages {
                let key = PageKey {
                    ram_block: r as u32,
                    page: p,
                };
                if !self.is_given(key) {
                    missing += 1;
                    first.get_or_insert(key);
                }
            }
        }
        match first {
            Some(first) => Err(WriteError::Incomplete { missing, first }),
            None => Ok(()),
        }
    }

    fn manifest(&self, files: Files) -> Manifest {
        let mut metrics = self.metrics.clone();
        let zero = self.pages_zero();
        metrics.pages_total = Some(
            self.pages_stored
                + self.dups.len() as u64
                + self.pages_in_parent
                + self.pages_on_disk
                + zero,
        );
        metrics.pages_zero = Some(zero);
        metrics.bytes_written = Some(files.all().iter().map(|(_, f)| f.size).sum());
        if metrics.pages_guest_written.is_none() {
            let fafl = self.traces.iter().find(|s| s.name == TRACE_FAFL);
            metrics.pages_guest_written = Some(fafl.map_or(0, |s| s.entries.len() as u64));
        }
        let created_unix_ms = self.created_unix_ms.unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0)
        });
        Manifest {
            image_id: self.image_id.iter().map(|b| format!("{b:02x}")).collect(),
            created_unix_ms,
            vm: self.meta.vm.clone(),
            qemu: self.meta.qemu.clone(),
            page_size: self.page_size as u32,
            pages_per_block: self.opts.pages_per_block,
            blocks: self.blocks.len() as u32,
            ram_blocks: self.meta.ram_blocks.clone(),
            disks: self.meta.disks.clone(),
            device_state_format: self.meta.device_state_format.clone(),
            files,
            metrics,
            labels: self.meta.labels.clone(),
            parent: self.parent.as_ref().map(|p| p.reference.clone()),
            storage: (self.opts.format_major >= 2).then(|| Storage {
                codec: self.opts.codec.name().into(),
                blocks_hot: self.blocks_hot,
                blocks_compressed: self.blocks_compressed,
                blocks_raw_fallback: self.pool.raw_fallback,
                pages_duplicate: self.dups.len() as u64,
                pages_in_parent: self.pages_in_parent,
                pages_on_disk: self.pages_on_disk,
                payload_raw_bytes: self.raw_bytes,
                payload_stored_bytes: self.blocks.iter().map(|b| u64::from(b.payload_len())).sum(),
            }),
        }
    }
}

/// Fsyncs the directory holding `dir` (after a rename into it).
fn sync_parent(dir: &std::path::Path) -> Result<(), WriteError> {
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    sync_dir(&parent).map_err(|e| WriteError::Io {
        path: parent,
        source: e,
    })
}

fn file_ref(kind: FileKind, size: u64) -> FileRef {
    FileRef {
        name: kind.default_name().into(),
        size,
    }
}
