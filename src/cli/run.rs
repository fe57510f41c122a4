//! `trimul run`: one layer applied to one input file.

use std::process::ExitCode;
use std::time::Instant;

use trimul::finite::{self, NonFinite};
use trimul::report::fmt_bytes;
use trimul::{io, Direction, Options, TriMul, Weights};

use super::args::{check_output_path, open_device, RunArgs};
use super::exit::{CliError, CliResult};
use super::output::{device_summary, Progress};

pub fn run(args: &RunArgs) -> CliResult {
    // Before reading and computing: a forward can take minutes.
    check_output_path("--output", &args.output)?;
    // The worker threads start now, while memory is plentiful: a thread that first starts when
    // the host is out of memory dies in glibc (registering its thread-local destructors) before
    // the forward's own allocations can report the shortage as an error.
    rayon::broadcast(|_| ());
    let progress = Progress::spinner();
    progress.set_message(format!("reading weights {}", args.weights.display()));
    let weights = match &args.prefix {
        Some(p) => Weights::from_safetensors_with_prefix(&args.weights, p)?,
        None => Weights::from_safetensors(&args.weights)?,
    };
    let config = weights.config();
    progress.set_message(format!("reading input {}", args.input.display()));
    let input = io::read_input(&args.input)?;
    if input.c != config.c {
        return Err(CliError::usage(format!(
            "{}: x has C = {} channels, but the weights in {} are for C = {}",
            args.input.display(),
            input.c,
            args.weights.display(),
            config.c
        )));
    }

    let device = open_device(args.backend)?;
    let direction = Direction::from(args.direction);
    progress.set_message(format!("forward on {}", device.kind()));
    let start = Instant::now();
    let mut layer = TriMul::new(&device, &weights, Options::new(direction))?;
    layer.set_memory_budget(args.max_memory);
    let shape = input.shape();
    let masked = input.mask.is_some();
    if let Some(budget) = args.max_memory {
        // A budget no plan fits is the user's number, not a failure of the device (exit 2, not 1).
        let needs = layer.memory_needs(shape, masked, args.in_place)?;
        if needs.min_total() > budget {
            return Err(CliError::usage(format!(
                "--max-memory {budget}: B={} N={} C={} needs at least {} bytes ({}: weights {}, x/mask/y {}, the \
                 narrowest workspace {}); raise it or leave it out",
                input.batch,
                input.n,
                config.c,
                needs.min_total(),
                fmt_bytes(needs.min_total()),
                fmt_bytes(needs.weights),
                fmt_bytes(needs.io),
                fmt_bytes(needs.min_workspace)
            )));
        }
    }
    // Counted before the forward: in place, y overwrites x.
    let x_non_finite = NonFinite::count(&input.x);
    let y = if args.in_place {
        let mut xy = input.x;
        layer.forward_in_place(&mut xy, input.mask.as_deref(), shape)?;
        xy
    } else {
        layer.forward(&input.x, input.mask.as_deref(), shape)?
    };
    let seconds = start.elapsed().as_secs_f64();
    // NaN in x propagates (as in PyTorch) and is reported; NaN from a finite x is an overflow of
    // the intermediates, and that y is refused rather than written.
    let y_non_finite = finite::check_output(&x_non_finite, &y, device.kind())?;
    if !y_non_finite.all_finite() {
        eprintln!(
            "trimul run: warning: y has {} non-finite values ({} NaN, {} infinite) of {}, propagated from the {} \
             non-finite values of x ({} NaN, {} infinite)",
            y_non_finite.total(),
            y_non_finite.nan,
            y_non_finite.infinite,
            y_non_finite.len,
            x_non_finite.total(),
            x_non_finite.nan,
            x_non_finite.infinite
        );
    }
    let plan = layer.exec_plan().map_or_else(String::new, |p| format!(" ({})", p.describe()));

    progress.set_message(format!("writing {}", args.output.display()));
    io::write_output(&args.output, &y, input.batch, input.n, input.c)?;
    progress.finish();
    eprintln!(
        "trimul run: {} {direction}, B={} N={} C={} H={}, {}; {} ({}): {:.1} ms including weight preparation \
         and transfers{plan}; wrote {}",
        config.formulation,
        input.batch,
        input.n,
        config.c,
        config.h,
        if masked { "masked" } else { "no mask" },
        device.kind(),
        device_summary(device.kind(), &device.info()),
        seconds * 1e3,
        args.output.display()
    );
    Ok(ExitCode::SUCCESS)
}
