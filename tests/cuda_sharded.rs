//! The sharded forward across the GPUs of one host (NCCL), against the f64 reference and the
//! one-GPU forward. Skips with a visible message without the `cuda` feature, two GPUs or NCCL
//! (`TRIMUL_REQUIRE_DEVICE` makes that a failure).
#![cfg(feature = "cuda")]

use std::io::Write;
use std::time::{Duration, Instant};

use trimul::backend::cuda::CudaBackend;
use trimul::collective::Communicator;
use trimul::plan::shard::ShardOptions;
use trimul::rand::Rng;
use trimul::reference;
use trimul::sharded::ShardedGroup;
use trimul::{Config, Direction, Formulation, Layer, Options, Precision, Problem, Shape, Weights};

#[path = "support/seed.rs"]
mod test_seed;
use test_seed::this_test_seed as seed;

const TOL: f64 = 2e-2;

/// Two GPUs and NCCL, or `None` with a visible message.
fn two_gpus() -> Option<CudaBackend> {
    let why = match (CudaBackend::new(1), trimul::collective::nccl_version()) {
        (Ok(_), Ok(_)) => return CudaBackend::new(0).ok(),
        (Err(e), _) | (_, Err(e)) => e,
    };
    if std::env::var_os("TRIMUL_REQUIRE_DEVICE").is_some() && std::env::var_os("TRIMUL_REQUIRE_GPUS").is_some() {
        panic!("two CUDA GPUs and NCCL required (TRIMUL_REQUIRE_GPUS is set) but unavailable: {why}");
    }
    let _ = writeln!(std::io::stderr(), "SKIPPED: the sharded forward needs two CUDA GPUs and NCCL: {why}");
    None
}

/// One sharded forward of `problem` over two GPUs against the f64 reference and the one-GPU
/// forward of the same (rounded) x, with weights (biased where the formulation has biases) and x
/// from this test's seed.
fn check(one: &CudaBackend, problem: &Problem) {
    check_with(one, problem, None)
}

