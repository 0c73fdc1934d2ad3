//! Result objects handed to Python: hits, schedules, statistics, pool usage.
//!
//! Frozen value objects built from the core's result types; they compare by value and hold no
//! reference to the manager. Names in Python drop the `Py` prefix (`PyHit` is `Hit`).

use prefixcache_core::{
    Added, GroupHit, GroupStats, Hit, MissReason, PoolUsage, Scheduled, SkipReason, Stats,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn optional<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "None".to_string(), |v| v.to_string())
}

/// What `CacheManager.add` did with the prompt's hashes.
#[pyclass(frozen, eq, get_all, skip_from_py_object, name = "Added", module = "prefixcache")]
#[derive(Clone, PartialEq, Eq)]
pub struct PyAdded {
    /// Tokens whose unit hashes were reused: from the `extends` sequence, or without it
    /// from a live sequence with the same prefix (`CacheConfig.reuse_live_prefixes`).
    pub reused_tokens: u32,
    /// Units hashed by this call.
    pub hashed_units: u32,
    /// Whether the `extends` sequence was found (running or in the finished cache).
    pub extends_found: bool,
}

impl From<Added> for PyAdded {
    fn from(a: Added) -> Self {
        Self {
            reused_tokens: a.reused_tokens,
            hashed_units: a.hashed_units,
            extends_found: a.extends_found,
        }
    }
}

#[pymethods]
impl PyAdded {
    fn __repr__(&self) -> String {
        format!(
            "Added(reused_tokens={}, hashed_units={}, extends_found={})",
            self.reused_tokens,
            self.hashed_units,
            if self.extends_found { "True" } else { "False" }
        )
    }
}

/// One group's part of a `Hit`: its own longest hit and why it stops there.
#[pyclass(frozen, eq, get_all, skip_from_py_object, name = "GroupHit", module = "prefixcache")]
#[derive(Clone, PartialEq, Eq)]
pub struct PyGroupHit {
    /// Index of the group in the configuration.
    pub group: u32,
    /// The group's own longest hit in tokens (a multiple of the hash unit).
    pub tokens: u32,
    /// Why it does not reach `tokens + U`: `"not_cached"`, `"recently_evicted"`,
    /// `"no_state_at_position"` or `"window_gap"`; `None` when it reaches `Hit.max_tokens`.
    pub stop: Option<&'static str>,
}

impl From<&GroupHit> for PyGroupHit {
    fn from(g: &GroupHit) -> Self {
        Self { group: g.group, tokens: g.tokens, stop: g.stop.map(MissReason::name) }
    }
}

#[pymethods]
impl PyGroupHit {
    fn __repr__(&self) -> String {
        let stop = self.stop.map_or_else(|| "None".to_string(), |s| format!("{s:?}"));
        format!("GroupHit(group={}, tokens={}, stop={stop})", self.group, self.tokens)
    }
}

/// The result of a lookup: the prefix every group can resume from, and per-group detail.
#[pyclass(frozen, eq, skip_from_py_object, name = "Hit", module = "prefixcache")]
#[derive(Clone, PartialEq, Eq)]
pub struct PyHit {
    hit: Hit,
}

impl From<Hit> for PyHit {
    fn from(hit: Hit) -> Self {
        Self { hit }
    }
}

#[pymethods]
impl PyHit {
    /// The reconciled hit L in tokens: every group can resume there.
    #[getter]
    fn tokens(&self) -> u32 {
        self.hit.tokens
    }

    /// The largest hit a lookup could return: `((N - 1) // U) * U`.
    #[getter]
    fn max_tokens(&self) -> u32 {
        self.hit.max_tokens
    }

    /// The largest own hit of any group above `tokens`, when it exceeds `tokens` by at least
    /// two units (another request diverged there); else `None`.
    #[getter]
    fn junction(&self) -> Option<u32> {
        self.hit.junction
    }

    /// The hit the sequence would get once the plans in flight commit (at least `tokens`):
    /// an engine may hold the request for a step instead of recomputing that prefix.
    #[getter]
    fn pending_tokens(&self) -> u32 {
        self.hit.pending_tokens
    }

    /// The plan whose commit `pending_tokens` waits for, or `None` when nothing in flight
    /// extends the hit.
    #[getter]
    fn pending_plan(&self) -> Option<u64> {
        self.hit.pending_plan
    }

    /// Each group's own hit and why it stops, in group order.
    #[getter]
    fn groups(&self) -> Vec<PyGroupHit> {
        self.hit.groups.iter().map(PyGroupHit::from).collect()
    }

