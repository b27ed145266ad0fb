//! Commands (`QEMU_VM_COMMAND`, §1.5) that may appear in a precopy stream.
//!
//! Precopy streams carry OPEN_RETURN_PATH and PING when the `return-path`
//! capability is on, and POSTCOPY_ADVISE when `postcopy-ram` is on even if
//! postcopy never starts. Every other command means postcopy (or COLO)
//! actually ran, and is an error.

use std::io::Read;

use crate::error::StreamError;
use crate::input::Input;
use crate::wire::CommandKind;

/// A command the reader accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `OPEN_RETURN_PATH`: the destination opens its return path.
    OpenReturnPath,
    /// `PING` with its value; the destination answers PONG.
    Ping(u32),
    /// `POSTCOPY_ADVISE`: postcopy may follow (it did not, or the reader
    /// would fail at the next postcopy command).
    PostcopyAdvise {
        /// The OR of the page sizes of all RAM blocks, `None` for the
        /// 0-byte (dirty-bitmaps-only) form.
        page_size_summary: Option<u64>,
        /// The target page size, `None` for the 0-byte form.
        target_page_size: Option<u64>,
    },
}

impl Command {
    /// The kind (number) of this command.
    pub fn kind(&self) -> CommandKind {
        match self {
            Command::OpenReturnPath => CommandKind::OpenReturnPath,
            Command::Ping(_) => CommandKind::Ping,
            Command::PostcopyAdvise { .. } => CommandKind::PostcopyAdvise,
        }
    }
}

/// Reads a command after its 0x08 byte, which was at `at`.
pub(crate) fn read_command<R: Read>(
    input: &mut Input<R>,
    at: u64,
    page_size: u64,
) -> Result<Command, StreamError> {
    let cmd = input.be16("command number")?;
    let len = input.be16("command payload length")?;
    let kind = CommandKind::from_u16(cmd).ok_or(StreamError::UnknownCommand { offset: at, cmd })?;
    let name = kind.name();
    let bad_len = |expected| StreamError::BadCommandLength {
        offset: at,
        name,
        len,
        expected,
    };
    match kind {
        CommandKind::OpenReturnPath => {
            if len != 0 {
                return Err(bad_len("0"));
            }
            Ok(Command::OpenReturnPath)
        }
        CommandKind::Ping => {
            if len != 4 {
                return Err(bad_len("4"));
            }
            Ok(Command::Ping(input.be32("PING value")?))
        }
        CommandKind::PostcopyAdvise => match len {
            0 => Ok(Command::PostcopyAdvise {
                page_size_summary: None,
                target_page_size: None,
            }),
            16 => {
                let summary = input.be64("POSTCOPY_ADVISE page size summary")?;
                let tps = input.be64("POSTCOPY_ADVISE target page size")?;
                if tps != page_size {
                    return Err(StreamError::PageSizeMismatch {
                        offset: at,
                        stream: tps,
                        reader: page_size,
                    });
                }
                if summary != tps {
                    return Err(StreamError::HugePages {
                        offset: at,
                        summary,
                        target_page_size: tps,
                    });
                }
                Ok(Command::PostcopyAdvise {
                    page_size_summary: Some(summary),
                    target_page_size: Some(tps),
                })
            }
            _ => Err(bad_len("0 or 16")),
        },
        CommandKind::EnableColo => Err(StreamError::UnsupportedCommand {
            offset: at,
            name,
            hint: "COLO streams are not supported; disable the x-colo capability",
        }),
        CommandKind::PostcopyListen
        | CommandKind::PostcopyRun
        | CommandKind::PostcopyRamDiscard
        | CommandKind::Packaged
        | CommandKind::PostcopyResume
        | CommandKind::RecvBitmap => Err(StreamError::Postcopy { offset: at, name }),
    }
}
