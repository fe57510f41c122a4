//! safetensors files edited byte by byte, for the tests of what the readers refuse. Shared by
//! tests/io.rs (the library) and tests/cli_reliability.rs (the binary).

/// `bytes`, a safetensors file, with the tensor `name` named twice in its header: a copy of its
/// entry put first, the data unchanged.
pub fn with_tensor_named_twice(bytes: &[u8], name: &str) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    let key = format!("\"{name}\":");
    let entry = header.split(key.as_str()).nth(1).unwrap();
    let entry = &entry[..=entry.find('}').unwrap()];
    let doubled = header.replacen('{', &format!("{{{key}{entry},"), 1);
    let mut dup = (doubled.len() as u64).to_le_bytes().to_vec();
    dup.extend_from_slice(doubled.as_bytes());
    dup.extend_from_slice(&bytes[8 + n..]);
    dup
}
