//! The `granary` command line: ingest, list, inspect, read, verify, repair and benchmark a store.

#![deny(clippy::unwrap_used)]

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
