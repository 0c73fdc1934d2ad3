//! Block events as Python objects, for external indexers (KV-aware routers).
//!
//! Keys are the digests' meaningful bytes (16 for `xxh3_128`, 32 for `sha256`), the same bytes
//! `hash_prefix` returns, so a router can match events against its own hashes.

use prefixcache_core::{CacheEvent, Digest, EventRecord, HashAlgorithm};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

fn key_bytes(digest: &Digest, algorithm: HashAlgorithm) -> Vec<u8> {
    digest.as_bytes(algorithm).to_vec()
}

fn bytes_list<'py>(py: Python<'py>, keys: &[Vec<u8>]) -> Vec<Bound<'py, PyBytes>> {
    keys.iter().map(|k| PyBytes::new(py, k)).collect()
}

/// A run of keys published at a commit (or a decode-tail checkpoint at `finish`): consecutive
/// unit keys of one group, possibly across several blocks.
#[pyclass(frozen, eq, name = "BlockStored", module = "prefixcache")]
#[derive(PartialEq, Eq)]
pub struct PyBlockStored {
    /// Sequence number of the event (strictly increasing, never reused).
    #[pyo3(get)]
    sequence: u64,
    /// The group the block belongs to.
    #[pyo3(get)]
    group: u32,
    /// The block carrying the first key (its id in its group's pool).
    #[pyo3(get)]
    block: u32,
    keys: Vec<Vec<u8>>,
    parent: Option<Vec<u8>>,
    /// First token covered by the added keys.
    #[pyo3(get)]
    token_start: u32,
    /// One past the last token covered by the added keys.
    #[pyo3(get)]
    token_end: u32,
    /// Whether the block is a recurrent-state checkpoint.
    #[pyo3(get)]
    checkpoint: bool,
    /// The block carrying each key (a run may span several blocks of the group).
    #[pyo3(get)]
    blocks: Vec<u32>,
    /// The token ids `[tokens_start, token_end)`: the run's own, preceded by those of the
    /// wire block its first key falls in (none when the wire block is the hash unit).
    #[pyo3(get)]
    tokens: Vec<u32>,
    /// First token of `tokens`.
    #[pyo3(get)]
    tokens_start: u32,
    /// The sequence's adapter id.
    #[pyo3(get)]
    lora_id: Option<u64>,
    cache_salt: Option<Vec<u8>>,
}

#[pymethods]
impl PyBlockStored {
    /// The sequence's cache salt, when the run starts at token 0.
    #[getter]
    fn cache_salt<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.cache_salt.as_ref().map(|s| PyBytes::new(py, s))
    }

    /// The keys added, in position order (digest bytes).
    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        bytes_list(py, &self.keys)
    }

    /// The key just before the first added one (`None` at the start of the sequence).
    #[getter]
    fn parent<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.parent.as_ref().map(|p| PyBytes::new(py, p))
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockStored(sequence={}, group={}, block={}, keys={}, tokens=[{}, {}), checkpoint={})",
            self.sequence,
            self.group,
            self.block,
            self.keys.len(),
            self.token_start,
            self.token_end,
            if self.checkpoint { "True" } else { "False" }
        )
    }
}

/// A block lost every key (it was evicted for reuse).
#[pyclass(frozen, eq, name = "BlockRemoved", module = "prefixcache")]
#[derive(PartialEq, Eq)]
pub struct PyBlockRemoved {
    /// Sequence number of the event.
    #[pyo3(get)]
    sequence: u64,
    /// The group the block belonged to.
    #[pyo3(get)]
    group: u32,
    /// The block id in its group's pool.
    #[pyo3(get)]
    block: u32,
    keys: Vec<Vec<u8>>,
    gone: Vec<Vec<u8>>,
}

#[pymethods]
impl PyBlockRemoved {
    /// Every key the block lost (digest bytes).
    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        bytes_list(py, &self.keys)
    }

    /// The keys at wire-block boundaries that no block of the group carries any more (what
    /// the wire's `BlockRemoved` lists).
    #[getter]
    fn gone<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        bytes_list(py, &self.gone)
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockRemoved(sequence={}, group={}, block={}, keys={})",
            self.sequence,
            self.group,
            self.block,
            self.keys.len()
        )
    }
}

/// `reset` dropped every cached block and key.
#[pyclass(frozen, eq, get_all, name = "AllBlocksCleared", module = "prefixcache")]
#[derive(PartialEq, Eq)]
pub struct PyAllBlocksCleared {
    /// Sequence number of the event.
    sequence: u64,
}

#[pymethods]
impl PyAllBlocksCleared {
    fn __repr__(&self) -> String {
        format!("AllBlocksCleared(sequence={})", self.sequence)
    }
}

/// The Python object of one event.
pub fn to_python(
    py: Python<'_>,
    record: EventRecord,
    algorithm: HashAlgorithm,
) -> PyResult<Bound<'_, PyAny>> {
    let sequence = record.sequence;
    Ok(match record.event {
        CacheEvent::BlockStored {
            group,
            block,
            blocks,
            keys,
            parent,
            token_start,
            token_end,
            checkpoint,
            tokens,
            tokens_start,
            wire_parent: _,
            lora_id,
            cache_salt,
            multimodal: _,
        } => Bound::new(
            py,
            PyBlockStored {
                sequence,
                group,
                block,
                keys: keys.iter().map(|k| key_bytes(k, algorithm)).collect(),
                parent: parent.map(|p| key_bytes(&p, algorithm)),
                token_start,
                token_end,
                checkpoint,
                blocks,
                tokens,
                tokens_start,
                lora_id,
                cache_salt,
            },
        )?
        .into_any(),
        CacheEvent::BlockRemoved { group, block, keys, gone } => Bound::new(
            py,
            PyBlockRemoved {
                sequence,
                group,
                block,
                keys: keys.iter().map(|k| key_bytes(k, algorithm)).collect(),
                gone: gone.iter().map(|k| key_bytes(k, algorithm)).collect(),
            },
        )?
        .into_any(),
        CacheEvent::AllBlocksCleared => Bound::new(py, PyAllBlocksCleared { sequence })?.into_any(),
    })
}
