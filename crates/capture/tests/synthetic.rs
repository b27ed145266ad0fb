//! Edge cases with synthetic streams (built by `common::encoder`): the
//! FAFL trace and arrival order of a background snapshot, last-copy-wins
//! for precopy, re-sent pages in the direct modes, every truncation,
//! I/O errors, progress, and the options checks. The real-QEMU tests are
//! in `live_qemu.rs`.

mod common;

use std::collections::BTreeMap;
use std::io::{self, Read};

use common::encoder::{page_of, Encoder, PAGE};
use common::{assert_nothing_left, capture_bytes, check_pages, Expect};
use vmcsnap_capture::{
    capture, metric, CaptureError, CaptureMode, CaptureOptions, CaptureProgress, Phase,
    DEVICE_STATE_FORMAT, SCRATCH_NAME,
};
use vmcsnap_image::{Image, PageKey, PageState, TRACE_FAFL};
use vmcsnap_migstream::StreamError;

/// Expected content per (RAM block, page).
type Pages = BTreeMap<(u32, u32), Expect>;

/// A background snapshot of blocks "ram0" (8 pages) and "rom" (2 pages):
/// the scan saves 0, 1; the guest writes 5 (data), then 3 (a zero page);
/// the scan continues after 3 with 4, 6, 7, rom 0, rom 1 and wraps to 2.
/// Page 6 is a ZERO record with fill 0x11 (stored as data).
/// Returns the stream, its device state and what every page must be.
fn bgsnap_stream() -> (Vec<u8>, Vec<u8>, Pages) {
    let mut e = Encoder::new();
    e.config("microvm")
        .ram_setup(3, &[("ram0", 8 * PAGE), ("rom", 2 * PAGE)]);
    let mut want = BTreeMap::new();
    let mut data = |e: &mut Encoder, block: &str, rb: u32, p: u64| {
        let d = page_of(0x40 + p as u8, rb * 100 + p as u32);
        e.page(block, p, &d);
        want.insert((rb, p as u32), Expect::Data(d));
    };
    e.part(3);
    data(&mut e, "ram0", 0, 0);
    data(&mut e, "ram0", 0, 1);
    data(&mut e, "ram0", 0, 5); // guest write
    e.eos(3).part(3);
    e.zero("ram0", 3); // guest write (zero page)
    data(&mut e, "ram0", 0, 4); // scan continues after 3
    e.fill("ram0", 6, 0x11);
    data(&mut e, "ram0", 0, 7);
    data(&mut e, "rom", 1, 0);
    e.zero("rom", 1);
    e.eos(3).part(3);
    data(&mut e, "ram0", 0, 2); // wrapped
    e.eos(3);
    let device = e.finish();
    want.insert((0, 3), Expect::Zero);
    want.insert((0, 6), Expect::Data(vec![0x11; PAGE as usize]));
    want.insert((1, 1), Expect::Zero);
    (e.buf, device, want)
}

fn opts(mode: CaptureMode) -> CaptureOptions {
    let mut o = CaptureOptions::new(mode, "vm-a");
    o.qemu_version = "7.2.22".into();
    o.vm_config = serde_json::json!({"memory_mib": 16});
    o
}

