//! The capture loop: [`capture`] reads events from the stream reader and
//! hands pages, the FAFL trace and the device state to the image writer.

use std::io::{self, Read};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use vmcsnap_image::{ImageMeta, ImageWriter, PageKey, QemuInfo, RamBlock, VmInfo};
use vmcsnap_migstream::{Event, PageOrigin, StreamReader};

use crate::captured::{metric, Captured};
use crate::error::CaptureError;
use crate::options::{CaptureMode, CaptureOptions};
use crate::progress::{CaptureProgress, CaptureStats, Phase};
use crate::ram_check::{FinalRamSource, RamCheckReport};
use crate::stage::PageStage;

/// Reads QEMU's whole migration stream from `input` and writes it as a
/// vmcsnap image that [`Captured::commit`] will make `final_dir`.
///
/// Returns when the stream has ended (QEMU closes the connection when the
/// migration is done) and the image is complete. The image lives in the
/// writer's temporary directory next to `final_dir` until commit. On any
/// error the temporary directory is removed and `final_dir` is never
/// created. `progress` runs about every
/// [`CaptureOptions::progress_interval_bytes`] and once at the end.
///
/// `input` should be a blocking reader (a socket QEMU connected to). To
/// interrupt a capture from another thread, shut the socket down
/// (`UnixStream::shutdown`): the reader then sees the stream end early and
/// the capture fails with [`CaptureError::Stream`].
pub fn capture<R: Read>(
    input: R,
    final_dir: &Path,
    opts: CaptureOptions,
    progress: &mut dyn FnMut(&CaptureProgress),
) -> Result<Captured, CaptureError> {
    let started = Instant::now();
    check_target(final_dir)?;
    let first_byte = FirstByte {
        inner: input,
        at: None,
    };
    let mut reader = StreamReader::with_options(first_byte, opts.reader.clone());
    let mut run = Run {
        opts,
        final_dir,
        started,
        writer: None,
        stage: None,
        block_names: Vec::new(),
        page_size: 0,
        fill_page: Vec::new(),
        stream_machine: None,
        device_state_bytes: None,
        page_records: 0,
        pages_resent: 0,
        pages_guest_written: 0,
        stream_end: None,
    };
    let interval = run.opts.progress_interval_bytes;
    let mut next_report = interval;
    while let Some(event) = reader.next_event()? {
        match event {
            Event::Header { configuration, .. } => {
                run.stream_machine = configuration.map(|c| c.machine.clone());
            }
            Event::RamBlocks(blocks) => {
                let blocks: Vec<RamBlock> = blocks
                    .iter()
                    .map(|b| RamBlock {
                        name: b.name.clone(),
                        used_length: b.used_length,
                    })
                    .collect();
                let page_size = reader.page_size();
                run.start_image(blocks, page_size)?;
            }
            Event::Page {
                block,
                offset,
                data,
                origin,
            } => run.page(block, offset, Some(data), 0, origin)?,
            Event::ZeroPage {
                block,
                offset,
                fill,
                origin,
            } => run.page(block, offset, None, fill, origin)?,
            Event::DeviceState { data, .. } => run.device_state(data)?,
            Event::End { .. } => run.stream_end = Some(Instant::now()),
            Event::Command { .. } | Event::SectionStart(_) | Event::SectionEnd { .. } => {}
        }
        let bytes = reader.offset();
        if interval > 0 && bytes >= next_report {
            progress(&run.progress(Phase::Receiving, bytes));
            next_report = bytes + interval;
        }
    }
    let stream_bytes = reader.offset();
    let first_at = reader.into_inner().at;
    run.finish(stream_bytes, first_at, progress)
}

/// Fails early (before QEMU's bytes are read) if the snapshot cannot be
/// created at `final_dir`.
fn check_target(final_dir: &Path) -> Result<(), CaptureError> {
    let target = |reason: &str| CaptureError::Target {
        path: final_dir.into(),
        reason: reason.into(),
    };
    if final_dir.exists() {
        return Err(CaptureError::Exists(final_dir.into()));
    }
    if final_dir.file_name().is_none() {
        return Err(target(
            "the path has no final component to name the snapshot",
        ));
    }
    match final_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() && !p.is_dir() => Err(target(
            "its parent directory does not exist; create the snapshot root first",
        )),
        _ => Ok(()),
    }
}

/// Checks the staged pages against the final RAM `source` gives.
fn check_final_ram(
    stage: &mut PageStage,
    block_names: &[String],
    source: &dyn FinalRamSource,
) -> Result<RamCheckReport, CaptureError> {
    let ram = source
        .final_ram()
        .map_err(|detail| CaptureError::RamCheck { detail })?;
    let block = block_names
        .iter()
        .position(|n| *n == ram.block)
        .ok_or_else(|| CaptureError::RamCheck {
            detail: format!(
                "the stream has no RAM block {:?} (it has {block_names:?})",
                ram.block
            ),
        })?;
    stage.check_against(block as u32, &ram)
}

