//! The `trimul` command line. See `trimul --help` and the `cli` module.
#![forbid(unsafe_code)]

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
