//! `prefixcache-core`: the whole prefix-cache engine, with no Python in its dependency graph.
#![forbid(unsafe_code)]

pub mod hashing;
