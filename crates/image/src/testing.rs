//! Helpers for robustness tests and fuzzing (not needed by normal users).
//!
//! [`reseal`] recomputes the CRCs of a deliberately damaged file so the
//! damage reaches the structural checks behind the CRCs; [`exercise`]
//! opens an image and calls every read operation on it.
//! [`reseal_channel_log`] and [`exercise_channel_log`] do the same for a
//! cluster snapshot's channel-state file, and
//! [`sample_cluster_manifest`] and [`exercise_cluster_manifest`] give and
//! check a cluster manifest (`cluster.json`). [`write_small_snapshot`]
//! writes a tiny committed snapshot for tests of snapshot directories.

use std::path::Path;

use crate::channel_log::FrameReason;
use crate::channel_log::{
    encode_channel_log, parse_channel_log, ChannelFrame, ChannelLogError, CHANNEL_HEADER_LEN,
    CHANNEL_TRAILER_LEN, MAX_CHANNEL_HEADER_LEN, RECORD_MAGIC, TRAILER_MAGIC,
};
use crate::cluster::{
    edges_from_frames, ChannelStateRef, ClusterError, ClusterManifest, ClusterVm, Timeline,
    CHANNEL_LOG, VMS_DIR,
};
use crate::error::ReadError;
use crate::format::{
    get_u16, get_u32, put_u32, FileKind, BLOCK_ENTRY_LEN, BLOCK_HEADER_LEN, BLOCK_MAGIC,
    FILE_HEADER_LEN,
};
use crate::manifest::MAX_MANIFEST_HEADER;
use crate::reader::{Image, PageState};
use crate::PageKey;

/// Recomputes every CRC of `data`, a file of kind `kind`, as far as its
/// (possibly damaged) structure allows; leaves everything else alone.
pub fn reseal(kind: FileKind, data: &mut Vec<u8>) {
    if kind == FileKind::Manifest {
        let head = &data[..data.len().min(MAX_MANIFEST_HEADER)];
        let Some(nl) = head.iter().position(|&c| c == b'\n') else {
            return;
        };
        let line = String::from_utf8_lossy(&head[..nl]).into_owned();
        let mut parts = line.splitn(3, ' ');
        let (Some(magic), Some(version)) = (parts.next(), parts.next()) else {
            return;
        };
        let body = data.split_off(nl + 1);
        let head = format!(
            "{magic} {version} len={} crc32c={:08x}\n",
            body.len(),
            crc32c::crc32c(&body)
        );
        *data = [head.into_bytes(), body].concat();
        return;
    }
    if data.len() < FILE_HEADER_LEN {
        return;
    }
    let header_len = get_u32(data, 12) as usize;
    if header_len < FILE_HEADER_LEN || header_len > data.len() {
        return;
    }
    if kind == FileKind::Memory {
        let mut pos = header_len;
        while pos + BLOCK_HEADER_LEN <= data.len() && data[pos..pos + 4] == BLOCK_MAGIC {
            let pages = usize::from(get_u16(data, pos + 8));
            let total =
                BLOCK_HEADER_LEN + pages * BLOCK_ENTRY_LEN + get_u32(data, pos + 12) as usize;
            if pos + total > data.len() {
                break;
            }
            let crc = crc32c::crc32c_append(
                crc32c::crc32c(&data[pos..pos + BLOCK_HEADER_LEN - 4]),
                &data[pos + BLOCK_HEADER_LEN..pos + total],
            );
            put_u32(data, pos + BLOCK_HEADER_LEN - 4, crc);
            pos += total;
        }
    } else {
        let crc = crc32c::crc32c(&data[header_len..]);
        put_u32(data, 52, crc);
    }
    let crc = crc32c::crc32c(&data[..header_len - 4]);
    put_u32(data, header_len - 4, crc);
}

