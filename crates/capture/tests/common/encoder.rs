//! A test-only encoder of QEMU 7.2 migration streams (after
//! `crates/migstream/tests/common/encoder.rs`), for synthetic edge cases.
#![allow(dead_code)]

use vmcsnap_migstream::wire::{ram_flags, SectionType, FILE_MAGIC, FILE_VERSION, SECTION_FOOTER};

pub const PAGE: u64 = 4096;

/// Builds a stream in memory.
pub struct Encoder {
    pub buf: Vec<u8>,
    /// Write section footers (send-section-footer).
    pub footers: bool,
    last_block: Option<String>,
}

impl Encoder {
    /// Magic and version.
    pub fn new() -> Self {
        let mut e = Encoder {
            buf: Vec::new(),
            footers: true,
            last_block: None,
        };
        e.be32(FILE_MAGIC).be32(FILE_VERSION);
        e
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
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

    /// The configuration section (machine name, no subsections).
    pub fn config(&mut self, machine: &str) -> &mut Self {
        self.u8(SectionType::Configuration as u8)
            .be32(machine.len() as u32)
            .bytes(machine.as_bytes())
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

    /// START "ram" with the block list.
    pub fn ram_setup(&mut self, id: u32, blocks: &[(&str, u64)]) -> &mut Self {
        self.u8(SectionType::Start as u8)
            .be32(id)
            .str8("ram")
            .be32(0)
            .be32(4);
        let total: u64 = blocks.iter().map(|b| b.1).sum();
        self.be64(total | ram_flags::MEM_SIZE);
        for (name, len) in blocks {
            self.str8(name).be64(*len);
        }
        self.eos(id)
    }

    /// A PART (or END) section header.
    pub fn part(&mut self, id: u32) -> &mut Self {
        self.u8(SectionType::Part as u8).be32(id)
    }
    pub fn end_section(&mut self, id: u32) -> &mut Self {
        self.u8(SectionType::End as u8).be32(id)
    }

    fn record(&mut self, block: &str, offset: u64, flags: u64) -> &mut Self {
        if self.last_block.as_deref() == Some(block) {
            self.be64(offset | flags | ram_flags::CONTINUE)
        } else {
            self.last_block = Some(block.to_owned());
            self.be64(offset | flags).str8(block)
        }
    }

    /// A PAGE record for page number `page`.
    pub fn page(&mut self, block: &str, page: u64, data: &[u8]) -> &mut Self {
        assert_eq!(data.len() as u64, PAGE);
        self.record(block, page * PAGE, ram_flags::PAGE).bytes(data)
    }

    /// A ZERO record for page number `page` with fill byte `fill`.
    pub fn fill(&mut self, block: &str, page: u64, fill: u8) -> &mut Self {
        self.record(block, page * PAGE, ram_flags::ZERO).u8(fill)
    }

    /// A ZERO record (fill 0).
    pub fn zero(&mut self, block: &str, page: u64) -> &mut Self {
        self.fill(block, page, 0)
    }

    /// A FULL device section with an opaque body.
    pub fn device(&mut self, id: u32, idstr: &str, body: &[u8]) -> &mut Self {
        self.u8(SectionType::Full as u8)
            .be32(id)
            .str8(idstr)
            .be32(0)
            .be32(1)
            .bytes(body)
            .footer(id)
    }

    pub fn eof(&mut self) -> &mut Self {
        self.u8(SectionType::Eof as u8)
    }

    pub fn vmdesc(&mut self, json: &str) -> &mut Self {
        self.u8(SectionType::VmDescription as u8)
            .be32(json.len() as u32)
            .bytes(json.as_bytes())
    }

    /// Two devices, EOF and a VM description; returns the device state
    /// (the FULL sections) as the stream carries it.
    pub fn finish(&mut self) -> Vec<u8> {
        let start = self.buf.len();
        self.device(7, "timer", &[1, 2, 3, 4, 5, 6, 7, 8]).device(
            8,
            "cpu",
            &[0x7e, 0, 0, 0, 1, 0, 0x06, 0],
        );
        let device = self.buf[start..].to_vec();
        self.eof().vmdesc(VMDESC);
        device
    }
}

pub const VMDESC: &str = r#"{"page_size": 4096, "devices": [{"name": "timer", "instance_id": 0, "vmsd_name": "timer", "version": 2, "fields": []}, {"name": "cpu", "instance_id": 0, "vmsd_name": "cpu", "version": 12, "fields": []}]}"#;

/// A page whose every byte is `b`, with `tag` in its first 4 bytes.
pub fn page_of(b: u8, tag: u32) -> Vec<u8> {
    let mut p = vec![b; PAGE as usize];
    p[..4].copy_from_slice(&tag.to_le_bytes());
    p
}
