//! `trimul info`: what this build can run on, and why not where it cannot.

use std::process::ExitCode;

use serde::Serialize;
use trimul::backend::BACKEND_ENV;
use trimul::{BackendKind, Device, DeviceInfo};

use super::args::InfoArgs;
use super::exit::CliResult;
use super::output::{device_summary, emit, emit_json};

#[derive(Serialize)]
struct Report {
    version: &'static str,
    git_commit: Option<String>,
    compiled: Vec<BackendKind>,
    /// The backend commands use without `--backend`, or `None` when that choice fails.
    selected: Option<BackendKind>,
    /// How `selected` was chosen: `TRIMUL_BACKEND` or `detection`.
    selected_by: &'static str,
    /// Why the choice failed (e.g. `TRIMUL_BACKEND` names a backend that cannot open).
    selection_error: Option<String>,
    /// Every backend in detection order.
    backends: Vec<BackendStatus>,
}

#[derive(Serialize)]
struct BackendStatus {
    backend: BackendKind,
    compiled: bool,
    available: bool,
    device: Option<DeviceInfo>,
    /// The error's message when the backend is unusable.
    error: Option<String>,
}

pub fn run(args: &InfoArgs) -> CliResult {
    let compiled = Device::compiled();
    // Each backend is opened once: opening a GPU may compile kernels, so the selection below is
    // derived from these probes rather than by calling `Device::detect` a second time.
    let backends: Vec<BackendStatus> = Device::probe_all()
        .into_iter()
        .map(|(backend, found)| {
            let (device, error) = match found {
                Ok(info) => (Some(info), None),
                Err(e) => (None, Some(e.to_string())),
            };
            BackendStatus { backend, compiled: compiled.contains(&backend), available: device.is_some(), device, error }
        })
        .collect();
    let (selected, selected_by, selection_error) = select(&backends);
    let report = Report {
        version: env!("CARGO_PKG_VERSION"),
        git_commit: trimul::report::git_commit(),
        compiled,
        selected,
        selected_by,
        selection_error,
        backends,
    };
    if args.json {
        emit_json(&report)?;
    } else {
        print_text(&report)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The choice `Device::detect` makes, from the probe results: `TRIMUL_BACKEND` when set
/// (failing if that backend is unusable), else the first usable backend in detection order.
fn select(backends: &[BackendStatus]) -> (Option<BackendKind>, &'static str, Option<String>) {
    match std::env::var(BACKEND_ENV) {
        Ok(v) if !v.trim().is_empty() => match v.parse::<BackendKind>() {
            Err(e) => (None, "TRIMUL_BACKEND", Some(format!("{BACKEND_ENV}={v:?}: {e}"))),
            Ok(kind) => match backends.iter().find(|b| b.backend == kind) {
                Some(b) if b.available => (Some(kind), "TRIMUL_BACKEND", None),
                Some(b) => (None, "TRIMUL_BACKEND", b.error.clone()),
                None => (None, "TRIMUL_BACKEND", Some(format!("backend {kind} was not probed"))),
            },
        },
        Err(std::env::VarError::NotUnicode(v)) => {
            (None, "TRIMUL_BACKEND", Some(format!("{BACKEND_ENV}={v:?} is not valid UTF-8: expected cpu, cuda or hip")))
        }
        _ => (backends.iter().find(|b| b.available).map(|b| b.backend), "detection", None),
    }
}

fn print_text(r: &Report) -> CliResult<()> {
    let commit = r.git_commit.as_deref().map(|c| format!(" (commit {c})")).unwrap_or_default();
    emit(&format!("trimul {}{commit}", r.version))?;
    let compiled: Vec<&str> = r.compiled.iter().map(|k| k.as_str()).collect();
    emit(&format!("compiled backends: {}", compiled.join(", ")))?;
    match (&r.selected, &r.selection_error) {
        (Some(k), _) if r.selected_by == "detection" => emit(&format!(
            "selected: {k} (first usable of hip, cuda, cpu; set {BACKEND_ENV} or --backend to override)"
        ))?,
        (Some(k), _) => emit(&format!("selected: {k} ({BACKEND_ENV})"))?,
        (None, Some(e)) => emit(&format!("selected: none ({BACKEND_ENV}): {e}"))?,
        (None, None) => emit("selected: none")?,
    }
    emit("")?;
    for b in &r.backends {
        match (&b.device, &b.error) {
            (Some(info), _) => {
                emit(&format!("{:<5} available: {}", b.backend.as_str(), device_summary(b.backend, info)))?;
                if !info.vendor.is_empty() {
                    emit(&format!("      vendor: {}", info.vendor))?;
                }
                if !info.versions.is_empty() {
                    let v: Vec<String> = info.versions.iter().map(|(n, v)| format!("{n} {v}")).collect();
                    emit(&format!("      versions: {}", v.join(", ")))?;
                }
            }
            (None, e) => {
                emit(&format!("{:<5} unavailable: {}", b.backend.as_str(), e.as_deref().unwrap_or("unknown reason")))?;
            }
        }
    }
    Ok(())
}
