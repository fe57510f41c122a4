//! How errors name what came from a file: its names and shapes in one line, its path in front.

use std::fmt;

use crate::error::Error;

/// At most `max` items, backtick-quoted and comma-separated, with a count of the rest.
pub(super) fn list<S: AsRef<str>>(items: &[S], max: usize) -> String {
    let mut s = items.iter().take(max).map(|i| format!("`{}`", shown(i.as_ref()))).collect::<Vec<_>>().join(", ");
    if items.len() > max {
        s.push_str(&format!(" and {} more", items.len() - max));
    }
    s
}

/// A name from a file as a message shows it: control characters (a newline in a tensor name)
/// escaped, so that every message stays one line.
pub(super) fn shown(name: &str) -> std::borrow::Cow<'_, str> {
    if name.chars().any(char::is_control) {
        std::borrow::Cow::Owned(name.escape_debug().to_string())
    } else {
        std::borrow::Cow::Borrowed(name)
    }
}

pub(super) fn shape_str(shape: &[usize]) -> String {
    format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

/// Prefixes the message of a content error with where the content came from.
pub(super) fn in_file(path: &str, e: Error) -> Error {
    match e {
        Error::Weights(m) => Error::Weights(format!("{path}: {m}")),
        Error::Dtype(m) => Error::Dtype(format!("{path}: {m}")),
        Error::Shape(m) => Error::Shape(format!("{path}: {m}")),
        Error::InvalidArgument(m) => Error::InvalidArgument(format!("{path}: {m}")),
        other => other,
    }
}

pub(super) fn file_err(path: &str, reason: impl fmt::Display) -> Error {
    Error::File { path: path.to_string(), reason: reason.to_string() }
}
