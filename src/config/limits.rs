//! Bounds on what a config may hold, checked before it can cost much
//! memory or time: bytes per file and per directory, YAML nodes once
//! aliases are expanded, descriptors per domain.
//!
//! serde_yaml_ng refuses nesting deeper than 128 levels ("recursion limit
//! exceeded") and stops alias chains whose jumps outnumber the document's
//! events a hundred times ("repetition limit exceeded"), but an anchor on
//! a large node, repeated by many aliases, passes both and builds a tree
//! far larger than the file. [`check_nodes`] counts the nodes the tree
//! would have, aliases expanded, and stops counting past its budget.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, Visitor};

/// Bounds on one config; [`ConfigLimits::STANDARD`] is far above any real
/// config (a rule takes about 100 bytes of YAML).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigLimits {
    /// Most bytes in one config file (`--max-config-file-bytes`).
    pub max_file_bytes: u64,
    /// Most bytes in all the files of a config directory together
    /// (`--max-config-bytes`).
    pub max_total_bytes: u64,
    /// Most descriptors, at every depth, in one domain
    /// (`--max-config-descriptors`).
    pub max_descriptors: usize,
}

impl ConfigLimits {
    /// 16 MiB per file, 64 MiB per directory, 100,000 descriptors per
    /// domain.
    pub const STANDARD: ConfigLimits = ConfigLimits {
        max_file_bytes: 16 << 20,
        max_total_bytes: 64 << 20,
        max_descriptors: 100_000,
    };
}

impl Default for ConfigLimits {
    fn default() -> Self {
        ConfigLimits::STANDARD
    }
}

/// YAML nodes aliases may add to a file beyond one per byte of its text.
/// A file without aliases has fewer nodes than bytes, so this bounds only
/// repetition.
pub const ALIAS_NODE_ALLOWANCE: u64 = 1_000_000;

/// The most YAML nodes a file of `bytes` may expand to.
pub fn node_budget(bytes: usize) -> u64 {
    (bytes as u64).saturating_add(ALIAS_NODE_ALLOWANCE)
}

/// Why [`check_nodes`] refused a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManyNodes {
    pub budget: u64,
}

impl fmt::Display for TooManyNodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the file expands to more than {} YAML nodes once aliases are repeated (at most its size in bytes plus {ALIAS_NODE_ALLOWANCE})",
            self.budget
        )
    }
}

/// Refuses `text` if its YAML tree, aliases expanded, has more than
/// [`node_budget`] nodes. Any other problem (a syntax error, nesting too
/// deep) passes: the real parse reports it, with its position.
pub fn check_nodes(text: &str) -> Result<(), TooManyNodes> {
    let budget = node_budget(text.len());
    let left = Cell::new(budget);
    let exceeded = Cell::new(false);
    let counter = Count {
        left: &left,
        exceeded: &exceeded,
    };
    let _ = counter.deserialize(serde_yaml_ng::Deserializer::from_str(text));
    if exceeded.get() {
        Err(TooManyNodes { budget })
    } else {
        Ok(())
    }
}

/// Visits every node as serde_yaml_ng's `Value` would, keeping nothing.
#[derive(Clone, Copy)]
struct Count<'c> {
    left: &'c Cell<u64>,
    exceeded: &'c Cell<bool>,
}

impl Count<'_> {
    fn take<E: de::Error>(self) -> Result<(), E> {
        match self.left.get().checked_sub(1) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => {
                self.exceeded.set(true);
                Err(E::custom("node budget exceeded"))
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML node")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.take()
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.take()
    }

    fn visit_i128<E: de::Error>(self, _: i128) -> Result<(), E> {
        self.take()
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.take()
    }

    fn visit_u128<E: de::Error>(self, _: u128) -> Result<(), E> {
        self.take()
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.take()
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.take()
    }

    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<(), E> {
        self.take()
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.take()
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.take()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        self.take()?;
        self.deserialize(deserializer)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        self.take()?;
        self.deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.take()?;
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.take()?;
        while map.next_key_seed(self)?.is_some() {
            map.next_value_seed(self)?;
        }
        Ok(())
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        use serde::de::VariantAccess;
        self.take()?;
        let (_, contents) = data.variant::<de::IgnoredAny>()?;
        contents.newtype_variant_seed(self)
    }
}
