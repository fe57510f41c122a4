//! safetensors I/O: layer weights under four naming schemes, and the pair tensors `x`, `mask`
//! and `y`.
//!
//! # Weights
//!
//! [`Weights::from_safetensors`] reads one TriMul layer and infers the formulation, `C` and `H`
//! from the tensor names and shapes. Accepted names (shapes in SPEC.md's notation):
//!
//! | scheme ([`NamingScheme`]) | tensors |
//! |---|---|
//! | `GpuMode` (formulation gpumode) | `norm.weight [C]`, `norm.bias [C]`, `left_proj.weight`, `right_proj.weight`, `left_gate.weight`, `right_gate.weight`, `out_gate.weight` (each `[H, C]`), `to_out_norm.weight [H]`, `to_out_norm.bias [H]`, `to_out.weight [C, H]`. No linear biases: a `left_proj.bias` (or any `*.bias` of a linear layer) is an error. |
//! | `Packed` (af3; cuEquivariance modules, Boltz) | `norm_in.weight [C]`, `norm_in.bias [C]`, `p_in.weight [2H, C]`, `g_in.weight [2H, C]`, `norm_out.weight [H]`, `norm_out.bias [H]`, `p_out.weight [C, H]`, `g_out.weight [C, C]`; optional `p_in.bias [2H]`, `g_in.bias [2H]`, `p_out.bias [C]`, `g_out.bias [C]`. The rows of `p_in`/`g_in` are `[a; b]`: the first `H` rows are the left (`a`) projection/gate, the next `H` the right (`b`) one. |
//! | `CuEquivarianceFunctional` (af3) | the `Packed` names with the dot replaced by `_`: `norm_in_weight`, `norm_in_bias`, `p_in_weight`, `p_in_bias`, `g_in_weight`, `g_in_bias`, `norm_out_weight`, `norm_out_bias`, `p_out_weight`, `p_out_bias`, `g_out_weight`, `g_out_bias`. |
//! | `OpenFold` (af3) | `layer_norm_in.{weight,bias} [C]`, `linear_a_p`, `linear_a_g`, `linear_b_p`, `linear_b_g` (`.weight [H, C]`, optional `.bias [H]`), `layer_norm_out.{weight,bias} [H]`, `linear_z.weight [C, H]`, `linear_g.weight [C, C]` (optional `.bias [C]`). |
//!
//! Canonical mapping ([`Weights`]): `a_p`/`left_proj` → `left_proj`, `a_g` → `left_gate`,
//! `b_p` → `right_proj`, `b_g` → `right_gate`, `g_out`/`linear_g`/`out_gate` → `out_gate`,
//! `p_out`/`linear_z`/`to_out` → `out_proj`.
//!
//! Weight tensors may be F32, F16, BF16 or F64; they are converted to f32. Every tensor of a file
//! must belong to one layer of one scheme: unknown tensors, names of two schemes, a missing
//! tensor, a wrong rank or shape are errors that name the tensor. The names may carry a common
//! prefix ending in `.` (a layer cut out of a whole checkpoint, e.g.
//! `pairformer.layers.0.tri_mul_out.p_in.weight`); it is stripped. A file holding several layers
//! is an error listing their prefixes; pick one with [`Weights::from_safetensors_with_prefix`].
//!
//! # Pair tensors
//!
//! [`read_input`] reads `x` (`[B, N, N, C]`, or `[N, N, C]` meaning `B = 1`; F32, F16, BF16 or
//! F64) and the optional `mask` (`[B, N, N]`, or `[N, N]` when `B = 1`; F32, F16, BF16, F64,
//! BOOL, U8, I32 or I64, every value 0 or 1). [`write_output`] writes `y` (`[B, N, N, C]`, F32)
//! and [`read_output`] reads it back. Other tensors in these files are ignored, so one file may
//! carry `x`, `mask` and a reference `y`. These files reach gigabytes (`x` at N = 2048, C = 128
//! is 2 GiB in f32), so they are streamed in chunks rather than read whole: peak memory is the
//! f32 tensor plus one chunk.
//!
//! Files are written to a sibling temporary file and renamed into place, so a failed write never
//! leaves a truncated file under the requested name.
//!
//! # Files
//!
//! `names.rs` holds the schemes and finds a layer among a file's names, `weights.rs` reads and
//! writes layers, `pairs.rs` the pair tensors, `tensor_file.rs` streams safetensors files (both
//! kinds go through it), `messages.rs` says in errors what came from a file, and `files.rs`
//! bounds reads and writes outputs atomically.
//!
//! [`Weights`]: crate::weights::Weights
//! [`Weights::from_safetensors`]: crate::weights::Weights::from_safetensors
//! [`Weights::from_safetensors_with_prefix`]: crate::weights::Weights::from_safetensors_with_prefix

mod files;
mod messages;
mod names;
mod pairs;
mod tensor_file;
mod weights;

pub use files::{check_output, check_output_dir, read_text, write_file, MAX_JSON_BYTES};
pub use names::NamingScheme;
pub use pairs::{read_input, read_input_bytes, read_output, write_input, write_output, PairInput};
