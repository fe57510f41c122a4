//! The errors of the commands and the exit codes they earn (see the `cli` module for what each
//! code means): every command returns a [`CliResult`], and `cli::main` turns its error into the
//! code and the one line on stderr.

use std::process::ExitCode;

/// Exit code of a failed check, or of a computation the device could not finish.
pub const EXIT_FAILED: u8 = 1;
/// Exit code of a usage or input error.
pub const EXIT_USAGE: u8 = 2;

/// An error on its way to the user: a one-line message and the exit code it earns.
#[derive(Debug)]
pub struct CliError {
    pub code: u8,
    pub message: String,
}

impl CliError {
    pub fn usage(message: impl Into<String>) -> CliError {
        CliError { code: EXIT_USAGE, message: message.into() }
    }
}

impl From<trimul::Error> for CliError {
    /// Failures of the device or its libraries while computing are "the run failed" (1);
    /// everything else (shapes, weights, files, a backend that is absent) is the caller's input (2).
    fn from(e: trimul::Error) -> CliError {
        use trimul::Error as E;
        let code = match e {
            E::Driver { .. } | E::Blas { .. } | E::NoKernels { .. } | E::OutOfMemory { .. } | E::NonFinite { .. } => {
                EXIT_FAILED
            }
            _ => EXIT_USAGE,
        };
        CliError { code, message: e.to_string() }
    }
}

pub type CliResult<T = ExitCode> = Result<T, CliError>;

/// Exit code when standard output is closed under us (`trimul check | head -1`: the reader is
/// gone). Nothing more is printed and the command stops where it was; 141 is what a shell
/// reports for a process killed by SIGPIPE, so `set -o pipefail` treats trimul like `grep` or
/// `yes`, and a script cannot mistake a run cut short for a complete one.
pub const EXIT_BROKEN_PIPE: u8 = 141;

#[cfg(test)]
mod tests {
    use trimul::BackendKind;

    use super::*;

    #[test]
    fn exit_codes_follow_the_error_kind() {
        let nc = trimul::Error::NotCompiled { backend: BackendKind::Cuda, feature: "cuda" };
        assert_eq!(CliError::from(nc).code, EXIT_USAGE);
        let drv = trimul::Error::driver(BackendKind::Cuda, "cuLaunchKernel", "CUDA_ERROR_LAUNCH_FAILED");
        assert_eq!(CliError::from(drv).code, EXIT_FAILED);
        assert_eq!(CliError::from(trimul::Error::Shape("x".into())).code, EXIT_USAGE);
    }
}
