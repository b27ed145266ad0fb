//! Commands (`QEMU_VM_COMMAND`, §1.5) that may appear in a precopy stream.
//!
//! Precopy streams carry OPEN_RETURN_PATH and PING when the `return-path`
//! capability is on, and POSTCOPY_ADVISE when `postcopy-ram` is on even if
//! postcopy never starts. QEMU 10.0 adds SWITCHOVER_START (command 11,
//! no payload) right before the RAM section's END of a precopy migration
//! (when its `send-switchover-start` property is on: the default, except
//! for machine types ≤ 9.2). Every other command means postcopy (or COLO)
//! actually ran, and is an error; so is a command the stream's QEMU
//! version does not define.

use std::io::Read;

use crate::dialect::Dialect;
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
    /// `SWITCHOVER_START` (QEMU 10.0): the source stopped iterating; the
    /// final RAM pass and the device state follow.
    SwitchoverStart,
}

impl Command {
    /// The kind (number) of this command.
    pub fn kind(&self) -> CommandKind {
        match self {
            Command::OpenReturnPath => CommandKind::OpenReturnPath,
            Command::Ping(_) => CommandKind::Ping,
            Command::PostcopyAdvise { .. } => CommandKind::PostcopyAdvise,
            Command::SwitchoverStart => CommandKind::SwitchoverStart,
        }
    }
}

/// Reads a command after its 0x08 byte, which was at `at`, of a stream
/// written by `dialect`'s QEMU.
pub(crate) fn read_command<R: Read>(
    input: &mut Input<R>,
    at: u64,
    page_size: u64,
    dialect: Dialect,
) -> Result<Command, StreamError> {
    let cmd = input.be16("command number")?;
    let len = input.be16("command payload length")?;
    let kind = CommandKind::for_dialect(cmd, dialect).ok_or(StreamError::UnknownCommand {
        offset: at,
        cmd,
        dialect,
        max: CommandKind::max_for(dialect),
    })?;
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
        CommandKind::SwitchoverStart => {
            if len != 0 {
                return Err(bad_len("0"));
            }
            Ok(Command::SwitchoverStart)
        }
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
