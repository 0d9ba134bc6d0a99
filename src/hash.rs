//! Hash maps and sets keyed by values Kairos makes or checks itself (job
//! ids, due keys, partitions, offsets) on its hot paths, with a fast
//! non-cryptographic hasher (foldhash, seeded per map) instead of the
//! standard library's SipHash.

/// A [`std::collections::HashMap`] with foldhash. Build with `default()`.
pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A [`std::collections::HashSet`] with foldhash. Build with `default()`.
pub type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
