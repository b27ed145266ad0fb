//! Prints a summary of a QEMU migration stream file (or stdin with `-`):
//! sections, RAM blocks, page counts by origin, device state and VM
//! description.
//!
//! ```sh
//! cargo run -p vmcsnap-migstream --example dump -- snapshot.mig [--pages]
//! zcat crates/migstream/tests/data/bgsnap-writer.mig.gz | cargo run -p vmcsnap-migstream --example dump -- -
//! ```
//!
//! `--pages` also lists every page saved out of scan order (guest writes);
//! `--records` lists every page record with its origin; `--qemu 10.0`
//! reads a stream of QEMU 10.0 (default 7.2).

use std::io::Read;
use std::process::ExitCode;

use vmcsnap_migstream::{Dialect, Event, PageOrigin, ReaderOptions, StreamReader};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let qemu = args.iter().position(|a| a == "--qemu");
    let dialect = match qemu.map(|i| args.get(i + 1).and_then(|v| Dialect::parse_version(v))) {
        None => Dialect::Qemu7_2,
        Some(Some(Ok(d))) => d,
        Some(_) => {
            eprintln!("--qemu wants a supported version: 7.2 or 10.0");
            return ExitCode::from(2);
        }
    };
    let Some(path) = args
        .iter()
        .enumerate()
        .find(|&(i, a)| !a.starts_with("--") && qemu.is_none_or(|q| i != q + 1))
        .map(|(_, a)| a)
    else {
        eprintln!("usage: dump FILE|- [--pages] [--records] [--qemu 7.2|10.0]");
        return ExitCode::from(2);
    };
    let list_pages = args.iter().any(|a| a == "--pages");
    let list_records = args.iter().any(|a| a == "--records");
    let source: Box<dyn Read> = if path == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        match std::fs::File::open(path) {
            Ok(f) => Box::new(f),
            Err(e) => {
                eprintln!("{path}: {e}");
                return ExitCode::FAILURE;
            }
        }
    };
    match dump(source, dialect, list_pages, list_records) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!();
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn dump(
    source: impl Read,
    dialect: Dialect,
    list_pages: bool,
    list_records: bool,
) -> Result<(), vmcsnap_migstream::StreamError> {
    let mut reader = StreamReader::with_options(source, ReaderOptions::for_dialect(dialect));
    let mut blocks: Vec<String> = Vec::new();
    let mut section_pages = 0u64;
    while let Some(event) = reader.next_event()? {
        match event {
            Event::Header {
                version,
                configuration,
            } => {
                println!("stream version {version}");
                match configuration {
                    Some(c) => println!(
                        "configuration: machine {:?}, capabilities {:?}, target page bits {:?}, uuid {}",
                        c.machine,
                        c.capabilities,
                        c.target_page_bits,
                        if c.uuid.is_some() { "set" } else { "none" }
                    ),
                    None => println!("configuration: none"),
                }
            }
            Event::Command {
                stream_offset,
                command,
            } => println!("@{stream_offset} command {command:?}"),
            Event::SectionStart(h) => {
                section_pages = 0;
                match &h.ident {
                    Some(i) => print!(
                        "@{} {} id={} {:?} instance {} version {}",
                        h.stream_offset,
                        h.kind.name(),
                        h.section_id,
                        i.idstr,
                        i.instance_id,
                        i.version_id
                    ),
                    None => print!("@{} {} id={}", h.stream_offset, h.kind.name(), h.section_id),
                }
            }
            Event::RamBlocks(list) => {
                print!(" [{} RAM blocks]", list.len());
                blocks = list.iter().map(|b| b.name.clone()).collect();
            }
            Event::Page {
                block,
                offset,
                origin,
                ..
            }
            | Event::ZeroPage {
                block,
                offset,
                origin,
                ..
            } => {
                section_pages += 1;
                if list_records {
                    println!("\n  record {} {offset:#x} {origin:?}", blocks[block]);
                }
                if list_pages && origin == PageOrigin::GuestWrite {
                    println!("\n  guest write: {} {offset:#x}", blocks[block]);
                }
            }
            Event::SectionEnd { footer, .. } => {
                println!(
                    ": {section_pages} page records{}",
                    if footer { ", footer" } else { "" }
                );
            }
            Event::DeviceState {
                stream_offset,
                data,
            } => {
                println!(
                    "@{stream_offset} device state: {} bytes, EOF at {}",
                    data.len(),
                    stream_offset + data.len() as u64
                )
            }
            Event::End { vmdesc } => match vmdesc {
                Some(d) => {
                    let names: Vec<&str> = d.devices.iter().map(|d| d.name.as_str()).collect();
                    println!(
                        "vmdesc: {} bytes JSON, page_size {:?}, {} devices: {}",
                        d.json.len(),
                        d.page_size,
                        names.len(),
                        names.join(" ")
                    )
                }
                None => println!("vmdesc: none"),
            },
        }
    }
    println!("RAM blocks:");
    for b in reader.ram_blocks() {
        let addr = b
            .guest_addr
            .map(|a| format!(" guest address {a:#x}"))
            .unwrap_or_default();
        println!("  {:<24} {:#12x} bytes{addr}", b.name, b.used_length);
    }
    let s = reader.stats();
    println!("pages        {:>8} {:>8} {:>8}", "total", "normal", "zero");
    for (name, origin) in [
        ("scan", PageOrigin::Scan),
        ("guest write", PageOrigin::GuestWrite),
        ("resent", PageOrigin::Resent),
    ] {
        let c = s.pages(origin);
        println!(
            "  {name:<12} {:>8} {:>8} {:>8}",
            c.total(),
            c.normal,
            c.zero
        );
    }
    let all = s.all_pages();
    println!(
        "  {:<12} {:>8} {:>8} {:>8}",
        "all",
        all.total(),
        all.normal,
        all.zero
    );
    println!(
        "{} bytes: {} ram sections, {} commands, device state {} bytes, vmdesc {} bytes, footers {:?}",
        s.bytes, s.ram_sections, s.commands, s.device_state_bytes, s.vmdesc_bytes, reader.section_footers()
    );
    Ok(())
}
