//! A run's document: what its steps read and where their results go.
//!
//! The document is one JSON object: `input`, the start's input, and beside
//! it each finished step's result at the step's `result` path
//! (`/steps/<name>` unless the step names another). A step's `input`
//! selection and the workflow's `output` selection are JSON pointers
//! (RFC 6901) over it. The state keeps the document without its `input`
//! (which it keeps already) as `results`, and only for a workflow that
//! selects data ([`crate::coordinator::definition::WorkflowDefinition::uses_document`]),
//! so that a straight line of steps, each taking the output of the one
//! before, stores no more than it did.
//!
//! In: the run's input, the results kept so far, a pointer. Out: the value
//! at the pointer, or the results with one more in place. Guarantees: pure
//! and total; a pointer that does not resolve is `None`, never a panic; a
//! result is placed only through objects, made on the way when missing,
//! and never in the input.

use serde_json::{Map, Value};

/// Longest JSON pointer a definition may hold.
pub const MAX_POINTER_LEN: usize = 256;
/// The document's member that holds the start's input.
pub const INPUT: &str = "input";
/// The document's member under which each step's result goes by default.
pub const STEPS: &str = "steps";

/// The reference tokens of `pointer`, unescaped (`~1` is `/`, `~0` is
/// `~`); `None` when it is no JSON pointer: not empty and not starting
/// with `/`, or with a `~` not followed by `0` or `1`. The empty pointer
/// is the whole document and has no tokens.
pub fn tokens(pointer: &str) -> Option<Vec<String>> {
    if pointer.is_empty() {
        return Some(Vec::new());
    }
    let rest = pointer.strip_prefix('/')?;
    rest.split('/').map(unescape).collect()
}

fn unescape(token: &str) -> Option<String> {
    let mut out = String::with_capacity(token.len());
    let mut chars = token.chars();
    while let Some(c) = chars.next() {
        if c == '~' {
            match chars.next() {
                Some('0') => out.push('~'),
                Some('1') => out.push('/'),
                _ => return None,
            }
        } else {
            out.push(c);
        }
    }
    Some(out)
}

/// The document's member under which the error of each caught failure
/// goes by default.
pub const ERRORS: &str = "errors";

/// The pointer of step `name`'s default result: `/steps/<name>`.
pub fn default_result(name: &str) -> String {
    format!("/{STEPS}/{}", escape(name))
}

/// The pointer of the error of step `name`'s caught failure by default:
/// `/errors/<name>`.
pub fn default_error(name: &str) -> String {
    format!("/{ERRORS}/{}", escape(name))
}

/// `token` escaped for a JSON pointer (`~` as `~0`, `/` as `~1`).
pub fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// The value at `pointer` in the document of `input` and `results`, cloned;
/// `None` when nothing is there. The empty pointer is the whole document.
pub fn resolve(
    input: &Value,
    results: Option<&Map<String, Value>>,
    pointer: &str,
) -> Option<Value> {
    let tokens = tokens(pointer)?;
    let Some((first, rest)) = tokens.split_first() else {
        let mut whole = results.cloned().unwrap_or_default();
        whole.insert(INPUT.to_owned(), input.clone());
        return Some(Value::Object(whole));
    };
    let root = if first == INPUT {
        input
    } else {
        results?.get(first)?
    };
    rest.iter()
        .try_fold(root, |at, token| step_into(at, token))
        .cloned()
}

fn step_into<'a>(at: &'a Value, token: &str) -> Option<&'a Value> {
    match at {
        Value::Object(map) => map.get(token),
        Value::Array(items) => {
            // RFC 6901: an array index is `0` or digits without a leading zero.
            let canonical = token == "0" || !token.starts_with('0');
            let index: usize = token.parse().ok().filter(|_| canonical)?;
            items.get(index)
        }
        _ => None,
    }
}

