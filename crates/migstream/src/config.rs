//! The configuration section (§1.3): machine type and the optional
//! target-page-bits, capabilities and uuid subsections. QEMU 10.0 writes
//! the same section with the same three subsections.

use std::io::Read;

use crate::error::StreamError;
use crate::input::Input;
use crate::wire::{config_subsection, CAP_MAPPED_RAM, CAP_X_IGNORE_SHARED, SUBSECTION};

/// Longest machine type name accepted. QEMU's are a few dozen bytes; the
/// wire length is a be32, so this bounds the allocation.
const MAX_MACHINE_NAME: u32 = 1024;
/// Most capabilities accepted in the capabilities subsection (QEMU 7.2
/// validates only one; the wire count is a be32).
const MAX_CAPABILITIES: u32 = 256;

/// The contents of the configuration section.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Configuration {
    /// The resolved machine type name, e.g. `microvm` or `pc-i440fx-7.2`.
    pub machine: String,
    /// `configuration/target-page-bits`, present only on targets with a
    /// variable page size (never on x86).
    pub target_page_bits: Option<u32>,
    /// `configuration/capabilities`: the validated capabilities that are on
    /// (in 7.2 only `x-ignore-shared` can appear; 10.0 adds `mapped-ram`,
    /// which only file migrations use). Empty if the subsection
    /// is absent.
    pub capabilities: Vec<String>,
    /// `configuration/uuid`: the source's `-uuid`, if `validate-uuid` was on.
    pub uuid: Option<[u8; 16]>,
}

impl Configuration {
    /// Whether the `x-ignore-shared` capability is listed, which adds a
    /// be64 guest address to every RAM block list entry (§2.2).
    pub fn ignore_shared(&self) -> bool {
        self.capabilities.iter().any(|c| c == CAP_X_IGNORE_SHARED)
    }
}

fn bad(offset: u64, reason: impl Into<String>) -> StreamError {
    StreamError::BadConfiguration {
        offset,
        reason: reason.into(),
    }
}

/// Reads the configuration section after its 0x07 byte has been consumed.
pub(crate) fn read_configuration<R: Read>(
    input: &mut Input<R>,
) -> Result<Configuration, StreamError> {
    let len_at = input.offset();
    let len = input.be32("configuration machine name length")?;
    if len > MAX_MACHINE_NAME {
        return Err(bad(
            len_at,
            format!("machine type name length {len} is implausible (at most {MAX_MACHINE_NAME})"),
        ));
    }
    let mut name = vec![0; len as usize];
    input.read_exact_at(&mut name, len_at, "configuration machine name")?;
    let machine =
        String::from_utf8(name).map_err(|_| bad(len_at + 4, "machine type name is not UTF-8"))?;
    let mut config = Configuration {
        machine,
        ..Configuration::default()
    };

    // Subsections end at the first byte that is not 0x05; top-level
    // section types never use 0x05 (§1.3).
    while input.peek_u8()? == Some(SUBSECTION) {
        let at = input.offset();
        input.u8("configuration subsection marker")?;
        let mut buf = [0u8; 256];
        let name = input
            .short_str(&mut buf, "configuration subsection name")?
            .to_vec();
        let name = String::from_utf8_lossy(&name).into_owned();
        let version = input.be32("configuration subsection version")?;
        if version != 1 {
            return Err(bad(
                at,
                format!("subsection {name:?} has version {version}, QEMU 7.2 and 10.0 write 1"),
            ));
        }
        match name.as_str() {
            config_subsection::TARGET_PAGE_BITS => {
                let bits_at = input.offset();
                let bits = input.be32("target page bits")?;
                if !(10..=16).contains(&bits) {
                    return Err(bad(
                        bits_at,
                        format!("target page bits {bits} outside 10..=16"),
                    ));
                }
                config.target_page_bits = Some(bits);
            }
            config_subsection::CAPABILITIES => {
                let count_at = input.offset();
                let count = input.be32("capability count")?;
                if count > MAX_CAPABILITIES {
                    return Err(bad(
                        count_at,
                        format!("capability count {count} is implausible"),
                    ));
                }
                for _ in 0..count {
                    let cap_at = input.offset();
                    let cap = input.short_str(&mut buf, "capability name")?;
                    if cap == CAP_MAPPED_RAM.as_bytes() {
                        return Err(bad(cap_at, "capability mapped-ram (QEMU 10.0: RAM at fixed file offsets) lays RAM out differently; disable the mapped-ram capability"));
                    }
                    config
                        .capabilities
                        .push(String::from_utf8_lossy(cap).into_owned());
                }
            }
            config_subsection::UUID => {
                let mut uuid = [0; 16];
                input.read_exact(&mut uuid, "uuid")?;
                config.uuid = Some(uuid);
            }
            _ => return Err(StreamError::UnknownConfigSubsection { offset: at, name }),
        }
    }
    Ok(config)
}
