//! Hash maps and sets for Kairos's hot paths (job ids, due keys, entity
//! keys, partitions, offsets), with a fast non-cryptographic hasher
//! (foldhash) instead of the standard library's SipHash. Each map is
//! seeded at random, so keys read from the network cannot choose their
//! buckets.

/// A [`std::collections::HashMap`] with foldhash. Build with `default()`.
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A [`std::collections::HashSet`] with foldhash. Build with `default()`.
pub type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