/// Puts `value` at `pointer` in `results`, making the objects on the way
/// that are missing. Refused, with why: a pointer that is no JSON pointer,
/// the whole document, the input, or a path through a value that is no
/// object.
pub fn place(results: &mut Map<String, Value>, pointer: &str, value: Value) -> Result<(), String> {
    let tokens = tokens(pointer).ok_or_else(|| format!("{pointer:?} is no JSON pointer"))?;
    let Some((last, parents)) = tokens.split_last() else {
        return Err("a result cannot replace the whole document".to_owned());
    };
    if tokens.first().is_some_and(|t| t == INPUT) {
        return Err(format!("a result cannot go in the run's input ({pointer})"));
    }
    let mut at = results;
    for (depth, token) in parents.iter().enumerate() {
        let next = at
            .entry(token.clone())
            .or_insert_with(|| Value::Object(Map::new()));
        at = match next {
            Value::Object(map) => map,
            other => {
                return Err(format!(
                    "the result path {pointer} goes through /{}, which holds a {}, not an object",
                    tokens[..=depth].join("/"),
                    type_name(other)
                ));
            }
        };
    }
    at.insert(last.clone(), value);
    Ok(())
}

/// The JSON type of `value`, as a condition or an error names it.
pub fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn results(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(map) => map,
            _ => unreachable!("an object"),
        }
    }

    #[test]
    fn pointers_unescape_and_refuse_what_is_no_pointer() {
        assert_eq!(tokens(""), Some(vec![]));
        assert_eq!(tokens("/a~1b/c~0d"), Some(vec!["a/b".into(), "c~d".into()]));
        assert_eq!(tokens("/"), Some(vec![String::new()]));
        assert_eq!(tokens("a"), None);
        assert_eq!(tokens("/a~2"), None);
        assert_eq!(tokens("/a~"), None);
    }

    #[test]
    fn a_pointer_reads_the_input_or_the_results() {
        let input = json!({"order": {"items": [{"sku": "a"}, {"sku": "b"}]}});
        let kept = results(json!({"steps": {"charge": {"id": 7}}}));
        let at = |p: &str| resolve(&input, Some(&kept), p);
        assert_eq!(at("/input/order/items/1/sku"), Some(json!("b")));
        assert_eq!(at("/steps/charge/id"), Some(json!(7)));
        assert_eq!(at("/steps/ship"), None);
        assert_eq!(at("/input/order/items/01"), None);
        assert_eq!(at("/input/order/items/9"), None);
        assert_eq!(at("/input/order/items/x"), None);
        assert_eq!(at("nope"), None);
        assert_eq!(
            at(""),
            Some(json!({"input": input, "steps": {"charge": {"id": 7}}}))
        );
        assert_eq!(resolve(&input, None, "/steps"), None);
        assert_eq!(
            resolve(&input, None, "/input/order/items/0/sku"),
            Some(json!("a"))
        );
    }

    #[test]
    fn a_result_is_placed_through_objects_it_makes() {
        let mut kept = Map::new();
        place(&mut kept, &default_result("charge"), json!({"id": 7})).unwrap();
        place(&mut kept, "/order/refund/id", json!(9)).unwrap();
        place(&mut kept, "/order/refund/id", json!(10)).unwrap();
        assert_eq!(
            Value::Object(kept.clone()),
            json!({"steps": {"charge": {"id": 7}}, "order": {"refund": {"id": 10}}})
        );
        let blocked = place(&mut kept, "/steps/charge/id/x", json!(1)).unwrap_err();
        assert!(blocked.contains("/steps/charge/id"), "{blocked}");
        assert!(blocked.contains("number"), "{blocked}");
        assert!(place(&mut kept, "", json!(1)).is_err());
        assert!(place(&mut kept, "/input/x", json!(1)).is_err());
        assert!(place(&mut kept, "x", json!(1)).is_err());
    }

    #[test]
    fn a_step_name_with_a_slash_is_escaped_in_its_default_result() {
        assert_eq!(default_result("a/b~c"), "/steps/a~1b~0c");
        assert_eq!(
            tokens(&default_result("a/b~c")),
            Some(vec!["steps".into(), "a/b~c".into()])
        );
    }
}
