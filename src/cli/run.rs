//! `trimul run`: one layer applied to one input file.

use std::process::ExitCode;
use std::time::Instant;

use trimul::{io, Direction, Options, TriMul, Weights};

use super::{device_summary, open_device, CliError, CliResult, Progress, RunArgs};

pub fn run(args: &RunArgs) -> CliResult {
    // Before reading and computing: a forward can take minutes.
    super::check_output_path("--output", &args.output)?;
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
    let y = if args.in_place {
        let mut xy = input.x;
        layer.forward_in_place(&mut xy, input.mask.as_deref(), shape)?;
        xy
    } else {
        layer.forward(&input.x, input.mask.as_deref(), shape)?
    };
    let seconds = start.elapsed().as_secs_f64();
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