#[test]
fn background_snapshot_writes_pages_trace_and_device_state() {
    let (stream, device, want) = bgsnap_stream();
    let root = tempfile::tempdir().unwrap();
    let captured = capture_bytes(
        &stream,
        root.path(),
        "s1",
        opts(CaptureMode::BackgroundSnapshot),
    )
    .expect("capture");
    assert_eq!(captured.stats().pages_guest_written, 2);
    assert_eq!(captured.stats().page_records, 10);
    assert_eq!(captured.stats().pages_resent, 0);
    assert!(list_is_empty_of_valid(root.path()), "visible before commit");
    let c = captured.commit().expect("commit");
    assert_eq!(c.path, root.path().join("s1"));

    let img = Image::open(&c.path).unwrap();
    check_pages(&img, &want);
    assert_eq!(img.device_state().unwrap(), device);
    assert_eq!(
        img.trace(TRACE_FAFL).unwrap(),
        &[PageKey::new(0, 5), PageKey::new(0, 3)]
    );
    let m = img.manifest();
    assert_eq!(m.qemu.machine, "microvm");
    assert_eq!(m.qemu.version, "7.2.22");
    assert_eq!(m.vm.name, "vm-a");
    assert_eq!(m.vm.config["memory_mib"], 16);
    assert_eq!(m.device_state_format, DEVICE_STATE_FORMAT);
    assert_eq!(m.labels["capture_mode"], "background-snapshot");
    let names: Vec<_> = m.ram_blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["ram0", "rom"]);
    assert_eq!(m.metrics.pages_total, Some(10));
    assert_eq!(m.metrics.pages_zero, Some(2));
    assert_eq!(m.metrics.pages_guest_written, Some(2));
    assert_eq!(m.metrics.other[metric::STREAM_BYTES], stream.len() as u64);
    let on_disk: u64 = m.files.all().iter().map(|(_, f)| f.size).sum();
    assert_eq!(m.metrics.bytes_written, Some(on_disk));

    // Arrival order in the memory image: 0, 1, 5, 4, 6, 7, rom 0, 2.
    let order: Vec<(u32, u32)> = [
        (0, 0),
        (0, 1),
        (0, 5),
        (0, 4),
        (0, 6),
        (0, 7),
        (1, 0),
        (0, 2),
    ]
    .into_iter()
    .collect();
    // Format 2: the guest-written pages (the FAFL trace) sit in hot
    // blocks in the order written, the others in cold blocks in arrival
    // order.
    let fafl = img.fafl().to_vec();
    assert_eq!(fafl.len(), 2);
    for hot in [true, false] {
        let mut positions = Vec::new();
        for &(rb, p) in &order {
            let k = PageKey::new(rb, p);
            if fafl.contains(&k) != hot {
                continue;
            }
            match img.locate(k).unwrap() {
                PageState::Stored(loc) => {
                    assert_eq!(img.blocks()[loc.block as usize].is_hot(), hot, "{k:?}");
                    positions.push((loc.block, loc.slot));
                }
                s => panic!("{rb}:{p} is {s:?}"),
            }
        }
        let mut sorted = positions.clone();
        sorted.sort();
        assert_eq!(positions, sorted, "hot={hot}: pages not in arrival order");
    }
}

fn list_is_empty_of_valid(root: &std::path::Path) -> bool {
    vmcsnap_image::list_snapshots(root)
        .unwrap()
        .iter()
        .all(|e| !e.is_valid())
}

/// A precopy stream of "ram0" (8 pages): a first round of every page,
/// then re-sends that change data to data, data to zero, zero to data,
/// a page twice in one round, and a zero record for a page still in the
/// stage's pending run followed by its data again.
fn precopy_stream() -> (Vec<u8>, Pages) {
    let mut e = Encoder::new();
    e.config("pc-i440fx-7.2")
        .ram_setup(2, &[("ram0", 8 * PAGE)]);
    e.part(2);
    for p in 0..8u64 {
        if p == 2 || p == 6 {
            e.zero("ram0", p);
        } else {
            e.page("ram0", p, &page_of(1, p as u32));
        }
    }
    e.eos(2).part(2);
    e.page("ram0", 3, &page_of(2, 3)); // data -> data
    e.zero("ram0", 1); // data -> zero
    e.page("ram0", 2, &page_of(2, 2)); // zero -> data
    e.page("ram0", 3, &page_of(3, 3)); // twice in one round
    e.eos(2).end_section(2);
    e.page("ram0", 4, &page_of(4, 4));
    e.page("ram0", 5, &page_of(4, 5)); // run 4..5 pending
    e.zero("ram0", 4); // zero while its data is in the pending run
    e.page("ram0", 7, &page_of(4, 7));
    e.zero("ram0", 7);
    e.page("ram0", 7, &page_of(5, 7)); // zero -> data again
    e.eos(2);
    e.finish();
    let mut want = BTreeMap::new();
    want.insert((0, 0), Expect::Data(page_of(1, 0)));
    want.insert((0, 1), Expect::Zero);
    want.insert((0, 2), Expect::Data(page_of(2, 2)));
    want.insert((0, 3), Expect::Data(page_of(3, 3)));
    want.insert((0, 4), Expect::Zero);
    want.insert((0, 5), Expect::Data(page_of(4, 5)));
    want.insert((0, 6), Expect::Zero);
    want.insert((0, 7), Expect::Data(page_of(5, 7)));
    (e.buf, want)
}

#[test]
fn precopy_keeps_the_last_copy_of_each_page() {
    let (stream, want) = precopy_stream();
    let root = tempfile::tempdir().unwrap();
    let captured =
        capture_bytes(&stream, root.path(), "s", opts(CaptureMode::Precopy)).expect("capture");
    assert_eq!(captured.stats().pages_resent, 10);
    assert_eq!(captured.stats().page_records, 18);
    assert!(
        !captured.temp_path().join(SCRATCH_NAME).exists(),
        "scratch file left in the image"
    );
    let c = captured.commit().unwrap();
    assert_eq!(c.manifest.metrics.other[metric::PAGES_RESENT], 10);
    assert_eq!(c.manifest.labels["capture_mode"], "precopy");
    let img = Image::open(&c.path).unwrap();
    check_pages(&img, &want);
    assert!(img.fafl().is_empty());
    let files: Vec<_> = std::fs::read_dir(&c.path)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(!files.contains(&SCRATCH_NAME.to_string()), "{files:?}");
}

