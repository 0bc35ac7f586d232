//! What a [`LockLayer`](super::LockLayer) was configured with.

use std::fmt;
use std::sync::Arc;

use axum::http::HeaderName;
use dlock_core::Locker;

use super::json::Want;
use super::quota::Quota;
use crate::pipeline::policy::Policy;

/// Where one part of the lock key comes from.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum KeySource {
    /// A field of the JSON body, as a path of object keys / array indices.
    Json { path: String, segments: Vec<String> },
    /// A query-string parameter.
    Query(String),
    /// A path parameter of the matched route.
    Path(String),
    /// A request header.
    Header(HeaderName),
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Json { path, .. } => write!(f, "JSON field `{path}`"),
            KeySource::Query(name) => write!(f, "query parameter `{name}`"),
            KeySource::Path(name) => write!(f, "path parameter `{name}`"),
            KeySource::Header(name) => write!(f, "header `{name}`"),
        }
    }
}

/// A further key ([`LockLayer::also`](super::LockLayer::also)): its name and parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Also {
    pub(crate) name: String,
    pub(crate) parts: Vec<KeySource>,
}

/// Everything a [`LockLayer`](super::LockLayer) was configured with.
#[derive(Clone)]
pub(crate) struct Spec {
    pub(crate) policy: Policy,
    /// The parts of the first key, whose name is the policy's.
    pub(crate) parts: Vec<KeySource>,
    /// The further keys, taken with the first one all or none.
    pub(crate) also: Vec<Also>,
    /// What of the JSON body the key needs.
    pub(crate) json_want: Want,
    /// The layer's own body limit; `None`: the installed runtime's.
    pub(crate) max_body_bytes: Option<usize>,
    pub(crate) locker: Option<Locker>,
    pub(crate) quota: Option<Arc<Quota>>,
}

impl Spec {
    pub(crate) fn needs_json(&self) -> bool {
        self.parts.iter().chain(self.also.iter().flat_map(|a| &a.parts)).any(|p| matches!(p, KeySource::Json { .. }))
    }

    /// Where a part declared now goes: the last [`Also`]'s key, else the first.
    pub(crate) fn last_parts(&mut self) -> &mut Vec<KeySource> {
        match self.also.last_mut() {
            Some(also) => &mut also.parts,
            None => &mut self.parts,
        }
    }
}
