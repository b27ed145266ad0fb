//! A test-only encoder of QEMU 7.2 migration streams, written from the
//! wire-format reference (it is not the writer the crate will get).

use vmcsnap_migstream::wire::{
    ram_flags, CommandKind, SectionType, FILE_MAGIC, FILE_VERSION, SECTION_FOOTER, SUBSECTION,
};

pub const PAGE: u64 = 4096;

/// Builds a stream in memory.
pub struct Encoder {
    pub buf: Vec<u8>,
    /// Write section footers (send-section-footer).
    pub footers: bool,
    /// Write a guest address after each block list entry (x-ignore-shared).
    pub guest_addrs: bool,
    last_block: Option<String>,
}

impl Encoder {
    /// Magic and version.
    pub fn new() -> Self {
        let mut e = Encoder {
            buf: Vec::new(),
            footers: true,
            guest_addrs: false,
            last_block: None,
        };
        e.be32(FILE_MAGIC);
        e.be32(FILE_VERSION);
        e
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn be16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub fn be32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub fn be64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }
    pub fn str8(&mut self, s: &str) -> &mut Self {
        self.u8(s.len() as u8).bytes(s.as_bytes())
    }

    /// The configuration section with an optional capabilities subsection.
    pub fn config(&mut self, machine: &str, caps: &[&str]) -> &mut Self {
        self.u8(SectionType::Configuration as u8)
            .be32(machine.len() as u32)
            .bytes(machine.as_bytes());
        if !caps.is_empty() {
            self.u8(SUBSECTION)
                .str8("configuration/capabilities")
                .be32(1)
                .be32(caps.len() as u32);
            for c in caps {
                self.str8(c);
            }
        }
        self
    }

    /// A START or FULL section header.
    pub fn full_header(
        &mut self,
        kind: SectionType,
        id: u32,
        idstr: &str,
        instance: u32,
        version: u32,
    ) -> &mut Self {
        self.u8(kind as u8)
            .be32(id)
            .str8(idstr)
            .be32(instance)
            .be32(version)
    }

    /// A PART or END section header.
    pub fn short_header(&mut self, kind: SectionType, id: u32) -> &mut Self {
        self.u8(kind as u8).be32(id)
    }

    pub fn footer(&mut self, id: u32) -> &mut Self {
        if self.footers {
            self.u8(SECTION_FOOTER).be32(id);
        }
        self
    }

    /// EOS and footer: the end of a RAM section.
    pub fn eos(&mut self, id: u32) -> &mut Self {
        self.be64(ram_flags::EOS).footer(id)
    }

    /// START "ram" with the block list (name, length, guest address).
    pub fn ram_setup(&mut self, id: u32, blocks: &[(&str, u64)]) -> &mut Self {
        self.full_header(SectionType::Start, id, "ram", 0, 4);
        let total: u64 = blocks.iter().map(|b| b.1).sum();
        self.be64(total | ram_flags::MEM_SIZE);
        for (i, (name, len)) in blocks.iter().enumerate() {
            self.str8(name).be64(*len);
            if self.guest_addrs {
                self.be64(0x1000_0000 * i as u64);
            }
        }
        self.eos(id)
    }

    fn record(&mut self, block: &str, offset: u64, flags: u64) -> &mut Self {
        if self.last_block.as_deref() == Some(block) {
            self.be64(offset | flags | ram_flags::CONTINUE)
        } else {
            self.last_block = Some(block.to_owned());
            self.be64(offset | flags).str8(block)
        }
    }

    /// A PAGE record (CONTINUE when the block is the previous record's).
    pub fn page(&mut self, block: &str, offset: u64, data: &[u8]) -> &mut Self {
        assert_eq!(data.len() as u64, PAGE);
        self.record(block, offset, ram_flags::PAGE).bytes(data)
    }

    /// A ZERO record.
    pub fn zero(&mut self, block: &str, offset: u64) -> &mut Self {
        self.record(block, offset, ram_flags::ZERO).u8(0)
    }

    /// Forget the previous block, so the next record names its block.
    pub fn forget_block(&mut self) -> &mut Self {
        self.last_block = None;
        self
    }

    /// A FULL device section with an opaque body; returns its bytes range.
    pub fn device(&mut self, id: u32, idstr: &str, body: &[u8]) -> std::ops::Range<usize> {
        let start = self.buf.len();
        self.full_header(SectionType::Full, id, idstr, 0, 1)
            .bytes(body)
            .footer(id);
        start..self.buf.len()
    }

    pub fn command(&mut self, kind: CommandKind, payload: &[u8]) -> &mut Self {
        self.u8(SectionType::Command as u8)
            .be16(kind as u16)
            .be16(payload.len() as u16)
            .bytes(payload)
    }

    pub fn eof(&mut self) -> &mut Self {
        self.u8(SectionType::Eof as u8)
    }

    pub fn vmdesc(&mut self, json: &str) -> &mut Self {
        self.u8(SectionType::VmDescription as u8)
            .be32(json.len() as u32)
            .bytes(json.as_bytes())
    }
}

/// A page whose every byte is `b`.
pub fn filled(b: u8) -> Vec<u8> {
    vec![b; PAGE as usize]
}

pub const VMDESC: &str = r#"{"page_size": 4096, "devices": [{"name": "timer", "instance_id": 0, "vmsd_name": "timer", "version": 2, "fields": []}, {"name": "cpu", "instance_id": 0, "vmsd_name": "cpu", "version": 12, "fields": []}]}"#;

/// A complete small stream: config, blocks "ram0" (8 pages) and "rom"
/// (2 pages), all pages in scan order over two PART sections (the second
/// starting with CONTINUE), an empty END, two devices, EOF, vmdesc.
/// Returns the stream and the device state bytes.
pub fn small_stream() -> (Vec<u8>, Vec<u8>) {
    let mut e = Encoder::new();
    e.config("microvm", &[]);
    e.ram_setup(2, &[("ram0", 8 * PAGE), ("rom", 2 * PAGE)]);
    e.short_header(SectionType::Part, 2);
    for p in 0..5 {
        if p % 2 == 0 {
            e.zero("ram0", p * PAGE);
        } else {
            e.page("ram0", p * PAGE, &filled(p as u8));
        }
    }
    e.eos(2);
    e.short_header(SectionType::Part, 2);
    for p in 5..8 {
        e.page("ram0", p * PAGE, &filled(p as u8));
    }
    e.page("rom", 0, &filled(0xee)).zero("rom", PAGE).eos(2);
    e.short_header(SectionType::End, 2).eos(2);
    let a = e.device(0, "timer", &[1, 2, 3, 4, 5, 6, 7, 8]);
    let b = e.device(1, "cpu", &[0x7e, 0, 0, 0, 1, 0, 0x06, 0]);
    let device = e.buf[a.start..b.end].to_vec();
    e.eof().vmdesc(VMDESC);
    (e.buf.clone(), device)
}