#[test]
fn precopy_mode_also_captures_single_copy_streams() {
    let (stream, _, want) = bgsnap_stream();
    let root = tempfile::tempdir().unwrap();
    let c = capture_bytes(&stream, root.path(), "s", opts(CaptureMode::Precopy))
        .unwrap()
        .commit()
        .unwrap();
    let img = Image::open(&c.path).unwrap();
    check_pages(&img, &want);
    // Out-of-order pages are a FAFL trace only in a background snapshot.
    assert!(img.fafl().is_empty());
}

#[test]
fn a_resent_page_fails_direct_modes_and_leaves_nothing() {
    let (stream, _) = precopy_stream();
    for mode in [CaptureMode::BackgroundSnapshot, CaptureMode::StopCopy] {
        let root = tempfile::tempdir().unwrap();
        let err = capture_bytes(&stream, root.path(), "s", opts(mode)).unwrap_err();
        match &err {
            CaptureError::PageResent {
                block,
                offset,
                mode: m,
            } => {
                assert_eq!((block.as_str(), *offset, *m), ("ram0", 3 * PAGE, mode));
            }
            e => panic!("{mode}: expected PageResent, got {e}"),
        }
        assert!(err.to_string().contains("CaptureMode::Precopy"), "{err}");
        assert_nothing_left(root.path());
    }
}

#[test]
fn every_truncation_fails_and_leaves_nothing() {
    let streams = [
        (bgsnap_stream().0, CaptureMode::BackgroundSnapshot),
        (precopy_stream().0, CaptureMode::Precopy),
    ];
    for (stream, mode) in streams {
        let len = stream.len();
        let mut cuts = 0;
        for cut in 0..len {
            // Every byte outside page payloads, a sample inside them.
            if cut % PAGE as usize > 64 && cut % 509 != 0 && cut + 600 < len {
                continue;
            }
            cuts += 1;
            let root = tempfile::tempdir().unwrap();
            match capture_bytes(&stream[..cut], root.path(), "s", opts(mode)) {
                Err(CaptureError::Stream(_)) => {}
                Err(e) => panic!("{mode}, cut at {cut}/{len}: not a stream error: {e}"),
                Ok(_) => panic!("{mode}: stream cut at {cut} of {len} bytes was accepted"),
            }
            assert_nothing_left(root.path());
        }
        assert!(cuts > 500, "{cuts}");
    }
}

/// Returns its bytes, then an error.
struct FailingReader<'a> {
    data: &'a [u8],
}

impl Read for FailingReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.data.is_empty() {
            return Err(io::Error::new(io::ErrorKind::ConnectionReset, "peer reset"));
        }
        let n = buf.len().min(self.data.len()).min(1000);
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

#[test]
fn an_io_error_fails_and_leaves_nothing() {
    let (stream, _) = precopy_stream();
    for mode in [CaptureMode::StopCopy, CaptureMode::Precopy] {
        let root = tempfile::tempdir().unwrap();
        let r = FailingReader {
            data: &stream[..stream.len() / 2],
        };
        let err = capture(r, &root.path().join("s"), opts(mode), &mut |_| {}).unwrap_err();
        assert!(
            matches!(err, CaptureError::Stream(StreamError::Io { .. })),
            "{err:?}"
        );
        assert_nothing_left(root.path());
    }
}

#[test]
fn progress_is_reported_through_the_capture() {
    for mode in [CaptureMode::StopCopy, CaptureMode::Precopy] {
        let root = tempfile::tempdir().unwrap();
        let mut o = opts(mode);
        o.progress_interval_bytes = 2 * PAGE;
        let mut reports: Vec<CaptureProgress> = Vec::new();
        // The precopy stream re-sends pages, which stop-copy refuses.
        let stream = match mode {
            CaptureMode::Precopy => precopy_stream().0,
            _ => bgsnap_stream().0,
        };
        let c = capture(&stream[..], &root.path().join("s"), o, &mut |p| {
            reports.push(p.clone())
        })
        .unwrap();
        let receiving: Vec<_> = reports
            .iter()
            .filter(|p| p.phase == Phase::Receiving)
            .collect();
        assert!(receiving.len() >= 3, "{mode}: {reports:?}");
        assert!(receiving
            .windows(2)
            .all(|w| w[1].stream_bytes >= w[0].stream_bytes + 2 * PAGE));
        let last = reports.last().unwrap();
        assert_eq!(last.phase, Phase::Done);
        assert_eq!(last.stream_bytes, stream.len() as u64);
        assert_eq!(
            last.pages_written,
            c.stats().pages_stored + c.stats().pages_zero
        );
        let writing = reports
            .iter()
            .filter(|p| p.phase == Phase::WritingImage)
            .count();
        if mode == CaptureMode::Precopy {
            assert!(writing >= 2, "{reports:?}");
        } else {
            assert_eq!(writing, 0);
        }
    }
}

