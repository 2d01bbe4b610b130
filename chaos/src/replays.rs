//! Dead-letter replays under faults: the load replays, as an operator
//! would, letters its own bad inputs caused, and the checker proves that
//! each replay was kept once and that no replayed letter did what its
//! original could not.
//!
//! In (the load, [`Replayer`]): the serves' admin addresses and an `admin`
//! key. It lists pending letters, replays one (`POST
//! /v1/dead-letters/{id}/replay`) or the few oldest of one class and topic
//! (`POST /v1/dead-letters/replay`), retries a call a retry can fix (no
//! answer, 5xx, `contended`: the same letter again, on the other serve),
//! and now and then asks for a replayed letter's replay again a few
//! seconds later on the other serve, so that the second call often comes
//! after a serve died. One call is in flight at a time: every copy of a
//! replay on the topic is then owed to a call that may have produced it.
//! Out: one log line per call or replayed letter ([`log::EV_REPLAY`]).
//!
//! In (the checker, [`check`]): those lines, the `dead_letters` rows,
//! every message of the input topics, every transition, the times serves
//! died. Out: violations and [`ReplayFigures`]. Guarantees: pure. Every
//! letter the load caused is refused for what its bytes say (a class a
//! replay cannot change), so a replay of it must be refused again, the
//! same way:
//!
//! - `replay_not_recorded` — an answered replay whose letter's row does not
//!   record that replay id at that position, or a message carrying a
//!   replay id that no letter records;
//! - `replay_answers_differ` — two answers for one letter name different
//!   replay ids or positions;
//! - `replay_not_on_topic` — a recorded replay whose position on the
//!   source topic holds no message with its replay id;
//! - `replay_differs` — a copy whose key or value is not the letter's
//!   input's, byte for byte;
//! - `replay_duplicated` — more copies with one replay id than the calls
//!   that could have produced one: the first, plus each call that got no
//!   answer or a 5xx or `contended` (a replay cut short is finished by the
//!   next call, which may produce it again); a second replay with the same
//!   id must produce nothing;
//! - `replay_fate_changed` — a copy that is not dead-lettered again under
//!   its letter's class (a bad input stays bad);
//! - `replay_applied` — a transition made from a copy (a refused input never
//!   makes one; a replayed mismatched start never starts a second run).
//!
//! The history replay of every run ([`super::history`]) reads its inputs
//! wherever the transitions say, copies included, so it still has to match.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use super::log::{self, LogWriter, Record};
use super::snapshot::{LetterRow, TransitionRow};
use super::topics::Msg;
use super::violations::Violations;
use ductor::contract::headers::REPLAY_ID;

/// Bound on one replay call; the serve's own bound on a replay's produce
/// is the delivery timeout (10 s in a chaos run).
const CALL_TIMEOUT: Duration = Duration::from_secs(15);
/// Calls per replay: the first plus retries of the same letter or set.
const ATTEMPTS: u32 = 3;
/// Pending letters listed to pick one from.
const LISTED: usize = 50;
/// Letters one replay of a set replays at most.
const SET_LIMIT: usize = 3;

/// Replays dead letters over the serves' admin listeners.
pub struct Replayer {
    admin: Vec<SocketAddr>,
    /// `Bearer <an admin key>`.
    authorization: String,
    /// One call at a time (see the module docs).
    slot: Semaphore,
}

/// A pending letter as the listing shows it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub id: i64,
    pub class: String,
    pub source_topic: String,
}

/// What the answer to one call says, and whether a retry can fix it.
struct Answer {
    status: Option<u16>,
    body: Value,
    error: Option<String>,
}

impl Answer {
    fn ok(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
    }

    /// No answer, a 5xx, or a letter that changed under the call: the
    /// same call again can finish it.
    fn retry(&self) -> bool {
        match self.status {
            None => true,
            Some(s) => s >= 500 || self.code() == "contended",
        }
    }

