//! Manager benchmarks (filled in below).
fn main() {}
