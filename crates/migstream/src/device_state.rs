//! The end of the stream: the device state as one opaque run of bytes,
//! the EOF byte and the optional VM description (§1.6, §5.3).
//!
//! The device sections (FULL, one per non-iterative device) are not
//! self-delimiting without understanding each device, so the reader takes
//! everything from the first device section to the end of the stream and
//! finds the boundaries from the back: the stream ends either with the EOF
//! byte 0x00, or with `0x00 | 0x06 | be32 N | N bytes of JSON`.

use serde_json::Value;

use crate::wire::{SectionType, SECTION_FOOTER};

/// The VM description (vmdesc) QEMU appends after EOF (§1.6). It is
/// informational: it lists the non-iterative devices in stream order with
/// their field layout.
#[derive(Debug, Clone, PartialEq)]
pub struct VmDescription {
    /// The JSON text as sent.
    pub json: String,
    /// `page_size`, if present.
    pub page_size: Option<u64>,
    /// The devices, in stream order.
    pub devices: Vec<VmDescDevice>,
}

/// One device of the VM description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmDescDevice {
    /// The section idstr, e.g. `timer`, `cpu`, `globalstate`.
    pub name: String,
    /// The instance id (0 if absent).
    pub instance_id: u64,
    /// The vmstate version (0 if absent).
    pub version: u64,
}

impl VmDescription {
    /// Parses vmdesc JSON; `None` unless it is a JSON object. Fields of
    /// other shapes than expected are left out rather than rejected: the
    /// description is informational.
    fn parse(json: &[u8]) -> Option<Self> {
        // from_slice stops at the first byte that cannot continue the JSON,
        // so a failed candidate costs little.
        let value: Value = serde_json::from_slice(json).ok()?;
        let obj = value.as_object()?;
        let devices = obj
            .get("devices")
            .and_then(Value::as_array)
            .map(|devs| {
                devs.iter()
                    .filter_map(|d| {
                        Some(VmDescDevice {
                            name: d.get("name")?.as_str()?.to_owned(),
                            instance_id: d.get("instance_id").and_then(Value::as_u64).unwrap_or(0),
                            version: d.get("version").and_then(Value::as_u64).unwrap_or(0),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        Some(VmDescription {
            json: String::from_utf8(json.to_vec()).ok()?,
            page_size: obj.get("page_size").and_then(Value::as_u64),
            devices,
        })
    }
}

/// Where the parts of the tail lie.
#[derive(Debug)]
pub(crate) struct TailLayout {
    /// Length of the device state: it is `tail[..device_len]`, and
    /// `tail[device_len]` is the EOF byte.
    pub(crate) device_len: usize,
    /// The VM description, if the stream has one.
    pub(crate) vmdesc: Option<VmDescription>,
}

/// Splits `tail` (from the first device section, or from the EOF byte if
/// there is no device section, to the end of the stream). `footers` says
/// whether sections end with footers, which the device state must then
/// end with too; `vmdesc_required` whether the VM description must be there.
pub(crate) fn split_tail(
    tail: &[u8],
    footers: bool,
    vmdesc_required: bool,
) -> Result<TailLayout, String> {
    let n = tail.len();
    if n == 0 {
        return Err("it has no EOF byte 0x00".into());
    }
    let (eof, vmdesc) = if tail[n - 1] == SectionType::Eof as u8 {
        // No vmdesc (suppress-vmdesc): a vmdesc would end with '}'.
        if vmdesc_required {
            return Err(
                "it ends at EOF without the VM description (0x06 be32 len JSON) QEMU sends unless \
                        suppress-vmdesc is on (for such sources use VmDescPolicy::Optional)"
                    .into(),
            );
        }
        (n - 1, None)
    } else {
        find_vmdesc(tail).ok_or(if vmdesc_required {
            "it does not end with EOF + VM description (0x00 0x06 be32 len JSON)"
        } else {
            "it ends neither with EOF (0x00) nor with EOF + VM description (0x00 0x06 be32 len JSON)"
        })?
    };
    let device = &tail[..eof];
    if !device.is_empty() {
        if device[0] != SectionType::Full as u8 {
            return Err(format!(
                "the device state starts with {:#04x}, not a FULL section",
                device[0]
            ));
        }
        if footers && (device.len() < 5 || device[device.len() - 5] != SECTION_FOOTER) {
            return Err(
                "the device state does not end with a section footer (0x7e be32 id) before EOF"
                    .into(),
            );
        }
    }
    Ok(TailLayout {
        device_len: eof,
        vmdesc,
    })
}

/// Finds `0x00 0x06 be32 N JSON` ending exactly at the end of `tail`:
/// returns the EOF position and the parsed description. JSON text holds no
/// raw 0x06, so the search from the back stops at the real header.
fn find_vmdesc(tail: &[u8]) -> Option<(usize, Option<VmDescription>)> {
    let n = tail.len();
    let mut p = n.checked_sub(5)?;
    while p >= 1 {
        if tail[p] == SectionType::VmDescription as u8 && tail[p - 1] == SectionType::Eof as u8 {
            let len =
                u32::from_be_bytes([tail[p + 1], tail[p + 2], tail[p + 3], tail[p + 4]]) as usize;
            if len == n - p - 5 && tail.get(p + 5) == Some(&b'{') {
                if let Some(desc) = VmDescription::parse(&tail[p + 5..]) {
                    return Some((p - 1, Some(desc)));
                }
            }
        }
        p -= 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail_with_vmdesc(device: &[u8], json: &str) -> Vec<u8> {
        let mut t = device.to_vec();
        t.push(0);
        t.push(6);
        t.extend_from_slice(&(json.len() as u32).to_be_bytes());
        t.extend_from_slice(json.as_bytes());
        t
    }

    #[test]
    fn splits_device_eof_vmdesc() {
        let dev = [
            4, 0, 0, 0, 3, 1, b'x', 0, 0, 0, 0, 0, 0, 0, 1, 0xaa, 0x7e, 0, 0, 0, 3,
        ];
        let json =
            r#"{"page_size": 4096, "devices": [{"name": "x", "instance_id": 0, "version": 1}]}"#;
        let t = tail_with_vmdesc(&dev, json);
        let l = split_tail(&t, true, true).unwrap();
        assert_eq!(l.device_len, dev.len());
        let d = l.vmdesc.unwrap();
        assert_eq!(d.page_size, Some(4096));
        assert_eq!(d.devices[0].name, "x");
        assert_eq!(d.json, json);
    }

    #[test]
    fn no_vmdesc() {
        let dev = [
            4, 0, 0, 0, 3, 1, b'x', 0, 0, 0, 0, 0, 0, 0, 1, 0x7e, 0, 0, 0, 3, 0,
        ];
        let l = split_tail(&dev, true, false).unwrap();
        assert_eq!(l.device_len, dev.len() - 1);
        assert!(l.vmdesc.is_none());
    }

    #[test]
    fn rejects_bad_ends() {
        assert!(split_tail(&[], false, false).is_err());
        assert!(split_tail(&[4, 1, 2], false, false).is_err());
        assert!(split_tail(&[4, 1, 2, 0], false, true).is_err());
        assert!(split_tail(&[4, 1, 2, 0], false, false).is_ok());
        // vmdesc length one too long
        let mut t = tail_with_vmdesc(&[], "{}");
        t[5] += 1;
        assert!(split_tail(&t, false, false).is_err());
        // not JSON
        assert!(split_tail(&tail_with_vmdesc(&[], "{nope"), false, false).is_err());
        // footers required but missing
        assert!(split_tail(&[4, 9, 9, 0], true, false).is_err());
    }
}