    fn code(&self) -> &str {
        self.body
            .pointer("/error/code")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    /// The line of this call, before what it names is filled in.
    fn record(&self, kind: &str, server: SocketAddr, note: Option<String>) -> Record {
        let mut rec = Record {
            ev: log::EV_REPLAY.into(),
            t_ms: log::now_ms(),
            kind: Some(kind.into()),
            acked: self.ok(),
            status: self.status,
            server: Some(server.to_string()),
            note,
            ..Record::default()
        };
        if let Some(e) = &self.error {
            rec = rec.with_error(e);
        } else if !self.ok() {
            rec = rec.with_error(format!("{} {}", self.status.unwrap_or(0), self.code()));
        }
        rec
    }
}

/// A replay's outcome (`DeadLetterReplay`) written into `rec`.
fn outcome_into(rec: &mut Record, outcome: &Value) {
    let text = |k: &str| outcome.get(k).and_then(Value::as_str).map(String::from);
    rec.letter = rec.letter.or(outcome.get("id").and_then(Value::as_i64));
    rec.replay_id = text("replay_id");
    rec.outcome = text("status");
    rec.topic = text("topic");
    rec.partition = outcome
        .get("partition")
        .and_then(Value::as_i64)
        .and_then(|p| i32::try_from(p).ok());
    rec.offset = outcome.get("offset").and_then(Value::as_i64);
}

impl Replayer {
    /// `None` without an admin address to replay through.
    pub fn new(admin: &[SocketAddr], authorization: String) -> Option<Replayer> {
        (!admin.is_empty()).then(|| Replayer {
            admin: admin.to_vec(),
            authorization,
            slot: Semaphore::new(1),
        })
    }

    async fn call(&self, server: SocketAddr, method: &str, path: &str, body: &[u8]) -> Answer {
        let headers = [
            ("Authorization", self.authorization.as_str()),
            ("Content-Type", "application/json"),
        ];
        let result =
            ductor_testkit::http::request(server, method, path, &headers, body, CALL_TIMEOUT).await;
        match result {
            Ok((status, raw)) => Answer {
                status: Some(status),
                body: serde_json::from_slice(&raw).unwrap_or(Value::Null),
                error: None,
            },
            Err(e) => Answer {
                status: None,
                body: Value::Null,
                error: Some(format!("{e:#}")),
            },
        }
    }

    /// The admin address after `i` (round robin).
    fn server(&self, i: usize) -> SocketAddr {
        self.admin[i % self.admin.len()]
    }

    /// A pending letter, picked at random from the newest ones; one a
    /// replay cannot send whole (cut, key or headers dropped) only now and
    /// then, so that the refusal is exercised too.
    pub async fn pending(&self) -> Option<Listed> {
        let server = self.server(rand::random_range(0..self.admin.len()));
        let path = format!("/v1/dead-letters?status=pending&limit={LISTED}");
        let answer = self.call(server, "GET", &path, b"").await;
        let letters = answer.body.get("letters")?.as_array()?;
        let whole = |l: &&Value| {
            ["value_cut", "key_dropped", "headers_dropped"]
                .iter()
                .all(|k| l.get(*k) != Some(&Value::Bool(true)))
        };
        let mut candidates: Vec<&Value> = letters.iter().filter(whole).collect();
        if candidates.is_empty() || rand::random_bool(0.05) {
            candidates = letters.iter().collect();
        }
        let l = candidates.get(rand::random_range(0..candidates.len().max(1)))?;
        Some(Listed {
            id: l.get("id")?.as_i64()?,
            class: l.get("class")?.as_str()?.to_owned(),
            source_topic: l.get("source_topic")?.as_str()?.to_owned(),
        })
    }