/// Opens the image in `dir` (and its parents) and calls every read
/// operation on it: verify, every page (resolved through the chain), every
/// block, a whole RAM block, a read plan, the page hashes, the device
/// state and the traces. Returns the first error; must never panic,
/// whatever the files hold.
pub fn exercise(dir: &Path) -> Result<(), ReadError> {
    exercise_with(dir, None)
}

/// [`exercise`] with a reader for the pages stored on frozen disks.
pub fn exercise_with(
    dir: &Path,
    disks: Option<std::sync::Arc<dyn crate::DiskPages>>,
) -> Result<(), ReadError> {
    let img = Image::open_with(dir, disks)?;
    let _ = img.verify().to_string();
    let _ = img.stats();
    let mut first_err = None;
    let mut keep = |r: Result<(), ReadError>| {
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    };
    let mut buf = vec![0u8; img.page_size()];
    let mut keys = Vec::new();
    for r in 0..img.ram_blocks().len() as u32 {
        let _ = img.zero_bitmap(r).map(|z| z.iter().count());
        for p in 0..img.ram_block_pages(r) {
            let k = PageKey::new(r, p);
            keys.push(k);
            keep(img.read_page(k, &mut buf).map(|_| ()));
            if let Ok(PageState::Stored(loc)) = img.locate(k) {
                let _ = loc.offset;
            }
            keep(img.resolve(k).map(|_| ()));
        }
        // Bounded: the RAM block's size is checked against the manifest.
        if u64::from(img.ram_block_pages(r)) * img.page_size() as u64 <= 64 << 20 {
            let mut all = vec![0u8; img.ram_block_pages(r) as usize * img.page_size()];
            keep(img.read_ram_block(r, &mut all).map(|_| ()));
        }
    }
    keep(img.page_hashes().map(|_| ()));
    for b in img.iter_blocks() {
        keep(b.map(|b| {
            let _ = b.iter().count();
        }));
    }
    let mut ext = Vec::new();
    let plan = img.plan_reads(&keys, 1 << 16, 1 << 20)?;
    for e in &plan.extents {
        keep(img.read_extent(e, &mut ext));
    }
    let _ = img.blocks_for(img.fafl())?;
    for s in img.trace_sections() {
        let _ = img.trace(&s.name);
    }
    keep(img.device_state().map(|_| ()));
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Recomputes every CRC of `data`, a (possibly damaged) channel-state
/// file, as far as its structure allows: the header's, each record's that
/// lies within the data, the trailer's. Leaves everything else alone.
pub fn reseal_channel_log(data: &mut [u8]) {
    if data.len() < 16 {
        return;
    }
    let header_len = get_u32(data, 12) as usize;
    if !(CHANNEL_HEADER_LEN..=MAX_CHANNEL_HEADER_LEN).contains(&header_len)
        || header_len > data.len()
    {
        return;
    }
    let crc = crc32c::crc32c(&data[..header_len - 4]);
    put_u32(data, header_len - 4, crc);
    let mut pos = header_len;
    while pos + 4 <= data.len() && data[pos..pos + 4] == RECORD_MAGIC {
        let mut p = pos + 4;
        for _ in 0..2 {
            match data.get(p) {
                Some(&n) => p += 1 + usize::from(n),
                None => return,
            }
        }
        if p + 21 > data.len() {
            return;
        }
        let crc_off = p + 21 + get_u32(data, p + 17) as usize;
        if crc_off + 4 > data.len() {
            return;
        }
        let crc = crc32c::crc32c(&data[pos..crc_off]);
        put_u32(data, crc_off, crc);
        pos = crc_off + 4;
    }
    if pos + CHANNEL_TRAILER_LEN <= data.len() && data[pos..pos + 8] == TRAILER_MAGIC {
        let crc = crc32c::crc32c(&data[pos..pos + 24]);
        put_u32(data, pos + 24, crc);
    }
}

/// Parses `bytes` as a channel-state file (what the `channel_log` fuzz
/// target runs). If that succeeds, the frames must encode again, and
/// re-encoding must give back the same records and trailer (and the same
/// file, if the header is the one this build writes); panics otherwise,
/// which is a bug. Must never panic on a parse error.
pub fn exercise_channel_log(bytes: &[u8]) -> Result<Vec<ChannelFrame>, ChannelLogError> {
    let frames = parse_channel_log(bytes)?;
    let _ = edges_from_frames(&frames);
    let again = match encode_channel_log(&frames) {
        Ok(v) => v,
        Err(e) => panic!("parsed frames do not encode again: {e}"),
    };
    let header_len = get_u32(bytes, 12) as usize;
    assert_eq!(
        again[CHANNEL_HEADER_LEN..],
        bytes[header_len..],
        "re-encoding changed the records or the trailer"
    );
    if bytes[..CHANNEL_HEADER_LEN] == again[..CHANNEL_HEADER_LEN] {
        assert_eq!(again, bytes, "re-encoding changed the file");
    }
    Ok(frames)
}

/// A valid `cluster.json` (three VMs, the edges and channel-state counts of
/// a few frames, nested and floating-point metrics), pretty-printed as
/// [`ClusterManifest::save`] writes it: the input the `cluster_manifest`
/// fuzz target and its unit test mutate.
pub fn sample_cluster_manifest() -> Vec<u8> {
    let vms = ["alpha", "beta", "gamma"];
    let frames: Vec<ChannelFrame> = (0..5usize)
        .map(|i| ChannelFrame {
            sender: vms[i % 3].into(),
            receiver: vms[(i + 1) % 3].into(),
            received_unix_us: 1_000 + i as u64,
            delivered_unix_us: 2_000 + i as u64,
            reason: FrameReason::InFlight,
            data: vec![i as u8; 60 + i * 7],
        })
        .collect();
    let file_size = encode_channel_log(&frames).map_or(0, |v| v.len() as u64);
    let m = ClusterManifest {
        format: ClusterManifest::FORMAT.into(),
        version: ClusterManifest::VERSION,
        name: "demo-1".into(),
        cluster: "demo".into(),
        mode: "hot".into(),
        created_unix_ms: 1_718_031_600_101,
        network: serde_json::json!({"name": "demo", "boot_timeout_s": 120}),
        vms: vms
            .iter()
            .enumerate()
            .map(|(i, vm)| {
                let t = 1_000_000 * i as u64;
                ClusterVm {
                    name: (*vm).into(),
                    snapshot: format!("{VMS_DIR}/{vm}"),
                    memory_mib: 256,
                    ip: format!("10.77.0.{}/24", i + 2),
                    mac: format!("52:54:00:77:00:{:02x}", i + 2),
                    timeline: Timeline {
                        start_us: t,
                        pause_start_us: t + 10,
                        pause_end_us: t + 15,
                        transient_done_us: t + 20,
                        complete_us: t + 100,
                    },
                    metrics: serde_json::json!({"downtime_ms": 8.25, "pages": [1, 2, 3]}),
                }
            })
            .collect(),
        channel_state: ChannelStateRef {
            file: CHANNEL_LOG.into(),
            frames: frames.len() as u64,
            bytes: frames.iter().map(|f| f.data.len() as u64).sum(),
            file_size,
        },
        edges: edges_from_frames(&frames),
        metrics: serde_json::json!({"backoff": {"avg_ms": 0.5, "max_ms": -1e-3}, "ok": true}),
    };
    // Cannot fail: plain strings, numbers and maps.
    serde_json::to_vec_pretty(&m).unwrap_or_default()
}

/// Decodes `bytes` as a cluster manifest, as [`ClusterManifest::load`]
/// does after reading the file (what the `cluster_manifest` fuzz target
/// runs). If that succeeds, the manifest must validate, encode as
/// [`ClusterManifest::save`] does and decode back to the same value, and
/// every path it names must stay inside the cluster snapshot directory;
/// panics otherwise, which is a bug. Must never panic on a decode error.
pub fn exercise_cluster_manifest(bytes: &[u8]) -> Result<ClusterManifest, ClusterError> {
    let file = Path::new("cluster.json");
    let m = ClusterManifest::decode(file, bytes)?;
    if let Err(e) = m.validate() {
        panic!("a decoded manifest does not validate: {e}");
    }
    let again = match serde_json::to_vec_pretty(&m) {
        Ok(v) => v,
        Err(e) => panic!("a decoded manifest does not encode: {e}"),
    };
    match ClusterManifest::decode(file, &again) {
        Ok(back) => assert_eq!(back, m, "re-encoding changed the manifest"),
        Err(e) => panic!("a re-encoded manifest does not decode: {e}"),
    }
    let dir = Path::new("/snapshots/c");
    for vm in &m.vms {
        let path = m.vm_dir(dir, &vm.name).expect("every VM has a directory");
        assert!(
            path.starts_with(dir)
                && path != dir
                && path.components().all(|c| matches!(
                    c,
                    std::path::Component::Normal(_) | std::path::Component::RootDir
                )),
            "VM {:?}: snapshot directory {path:?} is not inside {dir:?}",
            vm.name
        );
    }
    assert_eq!(m.channel_log_path(dir).parent(), Some(dir));
    Ok(m)
}

/// Applies structural edits to the JSON document `doc` (the
/// `cluster_manifest` fuzz target's and unit test's mutator): each 3-byte
/// chunk `[hi, lo, what]` of `edits` replaces value number
/// `u16(hi, lo) % count` of the document (depth first; 0 is the root) by
/// an interesting value chosen by `what` (extreme numbers, floats, path
/// tricks, long names, other types). Returns `doc` unchanged if it is not
/// JSON.
pub fn edit_json(doc: &[u8], edits: &[u8]) -> Vec<u8> {
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(doc) else {
        return doc.to_vec();
    };
    for e in edits.chunks_exact(3) {
        let target = usize::from(u16::from_be_bytes([e[0], e[1]])) % count_values(&v);
        if let Some(slot) = nth_value(&mut v, target) {
            *slot = interesting_value(e[2]);
        }
    }
    serde_json::to_vec(&v).unwrap_or_else(|_| doc.to_vec())
}

fn count_values(v: &serde_json::Value) -> usize {
    1 + match v {
        serde_json::Value::Array(a) => a.iter().map(count_values).sum(),
        serde_json::Value::Object(o) => o.values().map(count_values).sum(),
        _ => 0,
    }
}

fn nth_value(v: &mut serde_json::Value, n: usize) -> Option<&mut serde_json::Value> {
    if n == 0 {
        return Some(v);
    }
    let mut n = n - 1;
    let children: Vec<&mut serde_json::Value> = match v {
        serde_json::Value::Array(a) => a.iter_mut().collect(),
        serde_json::Value::Object(o) => o.values_mut().collect(),
        _ => return None,
    };
    for c in children {
        let size = count_values(c);
        if n < size {
            return nth_value(c, n);
        }
        n -= size;
    }
    None
}

fn interesting_value(what: u8) -> serde_json::Value {
    use serde_json::json;
    match what % 32 {
        0 => json!(0),
        1 => json!(1),
        2 => json!(-1),
        3 => json!(u64::MAX),
        4 => json!(i64::MIN),
        5 => json!(u64::from(u32::MAX) + 1),
        6 => json!(1e308),
        7 => json!(-0.0),
        8 => json!(0.5),
        9 => json!(""),
        10 => json!("."),
        11 => json!(".."),
        12 => json!("/"),
        13 => json!("vms/../.."),
        14 => json!("/etc/passwd"),
        15 => json!("alpha"),
        16 => json!("beta"),
        17 => json!("vms/alpha"),
        18 => json!("cluster.json"),
        19 => json!("channel-state.bin"),
        20 => json!("a".repeat(65)),
        21 => json!("x.tmp-1-2"),
        22 => json!(".hidden"),
        23 => json!("a\u{0}b"),
        24 => json!("vms//alpha/"),
        25 => json!(null),
        26 => json!(true),
        27 => json!([]),
        28 => json!({}),
        29 => json!([{"from": "alpha", "to": "beta", "frames": 1, "bytes": 1}]),
        30 => json!("é"),
        _ => json!(ClusterManifest::FORMAT),
    }
}

/// Writes a small committed per-VM snapshot of VM `vm` at `dir` (4 pages,
/// `disks` as its frozen disks) for tests of what manages directories of
/// snapshots (listing, deleting, pruning). With `created_unix_ms`, the
/// manifest says it was committed then (the writer stamps the time of the
/// commit). Returns its manifest.
pub fn write_small_snapshot(
    dir: &Path,
    vm: &str,
    created_unix_ms: Option<u64>,
    disks: Vec<crate::DiskRef>,
) -> Result<crate::Manifest, crate::WriteError> {
    let meta = crate::ImageMeta {
        vm: crate::VmInfo {
            name: vm.into(),
            config: serde_json::json!({"memory_mib": 1}),
        },
        page_size: 4096,
        ram_blocks: vec![crate::RamBlock {
            name: "pc.ram".into(),
            used_length: 4 * 4096,
        }],
        disks,
        device_state_format: "test".into(),
        ..Default::default()
    };
    let mut w = crate::ImageWriter::create(dir, meta)?;
    for p in 0..4u32 {
        w.add_page(0, p, &[p as u8 + 1; 4096])?;
    }
    w.set_device_state(b"dev")?;
    let mut m = w.commit()?.manifest;
    if let Some(ms) = created_unix_ms {
        m.created_unix_ms = ms;
        let path = dir.join(FileKind::Manifest.default_name());
        std::fs::write(&path, m.encode())
            .map_err(|source| crate::WriteError::Io { path, source })?;
    }
    Ok(m)
}

/// Writes a small committed cluster snapshot named `name` of cluster
/// `cluster` at `dir`: one [`write_small_snapshot`] per VM of `vms` under
/// `vms/`, with `disks(vm)` as its frozen disks, an empty channel-state
/// file and `cluster.json` saying it was committed at `created_unix_ms`.
pub fn write_small_cluster_snapshot(
    dir: &Path,
    name: &str,
    cluster: &str,
    vms: &[&str],
    created_unix_ms: u64,
    disks: &dyn Fn(&str) -> Vec<crate::DiskRef>,
) -> Result<ClusterManifest, Box<dyn std::error::Error + Send + Sync>> {
    std::fs::create_dir_all(dir.join(VMS_DIR))?;
    let mut list = Vec::new();
    for (i, vm) in vms.iter().enumerate() {
        let snapshot = format!("{VMS_DIR}/{vm}");
        write_small_snapshot(&dir.join(&snapshot), vm, Some(created_unix_ms), disks(vm))?;
        list.push(ClusterVm {
            name: (*vm).into(),
            snapshot,
            memory_mib: 1,
            ip: format!("10.77.0.{}", i + 2),
            mac: format!("52:54:00:77:00:{:02x}", i + 2),
            timeline: Timeline::default(),
            metrics: serde_json::Value::Null,
        });
    }
    let summary = crate::write_channel_log(&dir.join(CHANNEL_LOG), &[])?;
    let m = ClusterManifest {
        format: ClusterManifest::FORMAT.into(),
        version: ClusterManifest::VERSION,
        name: name.into(),
        cluster: cluster.into(),
        mode: "hot".into(),
        created_unix_ms,
        network: serde_json::Value::Null,
        vms: list,
        channel_state: ChannelStateRef::from_summary(&summary),
        edges: vec![],
        metrics: serde_json::Value::Null,
    };
    m.save(dir)?;
    Ok(m)
}