/// As [`check`], with the ranks' plans fixed by `options` (else left to memory), which every
/// rank must then show.
fn check_with(one: &CudaBackend, problem: &Problem, options: Option<ShardOptions>) {
    const GPUS: usize = 2;
    // Biases wherever the formulation has them (gpumode's linears have none).
    let biases = problem.config.formulation == Formulation::Af3;
    let seed = seed();
    let weights = Weights::random(problem.config, biases, seed).unwrap();
    let mut rng = Rng::new(seed ^ 0x5A);
    let x: Vec<f32> = rng.cauchy_vec(problem.x_len(), 1.0).into_iter().map(|v| problem.io.round(v)).collect();
    let mask = problem.masked.then(|| rng.mask_vec(problem.mask_len()));
    let devices: Vec<usize> = (0..GPUS).collect();
    let mut group = match options {
        Some(o) => ShardedGroup::with_options(&weights, problem, &devices, o).unwrap(),
        None => ShardedGroup::on_local_gpus(&weights, problem, &devices).unwrap(),
    };
    if let Some(o) = options {
        for layer in group.layers() {
            let plan = layer.plan();
            assert_eq!(o.hidden_pass.unwrap_or(problem.config.h), plan.pass, "{plan:?}");
            assert_eq!(o.output_rows, plan.output_rows, "{plan:?}");
        }
    }
    group.set_poison(true);
    let y = group.forward(&x, mask.as_deref()).unwrap();
    // Twice: a second forward reuses every buffer and must not see the first one's leftovers.
    let y2 = group.forward(&x, mask.as_deref()).unwrap();
    let what = format!(
        "{} {} {} B={} N={} on {GPUS} GPUs{}, {}",
        problem.config.formulation,
        problem.direction,
        problem.io,
        problem.shape.batch,
        problem.shape.n,
        if problem.in_place { " in place" } else { "" },
        group.layers()[0].plan().describe()
    );
    assert!(y.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: two forwards differ");
    let cmp = reference::check(&weights, problem, &x, mask.as_deref(), &y, TOL, TOL).unwrap();
    assert!(cmp.passed(), "{what}: {cmp:?}");
    assert!(cmp.rel_l2 < 5e-3, "{what}: rel L2 {}", cmp.rel_l2);

    let mut layer = Layer::new(one, &weights, Options::new(problem.direction)).unwrap();
    let mut want = vec![f32::NAN; x.len()];
    match problem.io {
        Precision::F32Io => layer.forward_into(&x, mask.as_deref(), &mut want, problem.shape).unwrap(),
        Precision::Bf16Io => {
            let xh: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let mut out = vec![half::bf16::NAN; xh.len()];
            layer.forward_into(&xh, mask.as_deref(), &mut out, problem.shape).unwrap();
            want = out.iter().map(|v| v.to_f32()).collect();
        }
        _ => {
            let xh: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
            let mut out = vec![half::f16::NAN; xh.len()];
            layer.forward_into(&xh, mask.as_deref(), &mut out, problem.shape).unwrap();
            want = out.iter().map(|v| v.to_f32()).collect();
        }
    }
    let cmp = reference::compare(&y, &want, TOL, TOL);
    assert_eq!(cmp.bad, 0, "{what}: differs from the one-GPU forward: {cmp}");
}

fn problem(f: Formulation, dir: Direction, b: usize, n: usize, io: Precision) -> Problem {
    let cfg = Config::new(f, 128, 128).unwrap();
    Problem::new(cfg, Shape::new(b, n), dir, true).unwrap().with_io(io)
}

/// Weights with biases for `p` from this test's seed, and a normal x and a mask from the seed
/// mixed with `salt`.
fn normal_inputs(p: &Problem, salt: u64) -> (Weights, Vec<f32>, Vec<f32>) {
    let weights = Weights::random(p.config, true, seed()).unwrap();
    let mut rng = Rng::new(seed() ^ salt);
    let x = rng.normal_vec(p.x_len(), 1.0);
    (weights, x, rng.mask_vec(p.mask_len()))
}

/// Both directions, both formulations, f32 and bf16 I/O, B = 2, an odd N (uneven rows: 49 and
/// 48), masked Cauchy inputs.
#[test]
fn sharded_forward_matches_reference_and_one_gpu() {
    let Some(one) = two_gpus() else { return };
    for dir in [Direction::Outgoing, Direction::Incoming] {
        check(&one, &problem(Formulation::Af3, dir, 2, 97, Precision::F32Io));
        check(&one, &problem(Formulation::Af3, dir, 1, 97, Precision::Bf16Io));
        check(&one, &problem(Formulation::GpuMode, dir, 2, 64, Precision::F32Io));
    }
}

/// Hidden passes (of 24 channels: passes that start inside the fused kernel's 32-channel
/// chunks, and a shorter last one), exchange steps of 5 matrices (a shorter last step per
/// batch), and the output stage in chunks of 1000 positions with the gate made again from x
/// (several per batch, the last shorter; B = 2; in place too): what a rank runs when memory is
/// short.
#[test]
fn sharded_forward_in_hidden_passes_with_the_gate_made_again() {
    let Some(one) = two_gpus() else { return };
    let o = ShardOptions { chunk_matrices: 5, hidden_pass: Some(24), output_rows: Some(1000), memory_limit: None };
    for dir in [Direction::Outgoing, Direction::Incoming] {
        check_with(&one, &problem(Formulation::Af3, dir, 2, 97, Precision::Bf16Io), Some(o));
        check_with(&one, &problem(Formulation::GpuMode, dir, 1, 64, Precision::F32Io), Some(o));
        // B = 2 with N² a multiple of 8: the kernels' 16-byte accesses on each batch's rows,
        // the gate made again and stored by the last of several passes.
        let b2 = problem(Formulation::Af3, dir, 2, 64, Precision::Bf16Io);
        check_with(&one, &b2, Some(o));
        check_with(&one, &b2, Some(ShardOptions { output_rows: None, ..o }));
        let in_place = problem(Formulation::Af3, dir, 1, 200, Precision::Bf16Io).in_place(true);
        check_with(&one, &in_place, Some(ShardOptions { output_rows: None, ..o }));
        check_with(&one, &in_place, Some(o));
    }
}

/// N whose rank blocks sit at addresses only 64 (N = 200) or 4 (N = 100, its column blocks)
/// bytes aligned inside the buffers: the GEMM plans must not assume more.
#[test]
fn sharded_forward_at_unaligned_row_offsets() {
    let Some(one) = two_gpus() else { return };
    for n in [200, 100] {
        for dir in [Direction::Outgoing, Direction::Incoming] {
            check(&one, &problem(Formulation::Af3, dir, 1, n, Precision::Bf16Io));
        }
    }
}

/// N = 1024 (the equality case), af3 bf16, both directions, and in place.
#[test]
fn sharded_forward_at_n1024_and_in_place() {
    let Some(one) = two_gpus() else { return };
    for dir in [Direction::Outgoing, Direction::Incoming] {
        check(&one, &problem(Formulation::Af3, dir, 1, 1024, Precision::Bf16Io));
    }
    check(&one, &problem(Formulation::Af3, Direction::Incoming, 1, 256, Precision::Bf16Io).in_place(true));
}

/// A communicator made from a unique id, as ranks in separate processes make one (here two
/// threads): each rank's `ShardedLayer` computes its rows, which put together equal the one-GPU
/// forward.
#[test]
fn ranks_joined_by_unique_id_match_one_gpu() {
    let Some(one) = two_gpus() else { return };
    let p = problem(Formulation::Af3, Direction::Outgoing, 1, 128, Precision::F32Io);
    let (weights, x, mask) = normal_inputs(&p, 0x1D);
    let (n, c) = (p.shape.n, p.config.c);
    let mut layer = Layer::new(&one, &weights, Options::new(p.direction)).unwrap();
    let mut want = vec![f32::NAN; x.len()];
    layer.forward_into(&x, Some(&mask), &mut want, p.shape).unwrap();
    // Joined blocking (`join`, the default) and with a deadline (`join_within`: non-blocking).
    for deadline in [None, Some(Duration::from_secs(120))] {
        let parts = on_two_joined_ranks_as(deadline, |comm| {
            let mut layer = trimul::sharded::ShardedLayer::new(&weights, &p, comm).unwrap();
            upload_rows(&mut layer, &x, &mask);
            layer.forward_uploaded().unwrap();
            (layer.rows(), layer.download().unwrap())
        });
        for (rows, y) in parts {
            let want = &want[rows.start * n * c..rows.end * n * c];
            let cmp = reference::compare(&y, want, TOL, TOL);
            assert_eq!(cmp.bad, 0, "rows {rows:?}, deadline {deadline:?}: differs from the one-GPU forward: {cmp}");
        }
    }
    // A wrong id length is an error, not a crash.
    let id = trimul::collective::Communicator::unique_id().unwrap();
    assert_eq!(id.len(), 128);
    assert!(trimul::collective::Communicator::join(&id[..10], 2, 0, 0).is_err());
}

/// A rank that stops once the ranks have exchanged (its process died, its GPU hung): the
/// others' exchanges would wait on the GPU forever. The group's deadline aborts every
/// communicator and returns an error naming the rank left waiting, in both directions; the
/// group then refuses further forwards, and dropping it does not hang.
#[test]
fn a_lost_rank_is_an_error_not_a_hang() {
    let Some(_one) = two_gpus() else { return };
    for dir in [Direction::Outgoing, Direction::Incoming] {
        let p = problem(Formulation::Af3, dir, 1, 128, Precision::Bf16Io);
        let (weights, x, mask) = normal_inputs(&p, 0x105);
        let mut group = ShardedGroup::on_local_gpus(&weights, &p, &[0, 1]).unwrap();
        group.upload(&x, Some(&mask)).unwrap();
        // The ranks connect in their first exchange.
        group.forward_uploaded().unwrap();
        group.set_timeout(std::time::Duration::from_secs(2));
        let start = std::time::Instant::now();
        let err = group.forward_losing_rank(1).unwrap_err().to_string();
        assert!(err.contains("rank 0") && err.contains("aborted"), "{dir}: {err}");
        assert!(start.elapsed().as_secs() < 30, "{dir}: took {:?}", start.elapsed());
        let again = group.forward(&x, Some(&mask)).unwrap_err().to_string();
        assert!(again.contains("aborted"), "{dir}: {again}");
        drop(group);
    }
}

/// Ranks that planned different passes (here fixed so on purpose; GPUs with different free
/// memory can too) find out together at their first forward, from one small all-reduce, and
/// each returns an error naming the plans instead of exchanging mismatched blocks.
#[test]
fn ranks_that_planned_differently_refuse_together() {
    let Some(_one) = two_gpus() else { return };
    let p = problem(Formulation::Af3, Direction::Outgoing, 1, 64, Precision::Bf16Io);
    let (weights, x, mask) = normal_inputs(&p, 0xD1F);
    let errors = on_two_joined_ranks(|comm| {
        // Rank 0 plans passes of 32 channels, rank 1 of 64.
        let pass = 32 << comm.rank();
        let options = ShardOptions { hidden_pass: Some(pass), ..ShardOptions::default() };
        let mut layer = trimul::sharded::ShardedLayer::with_options(&weights, &p, comm, options).unwrap();
        upload_rows(&mut layer, &x, &mask);
        layer.forward_uploaded().unwrap_err().to_string()
    });
    for e in errors {
        assert!(e.contains("planned different passes (from 32 to 64 channels"), "{e}");
    }
}

/// One `ShardedRank` per GPU serving several layers and shapes, as a model's layers share one
/// (the Python package's way): two weight sets, outgoing f32 at N = 64 and incoming bf16 at
/// N = 97 (uneven rows), on caller device buffers, enqueued back to back on two streams; a second
/// layer of a shape run before reuses its workspace. Each rank's rows equal the one-GPU
/// forward's.
#[test]
fn one_rank_serves_several_layers_and_shapes() {
    let Some(one) = two_gpus() else { return };
    let s = seed();
    let cases = [
        (problem(Formulation::Af3, Direction::Outgoing, 1, 64, Precision::F32Io), s),
        (problem(Formulation::Af3, Direction::Incoming, 2, 97, Precision::Bf16Io), s ^ 1),
        (problem(Formulation::Af3, Direction::Outgoing, 1, 64, Precision::F32Io), s ^ 2),
    ];
    let inputs: Vec<(Weights, Vec<f32>, Vec<f32>)> = cases
        .iter()
        .map(|(p, seed)| {
            let mut rng = Rng::new(seed ^ 0x3A);
            let x = rng.cauchy_vec(p.x_len(), 1.0).into_iter().map(|v| p.io.round(v)).collect();
            (Weights::random(p.config, true, *seed).unwrap(), x, rng.mask_vec(p.mask_len()))
        })
        .collect();
    let parts = on_two_joined_ranks(|comm| {
        let mut rank = trimul::sharded::ShardedRank::new(comm).unwrap();
        let gpu = rank.backend().clone();
        let mut out = Vec::new();
        // Every case's rows uploaded first, then the three forwards enqueued back to
        // back with no wait between them, the second on the legacy default stream
        // (the others on the backend's): the rank orders them across workspaces and
        // streams. Then one wait, and the downloads.
        let mut staged = Vec::new();
        for ((p, _), (weights, x, mask)) in cases.iter().zip(&inputs) {
            let layer = Layer::new(&gpu, weights, Options::new(p.direction)).unwrap();
            let rows = rank.rows(p.shape.n).unwrap();
            let (n, c) = (p.shape.n, p.config.c);
            // The rank's rows of every batch, one batch after another.
            let pick = |v: &[f32], width: usize| -> Vec<f32> {
                (0..p.shape.batch)
                    .flat_map(|b| v[(b * n + rows.start) * n * width..(b * n + rows.end) * n * width].to_vec())
                    .collect()
            };
            let xs = pick(x, c);
            let xb: Vec<u8> = match p.io {
                Precision::F32Io => xs.iter().flat_map(|v| v.to_le_bytes()).collect(),
                _ => xs.iter().flat_map(|&v| p.io.encode_half(v).to_le_bytes()).collect(),
            };
            let mb: Vec<u8> = pick(mask, 1).iter().flat_map(|v| v.to_le_bytes()).collect();
            let mut xd = gpu.alloc_buffer::<u8>(xb.len()).unwrap();
            let mut md = gpu.alloc_buffer::<u8>(mb.len()).unwrap();
            let yd = gpu.alloc_buffer::<u8>(xb.len()).unwrap();
            gpu.upload_bytes(&xb, &mut xd).unwrap();
            gpu.upload_bytes(&mb, &mut md).unwrap();
            staged.push((layer, rows, xd, md, yd));
        }
        let mut bytes_after = Vec::new();
        for (i, ((p, _), (layer, _, xd, md, yd))) in cases.iter().zip(&staged).enumerate() {
            let problem = layer.problem(p.shape, true).unwrap().with_io(p.io);
            let stream = if i == 1 { 0 } else { gpu.stream() as u64 };
            // SAFETY: the buffers hold the rank's rows and outlive the forward
            // (waited for below).
            unsafe { rank.forward_layer(layer, &problem, xd.ptr(), md.ptr(), yd.ptr(), stream) }.unwrap();
            bytes_after.push(rank.workspace_bytes());
        }
        rank.wait(std::time::Duration::from_secs(60)).unwrap();
        for ((p, _), (_, rows, xd, _, yd)) in cases.iter().zip(&staged) {
            let mut yb = vec![0u8; xd.len()];
            gpu.download_bytes(yd, &mut yb).unwrap();
            let y: Vec<f32> = match p.io {
                Precision::F32Io => yb.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
                _ => yb.chunks_exact(2).map(|b| p.io.decode_half(u16::from_le_bytes([b[0], b[1]]))).collect(),
            };
            out.push((rows.clone(), y));
        }
        // The third case's shape ran first: its layer took that workspace.
        assert_eq!(bytes_after[1], bytes_after[2], "a shape run before planned a second workspace");
        // A layer of the other direction is refused, not run as this problem's.
        let (p, _) = &cases[0];
        let other = Layer::new(&gpu, &inputs[0].0, Options::new(Direction::Incoming)).unwrap();
        // SAFETY: refused before any launch.
        let err = unsafe { rank.forward_layer(&other, p, 16, 0, 32, 0) }.unwrap_err().to_string();
        assert!(err.contains("direction"), "{err}");
        rank.release_workspaces(std::time::Duration::from_secs(60)).unwrap();
        assert_eq!(rank.workspace_bytes(), 0);
        out
    });
    for (i, ((p, _), (weights, x, mask))) in cases.iter().zip(&inputs).enumerate() {
        let mut layer = Layer::new(&one, weights, Options::new(p.direction)).unwrap();
        let want: Vec<f32> = match p.io {
            Precision::F32Io => {
                let mut y = vec![f32::NAN; x.len()];
                layer.forward_into(x, Some(mask), &mut y, p.shape).unwrap();
                y
            }
            _ => {
                let xh: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
                let mut y = vec![half::bf16::NAN; xh.len()];
                layer.forward_into(&xh, Some(mask), &mut y, p.shape).unwrap();
                y.iter().map(|v| v.to_f32()).collect()
            }
        };
        let (n, c) = (p.shape.n, p.config.c);
        for rank_parts in &parts {
            let (rows, y) = &rank_parts[i];
            let want: Vec<f32> = (0..p.shape.batch)
                .flat_map(|b| want[(b * n + rows.start) * n * c..(b * n + rows.end) * n * c].to_vec())
                .collect();
            let cmp = reference::compare(y, &want, TOL, TOL);
            assert_eq!(cmp.bad, 0, "case {i}, rows {rows:?}: differs from the one-GPU forward: {cmp}");
        }
    }
}

/// A join whose other ranks never come (their process died before joining, or they were given
/// another unique id) fails after its timeout with an error that says so, instead of waiting
/// forever. Needs one GPU.
#[test]
fn a_join_without_its_peers_times_out() {
    let why = match (CudaBackend::new(0), trimul::collective::nccl_version()) {
        (Ok(_), Ok(_)) => None,
        (Err(e), _) | (_, Err(e)) => Some(e),
    };
    if let Some(why) = why {
        assert!(std::env::var_os("TRIMUL_REQUIRE_DEVICE").is_none(), "a CUDA GPU and NCCL required: {why}");
        let _ = writeln!(std::io::stderr(), "SKIPPED: joining a communicator needs a CUDA GPU and NCCL: {why}");
        return;
    }
    let id = Communicator::unique_id().unwrap();
    let start = Instant::now();
    let err = Communicator::join_within(&id, 2, 0, 0, Duration::from_secs(2)).err().expect("joined alone").to_string();
    let took = start.elapsed();
    assert!(err.contains("did not join within 2.0 s"), "{err}");
    assert!((Duration::from_secs(2)..Duration::from_secs(30)).contains(&took), "the join returned after {took:?}");
}

/// A peer that joined and then went away before the first exchange (its process died): this
/// rank's first exchange cannot reach it, and the forward fails within the communicator's
/// timeout (or its wait's), instead of waiting forever; dropping the rank does not hang.
#[test]
fn a_peer_gone_before_the_first_exchange_is_an_error_not_a_hang() {
    let Some(_one) = two_gpus() else { return };
    let p = problem(Formulation::Af3, Direction::Outgoing, 1, 64, Precision::Bf16Io);
    let weights = Weights::random(p.config, true, seed()).unwrap();
    let id = Communicator::unique_id().unwrap();
    let timeout = Duration::from_secs(5);
    let outcome = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let (id, weights) = (&id, &weights);
                s.spawn(move || {
                    let mut comm = Communicator::join_within(id, 2, rank, rank, timeout).unwrap();
                    if rank == 1 {
                        comm.abort();
                        return None;
                    }
                    let mut sharded = trimul::sharded::ShardedRank::new(comm).unwrap();
                    let gpu = sharded.backend().clone();
                    let layer = Layer::new(&gpu, weights, Options::new(p.direction)).unwrap();
                    let problem = layer.problem(p.shape, false).unwrap().with_io(p.io);
                    let rows = sharded.rows(p.shape.n).unwrap();
                    let bytes = rows.len() * p.shape.n * p.config.c * 2;
                    let (x, y) = (gpu.alloc_buffer::<u8>(bytes).unwrap(), gpu.alloc_buffer::<u8>(bytes).unwrap());
                    let start = Instant::now();
                    // SAFETY: x and y hold the rank's rows and outlive the forward (waited for, or
                    // its communicator aborted, before they are freed).
                    let done =
                        unsafe { sharded.forward_layer(&layer, &problem, x.ptr(), 0, y.ptr(), gpu.stream() as u64) }
                            .and_then(|()| sharded.wait(timeout));
                    let result = (done.map_err(|e| e.to_string()), start.elapsed());
                    drop(sharded);
                    Some(result)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).next().flatten()
    });
    let (result, took) = outcome.expect("rank 0's outcome");
    let err = result.expect_err("a forward without its peer succeeded");
    assert!(took < 3 * timeout, "the forward failed only after {took:?}: {err}");
    assert!(err.contains("was aborted") || err.contains("aborted after"), "not the lost peer's error: {err}");
    let _ = writeln!(std::io::stderr(), "rank 0 after {took:?}: {err}");
}

