//! Writing to stdout and stderr without panicking (`println!` panics when stdout is full or
//! closed). Commands write their output with `outln!` and `out!`, which return a
//! `StdoutError` for `?`; `main` ends a command whose reader closed the pipe (`| head`) quietly,
//! as ripgrep and git do, and reports any other failure as its one-line error. Notes on stderr
//! go through `errln!` and `err!`, which drop what stderr cannot take: there is nowhere left to
//! say it. Every write is flushed at once, so a failure shows at the line that failed, not in
//! a silent flush at exit.
//!
//! Owns: the macros `out!`, `outln!`, `err!` and `errln!`, `write_bytes` (a record's raw bytes),
//! `StdoutError`, and `is_closed_pipe`, which tells `main` a closed pipe from a failure. Never:
//! panics on a write, or keeps output in a buffer past the call that wrote it.

use std::fmt;
use std::io::Write;

/// A write to stdout failed.
#[derive(Debug)]
pub(crate) struct StdoutError(std::io::Error);

impl fmt::Display for StdoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "write to stdout: {}", self.0)
    }
}

// No `source`: the message already holds the OS text, which is printed once.
impl std::error::Error for StdoutError {}

/// `print!` that returns an error: `out!("...")?`.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::output::write_out(format_args!($($arg)*))
    };
}

/// `println!` that returns an error: `outln!("...")?`.
macro_rules! outln {
    () => {
        $crate::cli::output::write_out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::output::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprint!` that never panics.
macro_rules! err {
    ($($arg:tt)*) => {
        $crate::cli::output::write_err(format_args!($($arg)*))
    };
}

/// `eprintln!` that never panics.
macro_rules! errln {
    () => {
        $crate::cli::output::write_err(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::output::write_err(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) fn write_out(args: fmt::Arguments<'_>) -> Result<(), StdoutError> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_fmt(args).and_then(|()| stdout.flush()).map_err(StdoutError)
}

/// Raw bytes to stdout (a record).
pub(crate) fn write_bytes(bytes: &[u8]) -> Result<(), StdoutError> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(bytes).and_then(|()| stdout.flush()).map_err(StdoutError)
}

pub(crate) fn write_err(args: fmt::Arguments<'_>) {
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_fmt(args).and_then(|()| stderr.flush());
}

/// True when the command failed only because stdout's reader went away: not an error.
pub(crate) fn is_closed_pipe(error: &anyhow::Error) -> bool {
    error
        .chain()
        .any(|cause| cause.downcast_ref::<StdoutError>().is_some_and(|e| e.0.kind() == std::io::ErrorKind::BrokenPipe))
}
