//! Option enums with a fixed set of names (`--strategy hybrid-shard-zero2`, `--device
//! cuda`): each value's kebab-case name, parsing and printing of those names
//! ([`FromStr`](std::str::FromStr), [`Display`](std::fmt::Display)), and each value's
//! description, so the `fsdp` command line (crates/fsdp-cli, which parses with clap) and
//! any other front end spell them alike, while the library depends on no argument parser.
//!
//! The enums are declared with the crate-private `choice_enum!` macro, which keeps each
//! value's doc comment and name next to it and derives the rest from them.

use crate::error::{Error, Result};

/// An enum whose values have fixed kebab-case names.
///
/// Its [`FromStr`](std::str::FromStr) accepts exactly the names of [`ALL`](Self::ALL) and
/// its [`Display`](std::fmt::Display) prints [`name`](Self::name).
pub trait Choice: Copy + Sized + 'static {
    /// What a value of the enum is, for error messages (`"sharding strategy"`).
    const WHAT: &'static str;
    /// Every value, in declaration order (the order `fsdp train --help` lists them).
    const ALL: &'static [Self];
    /// The value's name (`"hybrid-shard-zero2"`).
    fn name(self) -> &'static str;
    /// The value's doc comment, its lines joined with spaces, markdown as written.
    fn doc(self) -> &'static str;
}

/// The names of `T`'s values, in declaration order.
pub fn names<T: Choice>() -> impl Iterator<Item = &'static str> {
    T::ALL.iter().map(|v| v.name())
}

/// The value of `T` named `s` (exact, case-sensitive: the names `--help` prints).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `s`, what it should be and every accepted name.
pub fn parse<T: Choice>(s: &str) -> Result<T> {
    T::ALL
        .iter()
        .copied()
        .find(|v| v.name() == s)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "unknown {} '{s}': expected one of {}",
                T::WHAT,
                names::<T>().collect::<Vec<_>>().join(", ")
            ))
        })
}

/// Declares an enum whose variants are listed as `Variant = "name"` under their doc
/// comments and other attributes (`#[default]`), and implements [`Choice`], `FromStr`
/// ([`parse`]) and `Display` (the name) for it. Outer attributes (derives, docs) pass
/// through.
///
/// Crate-internal, public only for the layers above (`#[macro_export]` puts it at the
/// crate root too; name it as `choice::choice_enum`).
#[doc(hidden)]
#[macro_export]
macro_rules! choice_enum {
    (
        $(#[$attr:meta])*
        $vis:vis enum $name:ident: $what:literal {
            $(
                $(#[$($vattr:tt)*])*
                $variant:ident = $text:literal
            ),+ $(,)?
        }
    ) => {
        $(#[$attr])*
        $vis enum $name {
            $(
                $(#[$($vattr)*])*
                $variant,
            )+
        }

        impl $crate::choice::Choice for $name {
            const WHAT: &'static str = $what;
            const ALL: &'static [Self] = &[$(Self::$variant),+];
            fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $text,)+
                }
            }
            fn doc(self) -> &'static str {
                match self {
                    $(Self::$variant => {
                        $crate::choice::doc_text!([] $([$($vattr)*])*).trim_ascii()
                    })+
                }
            }
        }

        impl std::str::FromStr for $name {
            type Err = $crate::error::Error;
            fn from_str(s: &str) -> $crate::error::Result<Self> {
                $crate::choice::parse(s)
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str($crate::choice::Choice::name(*self))
            }
        }
    };
}
#[doc(hidden)] // crate-internal, public only for the layers above
pub use choice_enum;

/// `concat!` of the `doc = "..."` attributes among `[attribute]`s (after the accumulator
/// `[...]` of the literals found so far): a doc comment's lines, each with its leading space.
/// Crate-internal, public for [`choice_enum`]'s expansion in the layers above.
#[doc(hidden)]
#[macro_export]
macro_rules! doc_text {
    ([$($doc:literal)*]) => { concat!("", $($doc),*) };
    ([$($doc:literal)*] [doc = $line:literal] $($rest:tt)*) => {
        $crate::choice::doc_text!([$($doc)* $line] $($rest)*)
    };
    ([$($doc:literal)*] [$($other:tt)*] $($rest:tt)*) => {
        $crate::choice::doc_text!([$($doc)*] $($rest)*)
    };
}
#[doc(hidden)] // crate-internal, public only for the layers above
pub use doc_text;

#[cfg(test)]
mod tests {
    use super::{parse, Choice};

    choice_enum! {
        /// A test enum.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        enum Colour: "colour" {
            /// Like the sky
            /// at noon.
            Blue = "sky-blue",
            /// Green,
            #[default]
            /// the default.
            Green = "green",
            /// Red.
            Red = "red",
        }
    }

    #[test]
    fn names_docs_parse_and_display() {
        assert_eq!(Colour::ALL, [Colour::Blue, Colour::Green, Colour::Red]);
        assert_eq!(Colour::default(), Colour::Green);
        assert_eq!(Colour::Green.doc(), "Green, the default.");
        assert_eq!(Colour::Blue.doc(), "Like the sky at noon.");
        assert_eq!(Colour::Red.to_string(), "red");
        assert_eq!("sky-blue".parse::<Colour>().unwrap(), Colour::Blue);
        let e = parse::<Colour>("Blue").unwrap_err().to_string();
        assert!(
            e.contains("unknown colour 'Blue': expected one of sky-blue, green, red"),
            "{e}"
        );
    }
}
