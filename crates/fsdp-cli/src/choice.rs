//! clap parsing of the library's named option enums ([`fsdp::choice::Choice`]): the
//! possible values `--help` lists, with their help lines, come from the library's names and
//! doc comments, so the library depends on no argument parser and the spellings
//! (`hybrid-shard-zero2`, `gpt2-124m`) live in one place.

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use fsdp::choice::Choice;
use std::ffi::OsStr;
use std::marker::PhantomData;

/// A clap value parser of `T` by its [`Choice`] names: `#[arg(value_parser = choice::<T>())]`.
pub(crate) fn choice<T: Choice + Send + Sync>() -> ChoiceParser<T> {
    ChoiceParser(PhantomData)
}

/// See [`choice`].
#[derive(Clone, Copy)]
pub(crate) struct ChoiceParser<T>(PhantomData<T>);

/// The help line of a value: its doc comment without the final period (as clap's derive
/// writes a one-paragraph doc comment).
pub(crate) fn help(doc: &'static str) -> &'static str {
    doc.strip_suffix('.').unwrap_or(doc)
}

impl<T: Choice + Send + Sync> TypedValueParser for ChoiceParser<T> {
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<T, clap::Error> {
        // PossibleValuesParser writes clap's usual error ("invalid value 'x' for '--strategy
        // <STRATEGY>'", the possible values, a suggestion) for a name that is not one.
        let name = PossibleValuesParser::new(T::ALL.iter().map(|v| v.name()))
            .parse_ref(cmd, arg, value)?;
        fsdp::choice::parse(&name)
            .map_err(|e| clap::Error::raw(clap::error::ErrorKind::InvalidValue, e))
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(
            T::ALL
                .iter()
                .map(|v| PossibleValue::new(v.name()).help(help(v.doc()))),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::choice;
    use clap::builder::TypedValueParser;
    use fsdp::fsdp::ShardingStrategy;

    #[test]
    fn names_parse_and_others_are_clap_errors() {
        let cmd = clap::Command::new("t");
        let p = choice::<ShardingStrategy>();
        let got = p
            .parse_ref(&cmd, None, "hybrid-shard-zero2".as_ref())
            .unwrap();
        assert_eq!(got, ShardingStrategy::HybridShardZero2);
        let e = p.parse_ref(&cmd, None, "hybrid".as_ref()).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::InvalidValue);
        let names: Vec<String> = p
            .possible_values()
            .unwrap()
            .map(|v| v.get_name().to_string())
            .collect();
        assert_eq!(
            names,
            [
                "full-shard",
                "shard-grad-op",
                "no-shard",
                "hybrid-shard",
                "hybrid-shard-zero2"
            ]
        );
    }
}
