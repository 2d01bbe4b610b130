//! Recorded dead letters. The ingress's dead-letter writer
//! ([`super::dead_letter`]) records every letter in `dead_letters` before
//! it publishes it to the dead-letter topic; this module owns the table.
//!
//! In: a refused input ([`Refused`]). Out: its row ([`LetterRow`],
//! [`store::insert`]), and old rows deleted ([`retention`]). Guarantees:
//! one row per input and stage, however often the input is redelivered;
//! the row is decided purely ([`record`]); [`store`] holds the statements.

pub mod record;
pub mod retention;
pub mod store;

pub use record::{Bytes, Header, LetterRow, Refused};
