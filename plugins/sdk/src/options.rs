//! Options passed through from the user, and the errors a policy may return.

use std::str::FromStr;

/// Why a policy refused its input; becomes the WIT `policy-error`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// The input or an option is not one this policy accepts.
    InvalidInput(String),
    /// The policy does not implement what was asked.
    Unsupported(String),
}

/// Named options ("chunk-records" = "64").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Options(pub Vec<(String, String)>);

impl Options {
    /// The value of `name`, if given.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(key, _)| key == name).map(|(_, value)| value.as_str())
    }

    /// `name` parsed as a `T`, or `default` when absent.
    pub fn parse<T: FromStr>(&self, name: &str, default: T) -> Result<T, Error> {
        match self.get(name) {
            None => Ok(default),
            Some(value) => {
                value.parse().map_err(|_| Error::InvalidInput(format!("option {name}={value:?} is not a valid value")))
            }
        }
    }

    /// Refuses options this policy does not know, so a typo is an error rather than a default.
    pub fn allow_only(&self, known: &[&str]) -> Result<(), Error> {
        match self.0.iter().find(|(key, _)| !known.contains(&key.as_str())) {
            Some((key, _)) => Err(Error::InvalidInput(format!("unknown option {key:?} (known: {})", known.join(", ")))),
            None => Ok(()),
        }
    }
}
