//! Write an image, read everything back.

mod common;

use common::*;
use vmcsnap_image::{
    Image, ImageWriter, PageKey, PageState, WriteError, WriterOptions, FORMAT_V1, TRACE_FAFL,
};

#[test]
fn round_trip_everything_v1() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("snap1");
    let committed = build_v1(&dir);
    assert_eq!(committed.path, dir);

    let img = Image::open(&dir).unwrap();
    assert_eq!(img.version(), FORMAT_V1);
    assert!(img.manifest().storage.is_none());
    let m = img.manifest();
    assert_eq!(m, &committed.manifest);
    assert_eq!(m.vm.name, "a");
    assert_eq!(m.vm.config["cpus"], 1);
    assert_eq!(m.qemu.machine, "microvm");
    assert_eq!(m.disks[0].node, "disk0");
    assert_eq!(m.labels["cluster"], "c1");
    assert_eq!(img.ram_block_id("vga"), Some(1));
    assert_eq!(img.ram_block_pages(0), 50);

    // Every page reads back as written.
    let mut buf = vec![0xAAu8; PS];
    let (mut stored, mut zero) = (0u64, 0u64);
    for r in 0..2u32 {
        for p in 0..img.ram_block_pages(r) {
            let k = PageKey::new(r, p);
            let st = img.read_page(k, &mut buf).unwrap();
            match page_content(k) {
                Some(d) => {
                    assert!(matches!(st, PageState::Stored(_)), "{k:?}");
                    assert_eq!(buf, d, "{k:?}");
                    stored += 1;
                }
                None => {
                    assert_eq!(st, PageState::Zero, "{k:?}");
                    assert!(buf.iter().all(|&b| b == 0));
                    assert!(img.zero_bitmap(r).unwrap().is_zero(p));
                    zero += 1;
                }
            }
        }
    }
    let stats = img.stats();
    assert_eq!(
        (stats.pages_stored, stats.pages_zero, stats.pages_absent),
        (stored, zero, 0)
    );
    assert_eq!(stats.pages_total, 62);
    assert_eq!(stats.blocks as u64, stored.div_ceil(8));
    assert_eq!(stats.device_state_bytes, DEVICE.len() as u64);

    // Metrics: the writer's own plus the caller's, unknown ones kept.
    let mt = &m.metrics;
    assert_eq!(mt.downtime_ms, Some(4));
    assert_eq!(mt.duration_ms, Some(120));
    assert_eq!(mt.disk_snapshot_ms, Some(2));
    assert_eq!(mt.pages_total, Some(62));
    assert_eq!(mt.pages_zero, Some(zero));
    assert_eq!(mt.pages_guest_written, Some(5));
    assert_eq!(mt.other["wss_sampled_pages"], 1234);
    let files: u64 = m.files.all().iter().map(|(_, f)| f.size).sum();
    assert_eq!(mt.bytes_written, Some(files));

    // Traces.
    let (order, fafl) = arrival_order(&[50, 12]);
    assert_eq!(img.fafl(), fafl.as_slice());
    assert_eq!(img.trace(TRACE_FAFL).unwrap(), fafl.as_slice());
    assert_eq!(
        img.trace("restore-1").unwrap(),
        &[PageKey::new(0, 3), PageKey::new(0, 4)]
    );
    assert_eq!(img.trace_sections().len(), 2);

    // Blocks hold the non-zero pages in arrival order.
    let nonzero: Vec<PageKey> = order
        .iter()
        .copied()
        .filter(|k| page_content(*k).is_some())
        .collect();
    let mut seen = Vec::new();
    for b in img.iter_blocks() {
        let b = b.unwrap();
        for (k, data) in b.iter() {
            assert_eq!(Some(data.to_vec()), page_content(k));
            seen.push(k);
        }
    }
    assert_eq!(seen, nonzero);
    assert_eq!(img.device_state().unwrap(), DEVICE);
    let report = img.verify();
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.pages_checked, stored);
}

