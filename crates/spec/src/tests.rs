use crate::{Accel, ClusterSpec, SpecError};

const GOOD: &str = r#"
[cluster]
name = "demo"
accel = "tcg"

[[vm]]
name = "alpha"
memory_mib = 256
workload = "pingpong server 7000 &"

[[vm]]
name = "beta"
memory_mib = 128
vcpus = 2
disk_mib = 32
workload = "pingpong client {ip:alpha} 7000 & echo {name}; { true; }"
"#;

fn parse(text: &str) -> Result<ClusterSpec, SpecError> {
    ClusterSpec::from_toml_str(text, 64)
}

#[test]
fn parses_a_good_spec_with_defaults() {
    let s = parse(GOOD).unwrap();
    assert_eq!(s.cluster.name, "demo");
    assert_eq!(s.cluster.accel, Accel::Tcg);
    assert_eq!(s.cluster.boot_timeout_s, 120);
    assert_eq!(s.vm.len(), 2);
    assert_eq!(s.vm[0].vcpus, 1);
    assert_eq!(s.vm[0].disk_mib, 64);
    assert_eq!(s.vm[1].vcpus, 2);
}

#[test]
fn accel_defaults_to_auto() {
    let s = parse("[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=64\n").unwrap();
    assert_eq!(s.cluster.accel, Accel::Auto);
}

#[test]
fn expands_placeholders_and_keeps_shell_braces() {
    let s = parse(GOOD).unwrap();
    assert_eq!(
        s.expand_workload("beta").unwrap(),
        "pingpong client 10.77.0.2 7000 & echo beta; { true; }"
    );
}

#[test]
fn assigns_distinct_addresses_in_spec_order() {
    let s = parse(GOOD).unwrap();
    let a = s.addressing();
    assert_eq!(a[0].cidr(), "10.77.0.2/24");
    assert_eq!(a[1].cidr(), "10.77.0.3/24");
    assert_eq!(a[0].mac_string(), "52:54:00:77:00:02");
    assert_ne!(a[0].mac, a[1].mac);
}

#[test]
fn rejects_unknown_field_naming_it() {
    let e = parse("[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=64\nmemroy=3\n").unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("memroy"), "{msg}");
    assert!(!msg.contains('\n'), "one line: {msg}");
}

#[test]
fn rejects_unknown_cluster_field() {
    let e =
        parse("[cluster]\nname='c'\ncolour='x'\n[[vm]]\nname='a'\nmemory_mib=64\n").unwrap_err();
    assert!(e.to_string().contains("colour"), "{e}");
}

#[test]
fn rejects_duplicate_vm_name() {
    let e = parse(
        "[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=64\n[[vm]]\nname='a'\nmemory_mib=64\n",
    )
    .unwrap_err();
    assert_eq!(e, SpecError::DuplicateVm("a".into()));
    assert!(e.to_string().contains("duplicate VM name \"a\""));
}

#[test]
fn rejects_memory_below_minimum() {
    let e = parse("[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=16\n").unwrap_err();
    assert_eq!(
        e,
        SpecError::MemoryTooSmall {
            vm: "a".into(),
            got: 16,
            min: 64
        }
    );
}

#[test]
fn rejects_bad_names() {
    for bad in [
        "A",
        "1a",
        "a_b",
        "",
        "a-very-long-name-that-is-longer-than-24",
    ] {
        let text = format!("[cluster]\nname='c'\n[[vm]]\nname='{bad}'\nmemory_mib=64\n");
        assert!(
            matches!(parse(&text), Err(SpecError::BadName { .. })),
            "{bad}"
        );
    }
    let e = parse("[cluster]\nname='C/x'\n[[vm]]\nname='a'\nmemory_mib=64\n").unwrap_err();
    assert!(matches!(
        e,
        SpecError::BadName {
            what: "cluster",
            ..
        }
    ));
}

#[test]
fn rejects_no_vms_and_bad_ranges() {
    assert_eq!(
        parse("[cluster]\nname='c'\n").unwrap_err(),
        SpecError::NoVms
    );
    let e = parse("[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=64\nvcpus=0\n").unwrap_err();
    assert!(matches!(e, SpecError::OutOfRange { field: "vcpus", .. }));
    let e =
        parse("[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=64\ndisk_mib=1\n").unwrap_err();
    assert!(matches!(
        e,
        SpecError::OutOfRange {
            field: "disk_mib",
            ..
        }
    ));
}

#[test]
fn rejects_workload_naming_missing_vm_or_placeholder() {
    let e = parse("[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=64\nworkload='x {ip:zz}'\n")
        .unwrap_err();
    assert_eq!(
        e,
        SpecError::UnknownWorkloadVm {
            vm: "a".into(),
            target: "zz".into()
        }
    );
    let e = parse("[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib=64\nworkload='x {mac:a}'\n")
        .unwrap_err();
    assert!(matches!(e, SpecError::UnknownPlaceholder { .. }));
}

#[test]
fn rejects_bad_accel_and_wrong_types() {
    let e =
        parse("[cluster]\nname='c'\naccel='xen'\n[[vm]]\nname='a'\nmemory_mib=64\n").unwrap_err();
    assert!(
        e.to_string().contains("xen") || e.to_string().contains("variant"),
        "{e}"
    );
    let e = parse("[cluster]\nname='c'\n[[vm]]\nname='a'\nmemory_mib='lots'\n").unwrap_err();
    assert!(matches!(e, SpecError::Toml(_)));
}

/// Regression (fuzzing, issue 20): `boot_timeout_s = 9223372036854775807`
/// was accepted, and the agent's boot deadline (`Instant::now() +
/// Duration::from_secs(boot_timeout_s)`) panicked on the overflow.
#[test]
fn boot_timeout_is_bounded() {
    let spec = |t: &str| {
        parse(&format!(
            "[cluster]\nname='c'\nboot_timeout_s={t}\n[[vm]]\nname='a'\nmemory_mib=64\n"
        ))
    };
    for bad in ["9223372036854775807", "0", "86401"] {
        let e = spec(bad).unwrap_err();
        assert!(
            matches!(e, SpecError::BootTimeoutOutOfRange(_)),
            "{bad}: {e}"
        );
        assert!(e.to_string().contains("1-86400"), "{e}");
    }
    assert_eq!(spec("86400").unwrap().cluster.boot_timeout_s, 86_400);
    assert_eq!(spec("1").unwrap().cluster.boot_timeout_s, 1);
}
