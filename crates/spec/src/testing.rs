//! Helpers for robustness tests and fuzzing (not needed by normal users).
//!
//! [`sample_spec`] is a valid spec using most fields; [`edit_toml`]
//! replaces values of a TOML document by interesting ones; and
//! [`exercise_spec`] parses a spec and checks what its users rely on.
//! The `spec` fuzz target (`crates/spec/fuzz`) and the unit tests in
//! `src/tests_fuzz.rs` run them.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::{ClusterSpec, ExtraDisk, GuestKind, SpecError};

/// A valid spec: two lab VMs whose workloads use placeholders and shell
/// braces, and two image VMs (a file with extra disks and keys, a recipe).
pub const SAMPLE_SPEC: &str = r#"
[cluster]
name = "demo"
accel = "tcg"
boot_timeout_s = 300
host_access = "netns"

[[vm]]
name = "alpha"
memory_mib = 256
workload = "pingpong server 7000 & echo {name}; { true; }"

[[vm]]
name = "beta"
memory_mib = 128
vcpus = 2
disk_mib = 32
workload = "pingpong client {ip:alpha} 7000 &"

[[vm]]
name = "db"
memory_mib = 512
image = "images/debian.qcow2"
image_format = "qcow2"
ssh_authorized_keys = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILMxwQyC9ziD+RIBARpGDOb53+S2IbtAwf2E5OZE2ZQe me@host"]
disks = [{ size_mib = 64 }, { path = "data.raw", format = "raw" }]

[[vm]]
name = "cache"
memory_mib = 512
image_recipe = "redis"
cloud_init = false
"#;

/// The text of [`SAMPLE_SPEC`].
pub fn sample_spec() -> &'static str {
    SAMPLE_SPEC
}

/// Parses `text` as [`ClusterSpec::from_toml_str`] does with a guest floor
/// of 64 MiB (what the `spec` fuzz target runs). If that succeeds, every
/// accessor must work and every number must be usable: the boot deadline
/// (`now + boot_timeout_s`) and guest RAM in bytes fit, every workload
/// expands, every VM has an address; the spec must survive the JSON round
/// trip the agent stores it through, and making its paths absolute keeps
/// it valid. Panics otherwise, which is a bug; never on a parse error.
pub fn exercise_spec(text: &str) -> Result<ClusterSpec, SpecError> {
    let spec = ClusterSpec::from_toml_str(text, 64)?;
    let boot = Duration::from_secs(spec.cluster.boot_timeout_s);
    assert!(
        Instant::now().checked_add(boot).is_some(),
        "boot_timeout_s = {} overflows a deadline",
        spec.cluster.boot_timeout_s
    );
    assert_eq!(spec.addressing().len(), spec.vm.len());
    for vm in &spec.vm {
        assert!(vm.memory_mib.checked_mul(1 << 20).is_some());
        if let Err(e) = spec.expand_workload(&vm.name) {
            panic!(
                "VM {}: a valid spec's workload does not expand: {e}",
                vm.name
            );
        }
        if let GuestKind::Image(g) = vm.kind() {
            assert!(vm.is_image());
            for d in &g.disks {
                if let ExtraDisk::Empty { size_mib } = *d {
                    assert!(size_mib > 0 && size_mib.checked_mul(1 << 20).is_some());
                }
            }
        }
    }
    let json = match serde_json::to_string(&spec) {
        Ok(j) => j,
        Err(e) => panic!("a valid spec does not serialize: {e}"),
    };
    match serde_json::from_str::<ClusterSpec>(&json) {
        Ok(back) => assert_eq!(back, spec, "the JSON round trip changed the spec"),
        Err(e) => panic!("a valid spec does not deserialize from its JSON: {e}: {json}"),
    }
    let mut resolved = spec.clone();
    resolved.resolve_relative_paths(Path::new("/specs"));
    if let Err(e) = resolved.validate(64) {
        panic!("resolving relative paths made a valid spec invalid: {e}");
    }
    Ok(spec)
}

/// Applies structural edits to the TOML document `doc`: each 3-byte chunk
/// `[hi, lo, what]` of `edits` replaces value number `u16(hi, lo) % count`
/// (depth first, tables and arrays included, the root table excluded) by
/// an interesting value chosen by `what` (extreme integers, floats, odd
/// names and placeholders, other types). Returns `doc` unchanged if it is
/// not TOML.
pub fn edit_toml(doc: &str, edits: &[u8]) -> String {
    let Ok(table) = doc.parse::<toml::Table>() else {
        return doc.to_string();
    };
    let mut root = toml::Value::Table(table);
    for e in edits.chunks_exact(3) {
        let count = count_values(&root) - 1;
        if count == 0 {
            break;
        }
        let target = 1 + usize::from(u16::from_be_bytes([e[0], e[1]])) % count;
        if let Some(slot) = nth_value(&mut root, target) {
            *slot = interesting_value(e[2]);
        }
    }
    toml::to_string(&root).unwrap_or_else(|_| doc.to_string())
}

fn count_values(v: &toml::Value) -> usize {
    1 + match v {
        toml::Value::Array(a) => a.iter().map(count_values).sum(),
        toml::Value::Table(t) => t.values().map(count_values).sum(),
        _ => 0,
    }
}

fn nth_value(v: &mut toml::Value, n: usize) -> Option<&mut toml::Value> {
    if n == 0 {
        return Some(v);
    }
    let mut n = n - 1;
    let children: Vec<&mut toml::Value> = match v {
        toml::Value::Array(a) => a.iter_mut().collect(),
        toml::Value::Table(t) => t.iter_mut().map(|(_, v)| v).collect(),
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

fn interesting_value(what: u8) -> toml::Value {
    use toml::Value;
    match what % 32 {
        0 => Value::Integer(0),
        1 => Value::Integer(1),
        2 => Value::Integer(-1),
        3 => Value::Integer(i64::MAX),
        4 => Value::Integer(i64::MIN),
        5 => Value::Integer(1 << 20),
        6 => Value::Integer((1 << 20) + 1),
        7 => Value::Integer(1 << 44),
        8 => Value::Float(1e308),
        9 => Value::Float(f64::NAN),
        10 => Value::String(String::new()),
        11 => Value::String("{ip:alpha}{ip:nope}".into()),
        12 => Value::String("{name}{".into()),
        13 => Value::String("{ip:}".into()),
        14 => Value::String("..".into()),
        15 => Value::String("/abs/path".into()),
        16 => Value::String("alpha".into()),
        17 => Value::String("a".repeat(25)),
        18 => Value::String("Bad_Name".into()),
        19 => Value::String("kvm".into()),
        20 => Value::String("microvm".into()),
        21 => Value::String("qcow2".into()),
        22 => Value::String("ssh-rsa AAAA\nsecond".into()),
        23 => Value::String("redis".into()),
        24 => Value::Boolean(true),
        25 => Value::Boolean(false),
        26 => Value::Array(Vec::new()),
        27 => Value::Table(toml::Table::new()),
        28 => Value::Array(vec![Value::Table(toml::Table::from_iter([(
            "size_mib".to_string(),
            Value::Integer(8),
        )]))]),
        29 => Value::String("é\u{0}".into()),
        30 => Value::Integer(u32::MAX.into()),
        _ => Value::String("host".into()),
    }
}
