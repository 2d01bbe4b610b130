//! The conditions of a `choice` step: tests of the run's document.
//!
//! A condition is one test of the value at a JSON pointer (`equals`,
//! `less`, `greater`, `exists`, `is_type`, `starts_with`), or a combination
//! of conditions (`all`, `any`, `not`). In TOML, one inline table:
//! `{ pointer = "/input/priority", equals = "high" }`,
//! `{ all = [{ pointer = "/steps/charge/amount", greater = 100 }, { not = { pointer = "/input/vip", exists = true } }] }`.
//!
//! In: a condition as deserialized, the run's document. Out: whether it
//! holds, or why the condition is malformed. Guarantees: pure and total; a
//! test of a value that is missing or of another type is false (`exists =
//! false` excepted), never an error at run time; a condition holds at most
//! [`MAX_CONDITION_NODES`] tests and combinations, nested at most
//! [`MAX_CONDITION_DEPTH`] deep.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::document;

/// Deepest nesting of `all`, `any` and `not` in one condition.
pub const MAX_CONDITION_DEPTH: usize = 8;
/// Most tests and combinations in one condition.
pub const MAX_CONDITION_NODES: usize = 64;

/// One test, or a combination of conditions: exactly one operator.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Condition {
    /// What a test looks at: a JSON pointer over the run's document.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pointer: Option<String>,
    /// The value there equals this one (JSON equality).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<Value>,
    /// The value there is a number below this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub less: Option<f64>,
    /// The value there is a number above this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub greater: Option<f64>,
    /// Something is there (`true`) or nothing is (`false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exists: Option<bool>,
    /// The value there is of this JSON type: `null`, `boolean`, `number`,
    /// `string`, `array` or `object`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_type: Option<String>,
    /// The value there is a string that starts with this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starts_with: Option<String>,
    /// Every one of these holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all: Option<Vec<Condition>>,
    /// At least one of these holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub any: Option<Vec<Condition>>,
    /// This one does not hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not: Option<Box<Condition>>,
}

const TYPES: [&str; 6] = ["null", "boolean", "number", "string", "array", "object"];

impl Condition {
    /// The operators given, by name.
    fn operators(&self) -> Vec<&'static str> {
        let given = [
            ("equals", self.equals.is_some()),
            ("less", self.less.is_some()),
            ("greater", self.greater.is_some()),
            ("exists", self.exists.is_some()),
            ("is_type", self.is_type.is_some()),
            ("starts_with", self.starts_with.is_some()),
            ("all", self.all.is_some()),
            ("any", self.any.is_some()),
            ("not", self.not.is_some()),
        ];
        given
            .into_iter()
            .filter_map(|(name, present)| present.then_some(name))
            .collect()
    }

    fn children(&self) -> Vec<&Condition> {
        let mut children: Vec<&Condition> = Vec::new();
        children.extend(self.all.iter().flatten());
        children.extend(self.any.iter().flatten());
        children.extend(self.not.as_deref());
        children
    }

    /// Every pointer the condition reads.
    pub fn pointers(&self) -> Vec<&str> {
        let mut out: Vec<&str> = self.pointer.as_deref().into_iter().collect();
        for child in self.children() {
            out.extend(child.pointers());
        }
        out
    }

    /// Exactly one operator per node, a pointer with a test and none with
    /// a combination, a known type, finite bounds, non-empty combinations,
    /// within the bounds of depth and size. The error names where (`all[1].not`).
    pub fn validate(&self) -> Result<(), (String, String)> {
        let mut nodes = 0;
        self.validate_at("", 1, &mut nodes)?;
        if nodes > MAX_CONDITION_NODES {
            return Err((
                String::new(),
                format!("holds {nodes} tests and combinations, more than {MAX_CONDITION_NODES}"),
            ));
        }
        Ok(())
    }

    fn validate_at(
        &self,
        at: &str,
        depth: usize,
        nodes: &mut usize,
    ) -> Result<(), (String, String)> {
        *nodes += 1;
        let err = |message: String| Err((at.to_owned(), message));
        if depth > MAX_CONDITION_DEPTH {
            return err(format!("nests deeper than {MAX_CONDITION_DEPTH}"));
        }
        let operators = self.operators();
        let [operator] = operators.as_slice() else {
            return err(format!(
                "needs exactly one of equals, less, greater, exists, is_type, starts_with, all, any, not; has {}",
                if operators.is_empty() {
                    "none".to_owned()
                } else {
                    operators.join(", ")
                }
            ));
        };
        let combination = matches!(*operator, "all" | "any" | "not");
        match (&self.pointer, combination) {
            (Some(_), true) => return err(format!("{operator} takes no pointer")),
            (None, false) => return err(format!("{operator} needs a pointer")),
            _ => {}
        }
        if self.less.is_some_and(|x| !x.is_finite()) || self.greater.is_some_and(|x| !x.is_finite())
        {
            return err("a bound must be a finite number".to_owned());
        }
        if let Some(kind) = &self.is_type
            && !TYPES.contains(&kind.as_str())
        {
            return err(format!("is_type must be one of {}", TYPES.join(", ")));
        }
        for (name, list) in [("all", &self.all), ("any", &self.any)] {
            if let Some(list) = list {
                if list.is_empty() {
                    return err(format!("{name} needs at least one condition"));
                }
                for (i, child) in list.iter().enumerate() {
                    child.validate_at(&join(at, &format!("{name}[{i}]")), depth + 1, nodes)?;
                }
            }
        }
        if let Some(child) = &self.not {
            child.validate_at(&join(at, "not"), depth + 1, nodes)?;
        }
        Ok(())
    }

    /// Whether it holds over the document of `input` and `results`.
    pub fn holds(&self, input: &Value, results: Option<&Map<String, Value>>) -> bool {
        if let Some(all) = &self.all {
            return all.iter().all(|c| c.holds(input, results));
        }
        if let Some(any) = &self.any {
            return any.iter().any(|c| c.holds(input, results));
        }
        if let Some(not) = &self.not {
            return !not.holds(input, results);
        }
        let pointer = self.pointer.as_deref().unwrap_or_default();
        let value = document::resolve(input, results, pointer);
        if let Some(exists) = self.exists {
            return value.is_some() == exists;
        }
        let Some(value) = value else {
            return false;
        };
        if let Some(expected) = &self.equals {
            return equal(&value, expected);
        }
        if let Some(bound) = self.less {
            return value.as_f64().is_some_and(|x| x < bound);
        }
        if let Some(bound) = self.greater {
            return value.as_f64().is_some_and(|x| x > bound);
        }
        if let Some(kind) = &self.is_type {
            return document::type_name(&value) == kind;
        }
        if let Some(prefix) = &self.starts_with {
            return value
                .as_str()
                .is_some_and(|s| s.starts_with(prefix.as_str()));
        }
        false
    }
}