    /// Replays `letter`, retrying while a retry can fix the call, each
    /// call logged. `first` is the index of the admin address to call
    /// first. Returns the calls made and the index of the address that
    /// answered 2xx, if one did.
    pub async fn replay(
        &self,
        log: &LogWriter,
        letter: &Listed,
        first: usize,
        note: Option<&str>,
    ) -> (u64, Option<usize>) {
        let Ok(_slot) = self.slot.acquire().await else {
            return (0, None);
        };
        let path = format!("/v1/dead-letters/{}/replay", letter.id);
        let mut pause = Duration::from_millis(500);
        for attempt in 0..ATTEMPTS {
            let at = first + attempt as usize;
            let answer = self.call(self.server(at), "POST", &path, b"").await;
            let note = match (note, attempt) {
                (n, 0) => n.map(String::from),
                (n, a) => Some(format!(
                    "{}retry{a}",
                    n.map(|n| format!("{n},")).unwrap_or_default()
                )),
            };
            let mut rec = answer.record(log::KIND_REPLAY, self.server(at), note);
            rec.letter = Some(letter.id);
            rec.class = Some(letter.class.clone());
            if answer.ok() {
                outcome_into(&mut rec, &answer.body);
            }
            log.write(&rec);
            if answer.ok() {
                return (u64::from(attempt) + 1, Some(at % self.admin.len()));
            }
            if !answer.retry() {
                return (u64::from(attempt) + 1, None);
            }
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
        (u64::from(ATTEMPTS), None)
    }

    /// Replays the oldest few pending letters of `like`'s class and source
    /// topic, retrying while a retry can fix the call: one line per call
    /// and one per letter it replayed or refused. Returns the calls made.
    pub async fn replay_set(&self, log: &LogWriter, like: &Listed) -> u64 {
        let Ok(_slot) = self.slot.acquire().await else {
            return 0;
        };
        let body = json!({
            "filter": {"class": like.class, "source_topic": like.source_topic},
            "page": {"limit": SET_LIMIT},
        })
        .to_string();
        let first = rand::random_range(0..self.admin.len());
        let mut pause = Duration::from_millis(500);
        for attempt in 0..ATTEMPTS {
            let server = self.server(first + attempt as usize);
            let answer = self
                .call(server, "POST", "/v1/dead-letters/replay", body.as_bytes())
                .await;
            let note = (attempt > 0).then(|| format!("retry{attempt}"));
            let mut rec = answer.record(log::KIND_REPLAY_SET, server, note);
            rec.class = Some(like.class.clone());
            rec.topic = Some(like.source_topic.clone());
            log.write(&rec);
            if answer.ok() {
                log_set(log, &answer.body, like, server);
                return u64::from(attempt) + 1;
            }
            if !answer.retry() {
                return u64::from(attempt) + 1;
            }
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
        u64::from(ATTEMPTS)
    }
}

/// One line per letter a replay of a set replayed or refused.
fn log_set(log: &LogWriter, batch: &Value, like: &Listed, server: SocketAddr) {
    let items = |k: &str| batch.get(k).and_then(Value::as_array).cloned();
    for outcome in items("replayed").unwrap_or_default() {
        let mut rec = Record {
            ev: log::EV_REPLAY.into(),
            t_ms: log::now_ms(),
            kind: Some(log::KIND_REPLAY.into()),
            acked: true,
            status: Some(200),
            server: Some(server.to_string()),
            note: Some(log::NOTE_IN_SET.into()),
            class: Some(like.class.clone()),
            ..Record::default()
        };
        outcome_into(&mut rec, &outcome);
        log.write(&rec);
    }
    for refused in items("refused").unwrap_or_default() {
        let rec = Record {
            ev: log::EV_REPLAY.into(),
            t_ms: log::now_ms(),
            kind: Some(log::KIND_REPLAY.into()),
            status: Some(200),
            server: Some(server.to_string()),
            note: Some(log::NOTE_IN_SET.into()),
            letter: refused.get("id").and_then(Value::as_i64),
            class: Some(like.class.clone()),
            ..Record::default()
        };
        let reason = refused.get("reason").and_then(Value::as_str).unwrap_or("");
        log.write(&rec.with_error(format!("refused: {reason}")));
    }
}

/// What the replays came to, for the report.
#[derive(Debug, Default, Clone, Serialize)]
pub struct ReplayFigures {
    /// Replay calls the load made (of one letter or of a set), and those
    /// answered 2xx.
    pub calls: u64,
    pub acked: u64,
    /// Letters recorded as replayed.
    pub letters: u64,
    /// Replayed letters whose replay was answered again, and of those the
    /// ones answered again after a serve died.
    pub repeated: u64,
    pub across_restart: u64,
    /// Messages on the input topics that carry a replay id, and how many of
    /// them were dead-lettered again under their letter's class.
    pub copies: u64,
    pub dead_lettered_again: u64,
}

/// What [`check`] reads.
pub struct Seen<'a> {
    pub records: &'a [Record],
    pub letters: &'a [LetterRow],
    pub msgs: &'a [Msg],
    pub transitions: &'a [TransitionRow],
    /// The input topics (where replays go).
    pub inputs: &'a [String],
    /// When a serve died (SIGKILL or a failpoint crash), ms since the epoch.
    pub deaths_ms: &'a [i64],
}

type Position = (String, i32, i64);

/// The calls of the log, per letter.
#[derive(Default)]
struct Calls<'r> {
    /// Answered 2xx, by letter.
    answered: BTreeMap<i64, Vec<&'r Record>>,
    /// Calls that may have produced a copy without saying so, by letter.
    unanswered: HashMap<i64, u64>,
    /// Such calls of a set: their (class, source topic).
    unanswered_sets: Vec<(&'r str, &'r str)>,
    calls: u64,
}

impl<'r> Calls<'r> {
    fn of(records: &'r [Record]) -> Calls<'r> {
        let mut c = Calls::default();
        for r in records.iter().filter(|r| r.ev == log::EV_REPLAY) {
            let in_set = r.note.as_deref() == Some(log::NOTE_IN_SET);
            if !in_set {
                c.calls += 1;
            }
            let may_have_produced = !r.acked && unfinished(r);
            match (r.kind.as_deref(), r.letter) {
                (Some(log::KIND_REPLAY), Some(id)) if r.acked => {
                    c.answered.entry(id).or_default().push(r);
                }
                (Some(log::KIND_REPLAY), Some(id)) if may_have_produced && !in_set => {
                    *c.unanswered.entry(id).or_default() += 1;
                }
                (Some(log::KIND_REPLAY_SET), _) if may_have_produced => c.unanswered_sets.push((
                    r.class.as_deref().unwrap_or(""),
                    r.topic.as_deref().unwrap_or(""),
                )),
                _ => {}
            }
        }
        c
    }

    /// The calls that may have produced a copy of `letter`'s replay.
    fn allowed(&self, letter: &LetterRow) -> u64 {
        let sets = self
            .unanswered_sets
            .iter()
            .filter(|(class, topic)| *class == letter.class && *topic == letter.source_topic)
            .count() as u64;
        1 + self.unanswered.get(&letter.id).copied().unwrap_or(0) + sets
    }
}

/// A call that got no answer, a 5xx or `contended`: it may have produced
/// its letter's copy without recording it, and the next call then
/// produces it again.
fn unfinished(r: &Record) -> bool {
    match r.status {
        None => true,
        Some(s) => {
            s >= 500
                || (s == 409
                    && r.error
                        .as_deref()
                        .is_some_and(|e| e.ends_with(" contended")))
        }
    }
}

/// Every check of the module docs.
pub fn check(seen: &Seen<'_>, v: &mut Violations) -> ReplayFigures {
    let calls = Calls::of(seen.records);
    let by_id: HashMap<i64, &LetterRow> = seen.letters.iter().map(|l| (l.id, l)).collect();
    let mut figures = ReplayFigures {
        calls: calls.calls,
        acked: calls.answered.values().map(|a| a.len() as u64).sum(),
        letters: seen.letters.iter().filter(|l| l.replayed).count() as u64,
        ..ReplayFigures::default()
    };
    for (id, answers) in &calls.answered {
        answers_recorded(*id, answers, by_id.get(id).copied(), v);
        if answers.len() > 1 {
            figures.repeated += 1;
            let first = answers.iter().map(|r| r.t_ms).min().unwrap_or(0);
            let last = answers.iter().map(|r| r.t_ms).max().unwrap_or(0);
            if seen.deaths_ms.iter().any(|t| first < *t && *t < last) {
                figures.across_restart += 1;
            }
        }
    }
    copies_kept(seen, &calls, &mut figures, v);
    figures
}

/// Every answer for a letter names the replay its row records.
fn answers_recorded(id: i64, answers: &[&Record], row: Option<&LetterRow>, v: &mut Violations) {
    let named: HashSet<(Option<&str>, Option<i32>, Option<i64>)> = answers
        .iter()
        .map(|r| (r.replay_id.as_deref(), r.partition, r.offset))
        .collect();
    if named.len() > 1 {
        v.add("replay_answers_differ", || {
            format!(
                "letter {id} was answered with {} replays: {named:?}",
                named.len()
            )
        });
    }
    for (replay_id, partition, offset) in named {
        let recorded = row.is_some_and(|l| {
            l.replayed
                && l.replay_id.as_deref() == replay_id
                && l.replayed_partition == partition
                && l.replayed_offset == offset
        });
        if !recorded {
            v.add("replay_not_recorded", || {
                format!(
                    "letter {id}: replay {replay_id:?} at {partition:?}@{offset:?} answered, \
                     the row records {:?}",
                    row.map(|l| (&l.replay_id, l.replayed_partition, l.replayed_offset))
                )
            });
        }
    }
}

/// The input topics as the replay checks look them up.
struct Topics<'a> {
    /// Every message of an input topic, by position.
    msgs: HashMap<Position, &'a Msg>,
    /// The messages that carry a replay id, by that id.
    copies: HashMap<&'a str, Vec<&'a Msg>>,
    /// The classes each position was dead-lettered under.
    dead: HashMap<Position, Vec<&'a str>>,
    /// The positions a transition was made from.
    applied: HashSet<&'a Position>,
    /// The letter each replay id claimed.
    by_replay: HashMap<&'a str, &'a LetterRow>,
}

fn position(m: &Msg) -> Position {
    (m.topic.clone(), m.partition, m.offset)
}

impl<'a> Topics<'a> {
    fn of(seen: &Seen<'a>) -> Topics<'a> {
        let msgs: HashMap<Position, &Msg> = seen
            .msgs
            .iter()
            .filter(|m| seen.inputs.contains(&m.topic))
            .map(|m| (position(m), m))
            .collect();
        let mut copies: HashMap<&str, Vec<&Msg>> = HashMap::new();
        for m in msgs.values() {
            if let Some(id) = m.header_str(REPLAY_ID) {
                copies.entry(id).or_default().push(m);
            }
        }
        let mut dead: HashMap<Position, Vec<&str>> = HashMap::new();
        for l in seen.letters {
            dead.entry(l.source()).or_default().push(&l.class);
        }
        Topics {
            msgs,
            copies,
            dead,
            applied: seen
                .transitions
                .iter()
                .filter_map(|t| t.source.as_ref())
                .collect(),
            by_replay: seen
                .letters
                .iter()
                .filter_map(|l| Some((l.replay_id.as_deref()?, l)))
                .collect(),
        }
    }
}

/// The copies on the topics: each recorded replay's copy is there, and
/// each replay id's copies are kept ([`copies_of_one_replay`]).
fn copies_kept(
    seen: &Seen<'_>,
    calls: &Calls<'_>,
    figures: &mut ReplayFigures,
    v: &mut Violations,
) {
    let topics = Topics::of(seen);
    for l in seen.letters.iter().filter(|l| l.replayed) {
        let landed = (
            l.source_topic.clone(),
            l.replayed_partition.unwrap_or(-1),
            l.replayed_offset.unwrap_or(-1),
        );
        let there = topics
            .msgs
            .get(&landed)
            .is_some_and(|m| m.header_str(REPLAY_ID) == l.replay_id.as_deref());
        if !there {
            v.add("replay_not_on_topic", || {
                format!("letter {}: nothing with its replay id at {landed:?}", l.id)
            });
        }
    }
    for (replay_id, copies) in &topics.copies {
        figures.copies += copies.len() as u64;
        match topics.by_replay.get(replay_id) {
            Some(letter) => copies_of_one_replay(&topics, letter, copies, calls, figures, v),
            None => v.add("replay_not_recorded", || {
                format!(
                    "{} copies carry replay id {replay_id}, which no letter records",
                    copies.len()
                )
            }),
        }
    }
}

/// One replay's copies: no more than the calls that could make them, each
/// one the letter's input, refused again under its class, never applied.
fn copies_of_one_replay(
    topics: &Topics<'_>,
    letter: &LetterRow,
    copies: &[&Msg],
    calls: &Calls<'_>,
    figures: &mut ReplayFigures,
    v: &mut Violations,
) {
    let (id, class) = (letter.id, letter.class.as_str());
    let allowed = calls.allowed(letter);
    if copies.len() as u64 > allowed {
        v.add("replay_duplicated", || {
            format!(
                "letter {id}: {} copies of replay {:?}; calls that could make one: {allowed}",
                copies.len(),
                letter.replay_id
            )
        });
    }
    let original = topics.msgs.get(&letter.source());
    for m in copies {
        let pos = position(m);
        if original.is_some_and(|o| o.key != m.key || o.payload != m.payload) {
            v.add("replay_differs", || {
                format!("letter {id}: the copy at {pos:?} is not its input")
            });
        }
        match topics.dead.get(&pos) {
            Some(classes) if classes.contains(&class) => figures.dead_lettered_again += 1,
            refused => v.add("replay_fate_changed", || {
                format!(
                    "letter {id} ({class}): its copy at {pos:?} was dead-lettered as {refused:?}"
                )
            }),
        }
        if topics.applied.contains(&pos) {
            v.add("replay_applied", || {
                format!("letter {id} ({class}): its copy at {pos:?} made a transition")
            });
        }
    }
}

#[cfg(test)]
#[allow(
    clippy::too_many_lines,
    reason = "a test reads as one story, from its setup to its last assertion"
)]
mod tests {
    use super::*;

