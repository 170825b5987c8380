//! The `granary` command line: ingest, list, inspect, read, verify, repair and benchmark a store.
//! The commands live in the library (`granary::cli`), so the Python package runs the same code.

fn main() -> std::process::ExitCode {
    granary::cli::main()
}
