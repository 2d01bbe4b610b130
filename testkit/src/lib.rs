//! What Ductor's own harnesses share — the integration tests, `ductor-bench`
//! and `ductor-chaos` — so that each is built once and a change to it is
//! made in one place.
//!
//! - [`scratch`]: a database and topics of the harness's own, removed at
//!   its end;
//! - [`kafka`]: readers built on Ductor's own client settings;
//! - [`http`]: one HTTP/1.1 request per connection, bounded in time and
//!   size, with no client library;
//! - [`metrics`]: reading a series out of a Prometheus text exposition;
//! - [`schemas`]: the contract's committed JSON Schemas, and checking a
//!   message or a record against them;
//! - [`programs`]: the workspace's directory and the programs cargo built
//!   beside the running one;
//! - [`serve`]: `ductor serve` in this process, returned once it is
//!   ready;
//! - [`serve_process`]: `ductor serve` in a process of its own, killed and
//!   started again at will.
//!
//! Not a stable interface, and never published: it serves the harnesses of
//! this workspace only.

pub mod http;
pub mod kafka;
pub mod metrics;
pub mod programs;
pub mod schemas;
pub mod scratch;
pub mod serve;
pub mod serve_process;