    fn msg(topic: &str, offset: i64, value: &str, replay_id: Option<&str>) -> Msg {
        Msg {
            topic: topic.into(),
            partition: 0,
            offset,
            key: Some(b"k".to_vec()),
            payload: value.as_bytes().to_vec(),
            headers: replay_id
                .map(|id| vec![(REPLAY_ID.to_string(), id.as_bytes().to_vec())])
                .unwrap_or_default(),
            timestamp_ms: None,
        }
    }

    fn letter(id: i64, topic: &str, offset: i64, class: &str) -> LetterRow {
        LetterRow {
            id,
            source_topic: topic.into(),
            source_offset: offset,
            class: class.into(),
            ..LetterRow::default()
        }
    }

    fn replayed(mut l: LetterRow, replay_id: &str, offset: i64) -> LetterRow {
        l.replay_id = Some(replay_id.into());
        l.replayed = true;
        l.replayed_partition = Some(0);
        l.replayed_offset = Some(offset);
        l
    }

    fn answer(letter: i64, t_ms: i64, replay_id: &str, offset: i64) -> Record {
        Record {
            ev: log::EV_REPLAY.into(),
            t_ms,
            kind: Some(log::KIND_REPLAY.into()),
            acked: true,
            status: Some(200),
            letter: Some(letter),
            replay_id: Some(replay_id.into()),
            topic: Some("p.wakeups".into()),
            partition: Some(0),
            offset: Some(offset),
            ..Record::default()
        }
    }

