//! The names that the command line, JSON and messages use for the crate's small enums, each
//! enum's from one table: `as_str`, `Display`, and a case-insensitive `FromStr` that also takes
//! aliases and lists every accepted name when it refuses one.

/// `named_enum!(Type, "what it is", [Variant => "name" | "alias" …, …])` implements
/// `Type::as_str`, `Display` and `FromStr` from the table.
macro_rules! named_enum {
    ($ty:ident, $what:literal, [$($var:ident => $name:literal $(| $alias:literal)*),+ $(,)?]) => {
        impl $ty {
            /// Its name on the command line, in JSON and in messages; `parse` takes it back.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$var => $name,)+
                }
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = $crate::error::Error;
            fn from_str(s: &str) -> $crate::error::Result<Self> {
                match s.trim().to_ascii_lowercase().as_str() {
                    $($name $(| $alias)* => Ok($ty::$var),)+
                    other => Err($crate::error::Error::InvalidArgument(format!(
                        "unknown {} {other:?}: expected {}",
                        $what,
                        $crate::named::either(&[$($name),+])
                    ))),
                }
            }
        }
    };
}
pub(crate) use named_enum;

/// `a`, `a or b`, `a, b or c`.
pub(crate) fn either(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use crate::problem::{Direction, Formulation, Precision};

    #[test]
    fn names_round_trip_take_aliases_and_list_the_choices() {
        for d in [Direction::Outgoing, Direction::Incoming] {
            assert_eq!(d.as_str().parse::<Direction>().unwrap(), d);
            assert_eq!(d.to_string(), d.as_str());
        }
        assert_eq!(" IN ".parse::<Direction>().unwrap(), Direction::Incoming);
        assert_eq!("fp16".parse::<Precision>().unwrap(), Precision::F16Io);
        let err = "af2".parse::<Formulation>().unwrap_err().to_string();
        assert!(err.contains("unknown formulation \"af2\": expected gpumode or af3"), "{err}");
        let err = "f64".parse::<Precision>().unwrap_err().to_string();
        assert!(err.contains("expected f32-io, bf16-io or f16-io"), "{err}");
    }
}