/// JSON equality, numbers by value: `1` equals `1.0`.
fn equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x == y || x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

fn join(at: &str, next: &str) -> String {
    if at.is_empty() {
        next.to_owned()
    } else {
        format!("{at}.{next}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(toml_text: &str) -> Condition {
        #[derive(Deserialize)]
        struct Wrap {
            when: Condition,
        }
        toml::from_str::<Wrap>(&format!("when = {toml_text}"))
            .unwrap()
            .when
    }

    #[test]
    fn each_test_looks_at_its_pointer() {
        let input = json!({"priority": "high", "total": 120, "tags": ["a"], "note": null});
        let kept = json!({"steps": {"charge": {"id": "ch_1"}}});
        let results = kept.as_object();
        let holds = |text: &str| {
            let c = parse(text);
            c.validate().unwrap();
            c.holds(&input, results)
        };
        assert!(holds(r#"{ pointer = "/input/priority", equals = "high" }"#));
        assert!(!holds(r#"{ pointer = "/input/priority", equals = "low" }"#));
        assert!(holds(r#"{ pointer = "/input/total", equals = 120.0 }"#));
        assert!(holds(r#"{ pointer = "/input/total", greater = 100 }"#));
        assert!(!holds(r#"{ pointer = "/input/total", less = 100 }"#));
        assert!(!holds(r#"{ pointer = "/input/priority", less = 100 }"#));
        assert!(holds(r#"{ pointer = "/input/note", exists = true }"#));
        assert!(holds(r#"{ pointer = "/input/vip", exists = false }"#));
        assert!(!holds(r#"{ pointer = "/input/vip", equals = "x" }"#));
        assert!(holds(r#"{ pointer = "/input/tags", is_type = "array" }"#));
        assert!(holds(r#"{ pointer = "/input/note", is_type = "null" }"#));
        assert!(holds(
            r#"{ pointer = "/steps/charge/id", starts_with = "ch_" }"#
        ));
        assert!(!holds(r#"{ pointer = "/input/total", starts_with = "1" }"#));
        assert!(holds(
            r#"{ all = [{ pointer = "/input/total", greater = 100 }, { not = { pointer = "/input/vip", exists = true } }] }"#
        ));
        assert!(holds(
            r#"{ any = [{ pointer = "/input/total", less = 1 }, { pointer = "/input/priority", equals = "high" }] }"#
        ));
        assert!(!holds(
            r#"{ not = { pointer = "/input/priority", equals = "high" } }"#
        ));
    }

    #[test]
    fn a_malformed_condition_says_where_and_why() {
        let refused = |text: &str| parse(text).validate().unwrap_err();
        assert!(refused("{}").1.contains("exactly one"));
        assert!(
            refused(r#"{ pointer = "/a", equals = 1, less = 2 }"#)
                .1
                .contains("equals, less")
        );
        assert!(refused(r#"{ equals = 1 }"#).1.contains("needs a pointer"));
        assert!(
            refused(r#"{ pointer = "/a", all = [{ pointer = "/b", exists = true }] }"#)
                .1
                .contains("takes no pointer")
        );
        assert!(refused(r#"{ all = [] }"#).1.contains("at least one"));
        assert!(
            refused(r#"{ pointer = "/a", is_type = "integer" }"#)
                .1
                .contains("is_type")
        );
        assert!(
            refused(r#"{ pointer = "/a", less = nan }"#)
                .1
                .contains("finite")
        );
        let (at, _) =
            refused(r#"{ all = [{ pointer = "/a", exists = true }, { not = { equals = 1 } }] }"#);
        assert_eq!(at, "all[1].not");
        let mut deep = r#"{ pointer = "/a", exists = true }"#.to_owned();
        for _ in 0..MAX_CONDITION_DEPTH {
            deep = format!("{{ not = {deep} }}");
        }
        assert!(refused(&deep).1.contains("deeper"));
        let wide = format!(
            "{{ any = [{}] }}",
            vec![r#"{ pointer = "/a", exists = true }"#; MAX_CONDITION_NODES].join(", ")
        );
        assert!(refused(&wide).1.contains("more than"));
    }

    #[test]
    fn pointers_lists_every_pointer_read() {
        let c = parse(
            r#"{ all = [{ pointer = "/a", exists = true }, { not = { pointer = "/b", equals = 1 } }] }"#,
        );
        assert_eq!(c.pointers(), ["/a", "/b"]);
    }
}
