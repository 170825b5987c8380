//! The `granary` command line: ingest, list, inspect, read, verify, repair and benchmark a store.
//! The commands live in the library (`granary::cli`), so the Python package runs the same code.
//!
//! Owns: only `main`, which runs `granary::cli::main`. Never: parses an argument or runs a command
//! itself.

fn main() -> std::process::ExitCode {
    granary::cli::main()
}