#[test]
fn read_plans_merge_and_read_back_v1() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    build_v1(&dir);
    let img = Image::open(&dir).unwrap();
    let fafl = img.fafl().to_vec();
    // The FAFL pages were written first: they sit in the first block.
    assert_eq!(img.blocks_for(&fafl).unwrap(), vec![0]);
    let mut want: Vec<PageKey> = (0..50).map(|p| PageKey::new(0, p)).collect();
    want.push(PageKey::new(0, 7)); // a repeat
    let plan = img.plan_reads(&want, 0, 1 << 20).unwrap();
    assert_eq!(plan.zero.len(), 10);
    assert!(plan.absent.is_empty() && plan.whole_blocks.is_empty());
    // Contiguous pages merge, the block headers between blocks split extents.
    assert!(plan.extents.len() < 40, "{}", plan.extents.len());
    let mut offsets: Vec<u64> = plan.extents.iter().map(|e| e.offset).collect();
    offsets.sort();
    assert_eq!(
        offsets,
        plan.extents.iter().map(|e| e.offset).collect::<Vec<_>>()
    );
    let mut n = 0;
    let mut buf = Vec::new();
    for e in &plan.extents {
        img.read_extent(e, &mut buf).unwrap();
        for &(k, at, _) in &e.pages {
            assert_eq!(
                Some(buf[at as usize..at as usize + PS].to_vec()),
                page_content(k)
            );
            n += 1;
        }
    }
    assert_eq!(n, 40);
    // A gap allowance wide enough to read through block headers: one extent.
    let plan = img.plan_reads(&want, 4096, 1 << 30).unwrap();
    assert_eq!(plan.extents.len(), 1);
    // And an extent cap splits it again.
    let plan = img.plan_reads(&want, 4096, 8 * PS as u64).unwrap();
    assert!(plan.extents.iter().all(|e| e.len <= 8 * PS as u64));
    assert_eq!(
        plan.extents.iter().map(|e| e.pages.len()).sum::<usize>(),
        40
    );
}

#[test]
fn flush_block_ends_blocks_early() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let opts = WriterOptions {
        pages_per_block: 64,
        require_complete: false,
        ..Default::default()
    };
    let mut w = ImageWriter::create_with(&dir, meta(&[("mem", 100 * PS as u64)]), opts).unwrap();
    for p in [1u32, 2, 3] {
        w.add_page(0, p, &[p as u8; PS]).unwrap();
    }
    w.flush_block().unwrap();
    w.flush_block().unwrap(); // empty: no block
    for p in 10..80 {
        w.add_page(0, p, &[p as u8; PS]).unwrap();
    }
    w.set_device_state(b"").unwrap();
    w.commit().unwrap();
    let img = Image::open(&dir).unwrap();
    let counts: Vec<u16> = img.blocks().iter().map(|b| b.page_count).collect();
    assert_eq!(counts, vec![3, 64, 6]);
    assert_eq!(img.stats().pages_absent, 100 - 73);
    let mut buf = vec![7u8; PS];
    assert_eq!(
        img.read_page(PageKey::new(0, 0), &mut buf).unwrap(),
        PageState::Absent
    );
    assert!(img.read_page(PageKey::new(0, 100), &mut buf).is_err());
    assert!(img.read_page(PageKey::new(1, 0), &mut buf).is_err());
    assert!(img.read_page(PageKey::new(0, 1), &mut buf[..10]).is_err());
    // Every block and CRC is fine, but no restore can send the absent
    // pages: verify names them.
    let r = img.verify();
    assert!(r.bad_blocks.is_empty() && r.other.is_empty(), "{r}");
    assert_eq!(r.bad_pages_total, 100 - 73, "{r}");
    assert!(r.to_string().contains("page 0:0 is absent"), "{r}");
    assert!(img.device_state().unwrap().is_empty());
    assert!(img.fafl().is_empty());
}

