//! Encoders for the items of a postcopy stream, appending to a `Vec<u8>`.
//! Pure functions: the sender decides what goes where, these only know
//! the bytes (§1, §2, §3.2). All integers big-endian.

use crate::wire::{
    ram_flags, CommandKind, SectionType, FILE_MAGIC, FILE_VERSION, RAM_IDSTR, RAM_INSTANCE_ID,
    RAM_SECTION_VERSION, SECTION_FOOTER,
};

use super::DestBlock;

/// Most payload bytes per POSTCOPY_RAM_DISCARD command. The wire length is
/// a u16, QEMU itself sends at most 12 ranges (about 200 bytes); ~4000
/// keeps each command within one page of the destination's buffer while
/// needing few commands (233 ranges or more per command).
pub(crate) const MAX_DISCARD_PAYLOAD: usize = 4000;

/// The value of the first PING (after OPEN_RETURN_PATH) and of the PING in
/// the package, as QEMU numbers them (§3.1).
pub(crate) const PING_SETUP: u32 = 1;
/// See [`PING_SETUP`].
pub(crate) const PING_PACKAGE: u32 = 3;

pub(crate) fn be16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_be_bytes());
}
pub(crate) fn be32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_be_bytes());
}
pub(crate) fn be64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_be_bytes());
}
/// `u8 len | bytes`; `s` must be at most 255 bytes (checked by the config
/// validation).
fn str8(out: &mut Vec<u8>, s: &str) {
    debug_assert!(s.len() <= 255);
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

/// Magic, version and the configuration section with `machine` and no
/// subsection (§1.2, §1.3).
pub(crate) fn header(out: &mut Vec<u8>, machine: &str) {
    be32(out, FILE_MAGIC);
    be32(out, FILE_VERSION);
    out.push(SectionType::Configuration as u8);
    be32(out, machine.len() as u32);
    out.extend_from_slice(machine.as_bytes());
}

/// A command with its payload (§1.5); the payload must fit a u16 length.
pub(crate) fn command(out: &mut Vec<u8>, kind: CommandKind, payload: &[u8]) {
    debug_assert!(payload.len() <= usize::from(u16::MAX));
    out.push(SectionType::Command as u8);
    be16(out, kind as u16);
    be16(out, payload.len() as u16);
    out.extend_from_slice(payload);
}

/// `PING value`.
pub(crate) fn ping(out: &mut Vec<u8>, value: u32) {
    command(out, CommandKind::Ping, &value.to_be_bytes());
}

/// `POSTCOPY_ADVISE`: page size summary and target page size, both
/// `page_size` (no hugepages, §3.2).
pub(crate) fn advise(out: &mut Vec<u8>, page_size: u64) {
    let mut p = Vec::with_capacity(16);
    be64(&mut p, page_size);
    be64(&mut p, page_size);
    command(out, CommandKind::PostcopyAdvise, &p);
}

/// The "ram" START section with the block list, EOS and footer (§2.2).
pub(crate) fn ram_setup(out: &mut Vec<u8>, section_id: u32, blocks: &[DestBlock]) {
    out.push(SectionType::Start as u8);
    be32(out, section_id);
    str8(out, RAM_IDSTR);
    be32(out, RAM_INSTANCE_ID);
    be32(out, RAM_SECTION_VERSION);
    let total: u64 = blocks.iter().map(|b| b.used_length).sum();
    be64(out, total | ram_flags::MEM_SIZE);
    for b in blocks {
        str8(out, &b.name);
        be64(out, b.used_length);
    }
    section_close(out, section_id);
}

/// The header of a PART or END section (`type | be32 id`, §1.4).
pub(crate) fn section_open(out: &mut Vec<u8>, kind: SectionType, section_id: u32) {
    debug_assert!(matches!(kind, SectionType::Part | SectionType::End));
    out.push(kind as u8);
    be32(out, section_id);
}

/// The end of a RAM section's data: be64 EOS, then the footer.
pub(crate) fn section_close(out: &mut Vec<u8>, section_id: u32) {
    be64(out, ram_flags::EOS);
    out.push(SECTION_FOOTER);
    be32(out, section_id);
}

/// One page record (§2.3): `be64 offset | flags`, the block name unless
/// `name` is `None` (then CONTINUE is set), and the page (`Some`) or the
/// ZERO record's fill byte 0 (`None`).
pub(crate) fn page_record(out: &mut Vec<u8>, offset: u64, name: Option<&str>, data: Option<&[u8]>) {
    let mut flags = if data.is_some() {
        ram_flags::PAGE
    } else {
        ram_flags::ZERO
    };
    if name.is_none() {
        flags |= ram_flags::CONTINUE;
    }
    be64(out, offset | flags);
    if let Some(name) = name {
        str8(out, name);
    }
    match data {
        Some(d) => out.extend_from_slice(d),
        None => out.push(0),
    }
}

/// The end of the postcopy-preempt channel: a bare `be64 EOS` record (no
/// section around it), on which the destination's preempt thread stops
/// reading (docs/qemu-10.0-wire-format.md, "postcopy-preempt").
pub(crate) fn preempt_eos(out: &mut Vec<u8>) {
    be64(out, ram_flags::EOS);
}

/// Merges the pages for which `unsent(page)` holds, out of `pages`, into
/// byte ranges `(start, length)`.
pub(crate) fn unsent_ranges(
    pages: u64,
    page_size: u64,
    mut unsent: impl FnMut(u64) -> bool,
) -> Vec<(u64, u64)> {
    let mut ranges = Vec::new();
    let mut run: Option<u64> = None;
    for p in 0..=pages {
        let u = p < pages && unsent(p);
        match (run, u) {
            (None, true) => run = Some(p),
            (Some(start), false) => {
                ranges.push((start * page_size, (p - start) * page_size));
                run = None;
            }
            _ => {}
        }
    }
    ranges
}

/// POSTCOPY_RAM_DISCARD commands for `ranges` of block `name` (§3.2):
/// `u8 0 | u8 len | name | u8 0 | (be64 start, be64 length)...`, as many
/// ranges per command as fit [`MAX_DISCARD_PAYLOAD`]. None for no range.
pub(crate) fn discard_commands(out: &mut Vec<u8>, name: &str, ranges: &[(u64, u64)]) -> usize {
    let per_command = (MAX_DISCARD_PAYLOAD - 3 - name.len()) / 16;
    let mut n = 0;
    for chunk in ranges.chunks(per_command) {
        let mut p = Vec::with_capacity(3 + name.len() + 16 * chunk.len());
        p.push(0); // version
        str8(&mut p, name);
        p.push(0); // NUL "just for safety"
        for &(start, len) in chunk {
            be64(&mut p, start);
            be64(&mut p, len);
        }
        command(out, CommandKind::PostcopyRamDiscard, &p);
        n += 1;
    }
    n
}

/// The PACKAGED command and its blob: LISTEN, the device state verbatim,
/// PING 3, RUN (§3.2, §8.4).
pub(crate) fn packaged(out: &mut Vec<u8>, device_state: &[u8]) {
    let mut blob = Vec::with_capacity(device_state.len() + 32);
    command(&mut blob, CommandKind::PostcopyListen, &[]);
    blob.extend_from_slice(device_state);
    ping(&mut blob, PING_PACKAGE);
    command(&mut blob, CommandKind::PostcopyRun, &[]);
    command(
        out,
        CommandKind::Packaged,
        &(blob.len() as u32).to_be_bytes(),
    );
    out.extend_from_slice(&blob);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn header_and_config() {
        let mut out = Vec::new();
        header(&mut out, "microvm");
        let mut want = hex("5145564d 00000003 07 00000007");
        want.extend_from_slice(b"microvm");
        assert_eq!(out, want);
    }

    #[test]
    fn commands() {
        let mut out = Vec::new();
        command(&mut out, CommandKind::OpenReturnPath, &[]);
        ping(&mut out, 1);
        advise(&mut out, 0x1000);
        assert_eq!(
            out,
            hex("08 0001 0000  08 0002 0004 00000001  08 0003 0010 0000000000001000 0000000000001000")
        );
    }

    #[test]
    fn ram_setup_bytes() {
        let blocks = [
            DestBlock {
                name: "mem".into(),
                used_length: 0x4000,
            },
            DestBlock {
                name: "pc.bios".into(),
                used_length: 0x1000,
            },
        ];
        let mut out = Vec::new();
        ram_setup(&mut out, 2, &blocks);
        let mut want = hex("01 00000002 03");
        want.extend_from_slice(b"ram");
        want.extend(hex("00000000 00000004 0000000000005004 03"));
        want.extend_from_slice(b"mem");
        want.extend(hex("0000000000004000 07"));
        want.extend_from_slice(b"pc.bios");
        want.extend(hex("0000000000001000 0000000000000010 7e 00000002"));
        assert_eq!(out, want);
    }

    #[test]
    fn sections_and_page_records() {
        let mut out = Vec::new();
        section_open(&mut out, SectionType::Part, 2);
        let page = [0xabu8; 8];
        page_record(&mut out, 0x3000, Some("mem"), Some(&page));
        page_record(&mut out, 0x4000, None, None);
        page_record(&mut out, 0x5000, None, Some(&page));
        section_close(&mut out, 2);
        section_open(&mut out, SectionType::End, 2);
        section_close(&mut out, 2);
        let mut want = hex("02 00000002 0000000000003008 03");
        want.extend_from_slice(b"mem");
        want.extend_from_slice(&page);
        want.extend(hex("0000000000004022 00"));
        want.extend(hex("0000000000005028"));
        want.extend_from_slice(&page);
        want.extend(hex("0000000000000010 7e 00000002"));
        want.extend(hex("03 00000002 0000000000000010 7e 00000002"));
        assert_eq!(out, want);
        // A ZERO record with a name.
        let mut out = Vec::new();
        page_record(&mut out, 0, Some("mem"), None);
        let mut want = hex("0000000000000002 03");
        want.extend_from_slice(b"mem");
        want.push(0);
        assert_eq!(out, want);
    }

    #[test]
    fn range_merging() {
        let sent = [0u64, 1, 5, 9];
        let r = unsent_ranges(10, 0x1000, |p| !sent.contains(&p));
        assert_eq!(r, vec![(0x2000, 0x3000), (0x6000, 0x3000)]);
        assert_eq!(unsent_ranges(4, 0x1000, |_| true), vec![(0, 0x4000)]);
        assert_eq!(unsent_ranges(4, 0x1000, |_| false), vec![]);
        assert_eq!(
            unsent_ranges(4, 0x1000, |p| p % 2 == 1),
            vec![(0x1000, 0x1000), (0x3000, 0x1000)]
        );
        assert_eq!(unsent_ranges(0, 0x1000, |_| true), vec![]);
    }

    #[test]
    fn discard_bytes() {
        let mut out = Vec::new();
        let n = discard_commands(&mut out, "mem", &[(0x2000, 0x3000), (0x6000, 0x1000)]);
        assert_eq!(n, 1);
        let mut want = hex("08 0006 0026 00 03");
        want.extend_from_slice(b"mem");
        want.extend(hex(
            "00 0000000000002000 0000000000003000 0000000000006000 0000000000001000",
        ));
        assert_eq!(out, want);
        // The 8.1 case: one page held back gives exactly one one-page range.
        let mut out = Vec::new();
        assert_eq!(discard_commands(&mut out, "m", &[(0x7000, 0x1000)]), 1);
        assert_eq!(
            out,
            hex("08 0006 0014 00 01 6d 00 0000000000007000 0000000000001000")
        );
        let mut out = Vec::new();
        assert_eq!(discard_commands(&mut out, "m", &[]), 0);
        assert!(out.is_empty());
    }

    #[test]
    fn discard_splits_at_the_payload_limit() {
        let name = "pc.ram";
        let per = (MAX_DISCARD_PAYLOAD - 3 - name.len()) / 16;
        let ranges: Vec<(u64, u64)> = (0..(2 * per + 1) as u64)
            .map(|i| (i * 0x2000, 0x1000))
            .collect();
        let mut out = Vec::new();
        assert_eq!(discard_commands(&mut out, name, &ranges), 3);
        // Walk the commands and collect the ranges back.
        let (mut at, mut back) = (0, Vec::new());
        while at < out.len() {
            assert_eq!(out[at], 0x08);
            assert_eq!(u16::from_be_bytes([out[at + 1], out[at + 2]]), 6);
            let len = usize::from(u16::from_be_bytes([out[at + 3], out[at + 4]]));
            assert!(len <= MAX_DISCARD_PAYLOAD);
            let p = &out[at + 5..at + 5 + len];
            assert_eq!(&p[..3 + name.len()], b"\x00\x06pc.ram\x00");
            assert_eq!((len - 3 - name.len()) % 16, 0);
            for r in p[3 + name.len()..].chunks(16) {
                back.push((
                    u64::from_be_bytes(r[..8].try_into().unwrap()),
                    u64::from_be_bytes(r[8..].try_into().unwrap()),
                ));
            }
            at += 5 + len;
        }
        assert_eq!(back, ranges);
    }

    #[test]
    fn package_bytes() {
        let mut out = Vec::new();
        packaged(&mut out, b"DEV");
        let mut want = hex("08 0007 0004 00000016  08 0004 0000");
        want.extend_from_slice(b"DEV");
        want.extend(hex("08 0002 0004 00000003  08 0005 0000"));
        assert_eq!(out, want);
    }
}
