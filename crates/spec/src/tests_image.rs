//! Tests of the image-VM fields: parsing, defaults, each validation rule.

use std::path::Path;

use crate::{
    Boot, ClusterSpec, DiskFormat, ExtraDisk, GuestKind, HostAccess, ImageSource, ImageSuite,
    Machine, SpecError, SshKeys,
};

/// A real public key (made with ssh-keygen for these tests).
const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILMxwQyC9ziD+RIBARpGDOb53+S2IbtAwf2E5OZE2ZQe me@host";

fn parse(text: &str) -> Result<ClusterSpec, SpecError> {
    ClusterSpec::from_toml_str(text, 64)
}

/// A one-VM spec with `fields` added to the VM.
fn vm(fields: &str) -> Result<ClusterSpec, SpecError> {
    parse(&format!(
        "[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=512\n{fields}\n"
    ))
}

fn image_kind(s: &ClusterSpec) -> crate::ImageGuest<'_> {
    match s.vm[0].kind() {
        GuestKind::Image(g) => g,
        GuestKind::Lab => panic!("expected an image VM"),
    }
}

#[test]
fn example_specs_parse_the_lab_ones_unchanged_and_redis_as_image_vms() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let s = parse(&std::fs::read_to_string(&path).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(s.cluster.host_access, HostAccess::Netns);
            if path.file_name().is_some_and(|f| f == "redis.toml") {
                for v in &s.vm {
                    let GuestKind::Image(g) = v.kind() else {
                        panic!("{}: not an image VM", v.name)
                    };
                    assert_eq!(
                        g.source,
                        ImageSource::Recipe {
                            name: "redis",
                            suite: ImageSuite::Bookworm
                        },
                        "{}",
                        v.name
                    );
                    assert!(!g.cloud_init, "{}", v.name);
                }
            } else {
                assert!(
                    s.vm.iter()
                        .all(|v| v.kind() == GuestKind::Lab && !v.is_image()),
                    "{}",
                    path.display()
                );
            }
            n += 1;
        }
    }
    assert!(n >= 3, "found {n} example specs");
}

#[test]
fn image_vm_defaults_to_q35_firmware_boot_with_cloud_init() {
    let s = vm("image='/img/debian.qcow2'").unwrap();
    let g = image_kind(&s);
    assert_eq!(
        g.source,
        ImageSource::Path {
            path: Path::new("/img/debian.qcow2"),
            format: None
        }
    );
    assert_eq!(g.machine, Machine::Q35);
    assert_eq!(g.boot, Boot::Firmware);
    assert!(g.cloud_init);
    assert!(g.disks.is_empty());
    assert_eq!(g.ssh_keys, None);
}

