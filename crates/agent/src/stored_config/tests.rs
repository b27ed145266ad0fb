use serde_json::{json, Value};

use super::*;
use crate::qemu::DISK_NODE;

/// A lab VM's `vm.config` as main (a2be2f4) wrote it, with `json!`, into a
/// real snapshot's manifest.
const MAIN_A2BE2F4: &str = include_str!("main_a2be2f4_lab_vm.json");

fn fixture() -> Value {
    serde_json::from_str(MAIN_A2BE2F4).unwrap()
}

#[test]
fn a_config_main_wrote_loads_and_writes_back_the_same() {
    let c = StoredVmConfig::from_value(&fixture()).unwrap();
    assert_eq!(c.qemu.name, "a");
    assert_eq!(c.qemu.memory_mib, 128);
    assert_eq!(c.qemu.disks.len(), 1);
    assert_eq!(c.spec().unwrap().name, "a");
    assert_eq!(c.cluster.name, "ts");
    let a = c.address().unwrap();
    assert_eq!(a.cidr(), "10.77.0.2/24");
    assert_eq!(a.mac_string(), "52:54:00:77:00:02");
    // The manifest keeps its layout: what the typed writer records is
    // what the `json!` writer recorded.
    assert_eq!(c.to_value(), fixture());
}

#[test]
fn a_config_from_before_image_vms_loads() {
    // QEMU configurations persisted before image VMs: one `disk` path,
    // none of the fields added since.
    let mut v = fixture();
    let q = v["qemu"].as_object_mut().unwrap();
    for k in [
        "disks",
        "bios",
        "cpr_ready",
        "cpu",
        "data_dir",
        "image",
        "initrd",
        "machine",
        "module_dir",
        "paused",
    ] {
        q.remove(k);
    }
    q.insert("disk".into(), json!("/old/data.qcow2"));
    let c = StoredVmConfig::from_value(&v).unwrap();
    assert_eq!(c.qemu.disks.len(), 1);
    assert_eq!(c.qemu.disks[0].node, DISK_NODE);
    assert_eq!(
        c.qemu.disks[0].path,
        std::path::Path::new("/old/data.qcow2")
    );
}

#[test]
fn what_a_restore_cannot_use_is_named() {
    for v in [Value::Null, json!({ "memory_mib": 16 })] {
        let e = StoredVmConfig::from_value(&v).unwrap_err();
        assert!(matches!(e, StoredConfigError::Unreadable(_)), "{e}");
        assert!(e.to_string().contains("take a new snapshot"), "{e}");
    }
    let mut v = fixture();
    v["spec"] = Value::Null;
    let c = StoredVmConfig::from_value(&v).unwrap();
    assert!(matches!(c.spec(), Err(StoredConfigError::NoSpec)));
    assert_eq!(c.to_value(), v);
    for (ip, mac) in [
        ("10.77.0.2", "52:54:00:77:00:02"),
        ("10.77.0.2/24", "52:54:00"),
    ] {
        let mut v = fixture();
        v["ip"] = json!(ip);
        v["mac"] = json!(mac);
        let e = StoredVmConfig::from_value(&v)
            .unwrap()
            .address()
            .unwrap_err();
        assert!(matches!(e, StoredConfigError::BadAddress { .. }), "{e}");
    }
}