/// A reader that notes when the first byte arrived.
struct FirstByte<R> {
    inner: R,
    at: Option<Instant>,
}

impl<R: Read> Read for FirstByte<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n > 0 && self.at.is_none() {
            self.at = Some(Instant::now());
        }
        Ok(n)
    }
}

/// The state of one capture.
struct Run<'a> {
    opts: CaptureOptions,
    final_dir: &'a Path,
    started: Instant,
    writer: Option<ImageWriter>,
    /// Precopy mode: pages wait here until the stream ends.
    stage: Option<PageStage>,
    block_names: Vec<String>,
    page_size: u64,
    /// A page for ZERO records with a non-zero fill byte (QEMU never sends
    /// one, but the record allows it).
    fill_page: Vec<u8>,
    stream_machine: Option<String>,
    device_state_bytes: Option<u64>,
    page_records: u64,
    pages_resent: u64,
    pages_guest_written: u64,
    stream_end: Option<Instant>,
}

impl Run<'_> {
    /// The RAM block list arrived: create the image writer (and the
    /// precopy stage).
    fn start_image(&mut self, blocks: Vec<RamBlock>, page_size: u64) -> Result<(), CaptureError> {
        if blocks.is_empty() {
            return Err(CaptureError::NoRam);
        }
        let machine = match (&self.opts.machine, &self.stream_machine) {
            (Some(m), _) | (None, Some(m)) => m.clone(),
            (None, None) => return Err(CaptureError::UnknownMachine),
        };
        let mut labels = self.opts.labels.clone();
        labels
            .entry("capture_mode".into())
            .or_insert_with(|| self.opts.mode.name().into());
        let page_size32 = u32::try_from(page_size).unwrap_or(0); // 0: the writer refuses it
        let meta = ImageMeta {
            vm: VmInfo {
                name: self.opts.vm_name.clone(),
                config: self.opts.vm_config.clone(),
            },
            qemu: QemuInfo {
                version: self.opts.qemu_version.clone(),
                machine,
            },
            page_size: page_size32,
            ram_blocks: blocks,
            disks: self.opts.disks.clone(),
            device_state_format: self.opts.device_state_format.clone(),
            labels,
        };
        self.block_names = meta.ram_blocks.iter().map(|b| b.name.clone()).collect();
        // The writer checked that every block's page count fits a u32.
        let block_pages: Vec<u32> = meta
            .ram_blocks
            .iter()
            .map(|b| (b.used_length / page_size) as u32)
            .collect();
        let mut writer = ImageWriter::create_with(self.final_dir, meta, self.opts.writer)?;
        if let Some(init) = &self.opts.compress_worker_init {
            writer.on_worker_start(init.clone());
        }
        if let Some(parent) = self.opts.parent.take() {
            // Another RAM layout (the VM's memory was resized): a full
            // image, never a wrong one, and the manifest says why.
            if let Err(e) = writer.set_parent(parent) {
                writer
                    .metrics_mut()
                    .other
                    .insert("parent".into(), Value::String(format!("none: {e}")));
            }
        }
        if let Some(m) = &self.opts.disk_matcher {
            writer.set_disk_matcher((m.0)());
        }
        if self.opts.mode == CaptureMode::Precopy {
            self.stage = Some(PageStage::create(
                writer.temp_path(),
                page_size as usize,
                &block_pages,
            )?);
        }
        self.page_size = page_size;
        self.writer = Some(writer);
        Ok(())
    }

    /// A page record: `data` for a data page, `None` for a ZERO record with
    /// `fill`.
    fn page(
        &mut self,
        block: usize,
        offset: u64,
        data: Option<&[u8]>,
        fill: u8,
        origin: PageOrigin,
    ) -> Result<(), CaptureError> {
        // The stream reader yields pages only after the block list.
        let writer = self.writer.as_mut().ok_or(CaptureError::NoRam)?;
        self.page_records += 1;
        let key = PageKey::new(block as u32, (offset / self.page_size) as u32);
        let data = match data {
            Some(d) => Some(d),
            None if fill == 0 => None,
            None => {
                self.fill_page.clear();
                self.fill_page.resize(self.page_size as usize, fill);
                Some(&self.fill_page[..])
            }
        };
        let mut hot = false;
        match origin {
            PageOrigin::Resent => {
                self.pages_resent += 1;
                if self.stage.is_none() {
                    return Err(CaptureError::PageResent {
                        block: self.block_names[block].clone(),
                        offset,
                        mode: self.opts.mode,
                    });
                }
            }
            // Out of scan order the first time: in a background snapshot,
            // a page the guest wrote (the FAFL queue, in stream order).
            PageOrigin::GuestWrite if self.opts.mode == CaptureMode::BackgroundSnapshot => {
                writer.trace_push(key)?;
                self.pages_guest_written += 1;
                hot = true;
            }
            PageOrigin::GuestWrite | PageOrigin::Scan => {}
        }
        match (&mut self.stage, data) {
            (Some(stage), Some(d)) => stage.page(key.ram_block, key.page, d)?,
            (Some(stage), None) => stage.zero(key.ram_block, key.page),
            // Guest-written pages go to hot locality blocks (format v2).
            (None, Some(d)) if hot => writer.add_hot_page(key.ram_block, key.page, d)?,
            (None, Some(d)) => writer.add_page(key.ram_block, key.page, d)?,
            (None, None) => writer.add_zero_page(key.ram_block, key.page)?,
        }
        Ok(())
    }

    fn device_state(&mut self, data: &[u8]) -> Result<(), CaptureError> {
        let writer = self.writer.as_mut().ok_or(CaptureError::NoRam)?;
        writer.set_device_state(data)?;
        self.device_state_bytes = Some(data.len() as u64);
        Ok(())
    }

    fn progress(&self, phase: Phase, stream_bytes: u64) -> CaptureProgress {
        let (written, image_bytes) = self.writer.as_ref().map_or((0, 0), |w| {
            (w.pages_stored() + w.pages_zero(), w.memory_bytes())
        });
        CaptureProgress {
            phase,
            stream_bytes,
            page_records: self.page_records,
            pages_written: written,
            image_bytes,
            elapsed: self.started.elapsed(),
        }
    }

    /// The stream has ended: write staged pages, set the metrics.
    fn finish(
        mut self,
        stream_bytes: u64,
        first_byte: Option<Instant>,
        progress: &mut dyn FnMut(&CaptureProgress),
    ) -> Result<Captured, CaptureError> {
        let stream_end = self.stream_end.unwrap_or_else(Instant::now);
        let mut writer = self.writer.take().ok_or(CaptureError::NoRam)?;
        // The reader always yields DeviceState before End; the writer
        // would refuse to commit without one anyway.
        let device_state_bytes = self.device_state_bytes.unwrap_or(0);
        if let (Some(stage), Some(source)) = (self.stage.as_mut(), &self.opts.final_ram) {
            let outcome = check_final_ram(stage, &self.block_names, source.0.as_ref());
            source.0.checked(outcome.as_ref());
            let report = outcome?;
            let m = writer.metrics_mut();
            m.other.insert(
                metric::PRECOPY_PAGES_CHECKED.into(),
                Value::from(report.pages_checked),
            );
            m.other.insert(
                metric::PRECOPY_PAGES_PATCHED.into(),
                Value::from(report.pages_patched),
            );
        }
        if let Some(stage) = self.stage.take() {
            let interval = self.opts.progress_interval_bytes;
            let (started, page_records) = (self.started, self.page_records);
            stage.drain_into(&mut writer, interval, &mut |w| {
                progress(&CaptureProgress {
                    phase: Phase::WritingImage,
                    stream_bytes,
                    page_records,
                    pages_written: w.pages_stored() + w.pages_zero(),
                    image_bytes: w.memory_bytes(),
                    elapsed: started.elapsed(),
                })
            })?;
        }
        let now = Instant::now();
        let first = first_byte.unwrap_or(stream_end);
        let stats = CaptureStats {
            mode: self.opts.mode,
            stream_bytes,
            page_records: self.page_records,
            pages_resent: self.pages_resent,
            pages_guest_written: self.pages_guest_written,
            pages_stored: writer.pages_stored(),
            pages_zero: writer.pages_zero(),
            device_state_bytes,
            wait_first_byte: first.saturating_duration_since(self.started),
            stream_time: stream_end.saturating_duration_since(first),
            finish_time: now.saturating_duration_since(stream_end),
            total_time: now.saturating_duration_since(self.started),
        };
        let m = writer.metrics_mut();
        m.pages_guest_written = Some(stats.pages_guest_written);
        let ms = |d: Duration| Value::from(d.as_millis() as u64);
        m.other
            .insert(metric::STREAM_BYTES.into(), Value::from(stream_bytes));
        m.other
            .insert(metric::CAPTURE_STREAM_MS.into(), ms(stats.stream_time));
        m.other
            .insert(metric::CAPTURE_MS.into(), ms(stats.total_time));
        m.other
            .insert(metric::PAGES_RESENT.into(), Value::from(stats.pages_resent));
        let captured = Captured { writer, stats };
        progress(&CaptureProgress {
            phase: Phase::Done,
            stream_bytes,
            page_records: captured.stats.page_records,
            pages_written: captured.stats.pages_stored + captured.stats.pages_zero,
            image_bytes: captured.writer.memory_bytes(),
            elapsed: self.started.elapsed(),
        });
        Ok(captured)
    }
}