/// Runs `work` on ranks 0 and 1 at once, one thread each (rank r on GPU r), each with its
/// communicator joined from one unique id as ranks in separate processes join, with a deadline
/// (so that a rank whose join fails cannot leave the other's thread waiting in NCCL forever:
/// the test then fails instead of hanging); the ranks' results in rank order.
fn on_two_joined_ranks<T: Send>(work: impl Fn(Communicator) -> T + Sync) -> Vec<T> {
    on_two_joined_ranks_as(Some(Duration::from_secs(120)), work)
}

/// [`on_two_joined_ranks`] with the join's deadline given: `None` joins blocking.
fn on_two_joined_ranks_as<T: Send>(deadline: Option<Duration>, work: impl Fn(Communicator) -> T + Sync) -> Vec<T> {
    let id = Communicator::unique_id().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let (id, work) = (&id, &work);
                s.spawn(move || {
                    let comm = match deadline {
                        Some(t) => Communicator::join_within(id, 2, rank, rank, t),
                        None => Communicator::join(id, 2, rank, rank),
                    };
                    work(comm.unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Uploads the layer's rows of the whole `x` and `mask` (B = 1).
fn upload_rows(layer: &mut trimul::sharded::ShardedLayer, x: &[f32], mask: &[f32]) {
    let (rows, p) = (layer.rows(), *layer.problem());
    let (n, c) = (p.shape.n, p.config.c);
    layer.upload(&x[rows.start * n * c..rows.end * n * c], Some(&mask[rows.start * n..rows.end * n])).unwrap();
}