    /// Each planted fault is reported under its kind; a replay kept once,
    /// refused again and asked for twice across a serve's death is not,
    /// and neither is a second copy owed to a call that got no answer.
    #[test]
    fn planted_replay_faults_are_reported_by_kind() {
        let (w, r) = ("p.wakeups", "p.requests");
        let letters = vec![
            // Kept: its copy at 10 is refused again as unknown_run (letter 3).
            replayed(letter(1, w, 5, "unknown_run"), "r1", 10),
            // Two copies without a failed call; one other bytes; one
            // refused as another class, one not refused, one applied.
            replayed(letter(2, r, 1, "malformed"), "r2", 20),
            letter(3, w, 10, "unknown_run"),
            // Nothing at its recorded position; answered with two replays.
            replayed(letter(4, w, 6, "unknown_run"), "r4", 30),
            letter(6, r, 20, "invalid"),
            // Two copies, one call without an answer: both owed.
            replayed(letter(7, w, 7, "unknown_run"), "r7", 40),
            letter(8, w, 40, "unknown_run"),
            letter(9, w, 41, "unknown_run"),
        ];
        let msgs = vec![
            msg(w, 5, "nx", None),
            msg(w, 10, "nx", Some("r1")),
            msg(r, 1, "{", None),
            msg(r, 20, "{", Some("r2")),
            msg(r, 21, "{x", Some("r2")),
            msg(w, 6, "nx", None),
            msg(w, 7, "nx", None),
            msg(w, 40, "nx", Some("r7")),
            msg(w, 41, "nx", Some("r7")),
            msg(w, 50, "nx", Some("r9")),
            // Not an input topic: never a copy.
            msg("p.dlq", 0, "nx", Some("r1")),
        ];
        let unanswered = Record {
            ev: log::EV_REPLAY.into(),
            kind: Some(log::KIND_REPLAY.into()),
            letter: Some(7),
            ..Record::default()
        };
        let records = vec![
            answer(1, 100, "r1", 10),
            answer(1, 300, "r1", 10),
            answer(4, 100, "r4", 30),
            answer(4, 200, "r5", 31),
            unanswered,
            answer(7, 400, "r7", 40),
        ];
        let transitions = vec![TransitionRow {
            run_id: "c-1".into(),
            seq: 1,
            input_ref: "start".into(),
            kind: "run.started".into(),
            from_status: None,
            to_status: "running".into(),
            step_index: 0,
            detail: Value::Null,
            source: Some((r.into(), 0, 20)),
            created_at: chrono::DateTime::UNIX_EPOCH,
        }];
        let mut v = Violations::default();
        let figures = check(
            &Seen {
                records: &records,
                letters: &letters,
                msgs: &msgs,
                transitions: &transitions,
                inputs: &[r.to_string(), w.to_string()],
                deaths_ms: &[250],
            },
            &mut v,
        );
        let counts: Vec<(&str, u64)> = v.counts.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        assert_eq!(
            counts,
            [
                ("replay_answers_differ", 1),
                ("replay_applied", 1),
                ("replay_differs", 1),
                ("replay_duplicated", 1),
                ("replay_fate_changed", 2),
                ("replay_not_on_topic", 1),
                ("replay_not_recorded", 2),
            ],
            "{:#?}",
            v.examples
        );
        assert_eq!(figures.calls, 6);
        assert_eq!(figures.acked, 5);
        assert_eq!(figures.letters, 4);
        assert_eq!((figures.repeated, figures.across_restart), (2, 1));
        assert_eq!((figures.copies, figures.dead_lettered_again), (6, 3));
    }
}