    fn __repr__(&self) -> String {
        let groups: Vec<String> = self.groups().iter().map(PyGroupHit::__repr__).collect();
        format!(
            "Hit(tokens={}, max_tokens={}, junction={}, pending_tokens={}, pending_plan={}, \
             groups=[{}])",
            self.hit.tokens,
            self.hit.max_tokens,
            optional(self.hit.junction),
            self.hit.pending_tokens,
            optional(self.hit.pending_plan),
            groups.join(", ")
        )
    }
}

/// What `schedule` gave a sequence for the next plan.
#[pyclass(frozen, eq, skip_from_py_object, name = "Scheduled", module = "prefixcache")]
#[derive(Clone, PartialEq, Eq)]
pub struct PyScheduled {
    scheduled: Scheduled,
}

impl From<Scheduled> for PyScheduled {
    fn from(scheduled: Scheduled) -> Self {
        Self { scheduled }
    }
}

#[pymethods]
impl PyScheduled {
    /// The sequence.
    #[getter]
    fn seq_id(&self) -> u64 {
        self.scheduled.seq_id
    }

    /// Tokens computed before this chunk (the hit used, on a first schedule).
    #[getter]
    fn num_computed(&self) -> u32 {
        self.scheduled.num_computed
    }

    /// Tokens scheduled; 0 when the budget was below the chunk alignment (nothing pinned).
    #[getter]
    fn num_tokens(&self) -> u32 {
        self.scheduled.num_tokens
    }

    /// The hit this schedule started from (only on a sequence's first schedule).
    #[getter]
    fn hit(&self) -> Option<PyHit> {
        self.scheduled.hit.clone().map(PyHit::from)
    }

    fn __repr__(&self) -> String {
        let hit = self.hit().map_or_else(|| "None".to_string(), |h| h.__repr__());
        format!(
            "Scheduled(seq_id={}, num_computed={}, num_tokens={}, hit={hit})",
            self.scheduled.seq_id, self.scheduled.num_computed, self.scheduled.num_tokens
        )
    }
}

/// Blocks of one pool.
#[pyclass(frozen, eq, get_all, skip_from_py_object, name = "PoolUsage", module = "prefixcache")]
#[derive(Clone, PartialEq, Eq)]
pub struct PyPoolUsage {
    /// Block ids including the null block 0.
    pub num_blocks: u32,
    /// Blocks never used or freed without a key.
    pub free: u32,
    /// Published blocks nobody references (evictable, in the LRU).
    pub cached: u32,
    /// Blocks referenced by sequences or by the step in flight.
    pub owned: u32,
    /// Blocks holding checkpoints (published or pending).
    pub checkpoints: u32,
}

impl From<PoolUsage> for PyPoolUsage {
    fn from(p: PoolUsage) -> Self {
        Self {
            num_blocks: p.num_blocks,
            free: p.free,
            cached: p.cached,
            owned: p.owned,
            checkpoints: p.checkpoints,
        }
    }
}

#[pymethods]
impl PyPoolUsage {
    /// The fields as a dict (for JSON output).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("num_blocks", self.num_blocks)?;
        d.set_item("free", self.free)?;
        d.set_item("cached", self.cached)?;
        d.set_item("owned", self.owned)?;
        d.set_item("checkpoints", self.checkpoints)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "PoolUsage(num_blocks={}, free={}, cached={}, owned={}, checkpoints={})",
            self.num_blocks, self.free, self.cached, self.owned, self.checkpoints
        )
    }
}

/// Per-group counters.
#[pyclass(frozen, eq, skip_from_py_object, name = "GroupStats", module = "prefixcache")]
#[derive(Clone, PartialEq, Eq)]
pub struct PyGroupStats {
    stats: GroupStats,
}

#[pymethods]
impl PyGroupStats {
    /// Tokens of reconciled hits this group served (first schedules).
    #[getter]
    fn hit_tokens(&self) -> u64 {
        self.stats.hit_tokens
    }

    /// Blocks of this group evicted for reuse.
    #[getter]
    fn evictions(&self) -> u64 {
        self.stats.evictions
    }

    /// State groups: checkpoints published (decode tails included).
    #[getter]
    fn checkpoints_published(&self) -> u64 {
        self.stats.checkpoints_published
    }