#[test]
fn full_image_vm_parses() {
    let s = vm(r#"
image = "/img/u.img"
image_format = "qcow2"
machine = "microvm"
kernel = "/boot/vmlinuz"
initrd = "/boot/initrd.img"
cmdline = "root=/dev/vda1 console=ttyS0"
cloud_init = true
ssh_authorized_keys = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILMxwQyC9ziD+RIBARpGDOb53+S2IbtAwf2E5OZE2ZQe me@host"]
disks = [ { path = "/d/pg.raw", format = "raw" }, { path = "/d/x.qcow2" }, { size_mib = 1024 } ]
workload = "redis-cli -h {ip:a} ping"
"#)
    .unwrap();
    let g = image_kind(&s);
    assert_eq!(
        g.source,
        ImageSource::Path {
            path: Path::new("/img/u.img"),
            format: Some(DiskFormat::Qcow2)
        }
    );
    assert_eq!(g.machine, Machine::Microvm);
    assert_eq!(
        g.boot,
        Boot::Direct {
            kernel: Path::new("/boot/vmlinuz"),
            initrd: Some(Path::new("/boot/initrd.img")),
            cmdline: Some("root=/dev/vda1 console=ttyS0")
        }
    );
    assert_eq!(
        g.disks,
        vec![
            ExtraDisk::Image {
                path: Path::new("/d/pg.raw"),
                format: Some(DiskFormat::Raw)
            },
            ExtraDisk::Image {
                path: Path::new("/d/x.qcow2"),
                format: None
            },
            ExtraDisk::Empty { size_mib: 1024 },
        ]
    );
    assert_eq!(g.ssh_keys, Some(&SshKeys::Keys(vec![KEY.into()])));
    assert_eq!(
        s.expand_workload("a").unwrap(),
        "redis-cli -h 10.77.0.2 ping"
    );
}

#[test]
fn recipe_vm_and_keys_file_and_host_access() {
    let s = parse(
        "[cluster]\nname='c'\nhost_access='none'\n[[vm]]\nname='a'\nmemory_mib=256\nimage_recipe='redis'\nssh_authorized_keys='keys.pub'\ncloud_init=true\n",
    )
    .unwrap();
    assert_eq!(s.cluster.host_access, HostAccess::None);
    let g = image_kind(&s);
    assert_eq!(
        g.source,
        ImageSource::Recipe {
            name: "redis",
            suite: ImageSuite::Bookworm
        }
    );
    assert_eq!(g.ssh_keys, Some(&SshKeys::File("keys.pub".into())));
    let s = parse("[cluster]\nname='c'\nhost_access='host'\n[[vm]]\nname='a'\nmemory_mib=64\n")
        .unwrap();
    assert_eq!(s.cluster.host_access, HostAccess::Host);
    assert!(
        parse("[cluster]\nname='c'\nhost_access='bridge'\n[[vm]]\nname='a'\nmemory_mib=64\n")
            .is_err()
    );
}

#[test]
fn relative_paths_resolve_against_the_spec_dir() {
    let mut s = vm("image='img/d.qcow2'\nkernel='/abs/k'\nssh_authorized_keys='k.pub'\ndisks=[{path='x.raw'},{size_mib=8}]").unwrap();
    s.resolve_relative_paths(Path::new("/specs"));
    let v = &s.vm[0];
    assert_eq!(v.image.as_deref(), Some(Path::new("/specs/img/d.qcow2")));
    assert_eq!(v.kernel.as_deref(), Some(Path::new("/abs/k")));
    assert_eq!(v.disks[0].path.as_deref(), Some(Path::new("/specs/x.raw")));
    assert_eq!(
        v.ssh_authorized_keys,
        Some(SshKeys::File("/specs/k.pub".into()))
    );
}

#[test]
fn image_and_recipe_are_exclusive() {
    assert_eq!(
        vm("image='/i'\nimage_recipe='redis'").unwrap_err(),
        SpecError::ImageAndRecipe("a".into())
    );
}

#[test]
fn image_fields_on_a_lab_vm_are_rejected_naming_the_field() {
    for (fields, field) in [
        ("kernel='/k'", "kernel"),
        ("initrd='/i'", "initrd"),
        ("cmdline='x'", "cmdline"),
        ("disks=[{size_mib=8}]", "disks"),
        ("machine='q35'", "machine = \"q35\""),
        ("cloud_init=true", "cloud_init = true"),
        ("ssh_authorized_keys=['x']", "ssh_authorized_keys"),
        ("image_format='raw'", "image_format"),
    ] {
        let e = vm(fields).unwrap_err();
        assert_eq!(
            e,
            SpecError::NeedsImage {
                vm: "a".into(),
                field
            },
            "{fields}"
        );
        assert!(e.to_string().contains("needs image or image_recipe"), "{e}");
    }
    // What the lab guest is anyway is accepted.
    vm("machine='microvm'\ncloud_init=false").unwrap();
}

#[test]
fn direct_boot_fields_need_kernel() {
    assert_eq!(
        vm("image='/i'\ninitrd='/x'").unwrap_err(),
        SpecError::NeedsKernel {
            vm: "a".into(),
            field: "initrd"
        }
    );
    assert_eq!(
        vm("image='/i'\ncmdline='x'").unwrap_err(),
        SpecError::NeedsKernel {
            vm: "a".into(),
            field: "cmdline"
        }
    );
    let e = vm("image='/i'\nmachine='microvm'").unwrap_err();
    assert_eq!(e, SpecError::MicrovmNeedsKernel("a".into()));
    assert!(
        e.to_string().contains("machine = microvm needs kernel"),
        "{e}"
    );
    // With a kernel, q35 stays the default.
    let s = vm("image='/i'\nkernel='/k'").unwrap();
    assert_eq!(image_kind(&s).machine, Machine::Q35);
}

#[test]
fn image_vms_have_a_higher_memory_floor() {
    let text = "[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=128\nimage='/i'\n";
    assert_eq!(
        parse(text).unwrap_err(),
        SpecError::MemoryTooSmall {
            vm: "a".into(),
            got: 128,
            min: 256
        }
    );
    // The lab floor stays the caller's.
    parse("[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=128\n").unwrap();
}

#[test]
fn keys_need_cloud_init_and_must_look_like_keys() {
    assert_eq!(
        vm(&format!(
            "image='/i'\ncloud_init=false\nssh_authorized_keys=['{KEY}']"
        ))
        .unwrap_err(),
        SpecError::KeysNeedCloudInit("a".into())
    );
    for bad in [
        "['']",
        "['ssh-ed25519']",
        "[\"ssh-ed25519 AAAA\\nssh-rsa BBBB\"]",
    ] {
        let e = vm(&format!("image='/i'\nssh_authorized_keys={bad}")).unwrap_err();
        assert!(matches!(e, SpecError::BadSshKeys { .. }), "{bad}: {e}");
    }
    // Regression (issue 29): three words passed as TYPE BASE64 COMMENT.
    let e = vm(&format!(
        "image='/i'\nssh_authorized_keys=['{KEY}', 'not a key']"
    ))
    .unwrap_err();
    assert!(matches!(e, SpecError::BadSshKeys { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("VM \"a\"")
            && text.contains("entry 1 (\"not a key\")")
            && text.contains("not an SSH key type"),
        "{text}"
    );
    vm(&format!("image='/i'\nssh_authorized_keys=['{KEY}']")).unwrap();
    let e = vm("image='/i'\nssh_authorized_keys=42").unwrap_err();
    assert!(
        e.to_string().contains("list of public keys or the path"),
        "{e}"
    );
    assert_eq!(
        vm("image='/i'\nssh_authorized_keys=''").unwrap_err(),
        SpecError::EmptyPath {
            vm: "a".into(),
            field: "ssh_authorized_keys"
        }
    );
}

#[test]
fn bad_disks_are_rejected_with_their_index() {
    for (disks, needle) in [
        ("[{size_mib=8},{path='/x',size_mib=8}]", "not both"),
        ("[{}]", "set path"),
        ("[{path=''}]", "empty path"),
        ("[{size_mib=8,format='raw'}]", "format applies to path only"),
        ("[{size_mib=1}]", "out of range"),
    ] {
        let e = vm(&format!("image='/i'\ndisks={disks}")).unwrap_err();
        assert!(matches!(e, SpecError::BadDisk { .. }), "{disks}: {e}");
        assert!(e.to_string().contains(needle), "{disks}: {e}");
    }
    let s = vm("image='/i'\ndisks=[{size_mib=8},{path='/x'}]").unwrap();
    assert_eq!(s.vm[0].disks.len(), 2);
    assert!(s.vm[0].disks[0].path.is_none());
    let e = vm("image='/i'\ndisks=[{size_mib=8},{path='/x',fromat='raw'}]").unwrap_err();
    assert!(e.to_string().contains("fromat"), "{e}");
    let e = vm("image='/i'\ndisks=[{path='/x', size_mib=8}]").unwrap_err();
    assert_eq!(
        e,
        SpecError::BadDisk {
            vm: "a".into(),
            index: 0,
            reason: "set path or size_mib, not both".into()
        }
    );
}

fn sized_disks(n: usize) -> String {
    format!("[{}]", vec!["{size_mib=8}"; n].join(","))
}

#[test]
fn microvm_slots_are_counted() {
    // NIC, virtio-serial, root, seed and 4 disks.
    let e = vm(&format!(
        "image='/i'\nkernel='/k'\nmachine='microvm'\ndisks={}",
        sized_disks(5)
    ))
    .unwrap_err();
    assert_eq!(
        e,
        SpecError::TooManyDevices {
            vm: "a".into(),
            machine: Machine::Microvm,
            got: 9,
            max: 8,
            max_disks: 4,
        }
    );
    assert!(e.to_string().contains("at most 4 disks"), "{e}");
    vm(&format!(
        "image='/i'\nkernel='/k'\nmachine='microvm'\ncloud_init=false\ndisks={}",
        sized_disks(5)
    ))
    .unwrap();
    vm(&format!(
        "image='/i'\nkernel='/k'\nmachine='microvm'\ndisks={}",
        sized_disks(4)
    ))
    .unwrap();
}

/// Regression (issue 29): 40 disks on q35 reached QEMU, which failed with
/// "PCI: no slot/function available".
#[test]
fn q35_slots_are_counted() {
    let e = vm(&format!("image='/i'\ndisks={}", sized_disks(40))).unwrap_err();
    assert_eq!(
        e,
        SpecError::TooManyDevices {
            vm: "a".into(),
            machine: Machine::Q35,
            got: 44,
            max: 30,
            max_disks: 26,
        }
    );
    let text = e.to_string();
    assert!(
        text.contains("machine = q35 holds 30") && text.contains("at most 26 disks"),
        "{text}"
    );
    vm(&format!("image='/i'\ndisks={}", sized_disks(26))).unwrap();
    vm(&format!("image='/i'\ndisks={}", sized_disks(27))).unwrap_err();
    vm(&format!(
        "image='/i'\ncloud_init=false\ndisks={}",
        sized_disks(27)
    ))
    .unwrap();
}

#[test]
fn disk_mib_on_an_image_vm_is_rejected() {
    let e = vm("image='/i'\ndisk_mib=64").unwrap_err();
    assert!(
        matches!(
            e,
            SpecError::LabOnly {
                field: "disk_mib",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("disks = [{ size_mib = N }]"), "{e}");
}

#[test]
fn image_suite_chooses_the_recipes_debian_release() {
    let suite = |fields: &str| match image_kind(&vm(fields).unwrap()).source {
        ImageSource::Recipe { name, suite } => (name.to_string(), suite),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        suite("image_recipe='redis'\nimage_suite='trixie'"),
        ("redis".into(), ImageSuite::Trixie)
    );
    for f in [
        "image_recipe='redis'\nimage_suite='bookworm'",
        "image_recipe='redis'",
    ] {
        assert_eq!(suite(f), ("redis".into(), ImageSuite::Bookworm));
    }
    for fields in ["image='/i'\nimage_suite='trixie'", "image_suite='trixie'"] {
        assert_eq!(
            vm(fields).unwrap_err(),
            SpecError::SuiteNeedsRecipe("a".into()),
            "{fields}"
        );
    }
    let e = vm("image_recipe='redis'\nimage_suite='sid'").unwrap_err();
    assert!(e.to_string().contains("trixie"), "{e}");
}

#[test]
fn bad_recipe_names_and_empty_paths() {
    assert!(matches!(
        vm("image_recipe='Redis!'").unwrap_err(),
        SpecError::BadName {
            what: "image_recipe",
            ..
        }
    ));
    assert_eq!(
        vm("image=''").unwrap_err(),
        SpecError::EmptyPath {
            vm: "a".into(),
            field: "image"
        }
    );
    assert_eq!(
        vm("image='/i'\nkernel=''").unwrap_err(),
        SpecError::EmptyPath {
            vm: "a".into(),
            field: "kernel"
        }
    );
}

#[test]
fn spec_round_trips_through_json() {
    // Snapshots persist specs as JSON; the new fields must survive and old
    // JSON (without them) must still load.
    let s = vm(&format!(
        "image='/i'\ndisks=[{{size_mib=8}}]\nssh_authorized_keys=['{KEY}']"
    ))
    .unwrap();
    let j = serde_json::to_string(&s).unwrap();
    let back: ClusterSpec = serde_json::from_str(&j).unwrap();
    assert_eq!(back, s);
    let old = r#"{"cluster":{"name":"c","accel":"auto","boot_timeout_s":120},"vm":[{"name":"a","memory_mib":64,"vcpus":1,"disk_mib":64,"workload":""}]}"#;
    let back: ClusterSpec = serde_json::from_str(old).unwrap();
    assert_eq!(back.vm[0].kind(), GuestKind::Lab);
    assert_eq!(back.cluster.host_access, HostAccess::Netns);
}

#[test]
fn the_documented_image_example_parses() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/cluster-spec.md"),
    )
    .unwrap();
    let after = doc
        .split("### Example: an image VM")
        .nth(1)
        .expect("the example section");
    let block = after
        .split("```toml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("its toml block");
    let s = parse(block).unwrap();
    assert!(s.vm.iter().all(|v| v.is_image()));
    assert_eq!(image_kind(&s).machine, Machine::Q35);
}

#[test]
fn a_recipe_image_boots_on_microvm_with_its_own_kernel() {
    // Recipe images boot directly with the kernel the recipe built, so
    // microvm needs no `kernel` for them (it does for a user's image).
    let s = vm("image_recipe = 'redis'\nmachine = 'microvm'").unwrap();
    let g = image_kind(&s);
    assert_eq!((g.machine, g.boot), (Machine::Microvm, Boot::Firmware));
    let e = vm("image = '/x.qcow2'\nmachine = 'microvm'")
        .unwrap_err()
        .to_string();
    assert!(e.contains("microvm needs kernel"), "{e}");
}