#[test]
fn writer_rejects_misuse() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let mut w = ImageWriter::create(&dir, meta(&[("mem", 4 * PS as u64)])).unwrap();
    w.add_page(0, 1, &[1u8; PS]).unwrap();
    w.add_zero_page(0, 2).unwrap();
    assert!(matches!(
        w.add_page(0, 1, &[1u8; PS]),
        Err(WriteError::DuplicatePage(_))
    ));
    assert!(matches!(
        w.add_page(0, 2, &[1u8; PS]),
        Err(WriteError::DuplicatePage(_))
    ));
    assert!(matches!(
        w.add_zero_page(0, 1),
        Err(WriteError::DuplicatePage(_))
    ));
    assert!(matches!(
        w.add_page(0, 4, &[1u8; PS]),
        Err(WriteError::PageOutOfRange { .. })
    ));
    assert!(matches!(
        w.add_page(3, 0, &[1u8; PS]),
        Err(WriteError::UnknownRamBlock(3))
    ));
    assert!(matches!(
        w.add_page(0, 0, &[1u8; 100]),
        Err(WriteError::PageSize { .. })
    ));
    assert!(matches!(
        w.trace_push(PageKey::new(0, 9)),
        Err(WriteError::Trace(_))
    ));
    assert!(w.add_trace_section("", vec![]).is_err());
    w.add_trace_section("x", vec![]).unwrap();
    assert!(w.add_trace_section("x", vec![]).is_err());
    // Existing final directory.
    assert!(matches!(
        ImageWriter::create(&dir, meta(&[("mem", 4096)])).map(|_| ()),
        Ok(())
    ));
    std::fs::create_dir(tmp.path().join("taken")).unwrap();
    assert!(matches!(
        ImageWriter::create(&tmp.path().join("taken"), meta(&[])),
        Err(WriteError::Exists(_))
    ));
    assert!(matches!(
        ImageWriter::create(&tmp.path().join("a.tmp-1"), meta(&[])),
        Err(WriteError::InvalidMeta(_))
    ));
    let mut bad = meta(&[]);
    bad.page_size = 1000;
    assert!(matches!(
        ImageWriter::create(&tmp.path().join("b"), bad),
        Err(WriteError::InvalidMeta(_))
    ));
    assert!(ImageWriter::create(&tmp.path().join("c"), meta(&[("m", 1), ("m", 1)])).is_err());
    // Commit needs device state, then every page.
    let mut w2 =
        ImageWriter::create(&tmp.path().join("d"), meta(&[("mem", 4 * PS as u64)])).unwrap();
    w2.add_page(0, 0, &[1u8; PS]).unwrap();
    w2.set_device_state(b"x").unwrap();
    assert!(w2.set_device_state(b"x").is_err());
    let err = w2.commit().unwrap_err();
    assert!(
        matches!(err, WriteError::Incomplete { missing: 3, first } if first == PageKey::new(0, 1)),
        "{err}"
    );
    assert!(!tmp.path().join("d").exists());
    let w3 = ImageWriter::create(&tmp.path().join("e"), meta(&[])).unwrap();
    assert!(matches!(w3.commit(), Err(WriteError::MissingDeviceState)));
    // An empty VM (no RAM) is still a valid image.
    let mut w4 = ImageWriter::create(&tmp.path().join("f"), meta(&[])).unwrap();
    w4.set_device_state(b"d").unwrap();
    w4.commit().unwrap();
    let img = Image::open(&tmp.path().join("f")).unwrap();
    assert_eq!(img.stats().pages_total, 0);
    assert!(img.verify().is_ok());
    drop(w);
}

#[test]
fn image_is_shared_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Image>();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    build(&dir);
    let img = Image::open(&dir).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let img = &img;
            s.spawn(move || {
                let mut buf = vec![0u8; PS];
                for p in (t..50).step_by(4) {
                    let k = PageKey::new(0, p);
                    img.read_page(k, &mut buf).unwrap();
                    assert_eq!(page_content(k).unwrap_or_else(|| vec![0; PS]), buf);
                }
            });
        }
    });
}

#[test]
fn errors_say_what_to_do() {
    let tmp = tempfile::tempdir().unwrap();
    let e = Image::open(&tmp.path().join("missing")).unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
    let dir = tmp.path().join("s");
    build(&dir);
    std::fs::write(dir.join("pages.idx"), b"VMCSNIDX\x07\x00\x00\x00").unwrap();
    let e = Image::open(&dir).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("pages.idx") && msg.contains("use a vmcsnap release"),
        "{msg}"
    );
}
