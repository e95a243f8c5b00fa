//! Finds where a YAML path is written, by re-reading the file with a
//! deserializer that fails on purpose at the path's deepest existing node:
//! serde_yaml_ng stamps an error with the position of the node being read,
//! and the generic tree has no positions of its own.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// One step of a YAML path: a mapping key or a list index.
#[derive(Debug, Clone, Copy)]
enum PathStep<'p> {
    Key(&'p str),
    Index(usize),
}

/// Position of `path` (`a.b[2].c`), or of its deepest existing prefix.
pub(super) fn locate(text: &str, path: &str) -> Option<Location> {
    let mut steps = Vec::new();
    for part in path.split('.') {
        let mut pieces = part.split('[');
        if let Some(key) = pieces.next().filter(|it| !it.is_empty()) {
            steps.push(PathStep::Key(key));
        }
        for index in pieces {
            steps.push(PathStep::Index(index.trim_end_matches(']').parse().ok()?));
        }
    }
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    match (Seek { steps: &steps }).deserialize(deserializer) {
        Ok(()) => None,
        Err(err) => err.location().map(|it| Location {
            line: it.line(),
            column: it.column(),
        }),
    }
}

/// Always fails: at the target, or where the path stops existing.
struct Seek<'s, 'p> {
    steps: &'s [PathStep<'p>],
}

impl<'de> DeserializeSeed<'de> for Seek<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(SeekVisitor { steps: self.steps })
    }
}

struct SeekVisitor<'s, 'p> {
    steps: &'s [PathStep<'p>],
}

fn here<E: de::Error>() -> E {
    E::custom("here")
}

// Every `visit_*` left out fails with the node's position, which is the
// answer when the path ends there or goes on below a scalar.
impl<'de> Visitor<'de> for SeekVisitor<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the node at the path")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Some((PathStep::Key(wanted), rest)) = self.steps.split_first() else {
            return Err(here());
        };
        let at_key = rest.is_empty();
        while let Some(found) = map.next_key_seed(KeySeed { wanted, at_key })? {
            if found {
                return map.next_value_seed(Seek { steps: rest });
            }
            map.next_value::<IgnoredAny>()?;
        }
        Err(here())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Some((PathStep::Index(index), rest)) = self.steps.split_first() else {
            return Err(here());
        };
        for _ in 0..*index {
            if seq.next_element::<IgnoredAny>()?.is_none() {
                return Err(here());
            }
        }
        seq.next_element_seed(Seek { steps: rest })?;
        Err(here())
    }
}

/// Reads a mapping key: `true` if it is the wanted one; fails on it
/// (at the key's position) when the key itself is the target.
struct KeySeed<'p> {
    wanted: &'p str,
    at_key: bool,
}

impl<'de> DeserializeSeed<'de> for KeySeed<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for KeySeed<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
        match (key == self.wanted, self.at_key) {
            (true, true) => Err(here()),
            (found, _) => Ok(found),
        }
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<bool, E> {
        Ok(false)
    }

    fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }
}

/// A position in a file, both 1-based.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub line: usize,
    pub column: usize,
}