/// A reader that must not be read.
struct Untouchable;

impl Read for Untouchable {
    fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
        panic!("the stream was read although the target is unusable");
    }
}

#[test]
fn an_unusable_target_fails_before_reading() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("taken")).unwrap();
    let o = || opts(CaptureMode::StopCopy);
    let err = capture(Untouchable, &root.path().join("taken"), o(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, CaptureError::Exists(_)), "{err}");
    let err = capture(Untouchable, &root.path().join("no/such"), o(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, CaptureError::Target { .. }), "{err}");
    // A snapshot name the image format refuses (it contains ".tmp-").
    let (stream, _, _) = bgsnap_stream();
    let err = capture_bytes(&stream, root.path(), "a.tmp-1", o()).unwrap_err();
    assert!(matches!(err, CaptureError::Image(_)), "{err}");
    let names: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["taken"]);
}

#[test]
fn machine_comes_from_the_stream_or_the_options() {
    // No configuration section, no footers, no vmdesc (send-configuration=off).
    let mut e = Encoder::new();
    e.footers = false;
    e.ram_setup(2, &[("pc.ram", 2 * PAGE)]);
    e.part(2)
        .page("pc.ram", 0, &page_of(9, 0))
        .zero("pc.ram", 1)
        .eos(2);
    e.device(3, "cpu", &[1, 2, 3]).eof();
    let stream = e.buf;
    let root = tempfile::tempdir().unwrap();
    let err = capture_bytes(&stream, root.path(), "s", opts(CaptureMode::StopCopy)).unwrap_err();
    assert!(matches!(err, CaptureError::UnknownMachine), "{err}");
    assert_nothing_left(root.path());

    let mut o = opts(CaptureMode::StopCopy);
    o.machine = Some("pc-i440fx-2.3".into());
    let c = capture_bytes(&stream, root.path(), "s", o)
        .unwrap()
        .commit()
        .unwrap();
    assert_eq!(c.manifest.qemu.machine, "pc-i440fx-2.3");

    // Options override the stream's machine.
    let (stream, _, _) = bgsnap_stream();
    let mut o = opts(CaptureMode::BackgroundSnapshot);
    o.machine = Some("microvm-custom".into());
    let c = capture_bytes(&stream, root.path(), "t", o)
        .unwrap()
        .commit()
        .unwrap();
    assert_eq!(c.manifest.qemu.machine, "microvm-custom");
}

#[test]
fn caller_metrics_and_abort() {
    let (stream, _, _) = bgsnap_stream();
    let root = tempfile::tempdir().unwrap();
    let mut captured = capture_bytes(
        &stream,
        root.path(),
        "s",
        opts(CaptureMode::BackgroundSnapshot),
    )
    .unwrap();
    captured.metrics_mut().downtime_ms = Some(7);
    captured.metrics_mut().disk_snapshot_ms = Some(3);
    let c = captured.commit().unwrap();
    let m = Image::open(&c.path).unwrap().manifest().metrics.clone();
    assert_eq!((m.downtime_ms, m.disk_snapshot_ms), (Some(7), Some(3)));
    assert!(m.other.contains_key(metric::CAPTURE_MS));
    assert!(m.other.contains_key(metric::CAPTURE_STREAM_MS));

    let root = tempfile::tempdir().unwrap();
    let captured = capture_bytes(
        &stream,
        root.path(),
        "s",
        opts(CaptureMode::BackgroundSnapshot),
    )
    .unwrap();
    assert!(captured.temp_path().is_dir());
    captured.abort();
    assert_nothing_left(root.path());
}

#[test]
fn a_stream_without_ram_is_refused() {
    // Configuration and device state, no "ram" section at all.
    let mut e = Encoder::new();
    e.config("microvm");
    e.finish();
    let root = tempfile::tempdir().unwrap();
    let err = capture_bytes(&e.buf, root.path(), "s", opts(CaptureMode::StopCopy)).unwrap_err();
    assert!(matches!(err, CaptureError::NoRam), "{err}");
    assert_nothing_left(root.path());
}