    /// State groups: retained positions not exported, by reason (`"unaligned"`, `"capacity"`,
    /// `"already_cached"`, `"budget"`, `"mid_step"`).
    #[getter]
    fn checkpoints_skipped<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for reason in SkipReason::ALL {
            d.set_item(reason.name(), self.stats.checkpoints_skipped[reason.index()])?;
        }
        Ok(d)
    }

    /// Admissions whose own hit in this group stopped short of the prompt, by reason
    /// (`"not_cached"`, `"recently_evicted"`, `"no_state_at_position"`, `"window_gap"`).
    #[getter]
    fn misses<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for reason in MissReason::ALL {
            d.set_item(reason.name(), self.stats.misses[reason.index()])?;
        }
        Ok(d)
    }

    /// State groups: schedules that resumed from a published checkpoint.
    #[getter]
    fn checkpoint_hits(&self) -> u64 {
        self.stats.checkpoint_hits
    }

    /// State groups: decode-tail snapshots published by `finish`.
    #[getter]
    fn decode_tails_published(&self) -> u64 {
        self.stats.decode_tails_published
    }

    /// The fields as a dict (for JSON output).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("hit_tokens", self.stats.hit_tokens)?;
        d.set_item("evictions", self.stats.evictions)?;
        d.set_item("checkpoints_published", self.stats.checkpoints_published)?;
        d.set_item("checkpoints_skipped", self.checkpoints_skipped(py)?)?;
        d.set_item("checkpoint_hits", self.stats.checkpoint_hits)?;
        d.set_item("decode_tails_published", self.stats.decode_tails_published)?;
        d.set_item("misses", self.misses(py)?)?;
        Ok(d)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("GroupStats({})", self.to_dict(py)?.repr()?))
    }
}

/// Manager-wide counters (a snapshot).
#[pyclass(frozen, eq, skip_from_py_object, name = "Stats", module = "prefixcache")]
#[derive(Clone, PartialEq, Eq)]
pub struct PyStats {
    stats: Stats,
}

impl From<Stats> for PyStats {
    fn from(stats: Stats) -> Self {
        Self { stats }
    }
}

#[pymethods]
impl PyStats {
    /// `lookup` calls.
    #[getter]
    fn lookups(&self) -> u64 {
        self.stats.lookups
    }

    /// Sum of reconciled hit lengths over lookups.
    #[getter]
    fn lookup_hit_tokens(&self) -> u64 {
        self.stats.lookup_hit_tokens
    }

    /// First schedules (admissions).
    #[getter]
    fn admissions(&self) -> u64 {
        self.stats.admissions
    }

    /// Sum of the hits used by admissions.
    #[getter]
    fn admitted_hit_tokens(&self) -> u64 {
        self.stats.admitted_hit_tokens
    }

    /// Sum of the prompt tokens of admissions (vLLM's prefix-cache queries).
    #[getter]
    fn admitted_tokens(&self) -> u64 {
        self.stats.admitted_tokens
    }

    /// Tokens scheduled.
    #[getter]
    fn scheduled_tokens(&self) -> u64 {
        self.stats.scheduled_tokens
    }

    /// `schedule` calls that returned `None` (the pool could not supply the blocks).
    #[getter]
    fn refused_schedules(&self) -> u64 {
        self.stats.refused_schedules
    }

    /// Copy-on-write copies planned.
    #[getter]
    fn copies(&self) -> u64 {
        self.stats.copies
    }

    /// Plans committed.
    #[getter]
    fn commits(&self) -> u64 {
        self.stats.commits
    }

    /// Plans aborted.
    #[getter]
    fn aborts(&self) -> u64 {
        self.stats.aborts
    }

    /// Blocks evicted for reuse, all groups.
    #[getter]
    fn evictions(&self) -> u64 {
        self.stats.evictions
    }

    /// Events dropped because nobody drained them in time.
    #[getter]
    fn events_dropped(&self) -> u64 {
        self.stats.events_dropped
    }

    /// Per-group counters, in group order.
    #[getter]
    fn groups(&self) -> Vec<PyGroupStats> {
        self.stats.groups.iter().map(|g| PyGroupStats { stats: g.clone() }).collect()
    }

    /// The counters as a dict (per-group counters under `"groups"`), for JSON output.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.stats;
        let d = PyDict::new(py);
        d.set_item("lookups", s.lookups)?;
        d.set_item("lookup_hit_tokens", s.lookup_hit_tokens)?;
        d.set_item("admissions", s.admissions)?;
        d.set_item("admitted_hit_tokens", s.admitted_hit_tokens)?;
        d.set_item("admitted_tokens", s.admitted_tokens)?;
        d.set_item("scheduled_tokens", s.scheduled_tokens)?;
        d.set_item("refused_schedules", s.refused_schedules)?;
        d.set_item("copies", s.copies)?;
        d.set_item("commits", s.commits)?;
        d.set_item("aborts", s.aborts)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("events_dropped", s.events_dropped)?;
        let groups = self.groups().iter().map(|g| g.to_dict(py)).collect::<PyResult<Vec<_>>>()?;
        d.set_item("groups", groups)?;
        Ok(d)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("Stats({})", self.to_dict(py)?.repr()?))
    }
}
